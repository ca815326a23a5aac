"""ShardedAdamW (ZeRO-1): real multi-process gloo runs at W = 1..4, plus argument errors.

Each world size is ONE torchrun launch whose worker (tests/workers/zero_adamw_worker.py)
loops over every case: parity with torch.optim.AdamW (both collectives, with and without
clipping, uneven shards), bf16 masters, overlap == serial bit for bit, bit-identical
replicas, NaN skip, global clip, state-bytes accounting.
"""

import pytest
import torch
import torch.nn as nn

from blunb.optim.clip import global_clip
from blunb.optim.layout import refresh_stages
from blunb.optim.zero_adamw import ShardedAdamW, build_sharded_adamw
from tests.distributed import REPO, torchrun

WORKER = REPO / "tests" / "workers" / "zero_adamw_worker.py"


@pytest.mark.parametrize("world_size, kernels", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"),
                                                 (3, "adamw=triton")])
def test_zero_adamw_multiprocess(world_size, kernels, monkeypatch):
    """Every case at each W; once more at an uneven W with the fused shard update (kernels/fused/adamw.py,
    under the Triton interpreter here) in place of torch._fused_adamw_: the same bars against torch's AdamW."""
    monkeypatch.setenv("BLUNB_KERNELS", kernels)
    proc = torchrun(WORKER, world_size)
    assert f"zero_adamw worker OK at W={world_size}" in proc.stdout


def _fused_and_torch_paths(monkeypatch, dtype, steps, grads_of, **kw):
    """The same parameters stepped by the torch path and by the fused update -> (torch, fused) optimizers."""
    out = []
    for backend in ("adamw=torch", "adamw=triton"):
        monkeypatch.setenv("BLUNB_KERNELS", backend)
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(37, 5).to(dtype)), nn.Parameter(torch.randn(11).to(dtype)),
                  nn.Parameter(torch.randn(20, 15).to(dtype))]
        opt = ShardedAdamW(params, lr=1e-2, **kw)
        assert opt._fused == (backend == "adamw=triton")
        for step in range(steps):
            for p, g in zip(params, grads_of(step)):
                p.grad = None if g is None else g.to(dtype)
            opt.step()
        out.append(opt)
    return out


def test_fused_update_matches_the_torch_path(monkeypatch):
    """fp32 (the interpreter's bf16 rounding is not the GPU's: tests/test_speed_gpu.py checks bf16 on
    CUDA), four buckets, both decay classes, clipping, a non-finite step that must change nothing, and a
    step where one parameter has no gradient (the per-segment path steps the others). Bias corrections are
    fp32 here and double in torch: masters, moments and weights agree to fp32 rounding."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(37, 5, generator=gen), torch.randn(11, generator=gen), torch.randn(20, 15, generator=gen)]
             for _ in range(6)]
    grads[2][1] = torch.full((11,), float("nan"))   # the whole step skipped
    grads[4][0] = None                              # the first parameter not stepped
    ref, fused = _fused_and_torch_paths(monkeypatch, torch.float32, 6, grads.__getitem__, max_grad_norm=0.5,
                                        bucket_mb=0.0005)
    assert len(fused._buckets) > 2 and fused.skipped_steps == ref.skipped_steps == 1
    assert torch.equal(fused._steps, ref._steps)
    for mine, theirs in ((fused._master, ref._master), (fused._exp_avg, ref._exp_avg),
                         (fused._exp_avg_sq, ref._exp_avg_sq), (fused._flat_param, ref._flat_param)):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item())


def test_the_fused_update_stages_no_gradient_until_a_step_leaves_a_parameter_out(monkeypatch):
    """A bf16 group: the torch path keeps an fp32 staging buffer of the largest bucket chunk, the fused
    update none (state_bytes says so). A step with a parameter left out runs the per-segment path on
    both: the fused optimizer makes its staging buffer then, and that step is the torch path's exactly."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(37, 5, generator=gen), None, torch.randn(20, 15, generator=gen)]
    ref, fused = _fused_and_torch_paths(monkeypatch, torch.bfloat16, 0, None, bucket_mb=0.0005)
    stage_bytes = 4 * max(ref._bucket_chunk)
    assert ref._grad_stage is not None and fused._grad_stage is None
    assert ref.state_bytes() - fused.state_bytes() == stage_bytes
    for opt in (ref, fused):
        for p, g in zip(opt._params, grads):
            p.grad = None if g is None else g.to(torch.bfloat16)
        opt.step()
    assert fused._grad_stage is not None and fused._grad_stage.numel() == stage_bytes // 4
    for mine, theirs in ((fused._master, ref._master), (fused._exp_avg, ref._exp_avg),
                         (fused._exp_avg_sq, ref._exp_avg_sq), (fused._flat_param, ref._flat_param)):
        assert torch.equal(mine, theirs)


