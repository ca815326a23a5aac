"""Causal grouped-query flash attention in Triton: forward and backward.

Built around the model's layouts and around determinism: q [B,Hq,T,hd], k/v [B,Hkv,T,hd] are read in
place through any strides with a unit last-dim stride (the model's transposed views, no copies; K/V are
never repeated for GQA), and the output is laid out so the caller's reshape is free. The backward uses
no atomics: every output element is written by exactly one program in a fixed order, so it is bitwise
reproducible for a given launch config; under torch's deterministic mode the config is fixed too and
prefer() picks this kernel for every shape it supports.

Details (the layouts, the forward's online softmax, the backward's programs): docs/architecture.md,
section "blunb/kernels/fused/flash_attention.py".
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import Tuned, deterministic

LOG2E = 1.4426950408889634
# Exactly one config under the interpreter: several would be timed with a CUDA-only do_bench.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HEAD_DIMS = (16, 32, 64, 128)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim (BLOCK_M % BLOCK_N == 0); pruned to the
# tensor's hd. Candidates around the H200 winners of a wider first sweep; bench/attention.py
# prints the autotuner's timings.
_FWD_GPU = {
    64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4)],
}
# (BLOCK, SUB, num_warps, num_stages): BLOCK = key rows held for dk/dv = query rows held
# for dq; SUB = the streamed tile of the other side.
_BWD_GPU = {
    64: [(128, 32, 4, 3), (128, 32, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)],
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 2)],
}


def _gpu_configs(table, names):
    seen = {c for cs in table.values() for c in cs}
    return [triton.Config(dict(zip(names, c[:2], strict=True)), num_warps=c[2], num_stages=c[3]) for c in sorted(seen)]


def _pruner(table, names):
    def prune(cfgs, nargs, **kwargs):
        if len(cfgs) == 1:
            return cfgs
        hd = kwargs.get("HEAD_DIM", nargs.get("HEAD_DIM"))
        want = set(table.get(hd, table[64] if hd < 64 else table[128]))
        keep = [c for c in cfgs if (*(c.kwargs[n] for n in names), c.num_warps, c.num_stages) in want]
        return keep or cfgs

    return prune


# Under the interpreter: bigger tiles mean fewer Python-level steps; the odd-T tests still
# cross several blocks, the diagonal sub-tiles and a masked tail.
_FWD_NAMES, _BWD_NAMES = ("BLOCK_M", "BLOCK_N"), ("BLOCK", "SUB")
_FWD_CONFIGS = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32})] if INTERPRET else _gpu_configs(_FWD_GPU, _FWD_NAMES)
_BWD_CONFIGS = [triton.Config({"BLOCK": 64, "SUB": 32})] if INTERPRET else _gpu_configs(_BWD_GPU, _BWD_NAMES)


def _fixed_by_head_dim(table, names, configs):
    """The config deterministic mode launches: the first candidate of the head dim's table (the one
    config under the interpreter). A function of HEAD_DIM only, never of a timing."""
    if INTERPRET:
        return configs[0]

    @functools.cache
    def for_head_dim(hd: int) -> triton.Config:
        c = table.get(hd, table[64] if hd < 64 else table[128])[0]
        return triton.Config(dict(zip(names, c[:2], strict=True)), num_warps=c[2], num_stages=c[3])

    return lambda kwargs: for_head_dim(kwargs["HEAD_DIM"])


def _tune_bench(kernel_call, quantiles):
    # each candidate runs ~0.1-3 ms at training sizes: a few ms of timing per config suffices
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=30, quantiles=quantiles)


# ----------------------------------------------------------------------------- forward
@triton.jit
def _fwd_step(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d, start_n, T,
              MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr, DOT_PREC: tl.constexpr):
    cols = start_n + offs_n
    k_ptrs = K + cols[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + cols[:, None] * stride_vt + offs_d[None, :]
    if MASK_T:
        k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASK_CAUSAL:  # implies cols < T for every stored row
        s = tl.where(offs_m[:, None] >= cols[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    elif MASK_T:
        s = tl.where(cols[None, :] < T, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:  # scale folded into one FMA per score
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK_T:
        v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d, lo, hi, T,
               BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr, DOT_PREC: tl.constexpr,
               INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter (numpy 2.x) cannot range() over program-id-derived bounds
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d,
                                      start_n, T, MASK_CAUSAL, MASK_T, DOT_PREC)
            start_n += BLOCK_N
    else:  # a for loop, so the compiler software-pipelines the K/V loads
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d,
                                      start_n, T, MASK_CAUSAL, MASK_T, DOT_PREC)
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=["HEAD_DIM"], cache_results=True, do_bench=_tune_bench,
                 prune_configs_by={"early_config_prune": _pruner(_FWD_GPU, _FWD_NAMES)})
@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, qk_scale,
                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                Hq, T,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
                INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_bh = tl.program_id(0)
    # Axis 1 runs last query block first: the longest causal rows start early, short ones fill the tail.
    start_m = (tl.cdiv(T, BLOCK_M) - 1 - tl.program_id(1)) * BLOCK_M
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = (h // GROUP).to(tl.int64)
    Q += b * stride_qb + h.to(tl.int64) * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    O += b * stride_ob + h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        # Keys left of the block are visible to every row: no mask, always in range.
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d,
                                   0, start_m, T, BLOCK_N, False, False, DOT_PREC, INTERPRET)
        # The diagonal block (keys past T are masked by causality); keys right of it are skipped.
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d,
                                   start_m, start_m + BLOCK_M, T, BLOCK_N, True, True, DOT_PREC, INTERPRET)
    else:
        t_full = (T // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d,
                                   0, t_full, T, BLOCK_N, False, False, DOT_PREC, INTERPRET)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_n, offs_d,
                                   t_full, T, T, BLOCK_N, False, True, DOT_PREC, INTERPRET)

    acc = acc / l_i[:, None]
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, m_i + tl.log2(l_i), mask=row_ok)
    tl.store(O + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])


_fwd_kernel = Tuned(_fwd_kernel, _fixed_by_head_dim(_FWD_GPU, _FWD_NAMES, _FWD_CONFIGS))


# ---------------------------------------------------------------------------- backward
@triton.jit
def _bwd_preprocess(O, DO, Delta, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, Hq, T,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m[:, None] < T
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=ok,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, stride_qt, stride_dot, qk_scale, offs_n, offs_d, start_m, T,
                   SUB: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_m = start_m + tl.arange(0, SUB)
    q_ptrs = Q + offs_m[:, None] * stride_qt + offs_d[None, :]
    do_ptrs = DO + offs_m[:, None] * stride_dot + offs_d[None, :]
    if MASK_T:
        ok = offs_m < T
        q = tl.load(q_ptrs, mask=ok[:, None], other=0.0)
        lse = tl.load(LSE + offs_m, mask=ok, other=0.0)
    else:
        q = tl.load(q_ptrs)
        lse = tl.load(LSE + offs_m)
    # Scores transposed, [keys, queries]: P^T comes out directly as the dV / dK operand.
    qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    pT = tl.exp2(qkT * qk_scale - lse[None, :])
    if MASK_CAUSAL:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    if MASK_T:
        pT = tl.where(ok[None, :], pT, 0.0)
        do = tl.load(do_ptrs, mask=ok[:, None], other=0.0)
        delta = tl.load(Delta + offs_m, mask=ok, other=0.0)
    else:
        do = tl.load(do_ptrs)
        delta = tl.load(Delta + offs_m)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, stride_qt, stride_dot, qk_scale, offs_n, offs_d, lo, hi, T,
              SUB: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr, DOT_PREC: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Accumulate one query head's contribution, query rows [lo, hi), to dk/dv of the key block offs_n."""
    if INTERPRET:
        start_m = lo
        while start_m < hi:
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, stride_qt, stride_dot, qk_scale, offs_n, offs_d,
                                    start_m, T, SUB, MASK_CAUSAL, MASK_T, DOT_PREC)
            start_m += SUB
    else:
        for start_m in range(lo, hi, SUB):
            start_m = tl.multiple_of(start_m, SUB)
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, stride_qt, stride_dot, qk_scale, offs_n, offs_d,
                                    start_m, T, SUB, MASK_CAUSAL, MASK_T, DOT_PREC)
    return dk, dv


