"""Fused ZeRO-1 AdamW shard update: the gradient in its reduce dtype in, the model weights out.

Why: ShardedAdamW's torch path makes three passes over a bf16 group's shard (stage the gradient to
fp32, torch._fused_adamw_, copy the master back into the bf16 weights: 40 bytes per element); this one
pass moves 28 bytes per element, what torch's fused AdamW moves for an fp32 model. The math is
torch._fused_adamw_'s in fp32, so results agree to fp32 rounding, not bit for bit. A block table built
once by the optimizer makes the whole shard one launch that never touches padding.

Details (the update's formula, the block table): docs/architecture.md, section
"blunb/kernels/fused/adamw.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import interpreting

# Elements per block (the block table depends on it, so it is fixed rather than autotuned).
BLOCK = 128 if interpreting() else 4096


@triton.jit
def _adamw_update(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, param_ptr, steps_ptr,
                  blk_shard_ptr, blk_flat_ptr, blk_len_ptr, blk_param_ptr, blk_decays_ptr,
                  grad_scale_ptr, found_inf_ptr, lr, lr_ptr, beta1, beta2, eps, weight_decay,
                  LR_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if tl.load(found_inf_ptr) != 0:
        return
    if LR_ON_DEVICE:  # a captured step's lr (fp64): rounded to the fp32 a host float argument becomes
        lr = tl.load(lr_ptr).to(tl.float32)
    shard = tl.load(blk_shard_ptr + pid)
    flat = tl.load(blk_flat_ptr + pid)
    n = tl.load(blk_len_ptr + pid)
    step = tl.load(steps_ptr + tl.load(blk_param_ptr + pid)).to(tl.float32)
    wd = weight_decay * tl.load(blk_decays_ptr + pid).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
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


def block_table(segments: list[tuple[int, int, int, int, bool]], device) -> dict[str, torch.Tensor]:
    """segments: (shard offset, flat offset, length, parameter index, decays) -> the kernel's block
    table, each block inside one segment."""
    shard, flat, length, param, decays = [], [], [], [], []
    for s0, f0, n, i, dec in segments:
        for off in range(0, n, BLOCK):
            shard.append(s0 + off)
            flat.append(f0 + off)
            length.append(min(BLOCK, n - off))
            param.append(i)
            decays.append(int(dec))
    columns = {"shard": (shard, torch.int64), "flat": (flat, torch.int64), "len": (length, torch.int32),
               "param": (param, torch.int32), "decays": (decays, torch.int8)}
    return {name: torch.tensor(xs, dtype=dtype, device=device) for name, (xs, dtype) in columns.items()}


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
    n_blocks = table["shard"].numel()
    on_device = isinstance(lr, torch.Tensor)
    if n_blocks:
        _adamw_update[(n_blocks,)](master, exp_avg, exp_avg_sq, grad, param, steps, table["shard"], table["flat"],
                                   table["len"], table["param"], table["decays"], grad_scale, found_inf,
                                   0.0 if on_device else lr, lr if on_device else found_inf, beta1, beta2, eps,
                                   weight_decay, LR_ON_DEVICE=on_device, BLOCK=BLOCK, num_warps=8)