def test_single_process_without_process_group_matches_adamw():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    opt = ShardedAdamW(params, lr=1e-2, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW([{"params": ref[:1]}, {"params": ref[1:], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, r, g in zip(params, ref, grads):
            p.grad.copy_(g)
            r.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert all(p.grad is not None and not p.grad.any() for p in params)
    # one rank, fp32: the update steps the weights themselves, no master copy beside them
    assert opt._master is opt._flat_param and opt.state_bytes() == 8 * opt.shard_numel


def test_parameters_without_grad_are_not_stepped_like_torch():
    """A .grad of None (zero_grad() then a backward that never reaches the tensor) leaves the
    parameter, its moments and its step count alone, exactly as torch.optim.AdamW does."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(4, 2))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    opt = ShardedAdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW([{"params": [ref[0], ref[2]]}, {"params": [ref[1]], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(4):
        unused = {1: 2, 2: 0}.get(step)     # which tensor backward does not reach this step
        for k, (p, r) in enumerate(zip(params, ref)):
            if k != unused:
                g = torch.randn_like(p)
                (p * g).sum().backward()
                r.grad = g.clone()
        before = params[unused].detach().clone() if unused is not None else None
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if unused is not None:
            assert torch.equal(params[unused].detach(), before), "a parameter without .grad moved"
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert all(p.grad is None for p in params)
    assert opt._steps.tolist() == [3.0, 4.0, 3.0]  # each tensor counts its own steps, as torch


def test_replaced_grads_are_adopted():
    p = nn.Parameter(torch.ones(4, 4))
    opt = ShardedAdamW([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.full((4, 4), 2.0)          # a reassigned .grad must not be silently dropped
    opt.step()
    assert torch.allclose(p, torch.full((4, 4), 0.9))


def test_bad_arguments_raise_clearly():
    p32, p16 = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="collective"):
        ShardedAdamW([p32], lr=1e-3, collective="allreduce")
    with pytest.raises(ValueError, match="reduce_dtype"):
        ShardedAdamW([p32], lr=1e-3, reduce_dtype="fp16")
    with pytest.raises(ValueError, match="single dtype"):
        ShardedAdamW([p32, p16], lr=1e-3)
    with pytest.raises(ValueError, match="stages"):
        ShardedAdamW([p32], lr=1e-3, overlap_refresh=True)
    with pytest.raises(ValueError, match="one flat list"):
        ShardedAdamW([{"params": [p32]}, {"params": [nn.Parameter(torch.zeros(2))]}], lr=1e-3)
    with pytest.raises(ValueError, match="bucket_mb"):
        ShardedAdamW([p32], lr=1e-3, bucket_mb=0)
    with pytest.raises(ValueError, match="hyper-parameters"):
        ShardedAdamW([p32], lr=1e-3, betas=(0.9, 1.5))


def test_refresh_stages_follow_consumption_order():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 5)
    m = M()
    stages = refresh_stages(m)
    assert [mod for mod, _ in stages] == [m, m.layers[0], m.layers[1]]
    assert stages[0][1] == [m.emb.weight]
    assert stages[2][1] == [*m.layers[1].parameters(), *m.head.parameters()]
    opts = build_sharded_adamw(m, lr=1e-3)
    assert len(opts) == 1 and opts[0].numel == sum(p.numel() for p in m.parameters())


class _PartlyCovered:
    """Stand-in for a group that withholds the clip from part of its params (Muon-like)."""

    def __init__(self, sq_total, sq_covered):
        self.sq = torch.tensor(sq_total), torch.tensor(sq_covered)
        self.coef = self.found_inf = None

    def reduce_and_measure(self):
        return self.sq

    def set_external_clip_coef(self, coef, found_inf=None):
        self.coef, self.found_inf = coef, found_inf


@pytest.mark.parametrize("strict", [False, True])
def test_global_clip_covered_vs_strict(strict):
    opts = [_PartlyCovered(9.0, 1.0), _PartlyCovered(16.0, 3.0)]   # total 25 (norm 5), covered 4 (norm 2)
    st = global_clip(opts, max_norm=1.0, strict=strict)
    want = 1.0 / (5.0 + 1e-6) if strict else 1.0 / (2.0 + 1e-6)
    assert float(st.total_norm) == pytest.approx(5.0) and bool(st.clipped) and not bool(st.found_inf)
    assert all(float(o.coef) == pytest.approx(want) and not bool(o.found_inf) for o in opts)
    opts.append(_PartlyCovered(float("nan"), 0.0))
    st = global_clip(opts, max_norm=1.0, strict=strict)
    assert bool(st.found_inf) and not bool(st.clipped) and float(st.clip_coef) == 1.0
    assert all(bool(o.found_inf) for o in opts)
