"""Fused QK-norm + RoPE: RMSNorm over head_dim with a per-head-dim gamma, then RoPE.

ONE kernel per direction serves q [B,Hq,T,hd] and k [B,Hkv,T,hd] (any GQA ratio), so the model's two
norms and two rotations are one launch forward and one backward. The kernels read the model's
[B,T,H,hd] projection views and a contiguous [B,H,T,hd] as they are, without a copy, and allocate the
outputs like the inputs, so the model's memory goes through unchanged; the math runs in fp32. Both RoPE
conventions are served (NeoX half-split, GPT-J pairs). The gamma gradient is one sum over per-program
fp32 partials, no atomics.

Details (the row layouts, the tile, the backward): docs/architecture.md, section
"blunb/kernels/fused/qk_norm_rope.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import autotune, num_sms

_KEY = ["nq_rows", "nk_rows", "HQ", "HK", "HALF", "INTERLEAVED"]
_TUNE = dict(
    gpu=[triton.Config({"BLOCK_R": r}, num_warps=w) for r in (16, 32, 64) for w in (4, 8)],
    cpu=triton.Config({"BLOCK_R": 16}, num_warps=4),
    key=_KEY,
)
_MAX_BLOCK_R = 64  # the largest BLOCK_R above: a backward program's run of rows is a multiple of it


@triton.jit
def _positions(r, H: tl.constexpr, BHTD: tl.constexpr, T):
    """Position t of rows r (int32): (b, h, t) row order if BHTD, else (b, t, h)."""
    if BHTD:
        return r % T
    else:
        return (r // H) % T


@triton.jit
def _load_pairs(x_ptr, offs, mask, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """The rotation halves (x1, x2) of a row tile as fp32 [BLOCK_R, HALF_P].

    offs/mask address the tile: [BLOCK_R, HALF_P] (NeoX, x2 is HALF further) or
    [BLOCK_R, 2 * HALF_P] (GPT-J, split into even / odd columns)."""
    if INTERLEAVED:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_R, HALF_P, 2]))
    else:
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_pairs(o_ptr, offs, mask, y1, y2, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        y = tl.reshape(tl.join(y1, y2), [BLOCK_R, 2 * HALF_P])
        tl.store(o_ptr + offs, y.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(o_ptr + offs, y1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + offs + HALF, y2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_offsets(HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """In-tile element offsets (int32, relative to the tile's first row) and the column mask."""
    rl = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        col = tl.arange(0, 2 * HALF_P)
        return rl[:, None] * (2 * HALF) + col[None, :], col < 2 * HALF
    else:
        col = tl.arange(0, HALF_P)
        return rl[:, None] * (2 * HALF) + col[None, :], col < HALF


@triton.jit
def _gammas(g_ptr, HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """gamma at the pair columns, as fp32 [1, HALF_P] each."""
    i = tl.arange(0, HALF_P)
    if INTERLEAVED:
        g1 = tl.load(g_ptr + 2 * i, mask=i < HALF, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + 2 * i + 1, mask=i < HALF, other=0.0).to(tl.float32)
    else:
        g1 = tl.load(g_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + i + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    return g1[None, :], g2[None, :]


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, t, rmask, HALF: tl.constexpr, HALF_P: tl.constexpr):
    i = tl.arange(0, HALF_P)
    cs = t[:, None] * HALF + i[None, :]
    m = rmask[:, None] & (i < HALF)[None, :]
    return tl.load(cos_ptr + cs, mask=m, other=0.0), tl.load(sin_ptr + cs, mask=m, other=0.0)


@triton.jit
def _fwd_tile(x_ptr, o_ptr, g_ptr, cos_ptr, sin_ptr, r0, n_rows, T, eps,
              H: tl.constexpr, BHTD: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
              INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    base = r0.to(tl.int64) * (2 * HALF)  # 64-bit only in the tile's base; in-tile offsets fit 32 bits
    x_ptr += base
    o_ptr += base
    r = r0 + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    offs, cmask = _tile_offsets(HALF, HALF_P, BLOCK_R, INTERLEAVED)
    mask = rmask[:, None] & cmask[None, :]
    x1, x2 = _load_pairs(x_ptr, offs, mask, HALF, HALF_P, BLOCK_R, INTERLEAVED)
    c, s = _cos_sin(cos_ptr, sin_ptr, _positions(r, H, BHTD, T), rmask, HALF, HALF_P)
    g1, g2 = _gammas(g_ptr, HALF, HALF_P, INTERLEAVED)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    y1 = x1 * rstd * g1
    y2 = x2 * rstd * g2
    _store_pairs(o_ptr, offs, mask, y1 * c - y2 * s, y2 * c + y1 * s, HALF, HALF_P, BLOCK_R, INTERLEAVED)


@autotune(**_TUNE)
@triton.jit
def _qk_fwd(q_ptr, k_ptr, qo_ptr, ko_ptr, qg_ptr, kg_ptr, cos_ptr, sin_ptr, nq_rows, nk_rows, T, eps,
            HQ: tl.constexpr, HK: tl.constexpr, Q_BHTD: tl.constexpr, K_BHTD: tl.constexpr,
            HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    nq_blocks = tl.cdiv(nq_rows, BLOCK_R)
    if pid < nq_blocks:
        _fwd_tile(q_ptr, qo_ptr, qg_ptr, cos_ptr, sin_ptr, pid * BLOCK_R, nq_rows, T, eps,
                  HQ, Q_BHTD, HALF, HALF_P, INTERLEAVED, BLOCK_R)
    else:
        _fwd_tile(k_ptr, ko_ptr, kg_ptr, cos_ptr, sin_ptr, (pid - nq_blocks) * BLOCK_R, nk_rows, T, eps,
                  HK, K_BHTD, HALF, HALF_P, INTERLEAVED, BLOCK_R)


@triton.jit
def _bwd_run(x_ptr, do_ptr, dx_ptr, g_ptr, dg_ptr, cos_ptr, sin_ptr, start, stop, T, eps,
             H: tl.constexpr, BHTD: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
             INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [start, stop) in BLOCK_R tiles; writes this run's gamma-gradient partial to dg_ptr."""
    offs, cmask = _tile_offsets(HALF, HALF_P, BLOCK_R, INTERLEAVED)
    g1, g2 = _gammas(g_ptr, HALF, HALF_P, INTERLEAVED)
    # gamma-gradient terms accumulate per tile element and are reduced over rows once, after the loop
    # (a per-iteration reduction over rows spans warps: a shared-memory round trip and barrier each time)
    acc1 = tl.zeros([BLOCK_R, HALF_P], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, HALF_P], dtype=tl.float32)
    r0 = start
    # a while loop: the interpreter (numpy 2.x) cannot range() over runtime scalar args
    while r0 < stop:
        base = r0.to(tl.int64) * (2 * HALF)
        r = r0 + tl.arange(0, BLOCK_R)
        rmask = r < stop
        mask = rmask[:, None] & cmask[None, :]
        x1, x2 = _load_pairs(x_ptr + base, offs, mask, HALF, HALF_P, BLOCK_R, INTERLEAVED)
        do1, do2 = _load_pairs(do_ptr + base, offs, mask, HALF, HALF_P, BLOCK_R, INTERLEAVED)
        c, s = _cos_sin(cos_ptr, sin_ptr, _positions(r, H, BHTD, T), rmask, HALF, HALF_P)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        xh1 = x1 * rstd
        xh2 = x2 * rstd
        dy1 = do1 * c + do2 * s
        dy2 = do2 * c - do1 * s
        acc1 += dy1 * xh1
        acc2 += dy2 * xh2
        dxh1 = dy1 * g1
        dxh2 = dy2 * g2
        proj = ((tl.sum(dxh1 * xh1, axis=1) + tl.sum(dxh2 * xh2, axis=1)) / (2 * HALF))[:, None]
        _store_pairs(dx_ptr + base, offs, mask, (dxh1 - xh1 * proj) * rstd, (dxh2 - xh2 * proj) * rstd,
                     HALF, HALF_P, BLOCK_R, INTERLEAVED)
        r0 += BLOCK_R
    dg1 = tl.sum(acc1, axis=0)
    dg2 = tl.sum(acc2, axis=0)
    i = tl.arange(0, HALF_P)
    if INTERLEAVED:
        tl.store(dg_ptr + 2 * i, dg1, mask=i < HALF)
        tl.store(dg_ptr + 2 * i + 1, dg2, mask=i < HALF)
    else:
        tl.store(dg_ptr + i, dg1, mask=i < HALF)
        tl.store(dg_ptr + i + HALF, dg2, mask=i < HALF)


@autotune(**_TUNE)
@triton.jit
def _qk_bwd(q_ptr, k_ptr, dqo_ptr, dko_ptr, dq_ptr, dk_ptr, qg_ptr, kg_ptr, dg_part_ptr, cos_ptr, sin_ptr,
            nq_rows, nk_rows, q_run, k_run, n_prog, T, eps,
            HQ: tl.constexpr, HK: tl.constexpr, Q_BHTD: tl.constexpr, K_BHTD: tl.constexpr,
            HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    dg_ptr = dg_part_ptr + pid * (2 * HALF)  # row pid of the [2, n_prog, hd] partials
    if pid < n_prog:
        start = pid * q_run
        _bwd_run(q_ptr, dqo_ptr, dq_ptr, qg_ptr, dg_ptr, cos_ptr, sin_ptr, start, tl.minimum(start + q_run, nq_rows),
                 T, eps, HQ, Q_BHTD, HALF, HALF_P, INTERLEAVED, BLOCK_R)
    else:
        start = (pid - n_prog) * k_run
        _bwd_run(k_ptr, dko_ptr, dk_ptr, kg_ptr, dg_ptr, cos_ptr, sin_ptr, start, tl.minimum(start + k_run, nk_rows),
                 T, eps, HK, K_BHTD, HALF, HALF_P, INTERLEAVED, BLOCK_R)


def _layout(x: torch.Tensor):
    """(x or a contiguous copy, BHTD flag): x [B,H,T,hd] as dense rows, see the module doc."""
    if x.transpose(1, 2).is_contiguous():
        return x, False
    if x.is_contiguous():
        return x, True
    x = x.contiguous()
    return x, True


def _like(do: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """do in x's memory layout (a copy only when it differs)."""
    if do.stride() == x.stride():
        return do
    return torch.empty_like(x).copy_(do)


def _meta(q: torch.Tensor, k: torch.Tensor, q_bhtd: bool, k_bhtd: bool, interleaved: bool) -> dict:
    half = q.shape[-1] // 2
    return dict(HQ=q.shape[1], HK=k.shape[1], Q_BHTD=q_bhtd, K_BHTD=k_bhtd, HALF=half,
                HALF_P=triton.next_power_of_2(half), INTERLEAVED=bool(interleaved))


def _rope_rows(cos: torch.Tensor, sin: torch.Tensor, T: int):
    return cos[:T].float().contiguous(), sin[:T].float().contiguous()


# Custom ops with fake implementations and autograd (why: blunb/kernels/__init__.py).
@torch.library.custom_op("blunb::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd(q: torch.Tensor, k: torch.Tensor, q_gamma: torch.Tensor, k_gamma: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float,
                     interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T = q.shape[2]
    nq, nk = q.shape[:3].numel(), k.shape[:3].numel()
    q, q_bhtd = _layout(q)
    k, k_bhtd = _layout(k)
    cos, sin = _rope_rows(cos, sin, T)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if nq:
        grid = lambda m: (triton.cdiv(nq, m["BLOCK_R"]) + triton.cdiv(nk, m["BLOCK_R"]),)
        _qk_fwd[grid](q, k, qo, ko, q_gamma.contiguous(), k_gamma.contiguous(), cos, sin, nq, nk, T, eps,
                      **_meta(q, k, q_bhtd, k_bhtd, interleaved))
    return qo, ko


@qk_norm_rope_fwd.register_fake
def _(q, k, q_gamma, k_gamma, cos, sin, eps, interleaved):
    return torch.empty_like(_layout(q)[0]), torch.empty_like(_layout(k)[0])


@torch.library.custom_op("blunb::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd(dqo: torch.Tensor, dko: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_gamma: torch.Tensor,
                     k_gamma: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                     interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk) in the layout the forward read q/k in, and both gammas' fp32 gradients as one [2, hd]."""
    B, Hq, T, hd = q.shape
    nq, nk = q.shape[:3].numel(), k.shape[:3].numel()
    q, q_bhtd = _layout(q)
    k, k_bhtd = _layout(k)
    if not nq:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros((2, hd), dtype=torch.float32, device=q.device)
    cos, sin = _rope_rows(cos, sin, T)
    dqo, dko = _like(dqo, q), _like(dko, k)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    # q and k get the same number of programs P, each a run of rows (a multiple of every BLOCK_R)
    target = max(1, 16 * num_sms(q.device))  # several waves: no half-empty tail wave
    q_run = triton.cdiv(triton.cdiv(nq, target), _MAX_BLOCK_R) * _MAX_BLOCK_R
    n_prog = triton.cdiv(nq, q_run)
    k_run = triton.cdiv(triton.cdiv(nk, n_prog), _MAX_BLOCK_R) * _MAX_BLOCK_R
    dg_part = torch.empty((2, n_prog, hd), dtype=torch.float32, device=q.device)
    _qk_bwd[(2 * n_prog,)](q, k, dqo, dko, dq, dk, q_gamma.contiguous(), k_gamma.contiguous(), dg_part, cos, sin,
                           nq, nk, q_run, k_run, n_prog, T, eps, **_meta(q, k, q_bhtd, k_bhtd, interleaved))
    return dq, dk, dg_part.sum(1)


@qk_norm_rope_bwd.register_fake
def _(dqo, dko, q, k, q_gamma, k_gamma, cos, sin, eps, interleaved):
    return (torch.empty_like(_layout(q)[0]), torch.empty_like(_layout(k)[0]),
            q.new_empty((2, q.shape[-1]), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, q_gamma, k_gamma, cos, sin, eps, interleaved = inputs
    ctx.save_for_backward(q, k, q_gamma, k_gamma, cos, sin)
    ctx.eps, ctx.interleaved = eps, interleaved


def _backward(ctx, dqo, dko):
    q, k, q_gamma, k_gamma, cos, sin = ctx.saved_tensors
    dq, dk, dgammas = qk_norm_rope_bwd(dqo, dko, q, k, q_gamma, k_gamma, cos, sin, ctx.eps, ctx.interleaved)
    return dq, dk, dgammas[0].to(q_gamma.dtype), dgammas[1].to(k_gamma.dtype), None, None, None, None


qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)


def qk_norm_rope(q, k, q_gamma, k_gamma, cos, sin, eps: float, interleaved: bool = False):
    B, Hq, T, hd = q.shape
    Hk = k.shape[1]
    if k.shape != (B, Hk, T, hd) or hd % 2:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} need equal B, T and an even hd")
    if max(B * Hq * T, B * Hk * T) * 2 >= 2**31:  # row indices are int32 (element offsets are 64-bit)
        raise ValueError("qk_norm_rope: too many rows")
    return qk_norm_rope_fwd(q, k, q_gamma, k_gamma, cos, sin, eps, interleaved)
