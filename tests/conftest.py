import importlib.util
import os

import pytest
import torch

# Triton kernels run on CPU tensors only under the interpreter; it must be on before
# Triton is first imported (blunb.kernels sets it too, this covers direct imports).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test modules that run the fused kernels, so need the triton package. triton has no wheels for
# macOS or Windows (blunb's dev extra installs it only on Linux x86_64): there they skip, saying why.
TRITON_MODULES = {"test_fused_kernels.py", "test_flash_attention.py", "test_flash_attention_gpu.py", "test_syrk.py",
                  "test_compile.py"}
HAS_TRITON = importlib.util.find_spec("triton") is not None


class _NeedsTriton(pytest.Module):
    def collect(self):
        pytest.skip("triton is not installed (it has no wheel for this platform): Triton kernel tests skipped")


def pytest_pycollect_makemodule(module_path, parent):
    if not HAS_TRITON and module_path.name in TRITON_MODULES:
        return _NeedsTriton.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
