"""deterministic=true: the process-wide settings under which two runs of one config repeat each other's numbers.

torch's deterministic algorithms, cuBLAS's workspace, cuDNN and Inductor, applied by the trainer and
recorded in env.json. The kernels read no setting of their own: they follow torch's flag."""

from __future__ import annotations

import os

import torch

from blunb.config import TrainConfig

# The CUBLAS_WORKSPACE_CONFIG values cuBLAS documents as reproducible (the two torch's deterministic mode accepts).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


class Determinism:
    """deterministic=true's process-wide settings: train() applies them before CUDA is initialized and puts
    torch's flags back when it returns (a notebook or a test calling train() in-process gets its own back).

    - torch.use_deterministic_algorithms(True), warn_only=False: every op with a deterministic variant runs
      it (the embedding backward; index_put; SDPA's flash backward, and its cuDNN backend is excluded), one
      without raises naming itself, and torch.empty memory is filled (fill_uninitialized_memory, torch's
      default under the flag).
    - CUBLAS_WORKSPACE_CONFIG, torch.backends.cudnn.deterministic / benchmark=False.
    - blunb's kernels follow torch's flag (blunb/kernels/__init__.py): fixed Triton configs, backend
      choices by shape, nothing timed.
    - compile=true: Inductor's deterministic mode (its timed choices that change numerics are off).
    """

    def __init__(self, cfg: TrainConfig):
        self.on, self.compile = cfg.deterministic, cfg.compile
        self.notes: list[str] = []  # what the log and env.json must say about how the settings were applied
        self._saved: dict | None = None

    def apply(self) -> None:
        if not self.on:
            return
        self._saved = {"algorithms": (torch.are_deterministic_algorithms_enabled(),
                                      torch.is_deterministic_algorithms_warn_only_enabled()),
                       "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)}
        # torch sizes cuBLAS's workspace from this variable once, on the first GEMM of the process: it goes
        # into the environment here, before CUDA is initialized. It stays set afterwards (what was read
        # cannot be unread). A value set already is kept only if it is one of the reproducible ones.
        env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if env not in CUBLAS_DETERMINISTIC:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
            if env is not None:
                self.notes.append(f"CUBLAS_WORKSPACE_CONFIG={env!r} is not reproducible (one of "
                                  f"{', '.join(CUBLAS_DETERMINISTIC)}): replaced by {CUBLAS_DETERMINISTIC[0]}")
            if torch.cuda.is_initialized():
                self.notes.append("CUDA was in use in this process before CUBLAS_WORKSPACE_CONFIG was set: a GEMM "
                                  "before it fixed cuBLAS's workspace already; a fresh process is reproducible")
        if self.compile:
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config, "deterministic"):
                self._saved["inductor"] = inductor_config.deterministic  # before torch's flag (newer torch ties them)
            else:
                self.notes.append(f"torch {torch.__version__}'s Inductor has no deterministic mode: its timed "
                                  "reduction configs may differ between runs")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        if "inductor" in self._saved:
            inductor_config.deterministic = True

    def restore(self) -> None:
        if self._saved is None:
            return
        on, warn_only = self._saved["algorithms"]
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self._saved["cudnn"]
        if "inductor" in self._saved:
            import torch._inductor.config as inductor_config

            inductor_config.deterministic = self._saved["inductor"]
        self._saved = None

    def facts(self) -> dict:
        """env.json's record of the settings as they stand (torch's flag also when a caller set it)."""
        import torch.utils.deterministic

        fixed = torch.are_deterministic_algorithms_enabled()
        out = {"deterministic": self.on, "torch_deterministic_algorithms": fixed,
               "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
               "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
               "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
               "cudnn_deterministic": torch.backends.cudnn.deterministic,
               "cudnn_benchmark": torch.backends.cudnn.benchmark,
               "triton_configs": "fixed" if fixed else "autotuned (timed)",
               "backend_choice": "by shape (flash attention: triton; syrk: cuBLAS)" if fixed else
                                 "timed where a kernel decides per shape (flash attention, syrk)",
               "notes": list(self.notes)}
        if self.compile:
            import torch._inductor.config as inductor_config

            out["inductor_deterministic"] = getattr(inductor_config, "deterministic", None)
        return out
