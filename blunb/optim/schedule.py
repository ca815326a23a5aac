"""The WSD learning-rate schedule: linear warmup, a stable plateau, cosine decay."""

from __future__ import annotations

import math


def wsd_lr(step: int, max_lr: float, min_lr: float, warmup: int, max_steps: int, stable: int) -> float:
    """The seed's get_lr, exactly: (step+1)/warmup ramp, `stable` steps at max_lr, then cosine to min_lr.

    The decay tail spans max_steps - (warmup + stable) steps, its last step landing on min_lr.
    """
    if warmup + stable >= max_steps:
        raise ValueError(f"WSD schedule has no decay tail: warmup ({warmup}) + stable ({stable}) "
                         f">= max_steps ({max_steps})")
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step < warmup + stable:
        return max_lr
    tail = max_steps - (warmup + stable) - 1
    if tail == 0:  # a one-step tail: the seed divides by zero here; land on min_lr instead
        return min_lr
    decay_ratio = (step - (warmup + stable)) / tail
    if not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"step {step} is past the schedule's last step {max_steps - 1}")
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (max_lr - min_lr)


def as_fp32(value):
    """A learning-rate term as an fp32 kernel sees it: a host float as it is (a kernel rounds its scalars to the
    fp32 it computes in), a device scalar (a captured step's lr, fp64) rounded to fp32 on the device, so both
    give the same bits. Compute the term in fp64 first (1 - lr * wd on the host is fp64 arithmetic too)."""
    return value.float() if hasattr(value, "float") else value
