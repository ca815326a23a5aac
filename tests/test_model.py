import pytest
import torch

import blunb.model
from blunb.config import apply_overrides, preset
from blunb.model import BLU


def tiny(**overrides):
    return apply_overrides(preset("tiny"), [f"{k}={v}" for k, v in overrides.items()]).model


@pytest.mark.parametrize("tying", [True, False])
def test_shapes_and_parameter_count(tying):
    cfg = tiny(weight_tying=tying)
    model = BLU(cfg)
    assert model.num_params() == cfg.num_params()
    # the formula, spelled out for the tiny config: d128 L4 Hq4 Hkv2 hd32 F352 V320
    d, L, hd, F, V = 128, 4, 32, 352, 320
    block = d * 4 * hd + 2 * d * 2 * hd + 4 * hd * d + 2 * hd + d * 2 * F + F * d + 2 * d
    assert cfg.num_params() == V * d + L * block + d + (0 if tying else V * d)
    idx = torch.randint(0, V, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, V) and logits.dtype == torch.float32
    logits2, loss = model(idx, idx)
    assert torch.equal(logits, logits2) and loss.shape == () and loss.dtype == torch.float32


def test_init_statistics_and_reproducibility():
    cfg = tiny(n_layers=8, d_model=256, head_dim=64, ffn_hidden=704)
    model = BLU(cfg, seed=7)
    blk = model.blocks[0]
    assert blk.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert blk.ffn.gate_up.weight.std().item() == pytest.approx(0.02, rel=0.05)
    resid_std = 0.02 / (2 * 8) ** 0.5
    assert blk.attn.wo.weight.std().item() == pytest.approx(resid_std, rel=0.05)
    assert blk.ffn.down.weight.std().item() == pytest.approx(resid_std, rel=0.05)
    for p in (blk.attn_norm.weight, blk.ffn_norm.weight, blk.attn.q_gamma, blk.attn.k_gamma, model.norm_f.weight):
        assert torch.all(p == 1.0)
    assert blk.attn.q_gamma.dtype == torch.float32
    same = BLU(cfg, seed=7)
    other = BLU(cfg, seed=8)
    for (n, a), b, c in zip(model.named_parameters(), same.parameters(), other.parameters()):
        assert torch.equal(a, b), n
        if a.dim() >= 2:
            assert not torch.equal(a, c), n


def test_causality():
    model = BLU(tiny(), seed=1)
    idx = torch.randint(0, 320, (2, 24))
    changed = idx.clone()
    changed[:, 12:] = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_precision_flags_move_one_stage_each():
    idx = torch.randint(0, 320, (2, 8))
    base = BLU(tiny(), seed=0)
    assert base.wte.weight.dtype == torch.float32 and base(idx).dtype == torch.float32
    logits = BLU(tiny(bf16_logits=True), seed=0)
    _, loss = logits(idx, idx)
    assert logits(idx).dtype == torch.bfloat16 and loss.dtype == torch.float32  # the loss never drops to bf16
    assert BLU(tiny(bf16_embed=True), seed=0).wte.weight.dtype == torch.bfloat16
    resid = BLU(tiny(bf16_resid=True), seed=0)
    assert resid.blocks[0].attn_norm.weight.dtype == torch.bfloat16
    assert resid.blocks[0].attn.q_gamma.dtype == torch.float32  # the QK island stays fp32
    assert BLU(tiny(linear_dtype="bf16"), seed=0).blocks[0].attn.wq.weight.dtype == torch.bfloat16


def test_overlong_sequence_is_an_error():
    model = BLU(tiny())
    with pytest.raises(ValueError, match="exceeds context_length"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_backward_reaches_every_parameter():
    model = BLU(tiny(weight_tying=False), seed=3)
    idx = torch.randint(0, 320, (2, 16))
    model(idx, idx)[1].backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_chunked_ce_returns_the_loss_without_logits():
    model = BLU(tiny(chunked_ce=True), seed=0)
    idx = torch.randint(0, 320, (2, 8))
    logits, loss = model(idx, idx)
    assert logits is None and loss.shape == () and loss.dtype == torch.float32
    assert model(idx).shape == (2, 8, 320)  # without targets: the logits, as ever
    assert model.precision_layout()["logits"] == "fp32 (chunked, never materialized)"
    assert BLU(tiny(), seed=0).precision_layout()["logits"] == "fp32"


@pytest.mark.parametrize("native", [True, False])
def test_cpu_bf16_linears_round_the_fp32_accumulated_product(monkeypatch, native):
    """A bf16 Linear on the CPU, by oneDNN's bf16 GEMM (native) or as an fp32 GEMM of the bf16 values (a CPU
    without bf16 instructions): forward and both gradients within one bf16 rounding of the exact product."""
    monkeypatch.setattr(blunb.model, "NATIVE_CPU_BF16", native)
    torch.manual_seed(0)
    layer = blunb.model.Linear(67, 29, dtype=torch.bfloat16)   # odd shapes
    x = torch.randn(3, 5, 67).to(torch.bfloat16).requires_grad_()
    out = layer(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert out.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    x64, w64, g64 = x.detach().double(), layer.weight.detach().double(), grad_out.double()
    exact = {"out": x64 @ w64.T, "x.grad": g64 @ w64,
             "weight.grad": g64.reshape(-1, 29).T @ x64.reshape(-1, 67)}
    got = {"out": out, "x.grad": x.grad, "weight.grad": layer.weight.grad}
    for name, ref in exact.items():
        # bf16 keeps 8 significant bits: a correctly rounded result is within 2^-8 of |ref| (relative), plus
        # fp32 accumulation error far below that; the absolute floor covers results that cancel to near 0.
        err = (got[name].double() - ref).abs()
        assert bool((err <= ref.abs() * 2.0 ** -8 + 1e-2).all()), (name, float(err.max()))
