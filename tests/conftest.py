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


@pytest.fixture
def fake_gpu_runs(monkeypatch):
    """The study runner sees one GPU ("0"), and each run it launches is a stand-in that completes at once:
    it leaves what the cache reads (config.json, env.json with the gpu_sharing a GPU run would record from
    the environment it was given, a completed status.json). Returns the launches, in order: (run name,
    BLUNB_RUNS_PER_GPU, CUDA_VISIBLE_DEVICES) as each run's environment had them."""
    import json
    from pathlib import Path

    import blunb.data
    import blunb.study
    from blunb.runs import GPU_SHARE_ENV, gpu_sharing
    from blunb.train import parse_args
    from tests.run_folders import write_completed

    launches = []

    class Done:
        pid, returncode = 0, 0

        def poll(self):
            return 0

    def start(cmd, console, env):
        args = [a for a in cmd[cmd.index("blunb.train") + 1:] if a != "--overwrite"]
        cfg, parsed = parse_args(args)
        run_dir = Path(parsed.run_dir)
        (run_dir / "config.json").write_text(cfg.to_json())
        (run_dir / "env.json").write_text(json.dumps({"world_size": 1, "gpu_sharing": gpu_sharing("cuda:0", env)}))
        write_completed(run_dir, cfg.max_steps)
        launches.append((run_dir.name, env.get(GPU_SHARE_ENV), env.get("CUDA_VISIBLE_DEVICES")))
        return Done()

    monkeypatch.setattr(blunb.study, "_visible_gpus", lambda env: ["0"])
    monkeypatch.setattr(blunb.study, "start_process", start)
    monkeypatch.setattr(blunb.data, "ensure_default_corpus", lambda **kwargs: None)
    return launches