@triton.jit
def _bwd_dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_d, start_n, T,
                 SUB: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr, DOT_PREC: tl.constexpr):
    cols = start_n + tl.arange(0, SUB)
    k_ptrs = K + cols[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + cols[:, None] * stride_vt + offs_d[None, :]
    if MASK_T:
        k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)
        v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    p = tl.exp2(qk * qk_scale - lse[:, None])
    if MASK_CAUSAL:
        p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
    elif MASK_T:
        p = tl.where(cols[None, :] < T, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def _bwd_dq(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_d, lo, hi, T,
            SUB: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_T: tl.constexpr, DOT_PREC: tl.constexpr,
            INTERPRET: tl.constexpr):
    """Accumulate dq of the query block offs_m over keys [lo, hi)."""
    if INTERPRET:
        start_n = lo
        while start_n < hi:
            dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_d, start_n, T,
                              SUB, MASK_CAUSAL, MASK_T, DOT_PREC)
            start_n += SUB
    else:
        for start_n in range(lo, hi, SUB):
            start_n = tl.multiple_of(start_n, SUB)
            dq = _bwd_dq_step(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_m, offs_d, start_n, T,
                              SUB, MASK_CAUSAL, MASK_T, DOT_PREC)
    return dq


@triton.autotune(configs=_BWD_CONFIGS, key=["HEAD_DIM"], cache_results=True, do_bench=_tune_bench,
                 prune_configs_by={"early_config_prune": _pruner(_BWD_GPU, _BWD_NAMES)})
