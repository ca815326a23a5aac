"""Fused ZeRO-1 AdamW shard update: the gradient in its reduce dtype in, the model weights out.

Why: ShardedAdamW's torch path makes three passes over a bf16 group's shard (stage the gradient to
fp32, torch._fused_adamw_, copy the master back into the bf16 weights: 40 bytes per element); this one
pass moves 28 bytes per element, what torch's fused AdamW moves for an fp32 model. The math is
torch._fused_adamw_'s in fp32, so results agree to fp32 rounding, not bit for bit. A block table built
once by the optimizer makes the whole shard two launches that never touch padding: its whole blocks, aligned
and unmasked (16-byte vector loads and stores), then the rest, masked.

Details (the update's formula, the block table): docs/architecture.md, section
"blunb/kernels/fused/adamw.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import interpreting
from blunb.kernels.reference import ADAMW_ALIGN

# Elements per block (the block table depends on it, so it is fixed rather than autotuned).
BLOCK = 128 if interpreting() else 4096


@triton.jit
def _adamw_update(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, param_ptr, steps_ptr,
                  blk_shard_ptr, blk_flat_ptr, blk_len_ptr, blk_param_ptr, blk_decays_ptr,
                  grad_scale_ptr, found_inf_ptr, lr, lr_ptr, beta1, beta2, eps, weight_decay,
                  LR_ON_DEVICE: tl.constexpr, WHOLE: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    pid = tl.program_id(0)
    if tl.load(found_inf_ptr) != 0:
        return
    if LR_ON_DEVICE:  # a captured step's lr (fp64): rounded to the fp32 a host float argument becomes
        lr = tl.load(lr_ptr).to(tl.float32)
    shard = tl.load(blk_shard_ptr + pid)
    flat = tl.load(blk_flat_ptr + pid)
    offs = tl.arange(0, BLOCK)
    if WHOLE:
        # The table's whole blocks start on multiples of ALIGN in both buffers. Said so, and with a mask that is a
        # constant, the loads and stores become 16-byte vectors; offsets read at run time and a mask of a
        # run-time length each leave them 4-byte scalars (sm_90 PTX: 53 scalar loads per thread against 14 v4).
        shard = tl.multiple_of(shard, ALIGN)
        flat = tl.multiple_of(flat, ALIGN)
        mask = offs < BLOCK
    else:
        mask = offs < tl.load(blk_len_ptr + pid)
    step = tl.load(steps_ptr + tl.load(blk_param_ptr + pid)).to(tl.float32)
    wd = weight_decay * tl.load(blk_decays_ptr + pid).to(tl.float32)
    g = tl.load(grad_ptr + flat + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(grad_scale_ptr)
    p = tl.load(master_ptr + shard + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + shard + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + shard + offs, mask=mask, other=0.0)
    p = p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(master_ptr + shard + offs, p, mask=mask)
    tl.store(exp_avg_ptr + shard + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + shard + offs, v, mask=mask)
    tl.store(param_ptr + flat + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


def block_table(segments: list[tuple[int, int, int, int, bool]], device, whole_blocks: bool = True) -> dict:
    """segments: (shard offset, flat offset, length, parameter index, decays) -> the kernel's block
    table, each block inside one segment: one tensor per column, whole blocks first, and "whole", their count.

    A whole block holds BLOCK elements from offsets that are multiples of ADAMW_ALIGN in both buffers. A segment
    whose two offsets are congruent modulo ADAMW_ALIGN (ShardedAdamW's layout makes every one so) gives a short
    head up to its first aligned element, whole blocks, and a tail; any other segment only masked blocks.
    whole_blocks=False: masked blocks only (bench/kernels.py's baseline: the update before whole blocks).
    Segments that overlap in either buffer are refused: their blocks would race on the same elements."""
    bad = next((seg for seg in segments if min(seg[:3]) < 0), None)
    if bad is not None:
        raise ValueError(f"adamw block table: a segment with a negative offset or length: {bad[:3]}")
    for k, buffer in ((0, "shard"), (1, "flat")):
        spans = sorted((seg[k], seg[k] + seg[2]) for seg in segments if seg[2])
        for (s_a, e_a), (s_b, _) in zip(spans, spans[1:]):
            if s_b < e_a:
                raise ValueError(f"adamw block table: segments overlap in the {buffer} buffer "
                                 f"([{s_a}, {e_a}) and one from {s_b})")
    whole, rest = [], []

    def add(blocks, s0, f0, n, i, dec):
        for off in range(0, n, BLOCK):
            blocks.append((s0 + off, f0 + off, min(BLOCK, n - off), i, int(dec)))

    for s0, f0, n, i, dec in segments:
        head = min(n, (-s0) % ADAMW_ALIGN if whole_blocks and (s0 - f0) % ADAMW_ALIGN == 0 else n)
        body = (n - head) // BLOCK * BLOCK
        add(rest, s0, f0, head, i, dec)
        add(whole, s0 + head, f0 + head, body, i, dec)
        add(rest, s0 + head + body, f0 + head + body, n - head - body, i, dec)
    blocks = whole + rest
    columns = {"shard": torch.int64, "flat": torch.int64, "len": torch.int32, "param": torch.int32,
               "decays": torch.int8}
    table = {name: torch.tensor([b[k] for b in blocks], dtype=dtype, device=device)
             for k, (name, dtype) in enumerate(columns.items())}
    table["whole"] = len(whole)
    return table


def adamw_update_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                  param: torch.Tensor, steps: torch.Tensor, table: dict[str, torch.Tensor], *, lr,
                  beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: torch.Tensor,
                  found_inf: torch.Tensor) -> None:
    """One AdamW step over every block of `table`, in place: master, exp_avg, exp_avg_sq (fp32 shard,
    1-D), and param (the flat weights, 1-D) from grad (the flat reduced gradient, 1-D, any float
    dtype). steps: fp32 per-parameter step counts, already advanced for this step; grad_scale and
    found_inf: 0-dim fp32 device tensors (read there: no host sync). lr: a float, or a 0-dim device tensor (read
    there: a captured step's, blunb.cuda_graph) that gives the same bits as the float of its value."""
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"adamw_update_: {name} must be a contiguous fp32 tensor")
    on_device = isinstance(lr, torch.Tensor)
    n_whole = table["whole"]
    for whole, part in ((True, slice(0, n_whole)), (False, slice(n_whole, None))):
        blocks = {name: table[name][part] for name in ("shard", "flat", "len", "param", "decays")}
        if blocks["shard"].numel():
            _adamw_update[(blocks["shard"].numel(),)](
                master, exp_avg, exp_avg_sq, grad, param, steps, blocks["shard"], blocks["flat"], blocks["len"],
                blocks["param"], blocks["decays"], grad_scale, found_inf, 0.0 if on_device else lr,
                lr if on_device else found_inf, beta1, beta2, eps, weight_decay, LR_ON_DEVICE=on_device, WHOLE=whole,
                BLOCK=BLOCK, ALIGN=ADAMW_ALIGN, num_warps=8)
