"""torchrun worker for tests/test_muon.py: every ShardedMuon case at one world size.

ShardedMuon on rank-local gradients vs torch.optim.Muon + torch.optim.AdamW on the
rank-averaged gradient (every rank derives every rank's gradient from seeds, so each
holds the reference). Checks per case and step: Muon parity (bf16 NS tolerance), aux
AdamW parity (fp32), replicas bit-identical, exactly one owner per tensor with state
only there. Special cases: divergence guard, non-finite gradient skip, reduce_dtype (the
owner's averaged gradient is, bit for bit, what a reduce in that dtype gives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from blunb.optim.muon import ShardedMuon

SHAPES = {
    "few": [(24, 40), (40, 24)],  # fewer matrices than ranks at W >= 3
    "many": [(32, 32), (16, 48), (48, 16), (32, 32), (24, 40), (40, 24), (16, 48)],
}
AUX_SHAPES = [(32,), (48,), (2, 3, 4), (50, 16)]  # (50, 16): an embedding, AdamW by choice
LR, ADAMW_LR, WD, MU = 0.02, 0.01, 0.1, 0.95
MUON_TOL = 1e-2   # relative error of the accumulated update: bf16 NS
MUON_TOL_BF16 = 5e-2  # bf16 weights: the gradients are also reduced in bf16
STEPS = 3

CASES = [
    dict(name="rsag-many-match", shapes="many", collective="rs_ag", adjust_lr="match_rms_adamw",
         nesterov=True, clip=0.5, buckets=3),
    dict(name="rb-many-original", shapes="many", collective="reduce_bcast", adjust_lr="original",
         nesterov=False, clip=0.0, explicit_reduce=True),
    dict(name="rsag-few-original", shapes="few", collective="rs_ag", adjust_lr="original",
         nesterov=True, clip=0.0, buckets=6, explicit_reduce=True),
    dict(name="rb-few-match", shapes="few", collective="reduce_bcast", adjust_lr="match_rms_adamw",
         nesterov=True, clip=1e-3),
    dict(name="guard", shapes="many", collective="rs_ag", adjust_lr="match_rms_adamw", nesterov=True,
         clip=0.0, ns_coefficients=(100.0, 0.0, 0.0)),
    dict(name="nan-skip", shapes="many", collective="rs_ag", adjust_lr="match_rms_adamw", nesterov=True,
         clip=0.5, poison_step=1),
    dict(name="bf16-rsag", shapes="many", collective="rs_ag", adjust_lr="match_rms_adamw", nesterov=True,
         clip=0.0, dtype=torch.bfloat16),
    dict(name="rsag-bf16-reduce", shapes="many", collective="rs_ag", adjust_lr="match_rms_adamw", nesterov=True,
         clip=0.5, buckets=2, reduce_dtype="bf16", explicit_reduce=True),
    dict(name="rb-bf16-reduce", shapes="few", collective="reduce_bcast", adjust_lr="original", nesterov=True,
         clip=0.0, reduce_dtype="bf16", explicit_reduce=True),
    dict(name="bf16-rsag-fp32-reduce", shapes="many", collective="rs_ag", adjust_lr="match_rms_adamw",
         nesterov=True, clip=0.0, dtype=torch.bfloat16, reduce_dtype="fp32", explicit_reduce=True),
]


def params(shapes, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def rank_grads(shapes, step, rank, seed):
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """t from every rank (just [t] without torch.distributed: the single-process run)."""
    if not dist.is_initialized():
        return [t]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reduced_mean(grads, dtype):
    """What a reduce in `dtype` gives: the sum in that dtype (rank order), then / W in it."""
    total = grads[0].to(dtype)
    for g in grads[1:]:
        total = total + g.to(dtype)
    return (total * (1.0 / len(grads))).float()


def check_own_grads(opt, params, avg, reduce_dtype):
    """The owner's averaged gradient: its dtype, and its value (bf16: exactly; fp32: to the
    summation order)."""
    for p, want in zip(params, avg):
        if opt.owner_of(p) == opt.rank:
            got = opt._own_grad[p]
            assert got.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[reduce_dtype], got.dtype
            tol = 1e-6 if reduce_dtype == "fp32" else 0.0
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol / 10)


def run_case(case, rank, W):
    dtype = case.get("dtype", torch.float32)
    reduce_dtype = case.get("reduce_dtype")
    mshapes = SHAPES[case["shapes"]]
    seed = sum(map(ord, case["name"]))
    M, A = params(mshapes, seed, dtype), params(AUX_SHAPES, seed + 1, torch.float32)
    Mr = [torch.nn.Parameter(p.detach().float().clone()) for p in M]
    Ar = [torch.nn.Parameter(p.detach().clone()) for p in A]
    opt = ShardedMuon([{"params": M, "use_muon": True}, {"params": A, "use_muon": False}], lr=LR,
                      momentum=MU, nesterov=case["nesterov"], weight_decay=WD, adjust_lr=case["adjust_lr"],
                      collective=case["collective"], target_buckets=case.get("buckets", 6), adamw_lr=ADAMW_LR,
                      max_grad_norm=case["clip"], ns_coefficients=case.get("ns_coefficients", "fixed"),
                      reduce_dtype=reduce_dtype or "param", verbose=False)
    ref_muon = torch.optim.Muon(Mr, lr=LR, weight_decay=WD, momentum=MU, nesterov=case["nesterov"],
                                adjust_lr_fn=case["adjust_lr"])
    ref_adamw = torch.optim.AdamW([{"params": [p for p in Ar if p.ndim >= 2], "weight_decay": WD},
                                   {"params": [p for p in Ar if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=ADAMW_LR, betas=(0.9, 0.95), eps=1e-8)
    assert opt.param_groups[0]["params"] == M and opt.param_groups[1]["params"] == A

    # exactly one owner per tensor, the same map on every rank, state only on the owner
    owners = [opt.owner_of(p) for p in M + A]
    every = gather(torch.tensor(owners))
    assert all(torch.equal(o, every[0]) for o in every), f"owner maps differ across ranks: {every}"
    has_state = torch.tensor([1 if opt.state.get(p) else 0 for p in M + A])
    assert has_state.tolist() == [int(o == rank) for o in owners]
    assert sum(gather(has_state)).tolist() == [1] * len(owners)

    M0 = [p.detach().float().clone() for p in Mr]
    for step in range(STEPS):
        per_rank = [rank_grads(mshapes + AUX_SHAPES, step, r, seed) for r in range(W)]
        if reduce_dtype == "bf16" and W > 2:  # a sum of two is order-free; on this coarse grid any is exact
            per_rank = [[(g * 8).round().clamp(-16, 16) / 8 for g in grads] for grads in per_rank]
        poisoned = step == case.get("poison_step")
        if poisoned:
            per_rank[W - 1][0][0, 0] = float("nan")
        mine = per_rank[rank]
        for p, g in zip(M + A, mine):
            p.grad = g.to(p.dtype)
        avg = [torch.stack([per_rank[r][i] for r in range(W)]).mean(0) for i in range(len(mine))]
        if dtype != torch.float32:  # the reference sees the gradients our ranks actually hold
            avg[:len(M)] = [torch.stack([per_rank[r][i].to(dtype).float() for r in range(W)]).mean(0)
                            for i in range(len(M))]
        if reduce_dtype == "bf16":
            avg = [reduced_mean([per_rank[r][i] for r in range(W)], torch.bfloat16) for i in range(len(mine))]
        elif reduce_dtype == "fp32":  # of the gradients as the ranks hold them (bf16 for bf16 weights)
            avg = [reduced_mean([per_rank[r][i].to(p.dtype) for r in range(W)], torch.float32)
                   for i, p in enumerate(M + A)]
        sq_total = sum(float(g.double().square().sum()) for g in avg)
        sq_cov = sum(float(g.double().square().sum()) for g in avg[len(M):])
        before = [p.detach().clone() for p in M + A]

        if case.get("explicit_reduce"):
            t, c = opt.reduce_and_measure()
            assert abs(float(t) - sq_total) <= 1e-4 * sq_total, (float(t), sq_total)
            assert abs(float(c) - sq_cov) <= 1e-4 * sq_cov, (float(c), sq_cov)
            if reduce_dtype is not None:
                check_own_grads(opt, M + A, avg, reduce_dtype)
        opt.step()
        opt.zero_grad()

        if poisoned:  # the whole step is skipped: nothing moves, the reference does not step
            assert bool(opt.clip_stats.found_inf) and opt.skipped_steps == 1
            for p, b in zip(M + A, before):
                assert torch.equal(p.detach(), b), "a skipped step changed a parameter"
            continue

        for p, g in zip(Mr + Ar, avg):
            p.grad = g.clone()
        if case["clip"] > 0:
            ref_norm = torch.nn.utils.clip_grad_norm_(Ar, case["clip"])
            assert abs(float(opt.clip_stats.clip_coef) - min(1.0, case["clip"] / (float(ref_norm) + 1e-6))) < 1e-5
        norm_tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16 grads are reduced in bf16
        assert abs(float(opt.clip_stats.total_norm) ** 2 - sq_total) <= norm_tol * sq_total
        if case.get("ns_coefficients") is None:
            ref_muon.step()
        ref_adamw.step()

        if case.get("ns_coefficients") is not None:  # guard: every matrix update rejected
            assert opt.ns_rejected_last_step == len(M) and opt.rejected_ns_updates == len(M) * (step + 1)
            assert opt.ns_max_update_ratio == 0.0
            for p, b in zip(M, before):
                assert torch.equal(p.detach(), b), "a rejected update was applied"
        else:
            assert opt.ns_rejected_last_step == 0
            assert 0.3 < opt.ns_max_update_ratio < 1.5, opt.ns_max_update_ratio
            for i, (p, pr, p0) in enumerate(zip(M, Mr, M0)):
                if dtype == torch.float32:
                    err = rel(p.detach() - p0, pr.detach() - p0)
                elif opt.owner_of(p) == rank:  # bf16 weights: the fp32 master carries the update
                    master = opt.state[p]["master"]
                    assert torch.equal(p.detach(), master.to(dtype)), "weight != master.to(bf16)"
                    err = rel(master - p0, pr.detach() - p0)
                else:
                    continue
                tol = MUON_TOL if dtype == torch.float32 else MUON_TOL_BF16
                assert err < tol, f"{case['name']} step {step} matrix {i} {tuple(p.shape)}: rel err {err:.3e}"
        for i, (p, pr) in enumerate(zip(A, Ar)):
            torch.testing.assert_close(p.detach(), pr.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, step=step, i=i: f"{case['name']} step {step} aux {i}: {m}")

        # replicas bit-identical: every rank's flattened parameters equal rank 0's
        gathered = gather(torch.cat([p.detach().float().reshape(-1) for p in M + A]))
        assert all(torch.equal(g, gathered[0]) for g in gathered), "replicas diverged"
    return opt


def run_all(rank: int = 0, W: int = 1) -> None:
    """Every case; also called in-process (no torch.distributed) for W = 1."""
    for case in CASES:
        run_case(case, rank, W)
        if rank == 0:
            print(f"OK W={W} {case['name']}", flush=True)


def main():
    dist.init_process_group("gloo")
    run_all(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