@triton.heuristics({"MASK_T": lambda a: a["T"] % a["BLOCK"] != 0})
@triton.jit
def _bwd_kernel(Q, K, V, DO, DQ, DK, DV, LSE, Delta, qk_scale, sm_scale,
                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt,
                stride_dvb, stride_dvh, stride_dvt,
                Hq, Hkv, T,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
                INTERPRET: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, MASK_T: tl.constexpr):
    tl.static_assert(BLOCK % SUB == 0)
    start = tl.program_id(0) * BLOCK
    pid_bk = tl.program_id(1)
    b = (pid_bk // Hkv).to(tl.int64)
    hk = (pid_bk % Hkv).to(tl.int64)
    offs_blk = start + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    blk_ok = offs_blk < T
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh

    # Phase 1: dk, dv of key block [start, start + BLOCK), summed over the group's query heads.
    k = tl.load(K + offs_blk[:, None] * stride_kt + offs_d[None, :], mask=blk_ok[:, None], other=0.0)
    v = tl.load(V + offs_blk[:, None] * stride_vt + offs_d[None, :], mask=blk_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        row = (b * Hq + h) * T
        if CAUSAL:
            # Query rows on the diagonal block need the mask; rows above it see every key.
            dk, dv = _bwd_dkdv(dk, dv, k, v, Qh, DOh, LSE + row, Delta + row, stride_qt, stride_dot, qk_scale,
                               offs_blk, offs_d, start, start + BLOCK, T, SUB, True, MASK_T, DOT_PREC, INTERPRET)
            dk, dv = _bwd_dkdv(dk, dv, k, v, Qh, DOh, LSE + row, Delta + row, stride_qt, stride_dot, qk_scale,
                               offs_blk, offs_d, start + BLOCK, T, T, SUB, False, MASK_T, DOT_PREC, INTERPRET)
        else:
            dk, dv = _bwd_dkdv(dk, dv, k, v, Qh, DOh, LSE + row, Delta + row, stride_qt, stride_dot, qk_scale,
                               offs_blk, offs_d, 0, T, T, SUB, False, MASK_T, DOT_PREC, INTERPRET)
    dk_ptrs = DK + b * stride_dkb + hk * stride_dkh + offs_blk[:, None] * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + hk * stride_dvh + offs_blk[:, None] * stride_dvt + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=blk_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=blk_ok[:, None])

    # Phase 2: dq of query block [start, start + BLOCK) for each of the group's query heads.
    for g in range(GROUP):
        h = hk * GROUP + g
        row = (b * Hq + h) * T
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_blk[:, None] * stride_qt + offs_d[None, :],
                    mask=blk_ok[:, None], other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_blk[:, None] * stride_dot + offs_d[None, :],
                     mask=blk_ok[:, None], other=0.0)
        lse = tl.load(LSE + row + offs_blk, mask=blk_ok, other=0.0)
        delta = tl.load(Delta + row + offs_blk, mask=blk_ok, other=0.0)
        dq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        if CAUSAL:
            dq = _bwd_dq(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_blk, offs_d,
                         start, start + BLOCK, T, SUB, True, MASK_T, DOT_PREC, INTERPRET)
            dq = _bwd_dq(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_blk, offs_d,
                         0, start, T, SUB, False, False, DOT_PREC, INTERPRET)
        else:
            dq = _bwd_dq(dq, q, do, lse, delta, K, V, stride_kt, stride_vt, qk_scale, offs_blk, offs_d,
                         0, T, T, SUB, False, MASK_T, DOT_PREC, INTERPRET)
        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_blk[:, None] * stride_dqt + offs_d[None, :]
        tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=blk_ok[:, None])


