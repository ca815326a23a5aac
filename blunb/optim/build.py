"""The optimizer sets and their registry: the seed's ZeRO-1 layouts, or torch DDP + AdamW as a baseline.

Every set implements blunb.optim.interface.OptimizerSet and the training loop uses nothing else, so an
optimizer is one module plus one registry line: OPTIMIZERS maps each `optimizer` setting to its builder
and what TrainConfig.validate needs to know of it; register() adds one (CONTRIBUTING.md, "An
optimizer"). Built in: "adamw", "muon", "ddp_adamw" (the baseline the ZeRO arms are measured against)
and "adamw_bf16_nomaster" (the precision study's counter-example, not for training).

Details (what each built-in set is, clipping and skipping): docs/architecture.md, section
"blunb/optim/build.py".
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from blunb.optim.clip import prepare_group_step
from blunb.optim.interface import Builder, OptimizerSet, StepStats
from blunb.optim.muon import ShardedMuon, muon_param_groups
from blunb.optim.schedule import wsd_lr
from blunb.optim.zero_adamw import build_sharded_adamw

if TYPE_CHECKING:
    from blunb.config import TrainConfig

log = logging.getLogger(__name__)

_DTYPE_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _clip_stats_vectors(opts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    norms = torch.stack([o.clip_stats.total_norm.float() for o in opts])
    coefs = torch.stack([o.clip_stats.clip_coef.float() for o in opts])
    skipped = torch.stack([o.clip_stats.found_inf for o in opts])
    return norms, coefs, skipped


class DDPAdamW:
    """torch DDP + fused AdamW on fp32 parameters (autocast bf16 on CUDA), no weight decay on 1-D
    params, torch.nn.utils.clip_grad_norm_ over all parameters. Sync-free: a non-finite norm
    skips the fused update through its found_inf argument instead of a host check."""

    masters = "none (fp32 params)"

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int):
        self.cfg = cfg
        self.device = device
        self.forward_model = model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.forward_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.params = list(model.parameters())
        decay = [p for p in self.params if p.dim() >= 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        self.groups = [("adamw", self.opt, (cfg.max_lr, cfg.min_lr))]
        self.label = "torch DDP + fused AdamW" if world_size > 1 else "torch fused AdamW"
        self.autocast = device.type == "cuda"
        self.world_size = world_size
        self._decayed = sum(p.numel() for p in decay)

    def _compute(self) -> str:
        return "autocast bf16" if self.autocast else "fp32"

    def describe(self) -> dict:
        total = sum(p.numel() for p in self.params)
        return {"label": self.label, "world_size": self.world_size,
                "precision": {"parameters": sorted({_DTYPE_LABEL.get(p.dtype, str(p.dtype)) for p in self.params}),
                              "compute": self._compute(), "masters": self.masters},
                "groups": [{"name": "adamw", "params": total, "lr_max": self.cfg.max_lr, "lr_min": self.cfg.min_lr}],
                "clip": {"max_norm": self.cfg.grad_clip, "mode": "torch clip_grad_norm_ (global)",
                         "covered_params": total, "total_params": total},
                "decayed_params": self._decayed, "non_decayed_params": total - self._decayed}

    @contextmanager
    def micro_step(self, last: bool):
        sync = nullcontext() if last or not hasattr(self.forward_model, "no_sync") else self.forward_model.no_sync()
        with sync, self._cast():
            yield

    def eval_context(self):
        return self._cast()   # validation in the precision training runs in

    def _cast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()

    def set_lr(self, step: int) -> dict:
        c = self.cfg
        lr = wsd_lr(step, c.max_lr, c.min_lr, c.warmup_steps, c.max_steps, c.stable_steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        return {"lr": lr}

    def step(self) -> StepStats:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm).float()
        found_inf = ~torch.isfinite(norm)
        coef = torch.where(found_inf, 1.0, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        self.opt.found_inf = found_inf.float()  # the fused kernel leaves params, moments and steps as they were
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepStats(["adamw"], norm[None], coef[None], found_inf[None])

    def drain(self) -> None:
        pass


class NoMasterAdamW(DDPAdamW):
    """The precision study's counter-example: DDPAdamW's torch AdamW (same groups, clip and skip)
    stepping the model's parameters as they are, so its bf16 Linears are updated in bf16 with bf16
    moments and no fp32 master. No autocast: the model's own precision layout does the casts."""

    masters = "NONE: counter-example, bf16 parameters and moments updated in place by torch AdamW"

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int):
        super().__init__(model, cfg, device, world_size)
        self.autocast = False
        self.label = "COUNTER-EXAMPLE: torch AdamW on bf16 parameters, no fp32 masters"
        bf16 = sum(p.numel() for p in self.params if p.dtype == torch.bfloat16)
        self.bf16_fraction = bf16 / max(sum(p.numel() for p in self.params), 1)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(f"optimizer=adamw_bf16_nomaster is the precision study's COUNTER-EXAMPLE, not a training "
                        f"setup: {100 * self.bf16_fraction:.1f}% of the parameters are bf16 and have no fp32 master, "
                        "so updates below half a bf16 step (the whole weight decay among them) are rounded away")

    def _compute(self) -> str:
        return "the model's precision layout (no autocast)"

    def describe(self) -> dict:
        facts = super().describe()
        facts["counter_example"] = {"bf16_param_fraction": self.bf16_fraction,
                                    "why": "no fp32 master: w*(1-lr*wd) and updates below half a bf16 ulp round "
                                           "to w"}
        return facts


