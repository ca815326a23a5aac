"""Fault injection, the testing aids of the trainer's health checks (fault_nan_grad, fault_stall).

fault_nan_grad=STEP:RANK poisons that rank's gradient on that step (the skip path); fault_stall=STEP:RANK
SIGSTOPs that rank as the step starts (the collective timeout). The start lines say when either is set."""

from __future__ import annotations

import os
import signal

import torch

from blunb.config import TrainConfig


class NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: fault_nan_grad's poison, applied to the embedding output
    so the loss stays finite and only the gradients reduced afterwards are non-finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def poison_next_forward(model: torch.nn.Module):
    """Make the next forward's embedding output poison this rank's gradient (one micro-batch)."""
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    handle = None

    def hook(module, args, out):
        handle.remove()
        return NanGradient.apply(out)
    handle = embedding.register_forward_hook(hook)


class Faults:
    """The faults one run injects: the (step, rank) pairs of each setting."""

    def __init__(self, cfg: TrainConfig):
        self.nan_at, self.stall_at = cfg.fault_nan_grad_at(), cfg.fault_stall_at()

    @property
    def active(self) -> bool:
        return bool(self.nan_at or self.stall_at)

    def stall(self, step: int, rank: int) -> None:
        """fault_stall: stop this process where the step starts (its peers then wait in a collective)."""
        if (step, rank) in self.stall_at:
            os.kill(os.getpid(), signal.SIGSTOP)

    def poison(self, model: torch.nn.Module, step: int, rank: int) -> None:
        """fault_nan_grad: poison this rank's gradient of the step's first micro-batch."""
        if (step, rank) in self.nan_at:
            poison_next_forward(model)
