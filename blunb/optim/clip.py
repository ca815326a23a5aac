"""Sync-free gradient-clip statistics shared by the sharded optimizers.

Every clipping rule lives here: per-group stats, the global two-phase clip and the skip
verdict across groups (prepare_group_step). Everything stays on the device as 0-dim
tensors: no `.item()`, so the clip path never stalls the host. A non-finite norm means
the step must be skipped: found_inf is True, clipped is False, and the coefficient is 1
(never NaN) so nothing is scaled by it.
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


def global_clip(optimizers, max_norm: float, strict: bool = False) -> ClipStats:
    """Two-phase clip over disjoint optimizer groups with ONE coefficient.

    Phase 1 reduces every group and sums the squared norms; phase 2 hands each group the
    coefficient (its next step() uses it and does not reduce again). The coefficient comes
    from the norm of the gradients it actually scales (`covered`: groups that withhold the
    clip, like Muon's orthogonalized matrices, are left out) unless strict=True, which uses
    the full norm. The reported total_norm is always the full norm. Any non-finite group
    norm skips the step in every group. Sync-free: everything stays on the device.
    """
    sq_total = sq_covered = 0.0
    for opt in optimizers:
        t, c = opt.reduce_and_measure()
        sq_total, sq_covered = t + sq_total, c + sq_covered
    full = clip_stats_from_sq_norm(sq_total, max_norm)
    coef = full.clip_coef if strict else clip_stats_from_sq_norm(torch.as_tensor(sq_covered), max_norm).clip_coef
    coef = torch.where(full.found_inf, torch.ones_like(coef), coef)
    for opt in optimizers:
        opt.set_external_clip_coef(coef, full.found_inf)
    return ClipStats(total_norm=full.total_norm, clip_coef=coef, clipped=(coef < 1) & ~full.found_inf,
                     found_inf=full.found_inf)


def prepare_group_step(optimizers, max_norm: float, use_global_clip: bool, strict: bool,
                       nan_policy: str) -> ClipStats | None:
    """Decide, before a set of disjoint optimizer groups steps, how each one clips and skips.

    - global clip (use_global_clip and max_norm > 0; a disabled clip has nothing to share):
      one coefficient for all groups (global_clip), and any non-finite norm skips every group.
    - otherwise each group clips on its own norm. nan_policy "step": every group's norm is
      measured first and a non-finite one in any group skips all of them (the AMP / DeepSpeed
      rule); "group": only the group whose norm is non-finite skips (the reference trainer).
    Returns the global ClipStats when a global clip applies, else None. Sync-free.
    """
    if use_global_clip and max_norm > 0:
        return global_clip(optimizers, max_norm, strict=strict)
    if nan_policy == "step" and len(optimizers) > 1:
        found = torch.stack([~torch.isfinite(opt.reduce_and_measure()[0]) for opt in optimizers]).any()
        for opt in optimizers:
            opt.set_external_clip_coef(None, found)
    return None
