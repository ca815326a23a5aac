"""Fused QK-norm + RoPE: RMSNorm over head_dim with a per-head-dim gamma, then RoPE.

ONE kernel per direction serves q [B,Hq,T,hd] and k [B,Hkv,T,hd] (any GQA ratio): the
first programs of the launch take q's rows, the rest k's. A "row" is one head vector
(b, h, t) of hd elements, enumerated in (b, t, h) order. Inputs are read and outputs
written through their strides, so the model's projections viewed as
`x.view(B, T, H, hd).transpose(1, 2)` ([B,T,H,hd] in memory) are used without a
contiguous copy, and so is a plain contiguous [B,H,T,hd]; only hd must be unit-stride.
Outputs are allocated like the inputs (torch.empty_like keeps a dense input's strides),
so the model's [B,T,H,hd] memory layout goes through unchanged; they have q/k's dtype,
the math runs in fp32. cos/sin are [T_cache, hd/2]; rows 0..T-1 are used.

Each rotation pair (x1, x2) is (x[i], x[i + hd/2]) for NeoX and (x[2i], x[2i+1]) for
GPT-J, so both variants run the same [rows, hd/2] code with different column maps.
Backward recomputes rstd from x (it re-reads x anyway), undoes the rotation
(R^T: dy1 = do1 c + do2 s, dy2 = do2 c - do1 s), then applies the RMSNorm backward;
a persistent grid accumulates each gamma's gradient per program in fp32, and the
partial rows are summed once afterwards (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import autotune, num_sms

_TUNE = dict(
    gpu=[triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((8, 4), (16, 4), (32, 8))],
    cpu=triton.Config({"BLOCK_R": 8}, num_warps=4),
    key=["HALF", "INTERLEAVED"],
)


@triton.jit
def _pair_cols(HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    i = tl.arange(0, HALF_P)
    if INTERLEAVED:
        c1 = 2 * i
        c2 = 2 * i + 1
    else:
        c1 = i
        c2 = i + HALF
    return i, c1, c2, i < HALF


@triton.jit
def _row_offsets(blk, n_rows, H, T, BLOCK_R: tl.constexpr):
    r = blk * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    h = r % H
    bt = r // H
    t = bt % T
    b = bt // T
    return b, h, t, r < n_rows


@triton.jit
def _fwd_rows(x_ptr, o_ptr, g_ptr, cos_ptr, sin_ptr, blk, n_rows, H, T,
              sx_b, sx_h, sx_t, so_b, so_h, so_t, s_cos, eps,
              HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    i, c1, c2, cmask = _pair_cols(HALF, HALF_P, INTERLEAVED)
    b, h, t, rmask = _row_offsets(blk, n_rows, H, T, BLOCK_R)
    mask = rmask[:, None] & cmask[None, :]
    xrow = (b * sx_b + h * sx_h + t * sx_t)[:, None]
    x1 = tl.load(x_ptr + xrow + c1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + xrow + c2[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    g1 = tl.load(g_ptr + c1, mask=cmask, other=0.0).to(tl.float32)[None, :]
    g2 = tl.load(g_ptr + c2, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y1 = x1 * rstd * g1
    y2 = x2 * rstd * g2
    cs = t[:, None] * s_cos + i[None, :]
    c = tl.load(cos_ptr + cs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + cs, mask=mask, other=0.0)
    orow = (b * so_b + h * so_h + t * so_t)[:, None]
    tl.store(o_ptr + orow + c1[None, :], (y1 * c - y2 * s).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + orow + c2[None, :], (y2 * c + y1 * s).to(o_ptr.dtype.element_ty), mask=mask)


@autotune(**_TUNE)
@triton.jit
def _qk_fwd(q_ptr, k_ptr, qo_ptr, ko_ptr, qg_ptr, kg_ptr, cos_ptr, sin_ptr, nq_rows, nk_rows, Hq, Hk, T,
            sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t, s_cos, eps,
            HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    nq_blocks = tl.cdiv(nq_rows, BLOCK_R)
    if pid < nq_blocks:
        _fwd_rows(q_ptr, qo_ptr, qg_ptr, cos_ptr, sin_ptr, pid, nq_rows, Hq, T,
                  sq_b, sq_h, sq_t, sqo_b, sqo_h, sqo_t, s_cos, eps, HALF, HALF_P, INTERLEAVED, BLOCK_R)
    else:
        _fwd_rows(k_ptr, ko_ptr, kg_ptr, cos_ptr, sin_ptr, pid - nq_blocks, nk_rows, Hk, T,
                  sk_b, sk_h, sk_t, sko_b, sko_h, sko_t, s_cos, eps, HALF, HALF_P, INTERLEAVED, BLOCK_R)


@triton.jit
def _bwd_rows(x_ptr, do_ptr, dx_ptr, g_ptr, dg_part_ptr, cos_ptr, sin_ptr, pid, n_prog, n_rows, H, T,
              sx_b, sx_h, sx_t, sdo_b, sdo_h, sdo_t, sdx_b, sdx_h, sdx_t, s_cos, eps,
              HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    i, c1, c2, cmask = _pair_cols(HALF, HALF_P, INTERLEAVED)
    g1 = tl.load(g_ptr + c1, mask=cmask, other=0.0).to(tl.float32)[None, :]
    g2 = tl.load(g_ptr + c2, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dg1 = tl.zeros([HALF_P], dtype=tl.float32)
    dg2 = tl.zeros([HALF_P], dtype=tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_R)
    blk = pid
    # a while loop: the interpreter (numpy 2.x) cannot range() over runtime scalar args
    while blk < n_blocks:
        b, h, t, rmask = _row_offsets(blk, n_rows, H, T, BLOCK_R)
        mask = rmask[:, None] & cmask[None, :]
        xrow = (b * sx_b + h * sx_h + t * sx_t)[:, None]
        x1 = tl.load(x_ptr + xrow + c1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xrow + c2[None, :], mask=mask, other=0.0).to(tl.float32)
        dorow = (b * sdo_b + h * sdo_h + t * sdo_t)[:, None]
        do1 = tl.load(do_ptr + dorow + c1[None, :], mask=mask, other=0.0).to(tl.float32)
        do2 = tl.load(do_ptr + dorow + c2[None, :], mask=mask, other=0.0).to(tl.float32)
        cs = t[:, None] * s_cos + i[None, :]
        c = tl.load(cos_ptr + cs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + cs, mask=mask, other=0.0)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        dy1 = do1 * c + do2 * s
        dy2 = do2 * c - do1 * s
        dg1 += tl.sum(dy1 * xh1, axis=0)
        dg2 += tl.sum(dy2 * xh2, axis=0)
        dxh1 = dy1 * g1
        dxh2 = dy2 * g2
        proj = ((tl.sum(dxh1 * xh1, axis=1) + tl.sum(dxh2 * xh2, axis=1)) / (2 * HALF))[:, None]
        dxrow = (b * sdx_b + h * sdx_h + t * sdx_t)[:, None]
        tl.store(dx_ptr + dxrow + c1[None, :], ((dxh1 - xh1 * proj) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + dxrow + c2[None, :], ((dxh2 - xh2 * proj) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        blk += n_prog
    part = dg_part_ptr + pid * (2 * HALF)
    tl.store(part + c1, dg1, mask=cmask)
    tl.store(part + c2, dg2, mask=cmask)


@autotune(**_TUNE)
@triton.jit
def _qk_bwd(q_ptr, k_ptr, dqo_ptr, dko_ptr, dq_ptr, dk_ptr, qg_ptr, kg_ptr, dqg_ptr, dkg_ptr, cos_ptr, sin_ptr,
            nq_prog, nk_prog, nq_rows, nk_rows, Hq, Hk, T,
            sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sdqo_b, sdqo_h, sdqo_t, sdko_b, sdko_h, sdko_t,
            sdq_b, sdq_h, sdq_t, sdk_b, sdk_h, sdk_t, s_cos, eps,
            HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    if pid < nq_prog:
        _bwd_rows(q_ptr, dqo_ptr, dq_ptr, qg_ptr, dqg_ptr, cos_ptr, sin_ptr, pid, nq_prog, nq_rows, Hq, T,
                  sq_b, sq_h, sq_t, sdqo_b, sdqo_h, sdqo_t, sdq_b, sdq_h, sdq_t, s_cos, eps,
                  HALF, HALF_P, INTERLEAVED, BLOCK_R)
    else:
        _bwd_rows(k_ptr, dko_ptr, dk_ptr, kg_ptr, dkg_ptr, cos_ptr, sin_ptr, pid - nq_prog, nk_prog, nk_rows, Hk, T,
                  sk_b, sk_h, sk_t, sdko_b, sdko_h, sdko_t, sdk_b, sdk_h, sdk_t, s_cos, eps,
                  HALF, HALF_P, INTERLEAVED, BLOCK_R)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _bht_strides(x: torch.Tensor):
    return x.stride(0), x.stride(1), x.stride(2)


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_gamma, k_gamma, cos, sin, eps, interleaved):
        B, Hq, T, hd = q.shape
        Hk = k.shape[1]
        if k.shape != (B, Hk, T, hd) or hd % 2:
            raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} need equal B, T and an even hd")
        q, k = _unit_last(q), _unit_last(k)
        cos = _unit_last(cos[:T].float())
        sin = _unit_last(sin[:T].float())
        if cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        qg, kg = q_gamma.contiguous(), k_gamma.contiguous()
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        half = hd // 2
        meta = dict(HALF=half, HALF_P=triton.next_power_of_2(half), INTERLEAVED=bool(interleaved))
        nq, nk = B * Hq * T, B * Hk * T
        if nq:
            grid = lambda m: (triton.cdiv(nq, m["BLOCK_R"]) + triton.cdiv(nk, m["BLOCK_R"]),)
            _qk_fwd[grid](q, k, qo, ko, qg, kg, cos, sin, nq, nk, Hq, Hk, T,
                          *_bht_strides(q), *_bht_strides(k), *_bht_strides(qo), *_bht_strides(ko),
                          cos.stride(0), eps, **meta)
        ctx.save_for_backward(q, k, qg, kg, cos, sin)
        ctx.eps, ctx.meta = eps, meta
        return qo, ko

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dqo, dko):
        q, k, qg, kg, cos, sin = ctx.saved_tensors
        B, Hq, T, hd = q.shape
        Hk = k.shape[1]
        dqo, dko = _unit_last(dqo), _unit_last(dko)
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        nq, nk = B * Hq * T, B * Hk * T
        # a persistent grid split between q and k in proportion to their rows
        n_prog = max(2, min(4 * num_sms(q.device), triton.cdiv(nq + nk, 8)))
        nq_prog = min(n_prog - 1, max(1, round(n_prog * nq / max(nq + nk, 1))))
        nk_prog = n_prog - nq_prog
        dqg_part = torch.empty((nq_prog, hd), dtype=torch.float32, device=q.device)
        dkg_part = torch.empty((nk_prog, hd), dtype=torch.float32, device=q.device)
        _qk_bwd[(n_prog,)](q, k, dqo, dko, dq, dk, qg, kg, dqg_part, dkg_part, cos, sin,
                           nq_prog, nk_prog, nq, nk, Hq, Hk, T,
                           *_bht_strides(q), *_bht_strides(k), *_bht_strides(dqo), *_bht_strides(dko),
                           *_bht_strides(dq), *_bht_strides(dk), cos.stride(0), ctx.eps, **ctx.meta)
        return (dq, dk, dqg_part.sum(0).to(qg.dtype), dkg_part.sum(0).to(kg.dtype), None, None, None, None)


def qk_norm_rope(q, k, q_gamma, k_gamma, cos, sin, eps: float, interleaved: bool = False):
    return _QKNormRope.apply(q, k, q_gamma, k_gamma, cos, sin, eps, interleaved)
