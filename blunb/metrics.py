"""metrics.csv's schema: every column declared once, with its source, its dtype and whether it is a timing.

A timing column measures time (or memory), which two identical runs never share. The file is the
reference trainer's 11 columns in its order (SEED_COLUMNS, blunb.runs.METRIC_COLUMNS), then blunb's
(EXTRA_COLUMNS, opt_step_ms first), then three per optimizer group (GROUP_COLUMNS, `<prefix>_<group>`).
The trainer fills a row by these names and Schema.check refuses a row that differs from the run's
columns, so no column is written without being declared here. An empty cell is a value that does not
apply (no validation on the step, no Muon group, the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Column:
    name: str
    source: str          # where the value comes from
    dtype: type          # int or float, as the file's readers parse it
    timing: bool = False  # time or memory: differs between two otherwise identical runs


SEED_COLUMNS = (
    Column("step", "the step's index, from 0", int),
    Column("train_loss", "the training loss, mean over the micro-batches, averaged over ranks", float),
    Column("val_loss", "the validation loss measured before this step, where it was due", float),
    Column("tok_per_sec", "tokens per step / dt", float, timing=True),
    Column("grad_norm", "the global gradient norm: the group norms' root sum of squares", float),
    Column("dt_ms", "dt: host wall-clock between this step's start and the next's", float, timing=True),
    Column("lr", "the optimizer set's set_lr(step)['lr']", float),
    Column("elapsed_min", "wall-clock since the run started (a resumed run continues the count)", float,
           timing=True),
    Column("mfu", "MFUMeter.mfu(dt): causal model FLOPs over the device's peak (NaN without a peak)", float,
           timing=True),
    Column("mfu_palm", "MFUMeter.mfu_palm(dt): the same with PaLM's dense attention FLOPs", float, timing=True),
    Column("tflops_per_gpu", "MFUMeter.tflops_per_gpu(dt)", float, timing=True),
)
EXTRA_COLUMNS = (
    Column("opt_step_ms", "the optimizer step alone: CUDA events on the GPU, the wall clock on the CPU", float,
           timing=True),
    Column("tokens", "tokens trained through this step: (step + 1) x tokens per step", int),
    Column("grad_accum", "micro-batches per step on each rank", int),
    Column("skipped", "1 where a group did not step (a non-finite gradient norm)", int),
    Column("last_val_loss", "the latest validation loss when the step ran", float),
    Column("lr_muon", "set_lr(step)['lr_muon'] (Muon sets)", float),
    Column("clip_covered_frac", "the share of parameters the gradient clip covers (describe()['clip'])", float),
    Column("global_clip_coef", "StepStats.scalars['global_clip_coef']: the global clip's coefficient", float),
    Column("ns_rejected", "StepStats.scalars['ns_rejected']: Muon's rejected matrix updates this step", int),
    Column("ns_rejected_total", "StepStats.scalars['ns_rejected_total']: the same over the run", int),
    Column("nsratio", "StepStats.scalars['ns_ratio']: Muon's worst Newton-Schulz ratio this step", float),
    Column("peak_mem_gib", "the step's own peak CUDA allocation, GiB (empty on the CPU)", float, timing=True),
)
GROUP_COLUMNS = (  # name: the prefix of `<prefix>_<group>`
    Column("norm", "StepStats.norms: the group's gradient norm", float),
    Column("clip", "StepStats.clip_coefs: the coefficient applied to the group (1 = unclipped or skipped)", float),
    Column("skipped", "StepStats.skipped: 1 where the group did not step", int),
)

METRIC_COLUMNS = [c.name for c in SEED_COLUMNS]
TIMING_COLUMNS = tuple(c.name for c in (*SEED_COLUMNS, *EXTRA_COLUMNS, *GROUP_COLUMNS) if c.timing)


class MetricsRowError(ValueError):
    """A metrics row whose columns are not the declared ones (a column added to the row builder only)."""


def group_cells(group: str, **values) -> dict:
    """One optimizer group's cells, given by GROUP_COLUMNS' prefixes (norm=..., clip=..., skipped=...)."""
    prefixes = [c.name for c in GROUP_COLUMNS]
    if sorted(values) != sorted(prefixes):
        raise MetricsRowError(f"group {group!r}: cells {sorted(values)}, declared {prefixes}")
    return {f"{p}_{group}": values[p] for p in prefixes}


class Schema:
    """One run's columns, in file order: the declared ones, GROUP_COLUMNS once per optimizer group."""

    def __init__(self, groups: Iterable[str]):
        self.columns = [*SEED_COLUMNS, *EXTRA_COLUMNS,
                        *(replace(c, name=f"{c.name}_{g}") for g in groups for c in GROUP_COLUMNS)]
        self.names = [c.name for c in self.columns]

    @property
    def extra(self) -> list[str]:
        """The columns after the reference trainer's (what blunb.runs.MetricsWriter adds to them)."""
        return self.names[len(SEED_COLUMNS):]

    def check(self, row: dict) -> dict:
        """`row` when its columns are exactly this run's; MetricsRowError naming the undeclared and the
        missing ones otherwise (a cell left out would be written empty without a word)."""
        declared = set(self.names)
        undeclared, missing = [k for k in row if k not in declared], [n for n in self.names if n not in row]
        if undeclared or missing:
            raise MetricsRowError(f"metrics row: undeclared column(s) {undeclared}, missing {missing} "
                                  "(blunb/metrics.py declares every column)")
        return row
