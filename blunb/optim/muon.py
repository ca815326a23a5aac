"""ShardedMuon: ZeRO-1 over WHOLE tensors, Muon for matrices plus an auxiliary AdamW.

Why whole tensors: AdamW is elementwise, so any flat cut of the parameter buffer is a valid shard;
Newton-Schulz orthogonalizes a whole matrix, so a flat cut through a matrix would not be Muon. Each
parameter therefore has exactly ONE owner rank (a longest-processing-time-first partition of the cost,
computed identically on every rank from shapes and order alone), which holds its state and computes its
whole update; the updated parameter is then published to every rank. The switches mean what they mean
for ShardedAdamW; the serial and the overlapped paths issue the SAME collectives, in the same order, on
the same bytes, so their results are bit-identical by construction. Nothing in the step syncs with the
host.

Details (the collective layouts, the switches, the update, clipping and the divergence guard,
param_groups): docs/architecture.md, section "blunb/optim/muon.py".
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from blunb import diag
from blunb.optim import collectives
from blunb.optim.clip import ClipStats, clip_stats_from_sq_norm
from blunb.optim.hooks import remove_hooks, weak_hook
from blunb.optim.layout import (
    COLLECTIVES,
    REDUCE_DTYPES,
    as_stages,
    lpt_partition,
    muon_buckets,
    ns_cost,
    publish_order,
    stage_index,
    stage_waits,
)
from blunb.optim.newton_schulz import NewtonSchulz
from blunb.optim.schedule import as_fp32
from blunb.optim.state import check_state_kind, local_piece, sharded_tensor, state_keys

log = logging.getLogger(__name__)

GUARD_MAX_ABS = 1000.0
# Cap on the step's fp32 gradient scratch: a shape group is stepped in runs of whole
# matrices of at most this many bytes (a few kernels per run, bounded extra memory).
SCRATCH_BYTES = 256 << 20
ADJUST_LR = ("match_rms_adamw", "original")


def adjust_lr_ratio(shape, adjust_lr: str) -> float:
    """torch.optim.Muon's per-shape lr multiplier."""
    A, B = shape[:2]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, A / B))
    return 0.2 * math.sqrt(max(A, B))


@dataclass
class _ShapeGroup:
    """Owned matrices of one shape (orientation included): one batched NS call in their own
    layout, and their fp32 state in two [n, rows, cols] buffers (state[p] holds views), so
    every elementwise pass over the group is a few contiguous kernels, not a few per matrix."""
    rows: int
    cols: int
    params: list
    master: torch.Tensor
    momentum: torch.Tensor
    ratio_t: torch.Tensor                         # adjust_lr multiplier per matrix
    has_grad_t: torch.Tensor                      # all True: the common case needs no host->device copy
    runs: list                                    # [lo, hi) matrix ranges within SCRATCH_BYTES of fp32


@dataclass
class _Bucket:
    chunk: int                                    # padded per-rank sub-chunk numel
    flat: torch.Tensor                            # [world * chunk], param dtype: AG output
    own: torch.Tensor                             # [chunk], param dtype: AG input (owned params)
    rflat: torch.Tensor                           # [world * chunk], reduce dtype: RS input (is `flat` if equal)
    rown: torch.Tensor                            # [chunk], reduce dtype: RS output (is `own` if equal)
    params: list = field(default_factory=list)    # every tensor in the bucket, all ranks'
    views: list = field(default_factory=list)     # its slot in `flat`
    rviews: list = field(default_factory=list)    # its slot in `rflat`
    own_params: list = field(default_factory=list)
    own_views: list = field(default_factory=list)   # its slot in `own` (owned tensors only)
    rown_views: list = field(default_factory=list)  # its slot in `rown`: the averaged gradient


def muon_param_groups(model: nn.Module, exclude: tuple[str, ...] = ("lm_head",)) -> list[dict]:
    """The seed's split: Muon for the transformer body's 2-D matrices; AdamW for the token
    embedding (every nn.Embedding), modules named in `exclude` (the output head; a tied
    head is the embedding itself) and every non-2-D tensor (RMSNorm / QK-norm scales)."""
    excluded = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.rsplit(".", 1)[-1] in exclude:
            excluded.update(id(p) for p in module.parameters())
    muon, aux = [], []
    for p in model.parameters():  # deduplicated: a tied weight appears once
        if p.requires_grad:
            (muon if p.ndim == 2 and id(p) not in excluded else aux).append(p)
    return [{"params": muon, "use_muon": True}, {"params": aux, "use_muon": False}]


