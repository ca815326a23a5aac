"""The torch reference ops against torch's own functions and hand-written math."""

import pytest
import torch
import torch.nn.functional as F

from blunb import kernels
from blunb.kernels import reference


def test_rms_norm_matches_the_formula():
    x, w = torch.randn(5, 7, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    expected = x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * w
    torch.testing.assert_close(kernels.rms_norm(x.float(), w.float(), 1e-5), expected.float())
    half = kernels.rms_norm(x.bfloat16(), w.float(), 1e-5)
    assert half.dtype == torch.bfloat16  # fp32 statistics, stored back in the input dtype
    torch.testing.assert_close(half.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_rope_cache_values():
    cos, sin = kernels.rope_cache(6, 8, 10000.0)
    assert cos.shape == (6, 4) and cos.dtype == torch.float32
    inv = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(cos[3].double(), torch.cos(3 * inv), check_dtype=False)
    torch.testing.assert_close(sin[5].double(), torch.sin(5 * inv), check_dtype=False)


def test_rope_interleaved_is_neox_on_permuted_dims():
    # GPT-J pairs (2i, 2i+1) == NeoX halves (i, i+hd/2) after moving even dims first.
    hd = 16
    q, k = torch.randn(2, 6, 5, hd), torch.randn(2, 2, 5, hd)
    g_q, g_k = torch.rand(hd) + 0.5, torch.rand(hd) + 0.5
    cos, sin = kernels.rope_cache(5, hd, 500000.0)
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    qj, kj = kernels.qk_norm_rope(q, k, g_q, g_k, cos, sin, 1e-6, interleaved=True)
    qn, kn = kernels.qk_norm_rope(q[..., perm], k[..., perm], g_q[perm], g_k[perm], cos, sin, 1e-6)
    torch.testing.assert_close(qj[..., perm], qn)
    torch.testing.assert_close(kj[..., perm], kn)


def test_rope_preserves_norm_and_relative_position():
    hd = 32
    cos, sin = kernels.rope_cache(9, hd, 10000.0)
    x = torch.randn(1, 1, 1, hd).expand(1, 1, 9, hd)
    r = reference.apply_rope(x, cos, sin, interleaved=False)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1))
    # <R_m q, R_n k> depends only on m - n
    q, k = torch.randn(hd), torch.randn(hd)
    rq = reference.apply_rope(q.expand(9, hd), cos, sin, False)
    rk = reference.apply_rope(k.expand(9, hd), cos, sin, False)
    torch.testing.assert_close(rq[5] @ rk[3], rq[7] @ rk[5], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (8, 1)])
def test_attention_reference_matches_math(hq, hkv):
    q, k, v = torch.randn(2, hq, 11, 16), torch.randn(2, hkv, 11, 16), torch.randn(2, hkv, 11, 16)
    torch.testing.assert_close(kernels.flash_attention(q, k, v), reference.attention_math(q, k, v),
                               rtol=1e-5, atol=1e-5)


def test_cross_entropy_matches_torch_and_ignores():
    logits, t = torch.randn(10, 37), torch.randint(0, 37, (10,))
    t[3] = -100
    torch.testing.assert_close(kernels.cross_entropy(logits, t), F.cross_entropy(logits, t))
    all_ignored = kernels.cross_entropy(logits, torch.full((10,), -100))
    assert all_ignored.item() == 0.0
    assert kernels.cross_entropy(logits.bfloat16(), t).dtype == torch.float32


def test_swiglu_and_syrk():
    gu = torch.randn(3, 4, 10)
    torch.testing.assert_close(kernels.swiglu(gu), F.silu(gu[..., :5]) * gu[..., 5:])
    x = torch.randn(3, 5, 7)
    torch.testing.assert_close(kernels.syrk(x), torch.bmm(x, x.transpose(1, 2)))


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="backend"):
        kernels.swiglu(torch.randn(2, 4), backend="cuda")


def test_a_per_op_backend_setting_forces_only_the_ops_it_names(monkeypatch):
    assert kernels.parse_backends("auto") == dict.fromkeys(kernels.OPS)
    assert kernels.parse_backends("torch") == dict.fromkeys(kernels.OPS, "torch")
    backends = kernels.parse_backends("swiglu=torch, cross_entropy=triton,rms_norm=auto")
    assert backends == {**dict.fromkeys(kernels.OPS), "swiglu": "torch", "cross_entropy": "triton"}
    monkeypatch.setenv("BLUNB_KERNELS", "cross_entropy=triton")
    described = kernels.describe("cpu")
    assert described["cross_entropy"] == "triton" and described["swiglu"] == "torch"
    # on the CPU auto is the reference; the forced op runs its Triton kernel (the interpreter, fp32 exact enough)
    logits, targets = torch.randn(5, 40), torch.randint(0, 40, (5,))
    torch.testing.assert_close(kernels.cross_entropy(logits, targets), reference.cross_entropy(logits, targets))
    assert kernels._resolve("cross_entropy", None, logits, ()) == "triton"
    assert kernels._resolve("swiglu", None, logits, ()) == "torch"


def test_a_kernel_that_is_never_the_auto_choice_is_described_as_torch(monkeypatch):
    """rms_norm's fused module says AUTO = False: auto resolves it to torch even for a CUDA tensor,
    and the run log's description says so; forcing it still picks Triton."""
    from blunb.kernels.fused import rms_norm as fused_rms_norm

    assert fused_rms_norm.AUTO is False
    monkeypatch.setenv("BLUNB_KERNELS", "auto")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.randn(3, 8)
    assert kernels._resolve("rms_norm", None, x, ()) == "torch"
    assert kernels._resolve("swiglu", None, x, ()) == "triton"
    assert kernels._resolve("rms_norm", "triton", x, ()) == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    described = kernels.describe("cuda")
    assert described["rms_norm"] == "torch" and described["swiglu"] == "triton"