_bwd_kernel = Tuned(_bwd_kernel, _fixed_by_head_dim(_BWD_GPU, _BWD_NAMES, _BWD_CONFIGS))


# ----------------------------------------------------------------------------- wrapper
def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (TF32 would break the fp32 contract); ignored for 16-bit.
    return "ieee" if dtype == torch.float32 else "tf32"


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q, k, v) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B,Hq,T,hd], k/v [B,Hkv,T,hd]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, Hq, T, hd = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != hd or Hq % k.shape[1]:
        raise ValueError(f"incompatible q {tuple(q.shape)} and k/v {tuple(k.shape)}")
    if hd not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {hd}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q/k/v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """[B,T,Hq,hd] storage, returned as the [B,Hq,T,hd] view (see module docstring)."""
    B, Hq, T, hd = q.shape
    return q.new_empty((B, T, Hq, hd)).transpose(1, 2)


# Custom ops with fake implementations and autograd (why: blunb/kernels/__init__.py).
@torch.library.custom_op("blunb::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o as _output_like(q), lse [B,Hq,T] fp32 in the log2 domain."""
    B, Hq, T, hd = q.shape
    Hkv = k.shape[1]
    sm_scale = hd**-0.5
    o = _output_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    with _device_guard(q):
        _fwd_kernel[lambda meta: (B * Hq, triton.cdiv(T, meta["BLOCK_M"]))](
            q, k, v, o, lse, sm_scale * LOG2E,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            Hq, T,
            GROUP=Hq // Hkv, HEAD_DIM=hd, CAUSAL=bool(causal), DOT_PREC=_dot_precision(q.dtype),
            INTERPRET=INTERPRET)
    return o, lse


@flash_attention_fwd.register_fake
def _(q, k, v, causal):
    return _output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("blunb::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each with the strides of q, k, v."""
    do = _unit_last(do)
    B, Hq, T, hd = q.shape
    Hkv = k.shape[1]
    sm_scale = hd**-0.5
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    with _device_guard(q):
        _bwd_preprocess[(triton.cdiv(T, 64), B * Hq)](
            o, do, delta, *o.stride()[:3], *do.stride()[:3], Hq, T, HEAD_DIM=hd, BLOCK_M=64)
        _bwd_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK"]), B * Hkv)](
            q, k, v, do, dq, dk, dv, lse, delta, sm_scale * LOG2E, sm_scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
            *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            Hq, Hkv, T,
            GROUP=Hq // Hkv, HEAD_DIM=hd, CAUSAL=bool(causal), DOT_PREC=_dot_precision(q.dtype),
            INTERPRET=INTERPRET)
    return dq, dk, dv


@flash_attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal = causal
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # lse gets no gradient: no zeros are made for it


def _backward(ctx, do, _):
    q, k, v, o, lse = ctx.saved_tensors
    return (*flash_attention_bwd(do, q, k, v, o, lse, ctx.causal), None)


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q, k, v, causal=True):
    """Attention of q [B,Hq,T,hd] over k/v [B,Hkv,T,hd]; returns a [B,Hq,T,hd] view of
    [B,T,Hq,hd] storage. Differentiable in q, k, v."""
    _check(q, k, v)
    return flash_attention_fwd(_unit_last(q), _unit_last(k), _unit_last(v), bool(causal))[0]