class ZeroOptimizers:
    """The ZeRO-1 groups (AdamW per dtype, with `muon` the body on ShardedMuon), stepped in the seed's order."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int, muon: bool = False):
        self.cfg = cfg
        self.device = device
        self.forward_model = model
        self.world_size = world_size
        adamw_params = list(model.parameters())
        self.muon = None
        if muon:
            muon_group = muon_param_groups(model)[0]["params"]
            self.muon = ShardedMuon([{"params": muon_group, "use_muon": True}], lr=cfg.muon_lr,
                                    momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                                    ns_coefficients=cfg.muon_ns_schedule, ns_precondition=cfg.muon_ns_precondition,
                                    weight_decay=cfg.muon_weight_decay, adjust_lr=cfg.muon_adjust_lr,
                                    collective=cfg.muon_collective, target_buckets=cfg.muon_buckets,
                                    reduce_dtype=cfg.reduce_dtype, overlap_backward=cfg.overlap_backward,
                                    overlap_refresh=cfg.overlap_refresh, stages=model, verbose=False)
            in_muon = {id(p) for p in muon_group}
            adamw_params = [p for p in adamw_params if id(p) not in in_muon]
        adamws = build_sharded_adamw(model, adamw_params, lr=cfg.max_lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip,
                                     collective=cfg.collective, reduce_dtype=cfg.reduce_dtype,
                                     overlap_backward=cfg.overlap_backward, overlap_refresh=cfg.overlap_refresh,
                                     bucket_mb=cfg.bucket_mb)
        self.groups: list[tuple[str, torch.optim.Optimizer, tuple[float, float]]] = [
            (f"adamw_{_DTYPE_LABEL.get(o.dtype, str(o.dtype))}", o, (cfg.max_lr, cfg.min_lr)) for o in adamws]
        if self.muon is not None:  # the body is the largest group: it steps last
            self.groups.append(("muon", self.muon, (cfg.muon_lr, cfg.muon_min_lr)))
        self.label = "ZeRO-1 " + " + ".join(name for name, _, _ in self.groups)
        self._decayed = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
        self._total = sum(p.numel() for p in model.parameters())

    def describe(self) -> dict:
        c = self.cfg
        total = sum(o.total_numel() for _, o, _ in self.groups)
        covered = sum(o.clip_covered_numel() for _, o, _ in self.groups)
        facts = {
            "label": self.label, "world_size": self.world_size,
            "zero": {"collective": c.collective, "muon_collective": c.muon_collective if self.muon else None,
                     "reduce_dtype": c.reduce_dtype, "overlap_backward": c.overlap_backward,
                     "overlap_refresh": c.overlap_refresh, "bucket_mb": c.bucket_mb,
                     "muon_buckets": c.muon_buckets if self.muon else None},
            "state_bytes_this_rank": sum(o.state_bytes() for _, o, _ in self.groups),
            "groups": [{"name": name, "params": o.total_numel(), "lr_max": hi, "lr_min": lo,
                        "dtype": _DTYPE_LABEL.get(getattr(o, "dtype", None), "mixed")}
                       for name, o, (hi, lo) in self.groups],
            "precision": {"masters": "fp32 (in each rank's shard)"},
            "clip": {"max_norm": c.grad_clip,
                     "mode": ("global strict" if c.global_clip_strict else "global (covered)") if c.global_clip
                     else "per group", "covered_params": covered, "total_params": total},
            "decayed_params": self._decayed, "non_decayed_params": self._total - self._decayed,
            "nan_policy": c.nan_policy,
        }
        if self.muon is not None:
            facts["muon"] = {"lr_max": c.muon_lr, "lr_min": c.muon_min_lr, "momentum": c.muon_momentum,
                             "nesterov": True, "ns_steps": c.muon_ns_steps, "ns_schedule": c.muon_ns_schedule,
                             "ns_precondition": c.muon_ns_precondition, "weight_decay": c.muon_weight_decay,
                             "adjust_lr": c.muon_adjust_lr, "matrices": self.muon.num_matrices(),
                             "comm_buffer_bytes": self.muon.comm_buffer_bytes()}
        return facts

    def micro_step(self, last: bool):
        if last:  # overlap_backward reduces buckets from hooks during the last micro-step only
            for _, opt, _ in self.groups:
                opt.arm_grad_sync()
        return nullcontext()

    def eval_context(self):
        return nullcontext()   # the model's own dtypes do the casts, in training and validation alike

    def set_lr(self, step: int) -> dict:
        c = self.cfg
        lrs = {}
        for name, opt, (hi, lo) in self.groups:
            lr = wsd_lr(step, hi, lo, c.warmup_steps, c.max_steps, c.stable_steps)
            held = opt.param_groups[0]["lr"]
            if isinstance(held, torch.Tensor):
                held.fill_(lr)  # queued on the stream: a replay after it reads this step's value
            else:
                opt.param_groups[0]["lr"] = lr
            lrs["lr_muon" if name == "muon" else "lr"] = lr
        return lrs

    def keep_lr_on_device(self) -> None:
        """From now on hold each group's lr as a 0-dim fp64 device tensor that set_lr fills in place, so a captured
        step (blunb.cuda_graph) reads each step's value, not the one it was captured with. fp64: the optimizers
        derive from it on the device exactly what they derive from a host float (schedule.as_fp32)."""
        for _, opt, _ in self.groups:
            lr = opt.param_groups[0]["lr"]
            if not isinstance(lr, torch.Tensor):
                opt.param_groups[0]["lr"] = torch.full((), lr, dtype=torch.float64, device=self.device)

    def step(self) -> StepStats:
        c = self.cfg
        opts = [opt for _, opt, _ in self.groups]
        gclip = prepare_group_step(opts, c.grad_clip, c.global_clip, c.global_clip_strict, c.nan_policy)
        for opt in opts:
            opt.step()
        norms, coefs, skipped = _clip_stats_vectors(opts)
        scalars = {"global_clip_coef": gclip.clip_coef} if gclip is not None else {}
        if self.muon is not None:
            scalars.update(self.muon.step_stats())
        stats = StepStats([name for name, _, _ in self.groups], norms, coefs, skipped, scalars)
        for opt in opts:  # keep the flat-buffer views: every BLU parameter gets a gradient each step
            opt.zero_grad(set_to_none=False)
        return stats

    def drain(self) -> None:
        for _, opt, _ in self.groups:
            opt.drain_refresh()


@dataclass(frozen=True)
class OptimizerSpec:
    """A registered optimizer set: its builder and what TrainConfig.validate and setup read of it."""

    build: Builder
    zero_switches: bool = False     # reads the ZeRO-1 switches (config._ZERO_ONLY); otherwise validate refuses them
    linear_dtype: str | None = None  # what model.linear_dtype=auto becomes under it (None: the model's own choice)
    check: Callable[[TrainConfig], str | None] | None = None   # why a config cannot work with it, or None


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register(name: str, build: Builder, **spec) -> None:
    """Make `build` the optimizer set of optimizer=<name> (spec: OptimizerSpec's other fields)."""
    OPTIMIZERS[name] = OptimizerSpec(build, **spec)


def _bf16_params(cfg: TrainConfig) -> str | None:
    m = cfg.model
    if m.linear_dtype == "fp32" and not (m.bf16_resid or m.bf16_embed):
        return ("it steps bf16 parameters without fp32 masters, but model.linear_dtype=fp32 (and neither bf16_resid "
                "nor bf16_embed) leaves every parameter fp32: it would be plain AdamW. Use linear_dtype=auto or bf16")
    return None


register("adamw", ZeroOptimizers, zero_switches=True)
register("muon", functools.partial(ZeroOptimizers, muon=True), zero_switches=True)
register("ddp_adamw", DDPAdamW, linear_dtype="fp32")
register("adamw_bf16_nomaster", NoMasterAdamW, linear_dtype="bf16", check=_bf16_params)


def build_optimizers(model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int) -> OptimizerSet:
    """The optimizer set for cfg.optimizer (cfg.validate has rejected impossible combinations)."""
    return OPTIMIZERS[cfg.optimizer].build(model, cfg, device, world_size)
