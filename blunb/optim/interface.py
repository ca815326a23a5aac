"""What the training loop steps: the OptimizerSet interface and its per-step statistics.

blunb.train uses nothing of an optimizer set beyond OptimizerSet; blunb.optim.build's registry maps
each `optimizer` setting to the builder of one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from blunb.config import TrainConfig


@dataclass
class StepStats:
    """One optimizer step's statistics, as device tensors: the loop copies them to the host in
    one batched read (`values()` then `StepRecord.from_values`), never one sync per number."""

    group_names: list[str]
    norms: torch.Tensor                 # [G] gradient norm of each group (the full group, for the log)
    clip_coefs: torch.Tensor            # [G] coefficient applied to each group (1 = unclipped or skipped)
    skipped: torch.Tensor               # [G] 1 where the group did not step
    # Further 0-dim statistics by name (e.g. "global_clip_coef", Muon's "ns_rejected"): an integer
    # tensor is read back as an int, any other as a float.
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)

    def values(self) -> torch.Tensor:
        """Everything as one fp32 vector on the device (the order StepRecord.from_values reads)."""
        extra = [t.reshape(1).float() for t in self.scalars.values()]
        return torch.cat([self.norms.float(), self.clip_coefs.float(), self.skipped.float(), *extra])


@dataclass
class StepRecord:
    """StepStats read back to the host: what the step line and metrics.csv show."""

    grad_norm: float
    group_norms: dict[str, float]
    group_clip: dict[str, float]
    group_skipped: dict[str, bool]
    scalars: dict[str, float | int] = field(default_factory=dict)
    skipped_groups: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> bool:
        """The step changed nothing in at least one group."""
        return bool(self.skipped_groups)

    @classmethod
    def from_values(cls, stats: StepStats, values: list[float]) -> "StepRecord":
        names, n = stats.group_names, len(stats.group_names)
        norms, coefs, skipped, rest = values[:n], values[n:2 * n], values[2 * n:3 * n], values[3 * n:]
        scalars = {k: v if t.is_floating_point() else int(v) for (k, t), v in zip(stats.scalars.items(), rest)}
        return cls(grad_norm=math.sqrt(sum(v * v for v in norms)), group_norms=dict(zip(names, norms)),
                   group_clip=dict(zip(names, coefs)), group_skipped={k: bool(s) for k, s in zip(names, skipped)},
                   scalars=scalars, skipped_groups=[k for k, s in zip(names, skipped) if s])


class OptimizerSet(Protocol):
    """The interface every optimizer set implements (the training loop uses nothing else)."""

    cfg: TrainConfig                    # the config it was built from
    forward_model: nn.Module            # the module to call for the loss (a DDP wrapper or the model)
    # [(name, optimizer, (lr_max, lr_min))] in step order; an optimizer that is
    # blunb.optim.state.ShardedStateful is checkpointed per parameter, any other as torch's
    groups: list[tuple[str, torch.optim.Optimizer, tuple[float, float]]]

    def micro_step(self, last: bool) -> AbstractContextManager:
        """The context around each micro-batch's forward + backward (`last`: the step's final one)."""
        ...

    def eval_context(self) -> AbstractContextManager:
        """The context around a validation forward: the compute precision of micro_step's forward, so that
        validation measures the model as it trains."""
        ...

    def set_lr(self, step: int) -> dict[str, float]:
        """Set this step's learning rates; returns them by name ("lr" always, more by name)."""
        ...

    def step(self) -> StepStats:
        """One optimizer step; its statistics stay on the device."""
        ...

    def drain(self) -> None:
        """Install any staged parameter refresh (before anything reads the weights)."""
        ...

    def describe(self) -> dict:
        """The start-of-run facts: "label", "world_size", "precision" {"masters", ...}, "groups"
        [{"name", "params", "lr_max", "lr_min"}], "clip" {"max_norm", "mode", "covered_params",
        "total_params"}, "decayed_params", "non_decayed_params"; more keys as the set has them."""
        ...


# What the registry maps a name to: (model, cfg, device, world_size) -> the set.
Builder = Callable[[nn.Module, "TrainConfig", torch.device, int], OptimizerSet]
