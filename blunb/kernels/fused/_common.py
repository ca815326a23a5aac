"""Helpers shared by the fused kernels: config choice (timed, fixed under deterministic=true, one under the
interpreter), SM count."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import triton

from blunb.determinism import fixed_kernel_configs


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def deterministic() -> bool:
    """Whether the fused kernels run a fixed launch config and no timed choice: under the trainer's
    deterministic=true (unless its bisection leaves the kernels out), else as torch's deterministic flag."""
    return fixed_kernel_configs()


def _quick_bench(kernel_call, quantiles):
    # these kernels run ~0.1-2 ms at training sizes: a few ms of timing per config is enough
    return triton.testing.do_bench(kernel_call, warmup=5, rep=30, quantiles=quantiles)


class Tuned:
    """A triton.autotune'd kernel, launched with one fixed config while deterministic() is on.

    The autotuner picks by timing, which can pick differently in two runs (a close race, a busy GPU),
    and the config sets the reduction order (block sizes, warps per reduction): the bits would follow
    the timing. `fixed` is a triton.Config, or a function of the launch's keyword arguments returning
    one (a choice that depends on the shape only). Everything else (configs_timings, base_fn, ...) is
    the autotuner's."""

    def __init__(self, autotuner, fixed):
        self.autotuner = autotuner
        self._fixed = fixed

    def fixed_config(self, kwargs: dict) -> triton.Config:
        return self._fixed(kwargs) if callable(self._fixed) else self._fixed

    def __getitem__(self, grid):
        if not deterministic():
            return self.autotuner[grid]

        def launch(*args, **kwargs):
            # the autotuner's own launch of its chosen config, with the fixed one: nothing is timed
            return self.autotuner.fn.run(*args, grid=grid, warmup=False, **kwargs,
                                         **self.fixed_config(kwargs).all_kwargs())
        return launch

    def __getattr__(self, name):
        if name == "autotuner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.autotuner, name)


def autotune(gpu: list[triton.Config], cpu: triton.Config, key: list[str], restore_value: tuple[str, ...] = (),
             fixed: triton.Config | None = None) -> Callable[..., Tuned]:
    """triton.autotune over `gpu` on a GPU; exactly `cpu` under the interpreter (more than one
    config would make the autotuner time them with a CUDA-only do_bench). Tuning runs the kernel
    several times: safe for a kernel that writes its outputs afresh on each call; one that updates
    a buffer in place names it in restore_value (copied before the trials, put back after).
    Under torch's deterministic mode the kernel runs `fixed` (default: the first of `gpu`; `cpu`
    under the interpreter), untimed (Tuned)."""
    configs = [cpu] if interpreting() else gpu
    fixed = configs[0] if interpreting() or fixed is None else fixed

    def wrap(fn):
        return Tuned(triton.autotune(configs=configs, key=key, do_bench=_quick_bench,
                                     restore_value=list(restore_value))(fn), fixed)
    return wrap


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
