"""The training loop's optimizer set: the seed's ZeRO-1 layouts, or torch DDP + AdamW as a baseline.

- "adamw": one ShardedAdamW per parameter dtype (fp32 embedding / scales, bf16 Linears on
  GPU), stepped smallest first and the largest group last (the seed's step order).
- "muon": ShardedMuon on the transformer body's 2-D matrices (whole-matrix owners), the
  rest (embedding, lm_head, every 1-D scale) on dtype-grouped ShardedAdamW; each group on
  the same WSD curve with its own (max, min) lr.
- "ddp_adamw": torch DDP + torch.optim.AdamW (fused on CUDA), the reference the ZeRO arms
  are measured against.

Clipping: each group clips on its own exact norm; with global_clip one coefficient for all
groups, derived from the norm of what it scales (covered) unless global_clip_strict. Muon's
orthogonalized matrices are never clipped.

Skipping: with nan_policy="step" (the default, the AMP / DeepSpeed rule) a non-finite gradient
norm in any group skips the whole step in every group on every rank; nan_policy="group" is the
reference trainer's rule (only the group whose norm is non-finite skips; with global_clip the
global norm decides for all).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from blunb.config import TrainConfig
from blunb.optim.schedule import wsd_lr

_DTYPE_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class DDPAdamW:
    """torch DDP + AdamW, no weight decay on 1-D params, clip_grad_norm_."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int):
        self.cfg = cfg
        self.forward_model = model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.forward_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.params = list(model.parameters())
        groups = [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(0.9, 0.95), eps=1e-8,
                                     fused=device.type == "cuda")
        self.label = "torch DDP + AdamW" if world_size > 1 else "torch AdamW"

    def describe(self) -> str:
        return f"optimizer: {self.label}, clip {self.cfg.grad_clip:g} on all parameters"

    def micro_step(self, last: bool):
        return nullcontext() if last or not hasattr(self.forward_model, "no_sync") else self.forward_model.no_sync()

    def set_lr(self, step: int) -> dict:
        c = self.cfg
        lr = wsd_lr(step, c.max_lr, c.min_lr, c.warmup_steps, c.max_steps, c.stable_steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        return {"lr": lr}

    def step(self) -> dict:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if math.isfinite(norm):  # one optimizer: a skipped step is skipped everywhere
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "skipped": int(not math.isfinite(norm)), "skipped_groups": []}

    def drain(self) -> None:
        pass


