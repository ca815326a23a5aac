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
    assert kernels.backend_for("cross_entropy", logits, targets) == "triton"
    assert kernels.backend_for("swiglu", logits) == "torch"
    assert kernels.backend_for("cross_entropy", logits, targets, backend="torch") == "torch"  # the argument wins


def test_a_kernel_that_is_never_the_auto_choice_is_described_as_torch(monkeypatch):
    """rms_norm's fused module says AUTO = False: auto resolves it to torch even for a CUDA tensor,
    and the run log's description says so; forcing it still picks Triton."""
    from blunb.kernels.fused import rms_norm as fused_rms_norm

    assert fused_rms_norm.AUTO is False
    monkeypatch.setenv("BLUNB_KERNELS", "auto")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.randn(3, 8)
    assert kernels.backend_for("rms_norm", x) == "torch"
    assert kernels.backend_for("swiglu", x) == "triton"
    assert kernels.backend_for("rms_norm", x, backend="triton") == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    described = kernels.describe("cuda")
    assert described["rms_norm"] == "torch" and described["swiglu"] == "triton"


def test_the_run_log_says_what_a_call_on_cuda_runs(monkeypatch):
    """describe("cuda") against backend_for on a CUDA tensor, op by op, auto and forced: "triton-or-torch" only
    for the ops whose fused module decides per shape (prefer), each other op exactly what its calls take."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.randn(4, 8)
    for spec in ("auto", "torch", "triton", "adamw=torch,linear_cross_entropy=torch"):
        monkeypatch.setenv("BLUNB_KERNELS", spec)
        described = kernels.describe("cuda")
        assert set(described) == set(kernels.OPS)
        for op in kernels.OPS:
            if described[op] == "triton-or-torch (per shape)":
                assert kernels.parse_backends(spec)[op] is None and op in ("flash_attention", "syrk")
            else:
                assert described[op] == kernels.backend_for(op, x), (spec, op)
    monkeypatch.setenv("BLUNB_KERNELS", "auto")
    described = kernels.describe("cuda")
    assert described["adamw"] == described["linear_cross_entropy"] == "triton" and described["rms_norm"] == "torch"


def test_adamw_reference_is_torchs_fused_adamw():
    """reference.adamw_update_ (the spec of kernels/fused/adamw.py) against torch._fused_adamw_ per segment,
    which ShardedAdamW runs with kernels=adamw=torch: equal to fp32 rounding (torch forms the bias
    corrections in double and updates in another order: ulps apart, 1e-6 relative). A table of one block
    per segment, the torch backend's need (no triton here); fp16 grads and weights (the reduce dtype)."""
    segments = [(0, 3, 37, 0, True), (40, 45, 1, 1, False), (41, 50, 130, 2, True)]  # gaps: padding
    n_shard, n_flat = 171, 180
    master, m, v = torch.randn(n_shard), 0.1 * torch.randn(n_shard), 0.01 * torch.rand(n_shard)
    grad, param = torch.randn(n_flat).half(), torch.zeros(n_flat).half()
    steps = torch.tensor([1.0, 5.0, 300.0])
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    grad_scale, found_inf = torch.tensor(2.0), torch.tensor(0.0)
    table = {"shard": torch.tensor([s[0] for s in segments]), "flat": torch.tensor([s[1] for s in segments]),
             "len": torch.tensor([s[2] for s in segments], dtype=torch.int32),
             "param": torch.tensor([s[3] for s in segments], dtype=torch.int32),
             "decays": torch.tensor([s[4] for s in segments], dtype=torch.int8)}
    got = [t.clone() for t in (master, m, v, param)]
    kernels.adamw_update_(got[0], got[1], got[2], grad, got[3], steps, table, **hyper, weight_decay=0.1,
                          grad_scale=grad_scale, found_inf=found_inf)
    want = [t.clone() for t in (master, m, v)]
    for s0, f0, n, i, decays in segments:
        seg = [t[s0:s0 + n] for t in want]
        torch._fused_adamw_([seg[0]], [grad[f0:f0 + n].float()], [seg[1]], [seg[2]], [], [steps[i].clone()],
                            **hyper, weight_decay=0.1 if decays else 0.0, amsgrad=False, maximize=False,
                            grad_scale=grad_scale, found_inf=found_inf)
        assert torch.equal(got[3][f0:f0 + n], got[0][s0:s0 + n].half())  # the weights: the master rounded
    for a, b in zip(got[:3], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
