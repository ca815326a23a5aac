"""The precision study's instruments: the arithmetic behind the seed's precision claims, measured.

- `bf16_ulp(x)`, `representable_in_bf16(values)`: bf16's grid (8 significand bits: the spacing in
  [2^e, 2^(e+1)) is 2^(e-7), so 0.0625 around a loss of 10.8).
- `loss_readings(logits, targets)`: one batch of logits reduced to a loss scalar two ways, the
  seed's (bf16 scalar under bf16_logits) and blunb's (fp32); `loss_dtype_sweep` does it over a
  family of logits whose loss walks down from ln(V), as early training does.
- `decay_moved_fraction(weights, lr, wd)`, `decay_only(weights, lrs, wd)`: decoupled weight
  decay alone on bf16 weights with and without an fp32 master.
- `logits_memory(cfg)`: the seed's formula for what the [B,T,V] logits cost per micro-batch.
- `timing_common(common, steps)`: the grid's overrides for the timing pass (its own schedule, one validation);
- `solo_first(grid)`: the grid as two Study calls, each arm's first seed alone on its GPU, then the rest;
  `solo_runs(summary)`, `arm_costs(summary, ...)`: step time from the runs that trained alone only.
- `FP8_ARMS`, `fp8_arms_on(setting, facts, ...)`, `fp8_arms(setting, render_only, folder)`, `fp8_arm_seeds(...)`:
  the fp8 arms (model.fp8 on fp32_layout's settings), whether they run here, and their seeds (paired with the base's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from blunb import fp8, kernels
from blunb.config import FP8_RECIPES, ConfigError, TrainConfig
from blunb.study import Study

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


# ---------------------------------------------------------------- what a run's time figures may be read from

def solo_first(grid: Study) -> list[Study]:
    """`grid` as two Study calls into its folder, to be run in order: every arm's first seed one run per
    GPU (runs_per_gpu=1: these runs' step times are their arm's own), then the whole grid at grid's
    runs_per_gpu, where the first seeds are cached. Two runs sharing an H200 train at nearly twice the
    throughput of one alone, so only the runs whose time is reported need the GPU to themselves.
    An arm with seeds of its own (grid.arm_seeds) trains the first of those alone."""
    seeds = list(grid.seeds)
    own = {arm: list(s) for arm, s in grid.arm_seeds.items()} if isinstance(grid.arm_seeds, dict) else {}
    empty = [arm for arm, s in own.items() if not s] + ([] if seeds else ["(every other arm)"])
    if empty:
        raise ValueError(f"study {grid.name!r} has no seeds for {', '.join(empty)}")
    alone = dataclasses.replace(grid, seeds=seeds[:1], arm_seeds={arm: s[:1] for arm, s in own.items()},
                                runs_per_gpu=1)
    return [alone, grid]


# The overrides that set a run's length and validation: a timing pass drops them (its own steps, one validation).
_SCHEDULE_KEYS = ("max_steps", "warmup_steps", "stable_steps", "val_freq")


def timing_common(common: Sequence[str], steps: int) -> list[str]:
    """The timing pass's common overrides: the grid's (batch, data, model, precision) without those of its
    schedule, which would not fit `steps` (the study rescales the WSD schedule to them), and one validation,
    at the last step (a timing run's steps are its figures, not its loss)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise ValueError(f"timing steps must be an integer >= 3 (a WSD schedule with a decay tail), got {steps!r}")
    kept = [o for o in common if o.split("=", 1)[0].strip() not in _SCHEDULE_KEYS]
    return [*kept, f"val_freq={steps}"]


def solo_runs(summary: pd.DataFrame) -> pd.DataFrame:
    """The rows of a study's summary whose run trained alone on its GPUs (or on the CPU): `gpu_shared`
    (blunb.runs.gpu_shared of each run's env.json) exactly False. A run without a record (None: made
    before blunb kept one) is unknown, never taken for a solo one."""
    return summary[np.array([shared is False for shared in _shared(summary)], dtype=bool)]


def _shared(summary: pd.DataFrame) -> list[bool | None]:
    """Each row's gpu_shared as True, False or None (anything but a boolean, a NaN included, is unknown)."""
    if "gpu_shared" not in summary:
        raise ValueError("summary has no gpu_shared column: add blunb.runs.gpu_shared(run.env) for each run")
    return [bool(v) if isinstance(v, (bool, np.bool_)) else None for v in summary["gpu_shared"]]


def arm_costs(summary: pd.DataFrame, tokens_per_step: int, base: str) -> pd.DataFrame:
    """Per arm of a study's summary (its order): steady tok/s and step time (tokens_per_step over it) as the
    mean over the arm's solo runs only (`solo_runs`): a shared GPU's step time is two runs', not the arm's.
    Time is a device's: an arm whose solo runs trained on different devices (a borrowed machine may be an H100
    one day and an H200 the next) has no time, and `tok_per_sec_vs_base` is NaN where the arm's device is not
    the base's; `device` names the solo runs' device. An arm without a time says why in `time_na`. Peak memory
    is the mean over every run: it is each process's own torch.cuda.max_memory_allocated, which another process
    on the GPU does not change. `*_vs_base`: against arm `base`. Index: arm; also runs, solo_runs."""
    missing = [c for c in ("arm", "steady_tok_per_sec", "peak_mem_gib", "gpu_shared", "device") if c not in summary]
    if missing:
        raise ValueError(f"summary lacks {missing} (a Study's summary with gpu_shared added per run)")
    if base not in set(summary["arm"]):
        raise ValueError(f"base arm {base!r} is not in the summary's arms {list(dict.fromkeys(summary['arm']))}")
    solo = solo_runs(summary)
    rows = []
    for arm, runs in summary.groupby("arm", sort=False):
        mine = solo[solo["arm"] == arm]
        devices = list(dict.fromkeys(mine["device"].astype(str)))
        shared = _shared(runs).count(True)
        unknown = len(runs) - len(mine) - shared
        if not len(mine):
            why = (f"no run trained alone on its GPU: {shared} shared it, {unknown} have no record "
                   "(made before runs recorded it, or launched outside blunb.study)")
        elif len(devices) > 1:
            why = f"its solo runs trained on different devices ({', '.join(devices)}): no one device's time"
        else:
            why = ""
        tok_s = float(mine["steady_tok_per_sec"].mean()) if not why else math.nan
        rows.append({"arm": arm, "runs": len(runs), "solo_runs": len(mine), "device": " / ".join(devices),
                     "tok_per_sec": tok_s, "step_ms": tokens_per_step / tok_s * 1e3,
                     "peak_mem_gib": float(runs["peak_mem_gib"].mean()), "time_na": why})
    cost = pd.DataFrame(rows).set_index("arm")
    base_device = cost.loc[base, "device"]
    cost["tok_per_sec_vs_base"] = (cost["tok_per_sec"] / cost.loc[base, "tok_per_sec"]).where(
        cost["device"] == base_device)
    other = cost.index[(cost["device"] != base_device) & (cost["time_na"] == "") & cost["tok_per_sec"].notna()]
    cost.loc[other, "time_na"] = f"no ratio to {base}: trained alone on another device than {base}'s ({base_device})"
    cost["peak_mem_vs_base_gib"] = cost["peak_mem_gib"] - cost.loc[base, "peak_mem_gib"]
    return cost[["runs", "solo_runs", "device", "tok_per_sec", "step_ms", "tok_per_sec_vs_base", "peak_mem_gib",
                 "peak_mem_vs_base_gib", "time_na"]]


# ---------------------------------------------------------------- the fp8 arms (issue 30: the loss cost of FP8 GEMMs)

# arm -> its override on top of the base arm's (fp32_layout's) settings: the body's Linears through torchao's
# float8 training recipe of that name (blunb/fp8.py); everything else is the shipped layout.
FP8_ARMS = {f"fp8_{recipe}": f"model.fp8={recipe}" for recipe in FP8_RECIPES}
FP8_SETTINGS = ("auto", "on", "off")


def fp8_arms_on(setting: str, problems: Sequence[str], render_only: bool = False,
                fp8_runs: int = 0) -> tuple[bool, str]:
    """Whether the fp8 arms join the grid, and why, from the notebook's `fp8_arms` setting and fp8.problems of the
    device a run would get: "on" / "off" as forced; "auto" on exactly where model.fp8 can run (no problem), off
    otherwise, saying every problem. Rendering (render_only), where nothing trains, "auto" follows the study folder
    instead: on where it holds fp8 runs (`fp8_runs`), so that GPU runs render on any machine and a folder without
    them renders without them."""
    if setting not in FP8_SETTINGS:
        raise ValueError(f"fp8_arms must be one of {FP8_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return setting == "on", f"fp8_arms={setting}"
    if render_only:
        return (True, f"fp8_arms=auto, render_only: on, the study folder holds {fp8_runs} fp8 run(s)") if fp8_runs \
            else (False, "fp8_arms=auto, render_only: off, the study folder holds no fp8 run")
    if problems:
        return False, "fp8_arms=auto: off here: " + "; ".join(problems)
    return True, f"fp8_arms=auto: on here (torchao {fp8.torchao_version()})"


def fp8_arms(setting: str, render_only: bool = False, folder: str | Path | None = None) -> tuple[bool, str]:
    """fp8_arms_on for this machine's first device (what a run of the study gets) and the study `folder` (its fp8
    runs count when rendering). Forced on where runs would train (not render_only), a machine that cannot run
    model.fp8 stops here with every problem, before any arm trains."""
    runs = [d for arm in FP8_ARMS for d in Path(folder).glob(f"{arm}-s*")] if folder is not None else []
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    problems = fp8.problems(device)
    if setting == "on" and not render_only and problems:
        raise ConfigError("fp8_arms=on, but model.fp8 cannot run here: " + "; ".join(problems))
    return fp8_arms_on(setting, problems, render_only, len(runs))


def fp8_arm_seeds(on: bool, seeds: Sequence[int], fp8_seeds: Sequence[int], base: str) -> dict[str, list[int]]:
    """Study.arm_seeds for the fp8 arms and `base`: fp8_seeds for each (seed k of an fp8 arm pairs with seed k of
    base), none when the fp8 arms are off. fp8_seeds must hold every seed of `seeds`: base pairs with every arm."""
    if not on:
        return {}
    if short := [s for s in seeds if s not in fp8_seeds]:
        raise ConfigError(f"fp8_seeds {list(fp8_seeds)} are {base}'s seeds too and must hold every seed of seeds "
                          f"{list(seeds)} (the other arms pair with {base}); missing {short}")
    return {arm: list(fp8_seeds) for arm in (base, *FP8_ARMS)}
