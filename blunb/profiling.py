"""Where a training step's time goes: torch.profiler kernel times, per step, by category.

`profile_table(prof, steps)` turns a finished torch.profiler.profile into two tables: time per
category per step and the top kernels. On a GPU it counts device (kernel) time; on the CPU, where
there are no kernels, each op's self CPU time. The trainer's `profile_steps` setting and
bench/plain_llama.py both use it, so blunb and the baseline are binned by the same rules.

Categories come from kernel names, first match wins. Kernels that torch.compile generated
(Inductor's `triton_poi_*` / `triton_red_*` / `triton_per_*`) fuse several ops each; they are
their own category rather than being guessed into one of the ops they contain.
"""

from __future__ import annotations

import pandas as pd

# (category, substrings of the lower-cased kernel or op name); the first category with a match wins.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "all_reduce", "reduce_scatter", "all_gather", "broadcast")),
    ("attention", ("flash", "fmha", "attention", "_fwd_kernel", "_bwd_kernel", "_bwd_preprocess", "sdpa", "cudnn")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lerp", "addcmul")),
    ("syrk", ("_syrk_kernel",)),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "wgmma", "cublas", "aten::mm", "aten::bmm", "aten::addmm",
                "aten::baddbmm", "aten::linear", "aten::matmul", "sm90_", "sm80_")),
    ("rms_norm", ("rms_norm", "rmsnorm")),
    ("qk_norm_rope", ("_qk_fwd", "_qk_bwd", "rope")),
    ("swiglu", ("swiglu", "silu")),
    ("cross_entropy", ("_ce_fwd", "cross_entropy", "log_softmax", "nll_loss", "logsumexp")),
    ("inductor_fused", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("copy_cast", ("copy", "to_copy", "cast", "convert", "memcpy", "memset", "fill")),
    ("reduction", ("reduce", "norm", "sum", "amax", "max", "mean")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::add", "aten::mul", "aten::div", "aten::where")),
)


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def _kernel_times(prof) -> list[tuple[str, float, int]]:
    """(name, total microseconds, calls): the device kernels when the profile has any, else the CPU ops'
    self time (self, so no op's time is counted again in its caller)."""
    import torch

    averages = prof.key_averages()
    # record_function ranges (the optimizers' "Optimizer.step#...") also get a device-side span that
    # covers the kernels they launched: counting it would count those kernels twice.
    kernels = [(e.key, e.self_device_time_total, e.count) for e in averages
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
               and not getattr(e, "is_user_annotation", False)]
    if kernels:
        return kernels
    return [(e.key, e.self_cpu_time_total, e.count) for e in averages
            if e.self_cpu_time_total > 0 and "::" in e.key]   # ops only: no ProfilerStep or user ranges


def profile_table(prof, steps: int, top: int = 30) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(categories, kernels): ms per step and share of the profiled time, largest first."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rows = [{"kernel": name, "category": categorize(name), "ms_per_step": us / 1e3 / steps,
             "calls_per_step": calls / steps} for name, us, calls in _kernel_times(prof)]
    kernels = pd.DataFrame(rows, columns=["kernel", "category", "ms_per_step", "calls_per_step"])
    kernels = kernels.sort_values("ms_per_step", ascending=False, ignore_index=True)
    categories = kernels.groupby("category", as_index=False)[["ms_per_step", "calls_per_step"]].sum()
    categories = categories.sort_values("ms_per_step", ascending=False, ignore_index=True)
    total = categories["ms_per_step"].sum()
    categories["share"] = categories["ms_per_step"] / total if total > 0 else float("nan")
    return categories, kernels.head(top)


def write_profile(prof, steps: int, folder, prefix: str = "profile") -> pd.DataFrame:
    """profile.csv (categories) and profile_kernels.csv (top kernels) in `folder`; returns the categories."""
    from pathlib import Path

    categories, kernels = profile_table(prof, steps)
    folder = Path(folder)
    categories.to_csv(folder / f"{prefix}.csv", index=False)
    kernels.to_csv(folder / f"{prefix}_kernels.csv", index=False)
    return categories
