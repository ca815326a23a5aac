"""ShardedMuon on CPU: parity with torch.optim.Muon / AdamW at W = 1..4 (gloo, real
multi-process torchrun; every case of a world size in one launch), plus the pieces."""

from __future__ import annotations

import copy
import logging
import sys
import weakref

import pytest
import torch
from torch import nn

from blunb.optim import ShardedMuon
from blunb.optim import muon as muon_mod
from blunb.optim.layout import lpt_partition, ns_cost
from blunb.optim.muon import adjust_lr_ratio, build_muon, muon_param_groups
from blunb.optim.newton_schulz import NewtonSchulz, graphs_enabled, zeropower_reference
from tests.distributed import REPO, torchrun

WORKER = REPO / "tests" / "workers" / "muon_worker.py"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_owners_replicas_guard(world):
    """Both collectives x both adjust_lr modes, fewer/more matrices than ranks, rectangular
    both ways, aux AdamW, clip, divergence guard, non-finite skip, bf16 weights."""
    if world == 1:  # the single-process path: no torch.distributed at all
        from tests.workers.muon_worker import run_all
        run_all()
        return
    proc = torchrun(WORKER, world)
    assert proc.stdout.count(f"OK W={world}") == 10, proc.stdout
    assert "FutureWarning" not in proc.stderr, proc.stderr  # one collectives shim for both torch stacks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_a_plain_script_exits_cleanly():
    """Steps both ZeRO optimizers and destroys the process group: no gloo worker thread survives
    it (a survivor aborts the process at interpreter exit when it releases a collective)."""
    proc = torchrun(REPO / "tests" / "workers" / "plain_exit.py", 2)
    assert proc.stdout.count("clean exit") == 2, proc.stdout + proc.stderr


