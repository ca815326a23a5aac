"""Fused cross-entropy: fp32 mean loss over non-ignored targets, gradient made in forward.

logits [N, V] fp32 or bf16 (any V, unit stride along V). One program per row:
pass 1 streams the row in BLOCK_V chunks with an online (running max, running sum)
softmax in fp32 and picks the target logit; pass 2 re-reads the row, last chunk
first so the chunks pass 1 touched last are still in L2, and writes
d loss / d logits = (softmax - onehot) / n_valid. Reads 2x, writes 1x the logits.

The gradient goes to a fresh [N, V] buffer, not in place over the logits: the model
returns its logits to the caller, so overwriting them would be unsafe, and an
autograd.Function cannot tell whether anyone else holds the buffer. Backward scales
that buffer by the incoming grad in place; a kernel that reads the scalar on the
device and does nothing when it is 1.0 (the usual case) avoids both a host sync and
an extra [N, V] pass. Without grad (eval), pass 2 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import autotune, num_sms


@triton.jit
def _ce_fwd(logits_ptr, targets_ptr, loss_ptr, grad_ptr, n_valid_ptr, stride_l, stride_g, ignore_index,
            V: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    t = tl.load(targets_ptr + row).to(tl.int64)
    valid = t != ignore_index
    cols = tl.arange(0, BLOCK_V)

    m = tl.full([], float("-inf"), tl.float32)  # running max
    d = tl.full([], 0.0, tl.float32)  # running sum of exp(x - m)
    for off in tl.range(0, V, BLOCK_V):
        x = tl.load(base + off + cols, mask=off + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    x_t = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))

    if HAS_GRAD:
        n_valid = tl.load(n_valid_ptr).to(tl.float32)
        scale = tl.where(valid, 1.0 / tl.maximum(n_valid, 1.0), 0.0)
        gbase = grad_ptr + row * stride_g
        n_blocks: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
        for i in tl.range(0, n_blocks):
            off = (n_blocks - 1 - i) * BLOCK_V
            mask = off + cols < V
            x = tl.load(base + off + cols, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(off + cols == t, 1.0, 0.0)) * scale
            tl.store(gbase + off + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


_CONFIGS = ([triton.Config({"BLOCK_V": b}, num_warps=w) for b, w in ((4096, 8), (8192, 16), (16384, 16))],
            triton.Config({"BLOCK_V": 128}, num_warps=4))  # small: V=300 in the tests spans 3 blocks
_ce_fwd_tuned = autotune(*_CONFIGS, key=["V", "HAS_GRAD"])(_ce_fwd)
# the gradient over the logits in place: tuning's trial runs must each start from the logits
_ce_fwd_inplace = autotune(*_CONFIGS, key=["V", "HAS_GRAD"], restore_value=("logits_ptr",))(_ce_fwd)


@triton.jit
def _scale_inplace(x_ptr, s_ptr, numel, BLOCK: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, BLOCK)
        while start < numel:
            mask = start + offs < numel
            x = tl.load(x_ptr + start + offs, mask=mask).to(tl.float32)
            tl.store(x_ptr + start + offs, (x * s).to(x_ptr.dtype.element_ty), mask=mask)
            start += step


def loss_rows_and_grad_(logits: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, ignore_index: int,
                        has_grad: bool) -> torch.Tensor:
    """Each row's loss (fp32 [N], 0 on ignored rows); with has_grad, d loss / d logits of the mean over
    n_valid rows (a device scalar: rows of a larger batch) overwrites the logits in place (each program
    reads a block before writing it). For callers that own the buffer: fused/linear_cross_entropy.py."""
    if logits.stride(1) != 1:
        raise ValueError("loss_rows_and_grad_ needs logits with unit stride along V")
    N, V = logits.shape
    loss_rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        _ce_fwd_inplace[(N,)](logits, targets.contiguous(), loss_rows, logits, n_valid, logits.stride(0),
                              logits.stride(0), ignore_index, V=V, HAS_GRAD=has_grad)
    return loss_rows


# Custom ops with fake implementations and autograd (why: blunb/kernels/__init__.py). The forward
# returns the gradient buffer as a second, non-differentiable output only so autograd can save it:
# it belongs to autograd (backward scales it in place), so callers drop it, as cross_entropy() does.
@torch.library.custom_op("blunb::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                      has_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, d loss / d logits as a contiguous [N, V] when has_grad, else an empty tensor)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    N, V = logits.shape
    targets = targets.contiguous()
    n_valid = (targets != ignore_index).sum()
    loss_rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if has_grad else logits.new_empty(0)
    grad_out = grad if has_grad else loss_rows  # without HAS_GRAD the kernel only needs a valid pointer
    if N:
        _ce_fwd_tuned[(N,)](logits, targets, loss_rows, grad_out, n_valid, logits.stride(0), grad_out.stride(0),
                            ignore_index, V=V, HAS_GRAD=has_grad)
    return loss_rows.sum() / n_valid.clamp(min=1), grad


@cross_entropy_fwd.register_fake
def _(logits, targets, ignore_index, has_grad):
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if has_grad else logits.new_empty(0)
    return logits.new_empty((), dtype=torch.float32), grad


@torch.library.custom_op("blunb::cross_entropy_scale_grad_", mutates_args=("grad",))
def cross_entropy_scale_grad_(grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """grad *= grad_loss in place (a no-op pass when grad_loss is 1.0), read on the device: no sync."""
    block = 4096 if grad.is_cuda else 1024
    n_prog = max(1, min(triton.cdiv(grad.numel(), block), 8 * num_sms(grad.device)))
    _scale_inplace[(n_prog,)](grad, grad_loss.reshape(1), grad.numel(), BLOCK=block, num_warps=8)


@cross_entropy_scale_grad_.register_fake
def _(grad, grad_loss):
    return None


def _setup_context(ctx, inputs, output):
    grad = output[1]
    ctx.save_for_backward(grad)
    ctx.mark_non_differentiable(grad)
    ctx.set_materialize_grads(False)  # the buffer gets no gradient: no [N, V] zeros are made for it


def _backward(ctx, grad_loss, _):
    (grad,) = ctx.saved_tensors
    cross_entropy_scale_grad_(grad, grad_loss)
    return grad, None, None, None


cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"cross_entropy expects logits [N, V], got {tuple(logits.shape)}")
    # decided here: inside the op grad mode is off, and the eval pass skips making the gradient
    has_grad = logits.requires_grad and torch.is_grad_enabled()
    return cross_entropy_fwd(logits, targets, ignore_index, has_grad)[0]