class ZeroOptimizers:
    """The ZeRO-1 groups ("adamw" or "muon"), stepped in the seed's order."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int):
        from blunb.optim.muon import ShardedMuon, muon_param_groups
        from blunb.optim.zero_adamw import ShardedAdamW

        self.cfg = cfg
        self.forward_model = model
        self.world_size = world_size
        zero_kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip,
                       collective=cfg.collective, reduce_dtype=cfg.reduce_dtype,
                       overlap_backward=cfg.overlap_backward, overlap_refresh=cfg.overlap_refresh,
                       bucket_mb=cfg.bucket_mb, stages=model if cfg.overlap_refresh else None)
        self.groups: list[tuple[str, torch.optim.Optimizer, tuple[float, float]]] = []
        adamw_params = list(model.parameters())
        self.muon = None
        if cfg.optimizer == "muon":
            muon_group = muon_param_groups(model)[0]["params"]
            self.muon = ShardedMuon([{"params": muon_group, "use_muon": True}], lr=cfg.muon_lr,
                                    momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                                    weight_decay=cfg.muon_weight_decay, adjust_lr=cfg.muon_adjust_lr,
                                    collective=cfg.collective, verbose=False)
            in_muon = {id(p) for p in muon_group}
            adamw_params = [p for p in adamw_params if id(p) not in in_muon]
        by_dtype: dict[torch.dtype, list] = {}
        for p in adamw_params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, ps in sorted(by_dtype.items(), key=lambda kv: sum(p.numel() for p in kv[1])):
            opt = ShardedAdamW(ps, lr=cfg.max_lr, **zero_kw)
            self.groups.append((f"adamw-{_DTYPE_LABEL.get(dtype, dtype)}", opt, (cfg.max_lr, cfg.min_lr)))
        if self.muon is not None:  # the body is the largest group: it steps last
            self.groups.append(("muon", self.muon, (cfg.muon_lr, cfg.muon_min_lr)))
        self.label = "ZeRO-1 " + " + ".join(name for name, _, _ in self.groups)

    def describe(self) -> str:
        total = sum(o.total_numel() for _, o, _ in self.groups)
        covered = sum(o.clip_covered_numel() for _, o, _ in self.groups)
        mib = sum(o.state_bytes() for _, o, _ in self.groups) / 2**20
        lines = [f"optimizer: {self.label} over {self.world_size} rank(s), collective {self.cfg.collective}, "
                 f"state {mib:.1f} MiB on this rank"]
        if self.muon is not None and self.muon.comm_buffer_bytes():
            lines[0] += f" (+ {self.muon.comm_buffer_bytes() / 2**20:.1f} MiB of Muon collective buckets)"
        for i, (name, opt, (hi, lo)) in enumerate(self.groups):
            lines.append(f"  G{i} {name}: {opt.total_numel():,} params, lr {hi:g} -> {lo:g}")
        clip = "global" + (" strict" if self.cfg.global_clip_strict else " (covered)") \
            if self.cfg.global_clip else "per group"
        pct = 100.0 * covered / max(total, 1)
        lines.append(f"  grad clip {self.cfg.grad_clip:g} ({clip}) covers {covered:,} / {total:,} params ({pct:.2f}%)")
        if self.cfg.grad_clip > 0 and pct < 25.0:
            lines.append(f"  WARNING: the clip leaves {100 - pct:.2f}% of parameters (the orthogonalized matrices) "
                         "unclipped")
        return "\n".join(lines)

    def micro_step(self, last: bool):
        if last:  # overlap_backward reduces buckets from hooks during the last micro-step only
            for _, opt, _ in self.groups:
                opt.arm_grad_sync()
        return nullcontext()

    def set_lr(self, step: int) -> dict:
        c = self.cfg
        lrs = {}
        for name, opt, (hi, lo) in self.groups:
            lr = wsd_lr(step, hi, lo, c.warmup_steps, c.max_steps, c.stable_steps)
            opt.param_groups[0]["lr"] = lr
            lrs["lr_muon" if name == "muon" else "lr"] = lr
        return lrs

    def step(self) -> dict:
        from blunb.optim.zero_adamw import global_clip

        opts = [opt for _, opt, _ in self.groups]
        gclip = global_clip(opts, self.cfg.grad_clip, strict=self.cfg.global_clip_strict) \
            if self.cfg.global_clip and self.cfg.grad_clip > 0 else None
        if gclip is None and self.cfg.nan_policy == "step" and len(opts) > 1:
            # Every group's norm first, then one verdict for all of them (sync-free).
            found = torch.stack([~torch.isfinite(opt.reduce_and_measure()[0]) for opt in opts]).any()
            for opt in opts:
                opt.set_external_clip_coef(None, found)
        for opt in opts:
            opt.step()
        n = len(opts)
        norms = torch.stack([opt.clip_stats.total_norm for opt in opts]).float()
        skipped = torch.stack([opt.clip_stats.found_inf for opt in opts]).float()
        host = torch.cat([norms, skipped] + ([gclip.clip_coef.float()[None]] if gclip else [])).tolist()
        names = [f"G{i}({name})" for i, (name, _, _) in enumerate(self.groups)]
        out = {"grad_norm": math.sqrt(sum(v * v for v in host[:n])), "skipped": int(any(host[n:2 * n])),
               "skipped_groups": [name for name, s in zip(names, host[n:2 * n]) if s]}
        out["group_norms"] = dict(zip(names, host[:n]))
        if gclip is not None:
            out["global_clip"] = host[-1]
        if self.muon is not None:
            out["nsrej"] = (self.muon.ns_rejected_last_step, self.muon.rejected_ns_updates)
            out["nsratio"] = self.muon.ns_max_update_ratio
        for opt in opts:  # keep the flat-buffer views: every BLU parameter gets a gradient each step
            opt.zero_grad(set_to_none=False)
        return out

    def drain(self) -> None:
        for _, opt, _ in self.groups:
            opt.drain_refresh()


def build_optimizers(model: nn.Module, cfg: TrainConfig, device: torch.device, world_size: int):
    """The optimizer set for cfg.optimizer (cfg.validate has rejected impossible combinations)."""
    if cfg.optimizer == "ddp_adamw":
        return DDPAdamW(model, cfg, device, world_size)
    return ZeroOptimizers(model, cfg, device, world_size)


def check_replicas(model: nn.Module, world_size: int) -> bool:
    """True when every rank holds the same parameters (a --diag check: an fp64 sum per tensor,
    summed, compared exactly across ranks)."""
    mine = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    if world_size == 1:
        return True
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, gathered[0]) for g in gathered)
