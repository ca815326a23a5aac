"""Fused SwiGLU: gu [..., 2F] laid out [gate | up] -> silu(gate) * up, [..., F].

Elementwise, math in fp32. Backward reads gate, up and dy once and writes d(gu) =
[dgate | dup] in the same pass: dgate = dy * up * s * (1 + g * (1 - s)), dup = dy * g * s,
with s = sigmoid(g) recomputed (cheaper than saving the forward's silu).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import autotune, rows

_TUNE = dict(
    gpu=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8))],
    cpu=triton.Config({"BLOCK": 128}, num_warps=4),  # small: F=200 in the tests spans 2 blocks
    key=["F"],
)


@autotune(**_TUNE)
@triton.jit
def _swiglu_fwd(gu_ptr, y_ptr, stride_gu, stride_y, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(y_ptr + row * stride_y + cols, (g * s * u).to(y_ptr.dtype.element_ty), mask=mask)


@autotune(**_TUNE)
@triton.jit
def _swiglu_bwd(gu_ptr, dy_ptr, dgu_ptr, stride_gu, stride_dy, stride_dgu, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    out = dgu_ptr + row * stride_dgu + cols
    tl.store(out, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(out + F, du.to(dgu_ptr.dtype.element_ty), mask=mask)


def _grid(M, F):
    return lambda meta: (M, triton.cdiv(F, meta["BLOCK"]))


# Custom ops with fake implementations and autograd (why: blunb/kernels/__init__.py).
@torch.library.custom_op("blunb::swiglu_fwd", mutates_args=())
def swiglu_fwd(gu: torch.Tensor) -> torch.Tensor:
    gu2 = rows(gu)
    M, F = gu2.shape[0], gu2.shape[1] // 2
    y = torch.empty((M, F), dtype=gu.dtype, device=gu.device)
    if M and F:
        _swiglu_fwd[_grid(M, F)](gu2, y, gu2.stride(0), y.stride(0), F)
    return y.view(*gu.shape[:-1], F)


@swiglu_fwd.register_fake
def _(gu):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


@torch.library.custom_op("blunb::swiglu_bwd", mutates_args=())
def swiglu_bwd(gu: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    gu2, dy2 = rows(gu), rows(dy)
    M, F = gu2.shape[0], gu2.shape[1] // 2
    dgu = torch.empty((M, 2 * F), dtype=gu2.dtype, device=gu2.device)
    if M and F:
        _swiglu_bwd[_grid(M, F)](gu2, dy2, dgu, gu2.stride(0), dy2.stride(0), dgu.stride(0), F)
    return dgu.view(*dy.shape[:-1], 2 * F)


@swiglu_bwd.register_fake
def _(gu, dy):
    return gu.new_empty((*dy.shape[:-1], 2 * dy.shape[-1]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy):
    (gu,) = ctx.saved_tensors
    return swiglu_bwd(gu, dy)


swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim [gate | up], got {gu.shape[-1]}")
    return swiglu_fwd(gu)
