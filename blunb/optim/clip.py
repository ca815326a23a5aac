"""Sync-free gradient-clip statistics shared by the sharded optimizers.

Everything here stays on the device as 0-dim tensors: no `.item()`, so the clip path
never stalls the host. A non-finite norm means the step must be skipped: found_inf is
True, clipped is False, and the coefficient is 1 (never NaN) so nothing is scaled by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClipStats:
    total_norm: torch.Tensor  # fp32, the norm the coefficient was derived from
    clip_coef: torch.Tensor   # fp32 in (0, 1]; 1 when not clipped or when found_inf
    clipped: torch.Tensor     # bool
    found_inf: torch.Tensor   # bool


def clip_stats_from_sq_norm(sq_norm: torch.Tensor, max_norm: float) -> ClipStats:
    """Stats for a gradient whose squared L2 norm is `sq_norm` (already summed over ranks).

    Matches torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), capped at 1.
    max_norm <= 0 disables clipping (coef 1) but still measures the norm and detects inf/NaN.
    """
    total_norm = sq_norm.float().sqrt()
    found_inf = ~torch.isfinite(total_norm)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        coef = torch.where(found_inf, torch.ones_like(coef), coef)
        clipped = (coef < 1.0) & ~found_inf
    else:
        coef = torch.ones_like(total_norm)
        clipped = torch.zeros_like(found_inf)
    return ClipStats(total_norm=total_norm, clip_coef=coef, clipped=clipped, found_inf=found_inf)
