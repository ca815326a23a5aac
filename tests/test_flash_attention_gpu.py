"""kernels.flash_attention (Triton) on the GPU in bf16, with the flash-attention rule:
the kernel's max error against an fp32 reference must be at most twice the error of the
same computation done in bf16 by PyTorch (bf16 matmuls, softmax rounded to bf16), plus a
tiny absolute slack. Fresh random inputs each run (no fixed seed), T up to 4096."""

import pytest
import torch

from blunb import kernels
from blunb.kernels import reference
from blunb.kernels.fused import flash_attention as fa

pytestmark = pytest.mark.gpu

SLACK = 1e-4  # absolute, for outputs/grads whose bf16 reference error happens to be ~0


def _bf16_math(q, k, v, causal):
    """The same attention computed by PyTorch in the inputs' dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return s.softmax(-1).to(v.dtype) @ v


def _inputs(B, Hq, Hkv, T, hd, layout):
    def make(H):
        if layout == "bthd":
            x = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        else:
            x = torch.randn(B, H, T, hd, device="cuda", dtype=torch.bfloat16)
        return x.requires_grad_()

    return make(Hq), make(Hkv), make(Hkv)


def _fwd_bwd(fn, q, k, v, go, causal):
    out = fn(q, k, v, causal)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


@pytest.mark.parametrize(
    "B,Hq,Hkv,T,hd,layout,causal",
    [
        (2, 16, 16, 2048, 128, "bthd", True),
        (1, 24, 8, 4096, 128, "bthd", True),
        (2, 16, 4, 2048, 64, "bthd", True),
        (1, 8, 1, 4096, 64, "bhtd", True),
        (2, 6, 2, 1000, 128, "bhtd", True),  # masked tail (1000 = 7 * 128 + 104)
        (1, 4, 4, 77, 64, "bthd", True),
        (2, 8, 2, 333, 128, "bthd", False),
    ],
)
def test_flash_attention_rule(B, Hq, Hkv, T, hd, layout, causal):
    q, k, v = _inputs(B, Hq, Hkv, T, hd, layout)
    go = torch.randn(B, Hq, T, hd, device="cuda", dtype=torch.bfloat16)
    ref = _fwd_bwd(reference.attention_math, *(x.float().detach().requires_grad_() for x in (q, k, v)),
                   go.float(), causal)
    pt = _fwd_bwd(_bf16_math, q, k, v, go, causal)
    tri = _fwd_bwd(fa.flash_attention, q, k, v, go, causal)
    for name, r, p, t in zip(("out", "dq", "dk", "dv"), ref, pt, tri, strict=True):
        assert torch.isfinite(t).all(), name
        err_tri, err_pt = (t.float() - r).abs().max().item(), (p.float() - r).abs().max().item()
        assert err_tri <= 2 * err_pt + SLACK, f"{name}: triton {err_tri:.3e} vs bf16 torch {err_pt:.3e}"
    assert tri[0].transpose(1, 2).is_contiguous()


def test_backward_deterministic_on_gpu():
    q, k, v = _inputs(2, 16, 4, 2048, 64, "bthd")
    go = torch.randn(2, 16, 2048, 64, device="cuda", dtype=torch.bfloat16)
    a = _fwd_bwd(fa.flash_attention, q, k, v, go, True)
    b = _fwd_bwd(fa.flash_attention, q, k, v, go, True)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_auto_dispatch_decides_once(capsys):
    fa._choice.clear()
    q, k, v = _inputs(2, 16, 4, 2048, 64, "bthd")
    go = torch.randn(2, 16, 2048, 64, device="cuda", dtype=torch.bfloat16)
    out = _fwd_bwd(kernels.flash_attention, q, k, v, go, True)
    again = _fwd_bwd(kernels.flash_attention, q, k, v, go, True)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "kernels.flash_attention" in ln]
    assert len(lines) == 1 and ("triton for" in lines[0] or "SDPA for" in lines[0]), lines
    ref = _fwd_bwd(reference.flash_attention, q, k, v, go, True)
    for x, y, r in zip(out, again, ref, strict=True):
        torch.testing.assert_close(x, y)
        torch.testing.assert_close(x, r, atol=5e-2, rtol=5e-2)
    assert not fa.prefer(q.float(), k.float(), v.float(), True)  # fp32 stays on SDPA
