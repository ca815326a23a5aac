"""GPU: what the speed work added, on CUDA, at sizes where cuBLAS and the profiler behave as in
training: the chunked lm_head + loss against the unchunked path (eager and compiled), the profiler's
device-kernel tables and the trainer's opt_step_ms. Skipped without CUDA."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from blunb.config import apply_overrides, preset
from blunb.kernels import linear_cross_entropy, reference

pytestmark = pytest.mark.gpu


def _grads(fn, x, w, targets):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(x, w, targets)
    loss.backward()
    return loss.detach(), x.grad.float(), w.grad.float()


@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16], ids=["fp32_logits", "bf16_logits"])
def test_chunked_loss_matches_the_unchunked_path_on_cuda(logit_dtype):
    # 1b's lm_head shape, fewer tokens: N = 2 chunks + 17 (the last chunk partial), bf16 GEMMs.
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 2 * 4096 + 17, 2048, 50304
    x = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(v, d, device="cuda", generator=gen)).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[::97] = -100

    def plain(x, w, t):
        return reference.cross_entropy(F.linear(x, w).to(logit_dtype), t)

    loss, gx, gw = _grads(lambda x, w, t: linear_cross_entropy(x, w, t, logit_dtype=logit_dtype), x, w, targets)
    ref_loss, ref_gx, ref_gw = _grads(plain, x, w, targets)
    # cuBLAS may pick another kernel (and summation order) for a 4096-row GEMM than for the whole
    # one, so each logit can differ by an fp32 rounding before the cast: the mean loss agrees to fp32
    # accumulation noise, the bf16 gradients to a few bf16 half-ulps (2^-8 relative) of their largest
    # entry (grad_w: one rounding per chunk partial plus the final one, as on the CPU).
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=0)
    torch.testing.assert_close(gx, ref_gx, rtol=2**-7, atol=2**-7 * ref_gx.abs().max().item())
    torch.testing.assert_close(gw, ref_gw, rtol=0, atol=4 * 2**-8 * ref_gw.abs().max().item())


def test_chunked_loss_compiles_and_matches_eager_on_cuda():
    from blunb.model import BLU

    cfg = apply_overrides(preset("tiny"), ["model.chunked_ce=true"])
    model = BLU(cfg.model, device="cuda", seed=0)
    idx = torch.randint(0, cfg.model.vocab_size, (4, cfg.T + 1), device="cuda")
    _, eager = model(idx[:, :-1], idx[:, 1:])
    eager.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _, compiled = torch.compile(model)(idx[:, :-1], idx[:, 1:])
    compiled.backward()
    # Inductor fuses and reorders the elementwise work around the (opaque) chunked op: bf16 rounding
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=0)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad.float(), g.float(), rtol=0, atol=2**-6 * g.abs().max().item())


def test_profile_steps_tabulate_device_kernels_and_opt_step_ms_is_timed(tmp_path, monkeypatch):
    from blunb.train import train

    monkeypatch.setenv("BLUNB_CACHE_DIR", str(tmp_path / "cache"))
    cfg = apply_overrides(preset("tiny"), ["device=cuda", "profile_steps=2"])
    cfg.rescale_schedule(8)
    cfg.val_freq = 1000
    train(cfg, tmp_path / "run")
    categories = pd.read_csv(tmp_path / "run" / "profile.csv")
    kernels = pd.read_csv(tmp_path / "run" / "profile_kernels.csv")
    assert "matmul" in set(categories["category"]) and (categories["ms_per_step"] > 0).all()
    assert not kernels["kernel"].str.startswith("aten::").any()   # device kernels, not CPU ops
    assert not kernels["kernel"].str.contains("Optimizer.step|ProfilerStep").any()   # no annotation spans
    calls = kernels.set_index("kernel")["calls_per_step"]
    assert calls["_swiglu_fwd"] == calls["_swiglu_bwd"]   # training steps only: no validation forwards
    m = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert (m["opt_step_ms"] > 0).all() and (m["opt_step_ms"] < m["dt_ms"]).all()


def test_fused_adamw_update_matches_the_torch_path_in_bf16_on_cuda(monkeypatch):
    """The fused shard update on a bf16 group at a size with many blocks per parameter (kernels/fused/adamw.py):
    the masters and moments agree with torch._fused_adamw_'s path to fp32 rounding (its bias corrections
    are double, here fp32), and the bf16 weights are exactly the masters rounded (the GPU's conversion)."""
    import torch.nn as nn

    from blunb.optim.zero_adamw import ShardedAdamW

    opts = []
    for backend in ("adamw=torch", "adamw=triton"):
        monkeypatch.setenv("BLUNB_KERNELS", backend)
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(2048, 1000, device="cuda").bfloat16()),
                  nn.Parameter(torch.randn(2048, device="cuda").bfloat16()),
                  nn.Parameter(torch.randn(5632, 2048, device="cuda").bfloat16())]
        opt = ShardedAdamW(params, lr=1e-3, max_grad_norm=1.0, bucket_mb=8)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad.copy_(torch.randn(p.shape, device="cuda", generator=gen))
            opt.step()
        opts.append(opt)
    ref, fused = opts
    assert fused._fused and not ref._fused
    for mine, theirs in ((fused._master, ref._master), (fused._exp_avg, ref._exp_avg),
                         (fused._exp_avg_sq, ref._exp_avg_sq)):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item())
    for pc, mc in zip(fused._param_chunks, fused._master_chunks):
        assert torch.equal(pc, mc.to(torch.bfloat16))
