"""ShardedMuon: ZeRO-1 over WHOLE tensors, Muon for matrices plus an auxiliary AdamW.

Why whole tensors: AdamW is elementwise, so any flat cut of the parameter buffer is a
valid shard; Newton-Schulz orthogonalizes a whole matrix, so a flat cut through a matrix
would not be Muon. Each parameter therefore has exactly ONE owner rank, which holds its
fp32 master (plus momentum, or AdamW moments) and computes its whole update; the other
ranks hold no state for it. Owners come from a longest-processing-time-first partition
of the Newton-Schulz cost (matrices) and of numel (aux tensors), computed identically
on every rank from shapes and order alone.

Per step: gradient averaged over ranks and delivered to the owner -> owner updates ->
updated parameter published to every rank. Two collective layouts:
  "rs_ag" (default): per dtype, each rank's owned tensors are split into
      `target_buckets` consecutive sub-chunks; bucket k is the concatenation of every
      rank's k-th sub-chunk, each padded to the bucket's largest, so shard boundaries
      fall on tensor boundaries. One reduce-scatter + one all-gather per bucket.
  "reduce_bcast": reduce-to-owner + broadcast per tensor (the simple reference path).
A parameter whose .grad is None on its owner is not stepped, as in torch: its master,
momentum or moments and its step count stay as they were (the buckets still carry zeros).

Update on matrices = torch.optim.Muon(lr, momentum, nesterov, ns_steps, weight_decay,
adjust_lr_fn=adjust_lr) on the averaged gradient: momentum lerp, Nesterov, NS in bf16
(blunb.optim.newton_schulz: batched per shape, CUDA-graph replayed), decoupled weight
decay, lr scaled by "match_rms_adamw" 0.2*sqrt(max(A, B)) or "original" sqrt(max(1, A/B)).
Non-matrix tensors (and any given with use_muon=False) get AdamW = torch.optim.AdamW,
weight decay only on >= 2-D tensors, after the clip.

Clipping is withheld from orthogonalized matrices (NS renormalizes; a coefficient would
only rotate the momentum EMA), so `max_grad_norm` clips the aux-AdamW part only, with
the coefficient derived from that part's norm; construction prints the covered fraction.
A non-finite gradient norm skips the whole step (nothing changes, momenta included) and
counts in `skipped_steps`. Divergence guard: a matrix update with a non-finite element or
one above 1000 is rejected (the matrix is left as it was) and counted; `nsratio` is the
worst ||update||_F / sqrt(min(rows, cols)) among accepted updates (healthy ~1).

Everything in the step stays on the device: no host sync (counters are device tensors
read by the properties, i.e. when logging).

param_groups[0] is the Muon group (keys lr, momentum, nesterov, ns_steps, weight_decay,
adjust_lr), param_groups[1] the aux AdamW group (lr, betas, eps, weight_decay); set each
group's "lr" every step (or use any LR scheduler). `state[p]` exists only on p's owner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from blunb.optim import collectives
from blunb.optim.clip import ClipStats, clip_stats_from_sq_norm
from blunb.optim.newton_schulz import NewtonSchulz

GUARD_MAX_ABS = 1000.0
COLLECTIVES = ("rs_ag", "reduce_bcast")
ADJUST_LR = ("match_rms_adamw", "original")


def adjust_lr_ratio(shape, adjust_lr: str) -> float:
    """torch.optim.Muon's per-shape lr multiplier."""
    A, B = shape[:2]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, A / B))
    return 0.2 * math.sqrt(max(A, B))


def ns_cost(shape, steps: int) -> float:
    """FLOPs of NS on one matrix (wide orientation r <= c): Gram, A A, B X per step."""
    r, c = sorted(shape[:2])
    return steps * (4.0 * r * r * c + 2.0 * r ** 3)


def lpt_partition(costs: list[float], world: int) -> list[int]:
    """Owner rank per item: longest processing time first onto the least-loaded rank.
    Ties break on index and rank, so every rank computes the same answer."""
    loads = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return owners