def test_lpt_partition_is_balanced_and_deterministic():
    shapes = [(2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * 4
    costs = [ns_cost(s, 5) for s in shapes]
    owners = lpt_partition(costs, 3)
    assert owners == lpt_partition(costs, 3)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(costs)  # the LPT bound
    assert lpt_partition(costs[:2], 4)[:2] == [0, 1]  # fewer items than ranks: distinct owners


class _Toy(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.wte = nn.Embedding(40, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict({"wq": nn.Linear(16, 16, bias=False),
                                                   "up": nn.Linear(16, 48, bias=False),
                                                   "norm": nn.LayerNorm(16, bias=False)}) for _ in range(2))
        self.norm_f = nn.LayerNorm(16, bias=False)
        self.lm_head = nn.Linear(16, 40, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


@pytest.mark.parametrize("tied", [False, True])
def test_seed_split_and_coverage_report(tied, caplog):
    model = _Toy(tied)
    muon_g, aux_g = muon_param_groups(model)
    body = {id(b[k].weight) for b in model.blocks for k in ("wq", "up")}
    assert {id(p) for p in muon_g["params"]} == body
    aux_ids = {id(p) for p in aux_g["params"]}
    assert {id(model.wte.weight), id(model.lm_head.weight), id(model.norm_f.weight)} <= aux_ids
    assert len(aux_ids) == (4 if tied else 5)  # wte, (untied) head, norm_f, 2 block norms
    with caplog.at_level(logging.INFO, logger="blunb.optim.muon"):
        opt = build_muon(model, lr=0.02, adamw_lr=3e-3, max_grad_norm=1.0)
    out = caplog.text
    assert "APPLIES TO" in out and f"{opt.clip_covered_numel()} / {opt.total_numel()}" in out
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[1]["lr"] == 3e-3


def test_single_process_training_steps_and_state_dict_roundtrip():
    torch.manual_seed(0)
    model = _Toy(False).to(torch.bfloat16)
    opt = build_muon(model, lr=0.02, adamw_lr=3e-3, max_grad_norm=1.0, verbose=False)
    x = torch.randint(0, 40, (4, 8))

    def train_step(o):
        h = model.wte(x)
        for b in model.blocks:
            h = b["norm"](h + b["wq"](h))
            h = h + b["up"](h)[..., :16]
        loss = model.lm_head(model.norm_f(h)).float().logsumexp(-1).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    for _ in range(2):
        train_step(opt)
    assert all(st["master"].dtype == torch.float32 for st in opt.state.values())
    saved = copy.deepcopy(opt.state_dict())  # as if from disk: no aliasing with opt's live state
    params_before = [p.detach().clone() for p in model.parameters()]
    opt2 = build_muon(model, lr=0.02, adamw_lr=3e-3, max_grad_norm=1.0, verbose=False)
    opt2.load_state_dict(saved)
    assert all(t.dtype == torch.float32 for st in opt2.state.values() for t in st.values())
    train_step(opt)
    after_1 = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, b in zip(model.parameters(), params_before):
            p.copy_(b)
    train_step(opt2)
    for a, b in zip(after_1, model.parameters()):
        assert torch.equal(a, b.detach())
    assert opt.state_bytes() > 0 and opt.skipped_steps == 0 and opt.rejected_ns_updates == 0
    assert 0.3 < opt.ns_max_update_ratio < 1.5


def test_ns_engine_matches_torch_muon_bitwise_on_cpu():
    from torch.optim._muon import _zeropower_via_newtonschulz
    torch.manual_seed(0)
    ns = NewtonSchulz(graphs=False)
    G = torch.randn(3, 40, 24)  # tall: run in its own layout (X^T X), torch transposes it
    ref = torch.stack([_zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7) for g in G])
    assert torch.equal(ns(G), ref)
    assert torch.equal(zeropower_reference(G[0]), ref[0])


SHAPES_BOTH_WAYS = [(37, 13), (13, 37), (64, 64), (3, 37, 13), (3, 13, 37), (3, 64, 64)]


@pytest.mark.parametrize("shape", SHAPES_BOTH_WAYS)
def test_tall_ns_is_the_transposed_wide_ns_in_fp32(shape):
    """The iteration on a tall X (A = X^T X, X <- a X + X B) is the wide one on X^T, transposed.
    fp32 through the same chain (_ns is dtype-agnostic): only the summation order inside the
    GEMMs may differ with the operand layout, ~1e-7 relative per product; five steps, each
    amplifying a perturbation at most ~4x (the slope of a s + b s^3 + c s^5 where NS keeps the
    singular values s), stay well under 1e-5 on O(1) entries (measured: <= 1.5e-6). A wrong
    product order or a missing transpose is off by O(1)."""
    torch.manual_seed(0)
    ns = NewtonSchulz(graphs=False)
    G = torch.randn(*shape)
    G3 = G if G.dim() == 3 else G[None]
    out = ns._ns(G3, (False, False))
    torch.testing.assert_close(out, ns._ns(G3.mT.contiguous(), (False, False)).mT, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES_BOTH_WAYS)
def test_tall_ns_is_the_transposed_wide_ns_in_bf16(shape):
    """The engine as the optimizer runs it (bf16 staging, bf16 iterates), either orientation.
    Each bf16 run is within ~2e-2 of exact NS (its iterates are rounded to bf16 every step:
    the repo's bf16 NS tolerance; measured 1.2-1.7e-2 on these), so two runs whose roundings
    fall differently (a square X: X X^T vs X^T X) agree within twice that; non-square, both
    round the same products and agree far closer (bitwise on this CPU)."""
    torch.manual_seed(0)
    ns = NewtonSchulz(graphs=False)
    G = torch.randn(*shape)
    out = ns(G)
    assert out.dtype == torch.bfloat16 and out.shape == G.shape
    other = ns(G.mT.contiguous()).mT
    tol = 4e-2 if shape[-1] == shape[-2] else 1e-2
    assert float((out.float() - other.float()).norm() / other.float().norm()) < tol


def _per_matrix_step(state, grads, *, lr, wd, mu, nesterov, ns):
    """The matrix update written per parameter in plain ops, as _muon_step did before it worked
    on whole shape groups: returns (rejected, worst update ratio), updates `state` in place."""
    skip = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
    rejected, ratio = 0, 0.0
    for st, g in zip(state, grads):
        if g is None:
            continue
        g = torch.zeros_like(st["momentum_buffer"]) if skip else g.float()
        st["momentum_buffer"].lerp_(g, 0.0 if skip else 1 - mu)
        U = ns(g.lerp(st["momentum_buffer"], mu) if nesterov else st["momentum_buffer"])
        if not float(U.abs().max()) <= muon_mod.GUARD_MAX_ABS:
            rejected += 1
            continue
        ratio = max(ratio, float(U.float().norm()) / min(U.shape) ** 0.5)
        if not skip:
            st["master"].mul_(1 - lr * wd)
            st["master"].addcmul_(U, torch.tensor(st["ratio"], dtype=torch.float32) * -lr)
    return rejected, ratio


@pytest.mark.parametrize("scratch", [muon_mod.SCRATCH_BYTES, 1])  # 1: every matrix is its own run
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_step_equals_the_per_matrix_step(dtype, nesterov, scratch, monkeypatch):
    """Whole-group passes == the per-parameter step, bit for bit (same ops per element): tall,
    wide, square, repeated and single shapes; a step where one matrix has no gradient, and a
    step with an inf gradient (skipped: momenta kept, no update)."""
    monkeypatch.setattr(muon_mod, "SCRATCH_BYTES", scratch)
    torch.manual_seed(0)
    shapes = [(8, 12), (12, 8), (8, 12), (5, 5), (12, 8), (7, 3), (12, 8)]
    params = [nn.Parameter((torch.randn(s) * 0.5).to(dtype)) for s in shapes]
    lr, wd, mu = 0.02, 0.1, 0.95
    opt = ShardedMuon(params, lr=lr, momentum=mu, nesterov=nesterov, weight_decay=wd, verbose=False)
    assert scratch > 1 or all(len(sg.runs) == len(sg.params) for sg in opt._groups)
    ref = [{"master": p.detach().float().clone(), "momentum_buffer": torch.zeros(s),
            "ratio": adjust_lr_ratio(s, "match_rms_adamw")} for p, s in zip(params, shapes)]
    ns = NewtonSchulz(graphs=False)
    for step in range(4):
        grads = [None if (step == 1 and i == 1) else torch.randn(s).to(dtype) for i, s in enumerate(shapes)]
        if step == 2:
            grads[4][3, 2] = float("inf")
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        rejected, ratio = _per_matrix_step(ref, grads, lr=lr, wd=wd, mu=mu, nesterov=nesterov, ns=ns)
        assert opt.ns_rejected_last_step == rejected == 0
        assert opt.ns_max_update_ratio == pytest.approx(ratio, rel=1e-6)
        for i, (p, r) in enumerate(zip(params, ref)):
            st = opt.state[p]
            assert torch.equal(st["momentum_buffer"], r["momentum_buffer"]), f"step {step} matrix {i}: momentum"
            assert torch.equal(st["master"], r["master"]), f"step {step} matrix {i}: master"
            assert torch.equal(p.detach(), r["master"].to(dtype)), f"step {step} matrix {i}: weight"
    assert opt.skipped_steps == 1 and opt.rejected_ns_updates == 0


def test_a_nan_update_is_rejected_and_leaves_the_master_as_it_was():
    """NS gives NaN (here from NaN coefficients): rejected and counted, weight and master
    untouched (0 * NaN is NaN: the update must be masked, not only scaled by 0), momentum stepped."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in [(8, 12), (12, 8), (12, 8)]]
    opt = ShardedMuon(params, lr=0.02, ns_coefficients=(float("nan"), 0.0, 0.0), verbose=False)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.ns_rejected_last_step == 3 and opt.ns_max_update_ratio == 0.0
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b) and torch.equal(opt.state[p]["master"], b)
        assert bool(opt.state[p]["momentum_buffer"].ne(0).any())


def test_rejects_bad_arguments(monkeypatch):
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError):
        ShardedMuon([p], lr=0.1, adjust_lr="nope")
    with pytest.raises(ValueError):
        ShardedMuon([p], lr=0.1, collective="allreduce")
    with pytest.raises(ValueError):
        ShardedMuon([{"params": [nn.Parameter(torch.randn(4))], "use_muon": True}], lr=0.1)
    with pytest.raises(ValueError):
        NewtonSchulz(coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="reduce_dtype"):
        ShardedMuon([p], lr=0.1, reduce_dtype="fp16")
    with pytest.raises(ValueError, match="stages"):  # an explicit error, as ShardedAdamW's
        ShardedMuon([p], lr=0.1, overlap_refresh=True)
    monkeypatch.setenv("BLUNB_NS_GRAPHS", "0")
    assert not graphs_enabled() and not NewtonSchulz().graphs


def test_refresh_stage_map_and_hooks_hold_the_optimizer_weakly():
    model = _Toy(False)
    opt = build_muon(model, lr=0.02, adamw_lr=3e-3, overlap_refresh=True, stages=model, verbose=False)
    stage_map = opt.refresh_stage_map()
    assert len(stage_map["stages"]) == 3 and stage_map["uncovered"] == []  # model root, then each block
    assert all(set(row) == {"params", "numel", "bytes", "collectives"} for row in stage_map["stages"])
    assert len(model._forward_pre_hooks) == 1 and all(len(b._forward_pre_hooks) == 1 for b in model.blocks)
    ref = weakref.ref(opt)
    del opt                      # no reference cycle: freed at once, and its hooks go with it
    assert ref() is None
    assert not model._forward_pre_hooks and not any(b._forward_pre_hooks for b in model.blocks)
    blocks_only = [(b, list(b.parameters())) for b in model.blocks]
    opt = build_muon(model, lr=0.02, adamw_lr=3e-3, overlap_refresh=True, stages=blocks_only, verbose=False)
    uncovered = {id(p) for p in opt.refresh_stage_map()["uncovered"]}
    assert uncovered == {id(model.wte.weight), id(model.norm_f.weight), id(model.lm_head.weight)}
    assert build_muon(model, lr=0.02, adamw_lr=3e-3, verbose=False).refresh_stage_map() is None


def test_parameters_without_grad_are_not_stepped_like_torch():
    """A matrix or an aux tensor whose .grad is None keeps its weight, momentum / moments and
    step count, as torch.optim.Muon and torch.optim.AdamW do; the others still match them."""
    torch.manual_seed(0)
    M = [nn.Parameter(torch.randn(8, 12) * 0.5), nn.Parameter(torch.randn(12, 8) * 0.5)]
    A = [nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(5, 4))]
    Mr, Ar = [nn.Parameter(p.detach().clone()) for p in M], [nn.Parameter(p.detach().clone()) for p in A]
    opt = ShardedMuon([{"params": M, "use_muon": True}, {"params": A, "use_muon": False}], lr=0.02,
                      adamw_lr=0.01, verbose=False)
    ref_muon = torch.optim.Muon(Mr, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([{"params": [Ar[1]], "weight_decay": 0.1}, {"params": [Ar[0]], "weight_decay": 0.0}],
                                  lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        unused = {0, 3} if step == 1 else set()    # step 1: M[0] and A[1] get no gradient
        for k, (p, r) in enumerate(zip(M + A, Mr + Ar)):
            if k not in unused:
                g = torch.randn_like(p)
                p.grad, r.grad = g.clone(), g.clone()
        before = [p.detach().clone() for p in M + A]
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        opt.zero_grad()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
        if unused:
            assert torch.equal(M[0].detach(), before[0]) and torch.equal(A[1].detach(), before[3])
        for p, r in zip(M, Mr):
            assert float((p - r).detach().norm() / r.detach().norm()) < 1e-2   # bf16 Newton-Schulz
        for p, r in zip(A, Ar):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
    assert [float(opt.state[p]["adamw_step"]) for p in A] == [3.0, 2.0]
