"""deterministic=true: the process-wide settings under which two runs of one config repeat each other's numbers.

torch's deterministic algorithms, cuBLAS's workspace, cuDNN, Inductor and blunb's own kernels (fixed
launch configs, untimed backend choices), applied by the trainer and recorded in env.json. For finding
which of them a GPU needs (bench/determinism.py's bisection), $BLUNB_DETERMINISM_EXCEPT names parts
(PARTS) that deterministic=true leaves at their defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from blunb.config import ConfigError, TrainConfig

# The CUBLAS_WORKSPACE_CONFIG values cuBLAS documents as reproducible (the two torch's deterministic mode accepts).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
# What deterministic=true sets, each of which a bisection run may leave out: torch.use_deterministic_algorithms,
# CUBLAS_WORKSPACE_CONFIG, cuDNN's flags, Inductor's deterministic mode, blunb's kernels' fixed configs.
PARTS = ("algorithms", "cublas", "cudnn", "inductor", "kernels")
EXCEPT_ENV = "BLUNB_DETERMINISM_EXCEPT"

_fixed_kernels: bool | None = None   # set by Determinism.apply; None: the kernels follow torch's flag


def fixed_kernel_configs() -> bool:
    """Whether blunb's kernels run fixed launch configs and untimed backend choices: as deterministic=true set
    them in this process, else as torch's deterministic flag stands (a caller may set it directly)."""
    return torch.are_deterministic_algorithms_enabled() if _fixed_kernels is None else _fixed_kernels


def left_out_parts(env: Mapping[str, str]) -> tuple[str, ...]:
    """The PARTS $BLUNB_DETERMINISM_EXCEPT names (comma-separated); ConfigError for any other name."""
    names = tuple(n.strip() for n in env.get(EXCEPT_ENV, "").split(",") if n.strip())
    if unknown := [n for n in names if n not in PARTS]:
        raise ConfigError(f"{EXCEPT_ENV} names {unknown}: the parts of deterministic=true are {', '.join(PARTS)}")
    return names


class Determinism:
    """deterministic=true's process-wide settings: train() applies them before CUDA is initialized and puts
    torch's flags back when it returns (a notebook or a test calling train() in-process gets its own back).

    - torch.use_deterministic_algorithms(True), warn_only=False: every op with a deterministic variant runs
      it (the embedding backward; index_put; SDPA's flash backward, and its cuDNN backend is excluded), one
      without raises naming itself, and torch.empty memory is filled (fill_uninitialized_memory, torch's
      default under the flag).
    - CUBLAS_WORKSPACE_CONFIG, torch.backends.cudnn.deterministic / benchmark=False.
    - blunb's kernels (blunb/kernels/__init__.py, fixed_kernel_configs): fixed Triton configs, backend
      choices by shape, nothing timed.
    - compile=true: Inductor's deterministic mode (its timed choices that change numerics are off).

    $BLUNB_DETERMINISM_EXCEPT (env, default os.environ) leaves the named PARTS as they are: a diagnostic for
    the bisection, recorded in env.json and the start line; with deterministic=false it is a ConfigError.
    """

    def __init__(self, cfg: TrainConfig, env: Mapping[str, str] | None = None):
        self.on, self.compile = cfg.deterministic, cfg.compile
        self.left_out = left_out_parts(os.environ if env is None else env)
        if self.left_out and not self.on:
            raise ConfigError(f"{EXCEPT_ENV}={','.join(self.left_out)} leaves parts of deterministic=true out, but "
                              "this run has deterministic=false: set deterministic=true or unset the variable")
        self.notes: list[str] = []  # what the log and env.json must say about how the settings were applied
        self._saved: dict | None = None

    def apply(self) -> None:
        global _fixed_kernels
        if not self.on:
            return
        self._saved = {"algorithms": (torch.are_deterministic_algorithms_enabled(),
                                      torch.is_deterministic_algorithms_warn_only_enabled()),
                       "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)}
        _fixed_kernels = "kernels" not in self.left_out
        if "cublas" not in self.left_out:
            self._set_cublas()
        if self.compile:
            import torch._inductor.config as inductor_config

            if hasattr(inductor_config, "deterministic"):
                self._saved["inductor"] = inductor_config.deterministic  # before torch's flag, which sets it too
            elif "inductor" not in self.left_out:
                self.notes.append(f"torch {torch.__version__}'s Inductor has no deterministic mode: its timed "
                                  "reduction configs may differ between runs")
        if "algorithms" not in self.left_out:
            torch.use_deterministic_algorithms(True, warn_only=False)
        if "cudnn" not in self.left_out:
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        if "inductor" in self._saved:  # after torch's flag: left out, Inductor keeps the value it had
            inductor_config.deterministic = "inductor" not in self.left_out or self._saved["inductor"]

    def _set_cublas(self) -> None:
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

    def restore(self) -> None:
        global _fixed_kernels
        if self._saved is None:
            return
        _fixed_kernels = None
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

        fixed = fixed_kernel_configs()
        out = {"deterministic": self.on, "left_out": list(self.left_out),
               "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
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
