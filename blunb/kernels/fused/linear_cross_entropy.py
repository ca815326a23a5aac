"""kernels.linear_cross_entropy's Triton backend: the token chunks of kernels/chunked_ce.py, each chunk's
softmax, loss and gradient by the fused cross-entropy kernel (fused/cross_entropy.py) in place over the
chunk's GEMM output, so a chunk's logits live in one buffer of their own dtype.
"""

from __future__ import annotations

import torch

from blunb.kernels.chunked_ce import linear_cross_entropy as _chunks
from blunb.kernels.fused.cross_entropy import loss_rows_and_grad_


def chunk_loss_(z: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, ignore_index: int,
                logit_dtype: torch.dtype, has_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk from z = F.linear(x_c, weight): (its summed fp32 loss, its logits in logit_dtype, which
    with has_grad now hold d mean loss / d logits over n_valid rows)."""
    if z.dtype.itemsize > logit_dtype.itemsize:
        z = z.to(logit_dtype)  # the bf16_logits stage's rounding; a widening cast would change nothing
    return loss_rows_and_grad_(z, targets, n_valid, ignore_index, has_grad).sum(), z


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         logit_dtype: torch.dtype = torch.float32, chunk_tokens: int | None = None) -> torch.Tensor:
    return _chunks(x, weight, targets, ignore_index, logit_dtype, chunk_tokens, fused=True)