def build_muon(model: nn.Module, *, lr: float, adamw_lr: float, weight_decay: float = 0.1,
               momentum: float = 0.95, ns_steps: int = 5, max_grad_norm: float = 0.0,
               **kwargs) -> "ShardedMuon":
    """ShardedMuon over `model` with the seed's split (see muon_param_groups)."""
    return ShardedMuon(muon_param_groups(model), lr=lr, momentum=momentum, ns_steps=ns_steps,
                       weight_decay=weight_decay, adamw_lr=adamw_lr, max_grad_norm=max_grad_norm, **kwargs)


class ShardedMuon(torch.optim.Optimizer):
    """See the module docstring. `params`: tensors (2-D -> Muon, others -> AdamW) or
    dicts {"params": [...], "use_muon": bool} to decide explicitly (see muon_param_groups).

    Beyond the shared signature: max_grad_norm (aux-part clip; 0 disables),
    adamw_weight_decay (default weight_decay; applied to >= 2-D aux tensors only),
    ns_coefficients (a schedule name in newton_schulz.NS_SCHEDULES, "fixed" by default, or
    (a, b, c), or ns_steps triples; see NewtonSchulz), ns_precondition ("none" or "aol", the
    Newton-Schulz start; see NewtonSchulz), ns_graphs / ns_syrk (None = auto; see NewtonSchulz),
    verbose (rank-0 construction report).

    reduce_dtype, overlap_backward, overlap_refresh: see the module docstring. `stages`
    (required by overlap_refresh, ignored otherwise, as ShardedAdamW): the model itself
    (split by layout.refresh_stages), or a list of (module, params) in forward order
    whose params are installed by a forward pre-hook on that module (stage 0's module
    should be the model root). Give the parameters in forward order: the gradient
    reduction is issued in their reverse order.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.1, adjust_lr: str = "match_rms_adamw", process_group=None,
                 collective: str = "rs_ag", target_buckets: int = 6, adamw_lr: float | None = None,
                 adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, *, max_grad_norm: float = 0.0,
                 adamw_weight_decay: float | None = None, ns_coefficients="fixed", ns_precondition: str = "none",
                 ns_graphs: bool | None = None, ns_syrk: bool | None = None, reduce_dtype: str = "param",
                 overlap_backward: bool = False, overlap_refresh: bool = False, stages=None,
                 verbose: bool = True):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        if target_buckets < 1:
            raise ValueError(f"target_buckets must be >= 1, got {target_buckets}")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {tuple(REDUCE_DTYPES)}, got {reduce_dtype!r}")
        if overlap_refresh and stages is None:
            raise ValueError("overlap_refresh=True needs stages= (the model, or a list of (module, params) "
                             "in forward order) so forward pre-hooks can install each stage")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("lr, momentum and weight_decay must be >= 0")

        muon, aux = self._split(params)
        muon_group = {"params": muon, "kind": "muon", "lr": lr, "momentum": momentum, "nesterov": nesterov,
                      "ns_steps": ns_steps, "weight_decay": weight_decay, "adjust_lr": adjust_lr}
        aux_group = {"params": aux, "kind": "adamw", "lr": lr if adamw_lr is None else adamw_lr,
                     "betas": tuple(adamw_betas), "eps": adamw_eps,
                     "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay}
        super().__init__([muon_group, aux_group], {"lr": lr})

        self.max_grad_norm = float(max_grad_norm)
        self.collective = collective
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.ns = NewtonSchulz(ns_steps, ns_coefficients, graphs=ns_graphs, syrk=ns_syrk, precondition=ns_precondition)
        self.device = (muon + aux)[0].device
        self.reduce_dtype = reduce_dtype
        self.overlap_backward = overlap_backward and self.world > 1
        self.overlap_refresh = overlap_refresh

        self._muon_params, self._aux_params = muon, aux
        self._red_dtype = {p: REDUCE_DTYPES[reduce_dtype] or p.dtype for p in muon + aux}
        self._owner: dict[torch.Tensor, int] = {}
        for p, r in zip(muon, lpt_partition([ns_cost(p.shape, ns_steps) for p in muon], self.world)):
            self._owner[p] = r
        for p, r in zip(aux, lpt_partition([float(p.numel()) for p in aux], self.world)):
            self._owner[p] = r
        self._owned_muon = [p for p in muon if self._owner[p] == self.rank]
        self._owned_aux = [p for p in aux if self._owner[p] == self.rank]

        self._groups = self._shape_groups(adjust_lr)   # also the matrices' state
        for p in self._owned_aux:  # each with its own step count, as torch.optim.AdamW
            self.state[p] = {"master": p.detach().float().clone(),
                             "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                             "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                             "adamw_step": torch.zeros((), dtype=torch.float32, device=p.device)}

        self._buckets = self._build_buckets(target_buckets) if collective == "rs_ag" and self.world > 1 else []
        self._own_grad: dict[torch.Tensor, torch.Tensor] = {}
        self._no_grad: set[torch.Tensor] = set()   # owned tensors whose .grad was None at the reduce
        self._reduced = False
        self._build_units()
        self._armed = False
        self._missing: list[int] = []      # per unit: gradients still to arrive in the armed backward
        self._next_unit = 0                # position in _grad_order of the next unit to issue
        self._grad_works: list = []
        self._red: dict[torch.Tensor, torch.Tensor] = {}  # reduce_bcast: each tensor's reduce buffer
        self._pending_publish: list = []   # per publish position: (async works, unit), not yet installed
        self._installed = 0
        self._stage_map = None

        self._hook_handles: list = []
        weakref.finalize(self, remove_hooks, self._hook_handles)
        if self.overlap_backward:  # a tensor without requires_grad is left to the serial reduce
            for p in muon + aux:
                if p.requires_grad:
                    self._hook_handles.append(
                        p.register_post_accumulate_grad_hook(weak_hook(self, "_on_grad", self._unit_of[p])))
        if overlap_refresh:
            self._set_stages(as_stages(stages))
        self._external_coef = self._external_found_inf = None
        zero = lambda: torch.zeros((), dtype=torch.float32, device=self.device)  # noqa: E731
        self._skipped, self._rejected_total = zero(), zero()
        self._rejected_last, self._ratio_last = zero(), zero()
        self._clip_stats: ClipStats | None = None
        if verbose and self.rank == 0:
            log.info(self.describe())

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _split(params):
        items = list(params)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        muon, aux, seen = [], [], set()
        for g in groups:
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in ShardedMuon's params")
                seen.add(id(p))
                use_muon = g.get("use_muon")
                use_muon = p.ndim == 2 if use_muon is None else bool(use_muon)
                if use_muon and p.ndim != 2:
                    raise ValueError(f"Muon needs 2-D parameters, got shape {tuple(p.shape)}")
                (muon if use_muon else aux).append(p)
        if not muon and not aux:
            raise ValueError("ShardedMuon got an empty parameter list")
        return muon, aux

    def _shape_groups(self, adjust_lr: str) -> list[_ShapeGroup]:
        """The owned matrices by shape, with their state allocated per group."""
        by_shape: dict[tuple[int, int], list] = {}
        for p in self._owned_muon:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        groups = []
        for (rows, cols), ps in by_shape.items():
            master = torch.empty(len(ps), rows, cols, dtype=torch.float32, device=self.device)
            torch._foreach_copy_(list(master), [p.detach() for p in ps])
            momentum = torch.zeros_like(master)
            for p, m, b in zip(ps, master, momentum):
                self.state[p] = {"master": m, "momentum_buffer": b}
            per_run = max(1, SCRATCH_BYTES // (rows * cols * 4))
            groups.append(_ShapeGroup(
                rows, cols, ps, master, momentum,
                ratio_t=torch.tensor([adjust_lr_ratio(p.shape, adjust_lr) for p in ps], dtype=torch.float32,
                                     device=self.device),
                has_grad_t=torch.ones(len(ps), dtype=torch.bool, device=self.device),
                runs=[(lo, min(lo + per_run, len(ps))) for lo in range(0, len(ps), per_run)]))
        return groups

    def _build_buckets(self, target: int) -> list[_Bucket]:
        everything = self._muon_params + self._aux_params
        plan = muon_buckets([p.numel() for p in everything], [p.dtype for p in everything],
                            [self._owner[p] for p in everything], self.world, target)
        buckets = []
        for dtype, runs, chunk in plan:
            red = REDUCE_DTYPES[self.reduce_dtype] or dtype
            flat = torch.zeros(self.world * chunk, dtype=dtype, device=self.device)
            own = torch.zeros(chunk, dtype=dtype, device=self.device)
            # Reduce and publish share the buffers when the dtypes agree: the publish
            # only starts after the update has consumed the gradients.
            rflat = flat if red == dtype else torch.zeros(self.world * chunk, dtype=red, device=self.device)
            rown = own if red == dtype else torch.zeros(chunk, dtype=red, device=self.device)
            b = _Bucket(chunk, flat, own, rflat, rown)
            for r, run in enumerate(runs):
                off = 0
                for p in (everything[i] for i in run):
                    lo, hi = r * chunk + off, r * chunk + off + p.numel()
                    b.params.append(p)
                    b.views.append(flat[lo:hi].view(p.shape))
                    b.rviews.append(rflat[lo:hi].view(p.shape))
                    if r == self.rank:
                        b.own_params.append(p)
                        b.own_views.append(own[off: off + p.numel()].view(p.shape))
                        b.rown_views.append(rown[off: off + p.numel()].view(p.shape))
                    off += p.numel()
            buckets.append(b)
        return buckets

    def _build_units(self) -> None:
        """The collective units (an rs_ag bucket, or one tensor for reduce_bcast; none at W = 1)
        and their fixed orders, the same on every rank: gradients in backward order (a unit
        is complete once its earliest parameter's gradient arrives), publishes in forward order."""
        everything = self._muon_params + self._aux_params
        if self.world == 1:
            self._units = []
        elif self.collective == "rs_ag":
            self._units = [b.params for b in self._buckets]
        else:
            self._units = [[p] for p in everything]
        index = {p: i for i, p in enumerate(everything)}
        self._unit_first = first = [min(index[p] for p in unit) for unit in self._units]
        self._unit_of = {p: u for u, unit in enumerate(self._units) for p in unit}
        self._grad_order = sorted(range(len(self._units)), key=lambda u: -first[u])
        self._publish_order = sorted(range(len(self._units)), key=lambda u: first[u])

    def describe(self) -> str:
        n_muon = sum(p.numel() for p in self._muon_params)
        n_aux = self.clip_covered_numel()
        total = n_muon + n_aux
        pct = 100.0 * n_aux / max(total, 1)
        g0, g1 = self.param_groups
        clip = (f"grad clip max_grad_norm={self.max_grad_norm:g} APPLIES TO {n_aux} / {total} params ({pct:.2f}%), "
                f"the aux-AdamW part; the {len(self._muon_params)} orthogonalized matrices are never clipped")
        if self.max_grad_norm <= 0:
            clip = f"grad clip off (would cover {n_aux} / {total} params, {pct:.2f}%)"
        elif pct < 25.0:
            clip += f"\n[ShardedMuon] *** WARNING: grad clip leaves {100 - pct:.2f}% of parameters unclipped ***"
        return (f"[ShardedMuon] {len(self._muon_params)} matrices ({n_muon} params) -> Muon "
                f"(lr {g0['lr']:g}, momentum {g0['momentum']}, nesterov {g0['nesterov']}, NS{g0['ns_steps']} "
                f"{self.ns.schedule}, "
                f"adjust_lr {g0['adjust_lr']}, wd {g0['weight_decay']}); {len(self._aux_params)} tensors "
                f"({n_aux} params) -> AdamW (lr {g1['lr']:g}); world {self.world}, collective {self.collective}, "
                f"{len(self._buckets)} buckets, reduce_dtype {self.reduce_dtype}, overlap_backward "
                f"{self.overlap_backward}, overlap_refresh {self.overlap_refresh}\n[ShardedMuon] {clip}")

    # ------------------------------------------------------------------ shared surface
    def owner_of(self, param: torch.Tensor) -> int:
        return self._owner[param]

    def clip_covered_numel(self) -> int:
        return sum(p.numel() for p in self._aux_params)

    def total_numel(self) -> int:
        return sum(p.numel() for p in self._muon_params + self._aux_params)

    def set_external_clip_coef(self, coef, found_inf=None) -> None:
        """Use `coef` (float or 0-dim tensor) instead of our own clip coefficient for the
        next step only (a global clip across optimizers); None clears it. `found_inf` (a
        0-dim bool tensor): another group's norm is non-finite, so this step is skipped too."""
        self._external_coef, self._external_found_inf = coef, found_inf

    def arm_grad_sync(self) -> None:
        """Call before the LAST micro-step's backward: with overlap_backward, units reduce
        from the gradient hooks as they complete (a no-op otherwise)."""
        if self.overlap_backward:
            self._wait_grad_works()    # armed again without a step: start the reduction over
            self._missing = [len(unit) for unit in self._units]
            self._next_unit = 0
            self._armed = True

    def drain_refresh(self) -> None:
        """Install every parameter still in flight (before validation, checkpoint or exit)."""
        self._install(len(self._pending_publish))
        self._pending_publish, self._installed = [], 0

    def refresh_stage_map(self) -> dict | None:
        """What overlap_refresh's forward pre-hooks wait for (None without overlap_refresh):
        {"stages": per stage {"params", "numel", "bytes", "collectives"} of the publishes its
        pre-hook waits for and installs (beyond the earlier stages'; at W = 1 nothing is in
        flight), "uncovered": the parameters no stage names (they wait at stage 0); map them
        to names through model.named_parameters() by identity}."""
        return self._stage_map

    @property
    def clip_stats(self) -> ClipStats | None:
        """After step(): total_norm = the full gradient norm (matrices included, for the
        log), clip_coef = the coefficient applied to the aux part (from that part's norm,
        or the external one), clipped, found_inf (-> the step was skipped)."""
        return self._clip_stats

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped.item())

    @property
    def ns_rejected_last_step(self) -> int:
        return int(self._rejected_last.item())

    @property
    def rejected_ns_updates(self) -> int:
        return int(self._rejected_total.item())

    @property
    def ns_max_update_ratio(self) -> float:
        return float(self._ratio_last.item())

    def step_stats(self) -> dict[str, torch.Tensor]:
        """The last step's divergence-guard figures as 0-dim device tensors (no sync): ns_rejected
        (matrix updates rejected, int), ns_rejected_total (over the run, int), ns_ratio (the worst
        accepted ||U||_F / sqrt(min(rows, cols)))."""
        return {"ns_rejected": self._rejected_last.long(), "ns_rejected_total": self._rejected_total.long(),
                "ns_ratio": self._ratio_last}

    def num_matrices(self) -> int:
        """The matrices Muon orthogonalizes (the rest is aux AdamW)."""
        return len(self._muon_params)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (fp32 masters, momenta, moments)."""
        seen, total = set(), 0
        for st in self.state.values():
            for t in st.values():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    def comm_buffer_bytes(self) -> int:
        """Bytes of the rs_ag buckets (their reduce buffers counted once when shared)."""
        total = 0
        for b in self._buckets:
            bufs = {id(t): t for t in (b.flat, b.own, b.rflat, b.rown)}.values()
            total += sum(t.numel() * t.element_size() for t in bufs)
        return total

    def replica_checksum(self) -> torch.Tensor:
        """blunb.diag's bit-level hash of every parameter (equal on all ranks iff the replicas
        are, barring collisions). Installs pending refreshes first."""
        self.drain_refresh()
        return diag.replica_checksum(self._muon_params + self._aux_params)

    # ------------------------------------------------------------------ reduction
    @torch.no_grad()
    def reduce_and_measure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Average every gradient over ranks onto its owner; return (sq_norm_total,
        sq_norm_covered), 0-dim fp32 device tensors summed over ranks (covered = the
        aux-AdamW part, the only part the clip scales). The next step() reuses this."""
        W = self.world
        owned = self._owned_muon + self._owned_aux
        self._no_grad = {p for p in owned if p.grad is None}
        if W == 1:  # no reduce, but the gradient still takes the reduce dtype, as at any W
            self._own_grad = {p: self._grad(p).to(self._red_dtype[p]) for p in owned}
        else:
            start = self._next_unit if self._armed else 0
            for u in self._grad_order[start:]:     # the units the hooks did not issue
                self._grad_works += self._reduce_unit(u)
            self._armed = False
            self._wait_grad_works()
            if self.collective == "rs_ag":
                self._own_grad = {}
                for b in self._buckets:
                    b.rown.mul_(1.0 / W)
                    self._own_grad.update(zip(b.own_params, b.rown_views))
            else:
                self._own_grad = {p: self._red[p].mul_(1.0 / W) for p in owned}
            self._red = {}
        sq = torch.stack([self._sq_norm([self._own_grad[p] for p in self._owned_muon]),
                          self._sq_norm([self._own_grad[p] for p in self._owned_aux])])
        if W > 1:
            dist.all_reduce(sq, group=self.process_group)
        self._sq_total, self._sq_covered = sq[0] + sq[1], sq[1]
        self._reduced = True
        return self._sq_total, self._sq_covered

    @torch.no_grad()
    def _reduce_unit(self, u: int) -> list:
        """Issue unit u's gradient reduction (SUM, asynchronous); the serial and the
        overlapped paths both come through here, so they issue the same bytes."""
        self.drain_refresh()   # the new parameters must have landed (rs_ag: `flat` is also the RS input)
        if self.collective == "rs_ag":
            b = self._buckets[u]
            have = [(v, p.grad) for v, p in zip(b.rviews, b.params) if p.grad is not None]
            if have:
                torch._foreach_copy_([v for v, _ in have], [g for _, g in have])
            for v, p in zip(b.rviews, b.params):
                if p.grad is None:
                    v.zero_()
            return [collectives.reduce_scatter(b.rown, b.rflat, op=dist.ReduceOp.SUM, group=self.process_group,
                                               async_op=True)]
        (p,) = self._units[u]
        rd = self._red_dtype[p]
        # In place on .grad when the dtypes agree (it is collective scratch afterwards).
        red = self._red[p] = torch.zeros_like(p, dtype=rd) if p.grad is None else p.grad.to(rd)
        return [dist.reduce(red, group_dst=self._owner[p], op=dist.ReduceOp.SUM, group=self.process_group,
                            async_op=True)]

    def _on_grad(self, u: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of a parameter of unit u: when armed, issue every unit
        whose gradients are now complete, strictly in the fixed order (so every rank issues
        the same sequence)."""
        if not self._armed:
            return
        self._missing[u] -= 1
        order = self._grad_order
        while self._next_unit < len(order) and self._missing[order[self._next_unit]] == 0:
            self._grad_works += self._reduce_unit(order[self._next_unit])
            self._next_unit += 1

    def _wait_grad_works(self) -> None:
        for w in self._grad_works:
            w.wait()
        self._grad_works = []

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _sq_norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    def _make_clip_stats(self) -> ClipStats:
        covered = clip_stats_from_sq_norm(self._sq_covered, self.max_grad_norm)
        total_norm = self._sq_total.sqrt()
        found_inf = ~torch.isfinite(total_norm) | covered.found_inf
        if self._external_found_inf is not None:
            found_inf = found_inf | self._external_found_inf.to(self.device)
        coef = covered.clip_coef
        if self._external_coef is not None:
            ext = self._external_coef
            coef = (ext.to(self.device, torch.float32) if isinstance(ext, torch.Tensor)
                    else torch.full((), float(ext), dtype=torch.float32, device=self.device))
        coef = torch.where(found_inf, torch.ones_like(coef), coef)
        return ClipStats(total_norm=total_norm, clip_coef=coef, clipped=(coef < 1.0) & ~found_inf,
                         found_inf=found_inf)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._reduced:
            self.reduce_and_measure()
        self._reduced = False
        stats = self._clip_stats = self._make_clip_stats()
        self._external_coef = self._external_found_inf = None
        self._skipped += stats.found_inf.float()
        rejected, ratio = self._muon_step(stats.found_inf)
        self._aux_adamw_step(stats.clip_coef, stats.found_inf)
        if self.world > 1:  # before the publish, so this small gather does not queue behind it
            both = torch.stack([rejected, ratio])
            gathered = torch.empty(self.world * 2, dtype=torch.float32, device=self.device)
            collectives.all_gather(gathered, both, group=self.process_group)
            rejected, ratio = gathered[0::2].sum(), gathered[1::2].max()
        self._rejected_last, self._ratio_last = rejected, ratio
        self._rejected_total += rejected
        self._own_grad, self._no_grad = {}, set()
        self._publish()
        return loss

    def _muon_step(self, found_inf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group = self.param_groups[0]
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        keep = ~found_inf
        w_mom = keep.float() * (1 - mu)  # 0 on a skipped step: the momentum stays as it was
        rejected = torch.zeros((), dtype=torch.float32, device=self.device)
        ratio = torch.zeros((), dtype=torch.float32, device=self.device)
        for sg in self._groups:
            stage = self.ns.stage(len(sg.params), sg.rows, sg.cols, self.device)
            has_grad = sg.has_grad_t
            if self._no_grad.intersection(sg.params):
                has_grad = torch.tensor([p not in self._no_grad for p in sg.params]).to(self.device, non_blocking=True)
            for lo, hi in sg.runs:
                mom = sg.momentum[lo:hi]
                # The run's gradients in fp32 (the copy casts), then zeroed on a skipped step: a NaN
                # must not reach the momentum, it would persist forever. A matrix without a gradient
                # lerps toward its own momentum (which thus stays); its update is dropped below.
                g = torch.empty_like(mom)
                torch._foreach_copy_(list(g), [mom[i] if p in self._no_grad else self._own_grad[p]
                                               for i, p in enumerate(sg.params[lo:hi])])
                g.masked_fill_(found_inf, 0.0)
                mom.lerp_(g, w_mom)
                if group["nesterov"]:
                    torch.lerp(g, mom, mu, out=stage[lo:hi])   # fp32 math, rounded to bf16 like torch's .bfloat16()
                else:
                    stage[lo:hi].copy_(mom)
                del g  # back to the allocator before the next run and the NS
            U = self.ns.run(stage)
            good = torch.linalg.vector_norm(U, ord=math.inf, dim=(-2, -1)) <= GUARD_MAX_ABS  # NaN -> False
            fro = torch.linalg.vector_norm(U, dim=(-2, -1), dtype=torch.float32)
            rejected = rejected + (~good & has_grad).sum()
            ratio = torch.maximum(ratio, torch.where(good & has_grad, fro / math.sqrt(min(sg.rows, sg.cols)),
                                                     0.0).amax())
            apply = (good & keep & has_grad)[:, None, None]
            U.masked_fill_(~apply, 0.0)  # in place (NS allows it): a rejected U may hold NaN, and 0 * NaN = NaN
            # lr: a host float or, in a captured step, an fp64 device scalar: as_fp32 makes both the same bits
            sg.master.mul_(torch.where(apply, as_fp32(1.0 - lr * wd), 1.0))
            sg.master.addcmul_(U, torch.where(apply, sg.ratio_t[:, None, None] * as_fp32(-lr), 0.0))
        return rejected, ratio

    def _aux_adamw_step(self, coef: torch.Tensor, found_inf: torch.Tensor) -> None:
        if not self._owned_aux:
            return
        group = self.param_groups[1]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        keep = (~found_inf).float()
        # Device-side step counts and factors: a skipped step (keep = 0) changes nothing.
        lr_t = keep * as_fp32(lr)
        w1 = keep * (1 - beta1)
        b2 = 1 - keep * (1 - beta2)
        decay = 1 - lr_t * wd
        for p in self._owned_aux:
            if p in self._no_grad:
                continue
            st = self.state[p]
            master, m, v = st["master"], st["exp_avg"], st["exp_avg_sq"]
            st["adamw_step"] += keep
            step = st["adamw_step"].clamp(min=1.0)
            step_size = -lr_t / (1 - beta1 ** step)
            bias2_sqrt = (1 - beta2 ** step).sqrt()
            g = torch.where(found_inf, 0.0, self._own_grad[p].float() * coef)
            if p.ndim >= 2:
                master.mul_(decay)
            m.lerp_(g, w1)
            v.mul_(b2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(eps)
            master.addcmul_(m / denom, step_size)

    def _publish(self) -> None:
        """Owner's master -> every rank's parameter: issued in forward order; waited for here,
        or with overlap_refresh by the stages' forward pre-hooks (and drain_refresh)."""
        owned = self._owned_muon + self._owned_aux
        if owned and (self.world == 1 or self.collective == "reduce_bcast"):
            torch._foreach_copy_([p.data for p in owned], [self.state[p]["master"] for p in owned])
        if self.world == 1:
            return
        for b in self._buckets:
            if b.own_params:
                torch._foreach_copy_(b.own_views, [self.state[p]["master"] for p in b.own_params])
        self._pending_publish = [(self._publish_unit(u), u) for u in self._publish_order]
        self._installed = 0
        if not self.overlap_refresh:
            self.drain_refresh()

    def _publish_unit(self, u: int) -> list:
        if self.collective == "rs_ag":
            b = self._buckets[u]
            return [collectives.all_gather(b.flat, b.own, group=self.process_group, async_op=True)]
        (p,) = self._units[u]
        return [dist.broadcast(p.data, group_src=self._owner[p], group=self.process_group, async_op=True)]

    def _install(self, upto: int) -> None:
        """Wait for the publishes before position `upto` and install them (a broadcast lands
        in the parameter itself; an all-gathered bucket is copied out)."""
        while self._installed < min(upto, len(self._pending_publish)):
            works, u = self._pending_publish[self._installed]
            for w in works:
                w.wait()
            if self.collective == "rs_ag":
                b = self._buckets[u]
                torch._foreach_copy_([p.data for p in b.params], b.views)
            self._installed += 1

    # ---------------------------------------------------------- overlap_refresh
    def _set_stages(self, stages) -> None:
        """Publish order and per-stage wait positions from `stages` (forward order); a
        parameter no stage names is installed with stage 0: always correct, not overlapped."""
        stage_of = stage_index(stages)
        unit_stages = [[stage_of.get(id(p), 0) for p in unit] for unit in self._units]
        self._publish_order = publish_order(unit_stages, keys=self._unit_first)
        self._stage_wait_pos = need = stage_waits(unit_stages, self._publish_order, len(stages))
        rows = []
        for s in range(len(stages)):
            units = [self._units[u] for u in self._publish_order[need[s - 1] if s else 0: need[s]]]
            params = [p for unit in units for p in unit]
            rows.append({"params": len(params), "numel": sum(p.numel() for p in params),
                         "bytes": sum(p.numel() * p.element_size() for p in params), "collectives": len(units)})
        self._stage_map = {"stages": rows,
                           "uncovered": [p for p in self._muon_params + self._aux_params if id(p) not in stage_of]}
        for s, (module, _) in enumerate(stages):
            self._hook_handles.append(module.register_forward_pre_hook(weak_hook(self, "_install_stage", s)))

    def _install_stage(self, s: int, *_) -> None:
        self._install(self._stage_wait_pos[s])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, param_names=None) -> dict:
        """The optimizer state, independent of world size, buckets and collective.

        {"kind", "state": {key: {"master", "momentum_buffer"} for a matrix, {"master", "exp_avg",
        "exp_avg_sq", "adamw_step" ([1])} for an aux tensor, all fp32}, "counters": {"skipped_steps",
        "rejected_ns_updates"}}, keyed by param_names[p] (e.g. the model's FQN) or "p<index>" (the
        matrices first). At W > 1 each tensor is a ShardedTensor whose one piece, the whole tensor,
        is on its owner (the other ranks hold none): torch.distributed.checkpoint writes it once and
        the owner at any world size reads it back. Nothing is copied: the tensors are views of the
        live state, so a DCP load into this dict writes it in place.
        """
        params = self._muon_params + self._aux_params
        matrices = {id(p) for p in self._muon_params}
        state = {}
        for p, key in zip(params, state_keys(params, param_names)):
            owner = self._owner[p]
            fields = ("master", "momentum_buffer") if id(p) in matrices else \
                ("master", "exp_avg", "exp_avg_sq", "adamw_step")
            entry = {}
            for f in fields:
                shape = (1,) if f == "adamw_step" else tuple(p.shape)
                mine = self.state[p][f].view(shape) if owner == self.rank else None
                entry[f] = mine if self.world == 1 else sharded_tensor(
                    mine, shape, [(owner, (0,) * len(shape), shape)], device=self.device,
                    process_group=self.process_group)
            state[key] = entry
        return {"kind": "ShardedMuon", "state": state,
                "counters": {"skipped_steps": self._skipped, "rejected_ns_updates": self._rejected_total}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, param_names=None) -> None:
        """Restore what state_dict() gave, at any world size (the dict state_dict() gives here,
        filled by a DCP load, or full tensors), then publish the loaded fp32 masters to every
        rank's weights, so weights and masters agree. The state stays fp32 (torch's own load
        would cast it to each parameter's dtype, rounding the master of a bf16 parameter)."""
        check_state_kind(state_dict, "ShardedMuon")
        params = self._muon_params + self._aux_params
        keys = state_keys(params, param_names)
        missing = [k for k in keys if k not in state_dict["state"]]
        if missing:
            raise ValueError(f"ShardedMuon.load_state_dict: no state for {len(missing)} parameter(s): "
                             f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
        self.drain_refresh()
        for p, key in zip(params, keys):
            if self._owner[p] != self.rank:
                continue
            entry = state_dict["state"][key]
            for f, t in self.state[p].items():
                if f not in entry:
                    raise ValueError(f"ShardedMuon.load_state_dict: {key} has saved state {sorted(entry)}, "
                                     f"no {f} (was it a Muon matrix in one run and an AdamW tensor in the other?)")
                shape = tuple(t.shape) or (1,)
                t.view(shape).copy_(local_piece(entry[f], (0,) * len(shape), shape, shape, f"{key}.{f}"))
        counters = state_dict.get("counters", {})
        for name, t in (("skipped_steps", self._skipped), ("rejected_ns_updates", self._rejected_total)):
            if name in counters:
                t.copy_(torch.as_tensor(counters[name]))
        self._publish()
        self.drain_refresh()

    @torch.no_grad()
    def resync_masters_from_params(self) -> None:
        """Re-seed the owned fp32 masters from the model weights, after the weights were changed
        outside the optimizer (e.g. a weights-only checkpoint load): otherwise the next step starts
        from the stale master and silently reverts them. Momenta, moments and step counts are kept.
        Drain any staged refresh BEFORE changing the weights (it would land on top of them)."""
        if self._installed < len(self._pending_publish):
            raise RuntimeError("a staged parameter refresh is still in flight: call drain_refresh() before "
                               "changing the weights, then resync_masters_from_params()")
        for p in self._owned_muon + self._owned_aux:
            self.state[p]["master"].copy_(p.detach())
