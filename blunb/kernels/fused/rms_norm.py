"""Fused RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * weight.

Statistics in fp32 whatever the input dtype; y keeps x's dtype. Forward: one program
per row, saving the row's rstd (4 bytes) so backward needs no second reduction over x.
Backward: a persistent grid (a few programs per SM) walks the rows; each program keeps
its share of dweight in fp32 registers and writes one partial row, and the [P, N]
partials are summed once afterwards (no atomics on dweight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import autotune, num_sms, rows

_MAX_N = 65536  # one row is held in registers
# Never the auto choice: torch's native F.rms_norm measured faster on an H200 (16384x4096 bf16
# fwd+bwd 0.313 vs 0.455 ms, results/bench/kernels.csv; on 1b's fp32 residual stream this kernel is
# 0.30x, kernels_1b.csv), and under compile Inductor fuses it with the residual add and the cast.
# The kernel stays for A/B with backend="triton" / kernels=rms_norm=triton.
AUTO = False


@autotune([triton.Config({}, num_warps=w) for w in (4, 8, 16)], triton.Config({}, num_warps=4), key=["N"])
@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@autotune([triton.Config({}, num_warps=w) for w in (8, 16)], triton.Config({}, num_warps=4), key=["N"])
@triton.jit
def _rms_norm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, stride_dy, stride_x, stride_dx, M, N,
                  BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row = pid.to(tl.int64)
    # a while loop: the interpreter (numpy 2.x) cannot range() over runtime scalar args
    while row < M:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=0) / N
        tl.store(dx_ptr + row * stride_dx + cols, ((wdy - xhat * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        row += n_prog
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=mask)


# Custom ops with fake implementations and autograd (why: blunb/kernels/__init__.py).
@torch.library.custom_op("blunb::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y like x (contiguous), rstd fp32 per row."""
    N = x.shape[-1]
    x2 = rows(x)
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _rms_norm_fwd[(M,)](x2, weight.contiguous(), y, rstd, x2.stride(0), y.stride(0), N, eps,
                            BLOCK_N=triton.next_power_of_2(N))
    return y.view(x.shape), rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1].numel(), dtype=torch.float32)


@torch.library.custom_op("blunb::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like dy (contiguous), dweight like weight)."""
    x2, w, dy2 = rows(x), weight.contiguous(), rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    n_prog = max(1, min(M, 4 * num_sms(x2.device)))
    dw_part = torch.empty((n_prog, N), dtype=torch.float32, device=x2.device)
    if M:
        _rms_norm_bwd[(n_prog,)](dy2, x2, w, rstd, dx, dw_part, dy2.stride(0), x2.stride(0), dx.stride(0), M, N,
                                 BLOCK_N=triton.next_power_of_2(N))
    else:
        dw_part.zero_()
    return dx.view(dy.shape), dw_part.sum(0).to(w.dtype)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return dy.new_empty(dy.shape, dtype=x.dtype), torch.empty_like(weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    rstd = output[1]
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # rstd gets no gradient: no zeros are made for it


def _backward(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] > _MAX_N:
        raise ValueError(f"fused rms_norm supports a last dim up to {_MAX_N}, got {x.shape[-1]}")
    return rms_norm_fwd(x, weight, eps)[0]