# ------------------------------------------------------------------ backend choice (CUDA)
_choice: dict[tuple, bool] = {}
_fixed_choice: set[tuple] = set()  # the shape classes whose deterministic-mode choice was announced
# describe()'s words for the choice under torch's deterministic mode
DETERMINISTIC_CHOICE = "triton (fixed config; SDPA for fp32 or unsupported shapes)"


def _announce(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[blunb] kernels.flash_attention: {msg}", flush=True)


def _bench_ms(q, k, v, causal, grad, impl) -> float:
    """Median ms of one call (fwd, or fwd+bwd when `grad`) on fresh inputs laid out like q/k/v."""
    gen = torch.Generator(device=q.device).manual_seed(0)  # leaves the global RNG stream alone

    def like(x):
        y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).normal_(generator=gen)
        return y.requires_grad_(grad)

    qq, kk, vv = like(q), like(k), like(v)
    go = torch.empty_like(q).normal_(generator=gen)

    def step():
        out = impl(qq, kk, vv, causal)
        if grad:
            torch.autograd.grad(out, (qq, kk, vv), go)

    from triton.testing import do_bench

    with torch.enable_grad() if grad else torch.no_grad():
        step()  # compiles / autotunes outside the timing
        return do_bench(step, warmup=5, rep=25, return_mode="median")


def prefer(q, k, v, causal) -> bool:
    """Triton for this call (else SDPA)? Decided once per shape class (hd, T rounded up to a
    power of two, dtype, GQA ratio, causal, with/without backward) by timing both on inputs
    of this exact shape and layout; Triton wins ties. The choice and timings are printed once
    per class (rank 0). fp32 and unsupported shapes always go to SDPA. Under torch's deterministic
    mode nothing is timed: Triton for every shape it supports (its backward has no atomics; SDPA's
    cuDNN backend is excluded there and its flash backend runs a slower deterministic backward)."""
    B, Hq, T, hd = q.shape
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (hd, triton.next_power_of_2(T), q.dtype, Hq // max(k.shape[1], 1), bool(causal), grad, q.device)
    fixed = deterministic()
    if key in _choice and not fixed:
        return _choice[key]
    try:
        _check(q, k, v)
        supported = q.dtype != torch.float32
        reason = "fp32 inputs (SDPA keeps full fp32 matmuls)"
    except ValueError as err:
        supported, reason = False, str(err)
    if fixed:
        if not torch.compiler.is_compiling() and key not in _fixed_choice:  # no print inside a trace
            _fixed_choice.add(key)
            _announce(f"{'triton' if supported else 'SDPA'} for hd={hd} T={T} {q.dtype} Hq/Hkv={Hq}/{k.shape[1]} "
                      f"causal={bool(causal)}: deterministic mode, not timed" + ("" if supported else f" ({reason})"))
        return supported
    if supported and (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()):
        return False  # cannot time here; decided on the next eager call
    if supported:
        from blunb.kernels import reference

        t_tri = _bench_ms(q, k, v, causal, grad, flash_attention)
        t_ref = _bench_ms(q, k, v, causal, grad, reference.flash_attention)
        supported = t_tri <= t_ref
        reason = f"{'fwd+bwd' if grad else 'fwd'} {t_tri:.3f} ms (triton) vs {t_ref:.3f} ms (SDPA)"
    _choice[key] = supported
    _announce(f"{'triton' if supported else 'SDPA'} for hd={hd} T={T} (class T<={key[1]}) {q.dtype} "
              f"Hq/Hkv={Hq}/{k.shape[1]} causal={bool(causal)} B={B}: {reason}")
    return supported
