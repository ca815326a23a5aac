"""kernels.flash_attention (Triton) vs reference.attention_math, under the Triton interpreter.

Small shapes (B=1-2, few heads) keep the interpreter fast; the odd lengths (77, 129) cross
several 64-row blocks with a masked tail. fp32 and fp16 only: bf16 arithmetic is not
emulated by the interpreter (bf16 is tested on the GPU).
"""

import pytest
import torch

from blunb import kernels
from blunb.kernels import reference
from blunb.kernels.fused import flash_attention as fa

# fp32: the kernel differs from the fp32 reference only in summation order and exp2 vs exp
# (measured ~1e-6 on O(1) values), so 1e-4 is a safe margin. fp16: P and dS are rounded to
# fp16 before their matmuls (as on the GPU) and outputs to fp16 (ulp 2^-11 ~ 5e-4 at 1.0);
# measured max error ~2e-3 on O(1) gradients, 1e-2 leaves 5x margin.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _inputs(B, Hq, Hkv, T, hd, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(H):
        if layout == "bthd":  # the model's projection views: [B,T,H,hd] memory seen as [B,H,T,hd]
            x = torch.randn(B, T, H, hd, generator=g).to(dtype).transpose(1, 2)
        else:
            x = torch.randn(B, H, T, hd, generator=g).to(dtype)
        return x.requires_grad_()

    return make(Hq), make(Hkv), make(Hkv)


def _check_against_reference(B, Hq, Hkv, T, hd, dtype, layout, causal=True):
    q, k, v = _inputs(B, Hq, Hkv, T, hd, dtype, layout)
    out = kernels.flash_attention(q, k, v, causal, backend="triton")
    ref = reference.attention_math(q, k, v, causal)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref, **tol)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"d{n}: {m}")
    return out, grads, (q, k, v)


@pytest.mark.parametrize(
    "B,Hq,Hkv,T,hd,dtype,layout",
    [
        (1, 2, 2, 77, 64, torch.float32, "bthd"),  # GQA 1, odd T
        (1, 3, 1, 129, 64, torch.float32, "bhtd"),  # GQA 3, odd T, one row past 2 blocks
        (2, 8, 1, 64, 128, torch.float32, "bthd"),  # GQA 8, hd 128, even T, batch stride
        (1, 2, 2, 129, 128, torch.float32, "bhtd"),  # hd 128, odd T
        (1, 4, 2, 77, 64, torch.float16, "bthd"),  # fp16, GQA 2
        (1, 3, 1, 20, 128, torch.float16, "bhtd"),  # fp16, shorter than one block
    ],
)
def test_forward_backward_causal(B, Hq, Hkv, T, hd, dtype, layout):
    _check_against_reference(B, Hq, Hkv, T, hd, dtype, layout)


def test_non_causal_odd_t():
    _check_against_reference(1, 3, 1, 77, 64, torch.float32, "bthd", causal=False)


def test_output_and_grad_layouts():
    out, (dq, dk, dv), (q, k, v) = _check_against_reference(1, 4, 2, 64, 64, torch.float32, "bthd")
    B, Hq, T, hd = out.shape
    # [B,T,Hq,hd] storage: merging the heads back is a free view
    assert out.transpose(1, 2).is_contiguous()
    assert out.transpose(1, 2).reshape(B, T, Hq * hd).data_ptr() == out.data_ptr()
    # grads keep the inputs' strides, so the backward of their views is free as well
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


def test_backward_is_deterministic():
    q, k, v = _inputs(1, 3, 1, 77, 64, torch.float32, "bthd")
    go = torch.randn(1, 3, 77, 64)
    runs = [torch.autograd.grad(fa.flash_attention(q, k, v, True), (q, k, v), go) for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_rejects_unsupported_head_dim():
    q = torch.randn(1, 2, 8, 96)
    with pytest.raises(ValueError, match="head_dim"):
        fa.flash_attention(q, q, q, True)
