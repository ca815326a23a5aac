"""Every committed run folder stays what the current code would plan from the run's own command line.

A study re-renders its committed runs (render_only) and a GPU session resumes a study beside them; both take
a run as done only if its config.json equals the config the current code builds from the same arguments
(blunb.study's cache, config.PREDATED filling the fields a run predates). A new setting without a PREDATED
entry, or a changed default, would turn every committed run stale: render_only refuses, and a resumed GPU study
stops (BLUNB_KEEP_COMPLETED) instead of reusing them. This catches that here, on the CPU, before a GPU session.
"""

from __future__ import annotations

import json

import pytest

from blunb.config import predated_defaults
from blunb.study import _as_planned_auto, _with_new_fields
from blunb.train import parse_args
from tests.distributed import REPO

RUNS = sorted(p.parent for p in (REPO / "results").rglob("config.json") if (p.parent / "env.json").is_file())
# Runs made before data_order read the legacy shard order: their studies render with data_order=shards in their
# common overrides (each study's README says so), which their own command lines do not carry.
LEGACY = {"data_order": "shards"}


def _train_args(argv: list[str]) -> list[str]:
    """blunb.train's arguments from the recorded argv (the script path first), without the folder-handling flags."""
    args = list(argv[1:])
    args = [a for a in args if a != "--overwrite"]
    if "--resume" in args:
        i = args.index("--resume")
        del args[i:i + 2]
    return args


def test_there_are_committed_runs_to_check():
    assert len(RUNS) > 50 and any("clipping-gpu" in str(r) for r in RUNS)


@pytest.mark.parametrize("run", RUNS, ids=lambda p: str(p.relative_to(REPO / "results")))
def test_a_committed_run_is_what_its_command_line_plans_today(run):
    cfg, _ = parse_args(_train_args(json.loads((run / "env.json").read_text())["argv"]))
    planned = json.loads(cfg.to_json())
    stored = _as_planned_auto(_with_new_fields(json.loads((run / "config.json").read_text()), predated_defaults()),
                              planned)
    differ = {k: (stored.get(k), planned.get(k)) for k in set(stored) | set(planned) if stored.get(k) != planned.get(k)}
    legacy = {k: v for k, v in differ.items() if k in LEGACY and v[0] == LEGACY[k]}
    assert {k: v for k, v in differ.items() if k not in legacy} == {}, f"stored vs planned today: {differ}"
