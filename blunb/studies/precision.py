"""The precision study's instruments: the arithmetic behind the seed's precision claims, measured.

- `bf16_ulp(x)`, `representable_in_bf16(values)`: bf16's grid (8 significand bits: the spacing in
  [2^e, 2^(e+1)) is 2^(e-7), so 0.0625 around a loss of 10.8).
- `loss_readings(logits, targets)`: one batch of logits reduced to a loss scalar two ways, the
  seed's (bf16 scalar under bf16_logits) and blunb's (fp32); `loss_dtype_sweep` does it over a
  family of logits whose loss walks down from ln(V), as early training does.
- `decay_moved_fraction(weights, lr, wd)`, `decay_only(weights, lrs, wd)`: decoupled weight
  decay alone on bf16 weights with and without an fp32 master.
- `logits_memory(cfg)`: the seed's formula for what the [B,T,V] logits cost per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from blunb import kernels
from blunb.config import TrainConfig

BF16_SIGNIFICAND_BITS = 8  # 7 stored + the implicit one


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at |x| (normal range): 2^(floor(log2|x|) - 7)."""
    if x == 0 or not math.isfinite(x):
        raise ValueError(f"bf16_ulp needs a finite non-zero value, got {x}")
    return 2.0 ** (math.floor(math.log2(abs(x))) - (BF16_SIGNIFICAND_BITS - 1))


def representable_in_bf16(values) -> np.ndarray:
    """Per value: whether it is exactly a bf16 number (a loss logged through a bf16 scalar always is)."""
    x = torch.tensor(np.asarray(values, dtype=np.float64))
    return (x.to(torch.bfloat16).double() == x).numpy()


class LossReadings(NamedTuple):
    seed_bf16: float  # the seed under bf16_logits: fp32 row sum stored through bf16, divided in bf16
    fp32: float       # blunb: kernels.cross_entropy, an fp32 mean whatever the logits' dtype


def loss_readings(logits: torch.Tensor, targets: torch.Tensor) -> LossReadings:
    """The same logits [N, V] and targets [N] reduced to a mean loss the seed's way and blunb's.

    The seed keys the loss scalar's dtype off the logits': with bf16 logits the per-row losses are
    summed in fp32, stored back through a bf16 tensor and divided by N in bf16, so the reported
    loss lies on bf16's grid (the gradients are unaffected: only the metric is)."""
    row_losses = F.cross_entropy(logits.float(), targets, reduction="none")
    n = torch.tensor(float(targets.numel()), dtype=torch.bfloat16)
    seed = row_losses.sum().to(torch.bfloat16) / n
    return LossReadings(float(seed), float(kernels.cross_entropy(logits, targets, backend="torch")))


def loss_dtype_sweep(vocab_size: int = 50304, rows: int = 16, points: int = 61, max_margin: float = 0.5,
                     seed: int = 0) -> pd.DataFrame:
    """loss_readings over bf16 logits whose loss walks down from ~ln(vocab_size) (10.83 at the
    seed's 50304): noise plus a target margin growing from 0 to max_margin (loss ~ ln V - margin).
    Columns: margin, seed_bf16, fp32."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab_size, (rows,), generator=gen)
    noise = 0.1 * torch.randn(rows, vocab_size, generator=gen)
    logits = noise.to(torch.bfloat16)  # the bf16_logits stage
    at_target = (torch.arange(rows), targets)
    out = []
    for margin in np.linspace(0.0, max_margin, points):
        logits[at_target] = (noise[at_target] + float(margin)).to(torch.bfloat16)  # only the targets move
        out.append({"margin": float(margin), **loss_readings(logits, targets)._asdict()})
    return pd.DataFrame(out)


def _decay_in_bf16(weights: torch.Tensor, factor: float) -> torch.Tensor:
    # What torch AdamW does to a bf16 parameter: the product in fp32, rounded back to bf16.
    return (weights.float() * factor).to(torch.bfloat16)


def decay_moved_fraction(weights: torch.Tensor, lr: float, weight_decay: float) -> float:
    """The fraction of bf16 `weights` that one decoupled decay step w <- w * (1 - lr*wd) changes when
    there is no fp32 master (the product rounds back onto bf16's grid)."""
    if weights.dtype != torch.bfloat16:
        raise ValueError(f"weights must be bf16 (the no-master case), got {weights.dtype}")
    if weights.numel() == 0:
        raise ValueError("weights is empty")
    moved = _decay_in_bf16(weights, 1.0 - lr * weight_decay) != weights
    return float(moved.float().mean())


def decay_only(weights: torch.Tensor, lrs: Sequence[float], weight_decay: float) -> pd.DataFrame:
    """Weight decay alone (no gradient) over a learning-rate series, e.g. a run's `lr` column, on
    bf16 weights two ways: stored in bf16 with no master, and kept in an fp32 master whose bf16
    copy is what the model sees (the seed's and blunb's ZeRO layout).

    One row per step: step, lr, moved_no_master / moved_master (fraction of the bf16 weights that
    changed at that step), shrink_no_master / shrink_master (||w_t|| / ||w_0|| of the bf16 weights)
    and shrink_exact (prod (1 - lr*wd), what decay should have done)."""
    if weights.dtype != torch.bfloat16:
        raise ValueError(f"weights must be bf16, got {weights.dtype}")
    w0_norm = float(weights.float().norm())
    no_master, master, seen_master = weights.clone(), weights.float(), weights.clone()
    exact, rows = 1.0, []
    for step, lr in enumerate(lrs):
        factor = 1.0 - float(lr) * weight_decay
        stepped = _decay_in_bf16(no_master, factor)
        master.mul_(factor)
        view = master.to(torch.bfloat16)
        exact *= factor
        rows.append({"step": step, "lr": float(lr),
                     "moved_no_master": float((stepped != no_master).float().mean()),
                     "moved_master": float((view != seen_master).float().mean()),
                     "shrink_no_master": float(stepped.float().norm()) / w0_norm,
                     "shrink_master": float(view.float().norm()) / w0_norm, "shrink_exact": exact})
        no_master, seen_master = stepped, view
    return pd.DataFrame(rows)


class LogitsMemory(NamedTuple):
    tokens: int             # B*T: the rows of one micro-batch's logits on one rank
    vocab_size: int
    fp32_bytes: int         # [B,T,V] fp32 logits + their equal-size fp32 gradient
    bf16_bytes: int         # the same pair in bf16 (bf16_logits)
    saved_bytes: int        # what bf16_logits frees: B*T*V*4


def logits_memory(cfg: TrainConfig) -> LogitsMemory:
    """The seed's logits formula for one micro-batch on one rank: B*T*V elements, 4 bytes each in fp32,
    retained for the loss backward, plus an equal-size gradient (3.30 GB + 3.30 GB at B*T = 16384,
    V = 50304)."""
    tokens, vocab = cfg.B * cfg.T, cfg.model.vocab_size
    fp32, bf16 = 2 * tokens * vocab * 4, 2 * tokens * vocab * 2
    return LogitsMemory(tokens, vocab, fp32, bf16, fp32 - bf16)