@dataclass
class _ShapeGroup:
    """Owned matrices sharing a wide-orientation shape: one batched NS call."""
    rows: int
    cols: int
    params: list = field(default_factory=list)
    tall: list = field(default_factory=list)      # stored [cols, rows]: transposed into the batch
    ratios: list = field(default_factory=list)    # adjust_lr multiplier per matrix
    ratio_t: torch.Tensor | None = None
    has_grad_t: torch.Tensor | None = None        # all True: the common case needs no host->device copy


@dataclass
class _Bucket:
    dtype: torch.dtype
    chunk: int                                    # padded per-rank sub-chunk numel
    flat: torch.Tensor                            # [world * chunk]: RS input, AG output
    own: torch.Tensor                             # [chunk]: RS output (grads), AG input (params)
    params: list = field(default_factory=list)    # every tensor in the bucket, all ranks'
    views: list = field(default_factory=list)     # its slot in `flat`
    own_params: list = field(default_factory=list)
    own_views: list = field(default_factory=list)  # its slot in `own` (owned tensors only)


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
    ns_coefficients ("muon" | "polar_express" | (a, b, c)), ns_graphs / ns_syrk (None =
    auto; see NewtonSchulz), verbose (rank-0 construction report).
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.1, adjust_lr: str = "match_rms_adamw", process_group=None,
                 collective: str = "rs_ag", target_buckets: int = 6, adamw_lr: float | None = None,
                 adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, *, max_grad_norm: float = 0.0,
                 adamw_weight_decay: float | None = None, ns_coefficients="muon",
                 ns_graphs: bool | None = None, ns_syrk: bool | None = None, verbose: bool = True):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        if target_buckets < 1:
            raise ValueError(f"target_buckets must be >= 1, got {target_buckets}")
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
        self.ns = NewtonSchulz(ns_steps, ns_coefficients, graphs=ns_graphs, syrk=ns_syrk)
        self.device = (muon + aux)[0].device

        self._muon_params, self._aux_params = muon, aux
        self._owner: dict[torch.Tensor, int] = {}
        for p, r in zip(muon, lpt_partition([ns_cost(p.shape, ns_steps) for p in muon], self.world)):
            self._owner[p] = r
        for p, r in zip(aux, lpt_partition([float(p.numel()) for p in aux], self.world)):
            self._owner[p] = r
        self._owned_muon = [p for p in muon if self._owner[p] == self.rank]
        self._owned_aux = [p for p in aux if self._owner[p] == self.rank]

        for p in self._owned_muon:
            self.state[p] = {"master": p.detach().float().clone(),
                             "momentum_buffer": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}
        for p in self._owned_aux:  # each with its own step count, as torch.optim.AdamW
            self.state[p] = {"master": p.detach().float().clone(),
                             "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                             "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                             "adamw_step": torch.zeros((), dtype=torch.float32, device=p.device)}

        self._groups = self._shape_groups(adjust_lr)
        self._buckets = self._build_buckets(target_buckets) if collective == "rs_ag" and self.world > 1 else []
        self._own_grad: dict[torch.Tensor, torch.Tensor] = {}
        self._no_grad: set[torch.Tensor] = set()   # owned tensors whose .grad was None at the reduce
        self._reduced = False
        self._external_coef = self._external_found_inf = None
        zero = lambda: torch.zeros((), dtype=torch.float32, device=self.device)  # noqa: E731
        self._skipped, self._rejected_total = zero(), zero()
        self._rejected_last, self._ratio_last = zero(), zero()
        self._clip_stats: ClipStats | None = None
        self._zero1 = torch.zeros(1, dtype=torch.float32, device=self.device)
        if verbose and self.rank == 0:
            print(self.describe(), flush=True)

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
        groups: dict[tuple[int, int], _ShapeGroup] = {}
        for p in self._owned_muon:
            r, c = sorted(p.shape)
            g = groups.setdefault((r, c), _ShapeGroup(r, c))
            g.params.append(p)
            g.tall.append(p.shape[0] > p.shape[1])
            g.ratios.append(adjust_lr_ratio(p.shape, adjust_lr))
        for g in groups.values():
            g.ratio_t = torch.tensor(g.ratios, dtype=torch.float32, device=self.device)
            g.has_grad_t = torch.ones(len(g.params), dtype=torch.bool, device=self.device)
        return list(groups.values())

    def _build_buckets(self, target: int) -> list[_Bucket]:
        everything = self._muon_params + self._aux_params
        buckets = []
        for dtype in sorted({p.dtype for p in everything}, key=str):
            # per rank: its owned tensors of this dtype, cut into `target` runs of ~equal numel
            runs = []
            for r in range(self.world):
                owned = [p for p in everything if p.dtype == dtype and self._owner[p] == r]
                total = sum(p.numel() for p in owned)
                cuts, acc, k = [[] for _ in range(target)], 0, 0
                for p in owned:
                    cuts[min(k, target - 1)].append(p)
                    acc += p.numel()
                    while k < target - 1 and acc >= total * (k + 1) / target:
                        k += 1
                runs.append(cuts)
            for k in range(target):
                chunk = max(sum(p.numel() for p in runs[r][k]) for r in range(self.world))
                if chunk == 0:
                    continue
                flat = torch.zeros(self.world * chunk, dtype=dtype, device=self.device)
                b = _Bucket(dtype, chunk, flat, torch.zeros(chunk, dtype=dtype, device=self.device))
                for r in range(self.world):
                    off = 0
                    for p in runs[r][k]:
                        b.params.append(p)
                        b.views.append(flat[r * chunk + off: r * chunk + off + p.numel()].view(p.shape))
                        if r == self.rank:
                            b.own_params.append(p)
                            b.own_views.append(b.own[off: off + p.numel()].view(p.shape))
                        off += p.numel()
                buckets.append(b)
        return buckets

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
                f"(lr {g0['lr']:g}, momentum {g0['momentum']}, nesterov {g0['nesterov']}, NS{g0['ns_steps']}, "
                f"adjust_lr {g0['adjust_lr']}, wd {g0['weight_decay']}); {len(self._aux_params)} tensors "
                f"({n_aux} params) -> AdamW (lr {g1['lr']:g}); world {self.world}, collective {self.collective}, "
                f"{len(self._buckets)} buckets\n[ShardedMuon] {clip}")

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
        """No-op: the gradient reduction runs after backward (no backward overlap here)."""

    def drain_refresh(self) -> None:
        """No-op: step() publishes updated parameters synchronously before returning."""

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
        return sum((b.flat.numel() + b.own.numel()) * b.flat.element_size() for b in self._buckets)

    @torch.no_grad()
    def replica_checksum(self) -> float:
        """Position-weighted fp64 sum of every parameter: bit-identical replicas agree."""
        params = self._muon_params + self._aux_params
        sums = torch.stack([p.detach().double().sum() for p in params])
        return float((sums * torch.arange(1, len(params) + 1, dtype=torch.float64, device=sums.device)).sum())

    # ------------------------------------------------------------------ reduction
    @torch.no_grad()
    def reduce_and_measure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Average every gradient over ranks onto its owner; return (sq_norm_total,
        sq_norm_covered), 0-dim fp32 device tensors summed over ranks (covered = the
        aux-AdamW part, the only part the clip scales). The next step() reuses this."""
        W = self.world
        self._no_grad = {p for p in self._owned_muon + self._owned_aux if p.grad is None}
        if W == 1:
            self._own_grad = {p: self._grad(p) for p in self._owned_muon + self._owned_aux}
        elif self.collective == "rs_ag":
            self._own_grad = {}
            for b in self._buckets:  # every bucket holds some rank's tensors, so never empty
                torch._foreach_copy_(b.views, [self._grad(p) for p in b.params])
                collectives.reduce_scatter(b.own, b.flat, op=dist.ReduceOp.SUM, group=self.process_group)
                b.own.mul_(1.0 / W)
                self._own_grad.update(zip(b.own_params, b.own_views))
        else:
            self._own_grad = {}
            for p in self._muon_params + self._aux_params:
                g = self._grad(p)
                if p.grad is None:
                    p.grad = g  # reduce in place needs a real buffer
                owner = self._owner[p]
                dst = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
                dist.reduce(g, dst=dst, op=dist.ReduceOp.SUM, group=self.process_group)
                if owner == self.rank:
                    self._own_grad[p] = g.mul_(1.0 / W)
        sq = torch.stack([self._sq_norm([self._own_grad[p] for p in self._owned_muon]),
                          self._sq_norm([self._own_grad[p] for p in self._owned_aux])])
        if W > 1:
            dist.all_reduce(sq, group=self.process_group)
        self._sq_total, self._sq_covered = sq[0] + sq[1], sq[1]
        self._reduced = True
        return self._sq_total, self._sq_covered

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
        self._publish()
        if self.world > 1:
            both = torch.stack([rejected, ratio])
            gathered = torch.empty(self.world * 2, dtype=torch.float32, device=self.device)
            collectives.all_gather(gathered, both, group=self.process_group)
            rejected, ratio = gathered[0::2].sum(), gathered[1::2].max()
        self._rejected_last, self._ratio_last = rejected, ratio
        self._rejected_total += rejected
        self._own_grad, self._no_grad = {}, set()
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
            for i, (p, tall) in enumerate(zip(sg.params, sg.tall)):
                if p in self._no_grad:       # not stepped: its momentum stays, its update is dropped below
                    stage[i].zero_()
                    continue
                buf = self.state[p]["momentum_buffer"]
                # a NaN must not reach the momentum: it would persist forever. A [1]-shaped fp32
                # zero promotes a bf16 grad to fp32 in the same pass.
                g = torch.where(found_inf, self._zero1, self._own_grad[p])
                buf.lerp_(g, w_mom)
                dst = stage[i].mT if tall else stage[i]
                if group["nesterov"]:
                    torch.lerp(g, buf, mu, out=dst)   # fp32 math, rounded to bf16 like torch's .bfloat16()
                else:
                    dst.copy_(buf)
            U = self.ns.run(stage)
            good = torch.linalg.vector_norm(U, ord=math.inf, dim=(-2, -1)) <= GUARD_MAX_ABS  # NaN -> False
            fro = torch.linalg.vector_norm(U, dim=(-2, -1), dtype=torch.float32)
            rejected = rejected + (~good & has_grad).sum()
            ratio = torch.maximum(ratio, torch.where(good & has_grad, fro / math.sqrt(sg.rows), 0.0).amax())
            apply = good & keep & has_grad
            decay = torch.where(apply, 1.0 - lr * wd, 1.0)
            scale = torch.where(apply, sg.ratio_t * -lr, 0.0)
            U = torch.where(apply[:, None, None], U, 0.0)
            for i, (p, tall) in enumerate(zip(sg.params, sg.tall)):
                master = self.state[p]["master"]
                master.mul_(decay[i])
                master.addcmul_(U[i].mT if tall else U[i], scale[i])
        return rejected, ratio

    def _aux_adamw_step(self, coef: torch.Tensor, found_inf: torch.Tensor) -> None:
        if not self._owned_aux:
            return
        group = self.param_groups[1]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        keep = (~found_inf).float()
        # Device-side step counts and factors: a skipped step (keep = 0) changes nothing.
        lr_t = keep * lr
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
        """Owner's master -> every rank's parameter."""
        owned = self._owned_muon + self._owned_aux
        if owned and (self.world == 1 or self.collective == "reduce_bcast"):
            torch._foreach_copy_([p.data for p in owned], [self.state[p]["master"] for p in owned])
        if self.world == 1:
            return
        if self.collective == "reduce_bcast":
            for p in self._muon_params + self._aux_params:
                owner = self._owner[p]
                src = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
                dist.broadcast(p.data, src=src, group=self.process_group)
            return
        for b in self._buckets:
            if b.own_params:
                torch._foreach_copy_(b.own_views, [self.state[p]["master"] for p in b.own_params])
            collectives.all_gather(b.flat, b.own, group=self.process_group)
            torch._foreach_copy_([p.data for p in b.params], b.views)

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict) -> None:
        """torch casts loaded state to each param's dtype, which would round the fp32
        masters of bf16 params; ours is fp32 by design, so it is restored from the
        incoming dict itself."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            if i in state_dict["state"]:
                self.state[p] = {k: v.detach().to(self.device, torch.float32, copy=True)
                                 for k, v in state_dict["state"][i].items()}
        for p in self._owned_aux:
            self.state[p]["adamw_step"] = self.state[p]["adamw_step"].reshape(())
