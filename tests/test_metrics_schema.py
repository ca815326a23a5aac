"""metrics.csv's schema (blunb.metrics): each column declared once, the file written in its order and
dtypes, and a row that differs from the declared columns refused (the trainer's own builder included)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import blunb.train as train_mod
from blunb import metrics
from blunb.config import apply_overrides, preset
from blunb.metrics import MetricsRowError, Schema, group_cells
from blunb.runs import METRIC_COLUMNS, TIMING_COLUMNS


def test_the_reference_columns_and_the_timing_ones_come_from_the_schema():
    assert METRIC_COLUMNS == ["step", "train_loss", "val_loss", "tok_per_sec", "grad_norm", "dt_ms", "lr",
                              "elapsed_min", "mfu", "mfu_palm", "tflops_per_gpu"]
    assert TIMING_COLUMNS == ("tok_per_sec", "dt_ms", "elapsed_min", "mfu", "mfu_palm", "tflops_per_gpu",
                              "opt_step_ms", "peak_mem_gib")
    declared = [c.name for c in (*metrics.SEED_COLUMNS, *metrics.EXTRA_COLUMNS)]
    assert len(declared) == len(set(declared)) and declared[len(METRIC_COLUMNS)] == "opt_step_ms"
    assert all(c.source and c.dtype in (int, float) for c in (*metrics.SEED_COLUMNS, *metrics.EXTRA_COLUMNS,
                                                             *metrics.GROUP_COLUMNS))


def test_a_run_has_three_columns_per_group_in_group_order():
    schema = Schema(["adamw_fp32", "muon"])
    assert schema.names[:len(METRIC_COLUMNS)] == METRIC_COLUMNS
    assert schema.extra == schema.names[len(METRIC_COLUMNS):]
    assert schema.names[-6:] == ["norm_adamw_fp32", "clip_adamw_fp32", "skipped_adamw_fp32",
                                 "norm_muon", "clip_muon", "skipped_muon"]


def _full_row(schema: Schema) -> dict:
    return {name: 0 for name in schema.names}


def test_a_row_with_an_undeclared_or_a_missing_column_is_refused():
    schema = Schema(["g"])
    row = _full_row(schema)
    assert schema.check(row) is row
    with pytest.raises(MetricsRowError, match=r"undeclared column\(s\) \['new_metric'\], missing \[\]"):
        schema.check({**row, "new_metric": 1.0})
    del row["lr_muon"]
    with pytest.raises(MetricsRowError, match=r"undeclared column\(s\) \[\], missing \['lr_muon'\]"):
        schema.check(row)
    assert group_cells("g", norm=1.0, clip=0.5, skipped=0) == {"norm_g": 1.0, "clip_g": 0.5, "skipped_g": 0}
    with pytest.raises(MetricsRowError, match="group 'g'"):
        group_cells("g", norm=1.0, clip=0.5)
    with pytest.raises(MetricsRowError, match="group 'g'"):
        group_cells("g", norm=1.0, clip=0.5, skipped=0, extra=1)


def _tiny(*overrides):
    cfg = apply_overrides(preset("tiny"), list(overrides))
    cfg.rescale_schedule(3)
    return cfg


def test_the_trainer_writes_the_declared_columns_in_their_dtypes(tmp_path):
    run_dir = train_mod.train(_tiny("optimizer=muon"), tmp_path / "muon")
    m = pd.read_csv(run_dir / "metrics.csv")
    groups = [g["name"] for g in json.loads((run_dir / "env.json").read_text())["training"]["optimizer"]["groups"]]
    schema = Schema(groups)
    assert list(m.columns) == schema.names and len(groups) == 2
    for col in schema.columns:
        values = m[col.name].dropna()
        if values.empty:   # a value that does not apply here (peak_mem_gib on the CPU)
            continue
        if col.dtype is int:
            assert m[col.name].dtype.kind in "iu" and len(values) == len(m), col
        else:
            assert m[col.name].dtype.kind == "f", col


@pytest.mark.parametrize("change, message", [
    (lambda cells: {**cells, "extra_cell": 1}, r"undeclared column\(s\) \['extra_cell'\]"),
    (lambda cells: {k: v for k, v in cells.items() if not k.startswith("clip_")}, r"missing \['clip_adamw_fp32'\]"),
])
def test_the_trainers_row_builder_is_held_to_the_schema(change, message, monkeypatch, tmp_path):
    real = train_mod.group_cells
    monkeypatch.setattr(train_mod, "group_cells", lambda group, **values: change(real(group, **values)))
    with pytest.raises(MetricsRowError, match=message):
        train_mod.train(_tiny(), tmp_path / "r")
    assert json.loads((tmp_path / "r" / "status.json").read_text())["state"] == "failed"
