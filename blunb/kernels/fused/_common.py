"""Helpers shared by the fused kernels: config choice under the interpreter, SM count."""

from __future__ import annotations

import functools
import os

import torch
import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _quick_bench(kernel_call, quantiles):
    # these kernels run ~0.1-2 ms at training sizes: a few ms of timing per config is enough
    return triton.testing.do_bench(kernel_call, warmup=5, rep=30, quantiles=quantiles)


def autotune(gpu: list[triton.Config], cpu: triton.Config, key: list[str], restore_value: tuple[str, ...] = ()):
    """triton.autotune over `gpu` on a GPU; exactly `cpu` under the interpreter (more than one
    config would make the autotuner time them with a CUDA-only do_bench). Tuning runs the kernel
    several times: safe for a kernel that writes its outputs afresh on each call; one that updates
    a buffer in place names it in restore_value (copied before the trials, put back after)."""
    return triton.autotune(configs=[cpu] if interpreting() else gpu, key=key, do_bench=_quick_bench,
                           restore_value=list(restore_value))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device`; a small stand-in under the interpreter (CPU tensors),
    where every program instance is a Python loop and fewer, longer programs are cheaper."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last dim] tensor with a unit last-dim stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
