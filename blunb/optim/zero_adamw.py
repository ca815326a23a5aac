"""ZeRO-1 AdamW: every rank keeps the whole model, but only 1/W of the optimizer state.

The parameters of one instance (one dtype) are views into a flat buffer cut into buckets; rank r owns
the r-th 1/W of every bucket. Per-bucket chunks let every bucket be reduced the moment it is ready with
a real reduce-scatter, and make the overlapped and the serial paths issue the SAME collectives on the
same bytes, so their results are bit-identical by construction rather than by luck of summation order.
No host sync anywhere on the step's path. Hooks hold the optimizer weakly: dropping it frees it (and its
buffers) at once, no cycle.

Details (the layout, the step's phases, gradients as views, parameters without a gradient):
docs/architecture.md, section "blunb/optim/zero_adamw.py".
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from blunb import diag, kernels
from blunb.optim import collectives
from blunb.optim.clip import ClipStats, clip_stats_from_sq_norm
from blunb.optim.hooks import remove_hooks, weak_hook
from blunb.optim.layout import (
    COLLECTIVES,
    REDUCE_DTYPES,
    as_stages,
    backward_buckets,
    bucket_chunk,
    publish_order,
    stage_index,
    stage_waits,
)
from blunb.optim.state import check_state_kind, local_piece, sharded_tensor, state_keys

log = logging.getLogger(__name__)

def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


class ShardedAdamW(torch.optim.Optimizer):
    """ZeRO-1 AdamW over parameters of ONE dtype (module docstring has the design).

    Equals torch.optim.AdamW on the rank-averaged gradient, after clip_grad_norm_(params,
    max_grad_norm) when max_grad_norm > 0; no weight decay on 1-D params when
    exclude_1d_from_weight_decay. `stages` (needed for overlap_refresh): the model itself,
    or a list of (module, params) in forward order whose params get installed by a forward
    pre-hook on that module (stage 0's module should be the model root).
    """

    def __init__(self, params, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 exclude_1d_from_weight_decay=True, max_grad_norm=0.0, process_group=None,
                 collective="rs_ag", reduce_dtype="param", overlap_backward=False,
                 overlap_refresh=False, bucket_mb=50, stages=None):
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {tuple(REDUCE_DTYPES)}, got {reduce_dtype!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("ShardedAdamW takes one flat list of parameters (one fused update "
                             "over the shard); build one instance per group instead")
        # Dedupe (tied weights appear once) while keeping the caller's order.
        plist = list({id(p): p for p in self.param_groups[0]["params"]}.values())
        self.param_groups[0]["params"] = plist
        if not plist:
            raise ValueError("ShardedAdamW got no parameters")
        dtypes = {p.dtype for p in plist}
        devices = {p.device for p in plist}
        if len(dtypes) > 1:
            raise ValueError(f"ShardedAdamW needs parameters of a single dtype, got {sorted(map(str, dtypes))}; "
                             "use build_sharded_adamw(model) for one instance per dtype")
        if len(devices) > 1:
            raise ValueError(f"ShardedAdamW needs parameters on one device, got {sorted(map(str, devices))}")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        if self.device.type not in torch.utils._foreach_utils._get_fused_kernels_supported_devices():
            raise ValueError(f"torch._fused_adamw_ is not available on {self.device.type}")

        self.group = process_group
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.collective = collective
        self.max_grad_norm = float(max_grad_norm)
        self.overlap_backward = overlap_backward and self.world > 1
        self.overlap_refresh = overlap_refresh
        self.exclude_1d = exclude_1d_from_weight_decay
        self.red_dtype = REDUCE_DTYPES[reduce_dtype] or self.dtype
        self._params = plist

        self._build_layout(bucket_mb)
        # the fused shard update (the CUDA default) or torch._fused_adamw_ per segment (kernels adamw=torch)
        self._fused = kernels.backend_for("adamw", plist[0]) == "triton"
        self._allocate(reduce_dtype)
        self._build_update_lists()

        self.clip_stats: ClipStats | None = None
        self._steps = torch.zeros(len(plist), dtype=torch.float32, device=self.device)  # per parameter, as torch
        self._step_views = list(self._steps.unbind())
        self._skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self._ext_coef = self._ext_found_inf = None
        self._measured = None        # this step's ||avg grad||^2 once its grads are reduced
        self._armed = False
        self._grad_works: list = []
        self._pending_publish: list = []   # per publish position: async works not yet waited for
        self._installed = 0                # publish positions installed so far
        self._has_grad = [True] * len(plist)   # host-side, from .grad at the last _adopt_grads()

        self._hook_handles: list = []
        self._bucket_of = {id(p): b for b, idx in enumerate(self._buckets) for p in (plist[i] for i in idx)}
        for i, p in enumerate(plist):
            self._hook_handles.append(p.register_post_accumulate_grad_hook(weak_hook(self, "_on_grad", i)))
        weakref.finalize(self, remove_hooks, self._hook_handles)
        if overlap_refresh:
            if stages is None:
                raise ValueError("overlap_refresh=True needs stages= (the model, or a list of "
                                 "(module, params) in forward order) so forward pre-hooks can "
                                 "install each stage; build_sharded_adamw(model, ...) passes it")
            self._set_stages(as_stages(stages))

    # ------------------------------------------------------------------ layout
    def _build_layout(self, bucket_mb: float) -> None:
        W, plist = self.world, self._params
        cap = max(1, int(bucket_mb * 2**20) // torch.empty((), dtype=self.red_dtype).element_size())
        self._buckets = buckets = backward_buckets([p.numel() for p in plist], cap)
        self._bucket_base, self._bucket_chunk, self._param_off = [], [], [0] * len(plist)
        base = 0
        for idx in buckets:
            self._bucket_base.append(base)
            off = base
            for i in idx:
                self._param_off[i] = off
                off += plist[i].numel()
            chunk = bucket_chunk(off - base, W)
            self._bucket_chunk.append(chunk)
            base += chunk * W
        self.numel = sum(p.numel() for p in plist)
        self.padded_numel = base
        self.shard_numel = base // W

    def _bucket_view(self, flat, b):
        return flat[self._bucket_base[b]: self._bucket_base[b] + self._bucket_chunk[b] * self.world]

    def _chunk_view(self, flat, b, q):
        c = self._bucket_chunk[b]
        return flat[self._bucket_base[b] + q * c: self._bucket_base[b] + (q + 1) * c]

    def _shard_chunk(self, shard, b):
        start = sum(self._bucket_chunk[:b])
        return shard[start: start + self._bucket_chunk[b]]

    def _allocate(self, reduce_dtype: str) -> None:
        dev, S, N = self.device, self.shard_numel, self.padded_numel
        # Parameters and gradients become views of flat buffers: the all-gather writes
        # straight into the model weights and backward accumulates straight into the
        # reduce input, so neither needs an unsharded staging copy.
        self._flat_param = torch.zeros(N, dtype=self.dtype, device=dev)
        self._flat_grad = torch.zeros(N, dtype=self.dtype, device=dev)
        self._grad_views = []
        for p, off in zip(self._params, self._param_off):
            n = p.numel()
            self._flat_param[off: off + n].copy_(p.detach().reshape(-1))
            p.data = self._flat_param[off: off + n].view_as(p)
            self._grad_views.append(self._flat_grad[off: off + n].view_as(p))
            p.grad = self._grad_views[-1]
        nb = len(self._buckets)
        # A reduce dtype other than the parameters' needs its own flat reduce buffer.
        self._flat_red = (self._flat_grad if self.red_dtype == self.dtype
                          else torch.zeros(N, dtype=self.red_dtype, device=dev))
        # fp32 master + moments: the only copies of the optimizer state, shard-sized. On one rank an fp32
        # group's shard is its whole flat parameter buffer, which then is its master: no copy of it (the
        # fp32 embedding at 1b: 0.4 GB), and the update writes the weights as it writes the master.
        self._master_is_param = self.world == 1 and self.dtype == torch.float32
        if self._master_is_param:
            self._master = self._flat_param
        else:
            self._master = torch.empty(S, dtype=torch.float32, device=dev)
            for b in range(nb):
                self._shard_chunk(self._master, b).copy_(self._chunk_view(self._flat_param, b, self.rank))
        self._exp_avg = torch.zeros(S, dtype=torch.float32, device=dev)
        self._exp_avg_sq = torch.zeros(S, dtype=torch.float32, device=dev)
        # torch._fused_adamw_ wants fp32 gradients: a non-fp32 reduce stages one bucket's chunk at
        # a time in fp32 (the update runs bucket by bucket), not the whole shard. The fused shard
        # update reads the reduced gradient as it is: no staging (at 1b: lm_head's 103M-element
        # bucket, 0.4 GB) unless a step leaves a parameter out (see step).
        self._grad_stage = None if not self._stages_grads() else self._new_grad_stage()
        extra = self._extra_bytes(self.red_dtype) - self._extra_bytes(self.dtype)
        if self.red_dtype != self.dtype and self.rank == 0:
            log.info(f"[ShardedAdamW] reduce_dtype={reduce_dtype} on the {self.dtype} group "
                     f"({self.numel:,} params) costs {'+' if extra >= 0 else ''}{_mib(extra)} per rank "
                     f"vs reducing in the parameter dtype")

    def _stages_grads(self, red_dtype=None) -> bool:
        return not self._fused and (red_dtype or self.red_dtype) != torch.float32

    def _new_grad_stage(self) -> torch.Tensor:
        return torch.empty(max(self._bucket_chunk), dtype=torch.float32, device=self.device)

    def _extra_bytes(self, red_dtype) -> int:
        """Staging bytes beyond the 12 B/elem state for a given reduce dtype."""
        red = 0 if red_dtype == self.dtype else self.padded_numel * torch.empty((), dtype=red_dtype).element_size()
        stage = 4 * max(self._bucket_chunk) if self._stages_grads(red_dtype) else 0
        return red + stage

    def _build_update_lists(self) -> None:
        """Per bucket, the fused update's views of this rank's chunk: one segment per parameter
        that overlaps it (its fp32 master, gradient, moments and its own step counter), so a
        parameter without a gradient can be left out of a step. Gradients are the reduced chunk
        itself (fp32 reduce) or the fp32 staging buffer, which every bucket reuses from offset 0.
        Padding lies outside every segment: it is never updated and stays zero.
        """
        r = self.rank
        red_chunks = [self._chunk_view(self._flat_red, b, r) for b in range(len(self._buckets))]
        self._segments = []          # per bucket: [(param index, decays, master, grad, exp_avg, exp_avg_sq)]
        fused_segments = []          # (shard offset, flat offset, length, param index, decays)
        shard_start = 0
        for b, idx in enumerate(self._buckets):
            c = self._bucket_chunk[b]
            lo = self._bucket_base[b] + r * c           # owned flat range [lo, lo + c)
            grad_src = self._grad_stage if self._grad_stage is not None else red_chunks[b]
            segs = []
            for i in idx:
                p0, p1 = self._param_off[i], self._param_off[i] + self._params[i].numel()
                a, z = max(p0, lo) - lo, min(p1, lo + c) - lo
                if a < z:
                    decays = not (self.exclude_1d and self._params[i].ndim < 2)
                    sa, sz = shard_start + a, shard_start + z
                    segs.append((i, decays, self._master[sa:sz], grad_src[a:z], self._exp_avg[sa:sz],
                                 self._exp_avg_sq[sa:sz]))
                    fused_segments.append((sa, lo + a, z - a, i, decays))
            self._segments.append(segs)
            shard_start += c
        self._fused_table = kernels.adamw_block_table(fused_segments, self.device) if self._fused else None
        self._red_chunks = red_chunks
        self._param_chunks = [self._chunk_view(self._flat_param, b, r) for b in range(len(self._buckets))]
        self._master_chunks = [self._shard_chunk(self._master, b) for b in range(len(self._buckets))]

    # ------------------------------------------------------------ collectives
    def _reduce_bucket(self, b: int) -> list:
        if self._flat_red is not self._flat_grad:
            self._bucket_view(self._flat_red, b).copy_(self._bucket_view(self._flat_grad, b))
        if self.collective == "rs_ag":
            return [collectives.reduce_scatter(self._red_chunks[b], self._bucket_view(self._flat_red, b),
                                    group=self.group, async_op=True)]
        return [dist.reduce(self._chunk_view(self._flat_red, b, q), group_dst=q, group=self.group, async_op=True)
                for q in range(self.world)]

    def _publish_bucket(self, b: int) -> list:
        if self.collective == "rs_ag":
            return [collectives.all_gather(self._bucket_view(self._flat_param, b), self._param_chunks[b],
                               group=self.group, async_op=True)]
        return [dist.broadcast(self._chunk_view(self._flat_param, b, q), group_src=q, group=self.group,
                               async_op=True)
                for q in range(self.world)]

    def _adopt_grads(self) -> None:
        """Put any .grad that was replaced (reassigned, or None: zeros, and the parameter is not
        stepped) back into the flat buffer."""
        self._has_grad = [p.grad is not None for p in self._params]
        for p, v in zip(self._params, self._grad_views):
            if p.grad is not v:
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
                p.grad = v

    # --------------------------------------------------------- overlap_backward
    def arm_grad_sync(self) -> None:
        """Call before the LAST micro-step's backward: buckets reduce as they fill."""
        if self.overlap_backward:
            self._drain_grad_works()
            self._armed = True
            self._missing = [len(idx) for idx in self._buckets]
            self._next_bucket = 0

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter i: move a new gradient into the flat buffer;
        when armed, launch every bucket whose gradients are now complete."""
        if p.grad is not self._grad_views[i]:
            self._grad_views[i].copy_(p.grad)
            p.grad = self._grad_views[i]
        if not self._armed:
            return
        self._missing[self._bucket_of[id(p)]] -= 1
        # Launch strictly in bucket order so every rank issues the same sequence.
        while self._next_bucket < len(self._buckets) and self._missing[self._next_bucket] == 0:
            self._grad_works += self._reduce_bucket(self._next_bucket)
            self._next_bucket += 1

    def _drain_grad_works(self) -> None:
        for w in self._grad_works:
            w.wait()
        self._grad_works = []

    # ----------------------------------------------------------------- reduce
    @torch.no_grad()
    def reduce_and_measure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce this step's gradients into the shard; return (||g||^2, covered ||g||^2).

        Squared L2 norms of the rank-AVERAGED gradient over all of this instance's params,
        as 0-dim fp32 device tensors identical on every rank (all of them are covered by
        AdamW's clip). The following step() does not reduce again.
        """
        if self._measured is not None:
            return self._measured, self._measured
        self.drain_refresh()
        self._adopt_grads()
        if self.world > 1:
            start = self._next_bucket if self._armed else 0
            for b in range(start, len(self._buckets)):     # buckets the hooks did not launch
                self._grad_works += self._reduce_bucket(b)
            self._armed = False
            self._drain_grad_works()
        elif self._flat_red is not self._flat_grad:
            self._flat_red.copy_(self._flat_grad)
        norms = torch._foreach_norm(self._red_chunks, 2.0, dtype=torch.float32)
        sq = torch.stack(norms).square().sum() / self.world**2
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
        self._measured = sq
        return sq, sq

    def clip_covered_numel(self) -> int:
        return self.numel

    def total_numel(self) -> int:
        return self.numel

    def set_external_clip_coef(self, coef, found_inf=None) -> None:
        """For the next step only: use `coef` instead of this instance's own clip coefficient
        (None keeps its own: per-instance clipping), and skip the step when `found_inf` (a
        0-dim bool device tensor, e.g. another group's verdict) is set, as this instance's own
        non-finite norm does."""
        self._ext_coef, self._ext_found_inf = coef, found_inf

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedAdamW.step does not take a closure")
        sq, _ = self.reduce_and_measure()
        own = clip_stats_from_sq_norm(sq, self.max_grad_norm)
        found = own.found_inf if self._ext_found_inf is None else own.found_inf | self._ext_found_inf
        coef = own.clip_coef if self._ext_coef is None else torch.as_tensor(self._ext_coef, dtype=torch.float32,
                                                                            device=self.device)
        coef = torch.where(found, torch.ones_like(coef), coef)
        self.clip_stats = ClipStats(total_norm=own.total_norm, clip_coef=coef, clipped=(coef < 1) & ~found,
                                    found_inf=found)
        found_inf = found.float()
        stepped = self._has_grad
        if all(stepped):
            self._steps += 1.0 - found_inf
        else:
            self._steps += torch.tensor(stepped, dtype=torch.float32).to(self.device, non_blocking=True) \
                * (1.0 - found_inf)
        self._skipped += found.long()
        grad_scale = self.world / coef       # the kernel divides: g * coef / W
        g = self.param_groups[0]
        fused = self._fused and all(stepped)   # a parameter left out of the step: the per-segment path
        if not fused and self._grad_stage is None and self.red_dtype != torch.float32:
            # the fused update's first per-segment step: its staging buffer, made once, now
            self._grad_stage = self._new_grad_stage()
            self._build_update_lists()
        if fused:
            kernels.adamw_update_(  # backend "triton": the choice made at construction (self._fused)
                self._master, self._exp_avg, self._exp_avg_sq, self._flat_red, self._flat_param, self._steps,
                self._fused_table, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                weight_decay=g["weight_decay"], grad_scale=grad_scale, found_inf=found_inf, backend="triton")
        for b, segs in enumerate(self._segments if not fused else []):
            if self._grad_stage is not None:
                self._grad_stage[: self._bucket_chunk[b]].copy_(self._red_chunks[b])
            for decays in (True, False):
                run = [seg for seg in segs if seg[1] == decays and stepped[seg[0]]]
                if not run:
                    continue
                torch._fused_adamw_([s[2] for s in run], [s[3] for s in run], [s[4] for s in run],
                                    [s[5] for s in run], [], [self._step_views[s[0]] for s in run], lr=g["lr"],
                                    beta1=g["betas"][0], beta2=g["betas"][1],
                                    weight_decay=g["weight_decay"] if decays else 0.0, eps=g["eps"],
                                    amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        self._publish(copied=fused)
        self._measured = None
        self._ext_coef = self._ext_found_inf = None

    def _publish(self, copied: bool = False) -> None:
        """copied: the fused update has written the owned chunks already."""
        if not copied and not self._master_is_param:
            torch._foreach_copy_(self._param_chunks, self._master_chunks)
        if self.world == 1:
            return
        order = self._publish_order if self.overlap_refresh else range(len(self._buckets))
        works = [self._publish_bucket(b) for b in order]
        if self.overlap_refresh:
            self._pending_publish, self._installed = works, 0
        else:
            for ws in works:
                for w in ws:
                    w.wait()

    # ---------------------------------------------------------- overlap_refresh
    def _set_stages(self, stages) -> None:
        stage_of = stage_index(stages)
        # A parameter no stage names is installed with stage 0: always correct, just not overlapped.
        unit_stages = [[stage_of.get(id(self._params[i]), 0) for i in idx] for idx in self._buckets]
        self._publish_order = publish_order(unit_stages, keys=list(range(len(self._buckets))))
        self._stage_wait_pos = stage_waits(unit_stages, self._publish_order, len(stages))
        for s, (module, _) in enumerate(stages):
            self._hook_handles.append(module.register_forward_pre_hook(weak_hook(self, "_install_stage", s)))

    def _install_stage(self, s: int, *_) -> None:
        self._install(self._stage_wait_pos[s])

    def _install(self, upto: int) -> None:
        while self._installed < min(upto, len(self._pending_publish)):
            for w in self._pending_publish[self._installed]:
                w.wait()
            self._installed += 1

    def drain_refresh(self) -> None:
        """Install every parameter still in flight (before validation, checkpoint or exit)."""
        self._install(len(self._pending_publish))
        self._pending_publish, self._installed = [], 0

    # ------------------------------------------------------------------ misc
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer. set_to_none=True (the default, as torch) sets every
        .grad to None: a parameter that backward does not reach is then not stepped.
        set_to_none=False keeps each .grad a (zeroed) view of the buffer."""
        self._flat_grad.zero_()
        for p, v in zip(self._params, self._grad_views):
            p.grad = None if set_to_none else v

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an inf/NaN gradient norm (reading it syncs; for logging)."""
        return int(self._skipped)

    def state_bytes(self) -> int:
        """Optimizer bytes held on this rank: 12 B x shard (fp32 master, exp_avg, exp_avg_sq; 8 B where the
        master is the parameters themselves: one rank, fp32) + 4 B x the largest bucket chunk of fp32
        gradient staging when the reduce dtype is not fp32 + a flat reduce buffer (padded x reduce element
        size) when it differs from the param dtype."""
        return (8 if self._master_is_param else 12) * self.shard_numel + self._extra_bytes(self.red_dtype)

    def replica_checksum(self) -> torch.Tensor:
        """blunb.diag's bit-level hash of this group's parameters (equal on all ranks iff the
        replicas are, barring collisions). Installs pending refreshes first."""
        self.drain_refresh()
        return diag.replica_checksum(self._params)

    # ------------------------------------------------------------ checkpoints
    def _owned_range(self, i: int, q: int) -> tuple[int, int, int]:
        """(offset in parameter i's flat view, length, offset in rank q's shard) of the part of
        parameter i that rank q owns: one contiguous run, as a parameter lies in one bucket."""
        b = self._bucket_of[id(self._params[i])]
        c = self._bucket_chunk[b]
        lo = self._bucket_base[b] + q * c
        p0 = self._param_off[i]
        a, z = max(p0, lo), min(p0 + self._params[i].numel(), lo + c)
        return a - p0, max(z - a, 0), sum(self._bucket_chunk[:b]) + a - lo

    def state_dict(self, param_names=None) -> dict:
        """The optimizer state, independent of world size, bucket size and collective.

        {"kind", "state": {key: {"master", "exp_avg", "exp_avg_sq": flat [numel] fp32, "step"}},
        "counters": {"skipped_steps"}}, keyed by param_names[p] (e.g. the model's FQN) or "p<index>".
        At W > 1 each flat tensor is a ShardedTensor holding only this rank's slice at its offset
        in the parameter (none where the rank owns nothing of it), so torch.distributed.checkpoint
        writes every element once and loads it back re-cut for any layout. Nothing is copied: the
        tensors are views of the live state, so a DCP load into this dict writes it in place.
        """
        state = {}
        for i, (p, key) in enumerate(zip(self._params, state_keys(self._params, param_names))):
            off, n, s = self._owned_range(i, self.rank)
            pieces = [(q, (o,), (m,)) for q in range(self.world) for o, m, _ in [self._owned_range(i, q)] if m]
            entry = {}
            for field, buf in (("master", self._master), ("exp_avg", self._exp_avg),
                               ("exp_avg_sq", self._exp_avg_sq)):
                mine = buf[s: s + n]
                entry[field] = mine if self.world == 1 else sharded_tensor(
                    mine if n else None, (p.numel(),), pieces, device=self.device, process_group=self.group)
            entry["step"] = self._step_views[i]   # the same on every rank: written once
            state[key] = entry
        return {"kind": "ShardedAdamW", "state": state, "counters": {"skipped_steps": self._skipped}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, param_names=None) -> None:
        """Restore what state_dict() gave, at any world size (the dict state_dict() gives here,
        filled by a DCP load, or full tensors), then re-seed the model weights from the loaded fp32
        masters: weights and masters agree, on every rank."""
        check_state_kind(state_dict, "ShardedAdamW")
        keys = state_keys(self._params, param_names)
        missing = [k for k in keys if k not in state_dict["state"]]
        if missing:
            raise ValueError(f"ShardedAdamW.load_state_dict: no state for {len(missing)} parameter(s): "
                             f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
        self.drain_refresh()
        for i, (p, key) in enumerate(zip(self._params, keys)):
            entry = state_dict["state"][key]
            off, n, s = self._owned_range(i, self.rank)
            if n:
                for field, buf in (("master", self._master), ("exp_avg", self._exp_avg),
                                   ("exp_avg_sq", self._exp_avg_sq)):
                    buf[s: s + n].copy_(local_piece(entry[field], (off,), (n,), (p.numel(),), f"{key}.{field}"))
            self._step_views[i].copy_(torch.as_tensor(entry["step"]).reshape(()))
        counters = state_dict.get("counters", {})
        if "skipped_steps" in counters:
            self._skipped.copy_(torch.as_tensor(counters["skipped_steps"]))
        self._publish()
        self.drain_refresh()

    @torch.no_grad()
    def resync_masters_from_params(self) -> None:
        """Re-seed this rank's fp32 masters from the model weights, after the weights were changed
        outside the optimizer (e.g. a weights-only checkpoint load): otherwise the next step starts
        from the stale master and silently reverts them. Moments and step counts are kept. Drain
        any staged refresh BEFORE changing the weights (it would land on top of them)."""
        if self._installed < len(self._pending_publish):
            raise RuntimeError("a staged parameter refresh is still in flight: call drain_refresh() before "
                               "changing the weights, then resync_masters_from_params()")
        if not self._master_is_param:  # else the weights are the master
            torch._foreach_copy_(self._master_chunks, self._param_chunks)


def build_sharded_adamw(model: nn.Module, params: list | None = None, *, stages=None, **kw) -> list[ShardedAdamW]:
    """One ShardedAdamW per parameter dtype, ordered by size with the LARGEST LAST: the one
    place the trainer, the benchmarks and the tests build their AdamW groups.

    That is the seed's step order: the biggest group's publish is issued last, so no other
    group's collective queues behind it (head-of-line blocking would eat the overlap).
    `params`: the subset to cover (default every trainable parameter of `model`; the Muon
    set passes what its matrices leave). `stages` (used by overlap_refresh) defaults to the
    model itself (layout.refresh_stages).
    """
    by_dtype: dict[torch.dtype, list] = {}
    for p in (model.parameters() if params is None else params):
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    groups = sorted(by_dtype.values(), key=lambda ps: sum(p.numel() for p in ps))
    return [ShardedAdamW(ps, stages=model if stages is None else stages, **kw) for ps in groups]
