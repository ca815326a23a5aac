"""bench/train_presets.py --copies: identical runs started together, their rows averaged and their
throughput summed, as study runs sharing one GPU (here two real tiny runs on the CPU)."""

import os

import pytest

from bench.train_presets import run_trainer_variant
from blunb.runs import load_run, steady_aggregates


def test_copies_run_together_and_sum_their_throughput(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    row = run_trainer_variant("tiny", "b4", ["B=4", "global_batch=512"], steps=5, warmup=1, nproc=1,
                              runs_dir=tmp_path, copies=2)
    assert row["status"] == "ok" and row["copies"] == 2
    per_copy = []
    for i in range(2):
        m = load_run(tmp_path / f"tiny-w1-b4-copy{i}").metrics
        per_copy.append(steady_aggregates(m[(m["step"] >= 1) & (m["step"] < 5)])["steady_tok_per_sec"])
    assert row["aggregate_tok_per_sec"] == pytest.approx(sum(per_copy))
    assert row["steady_tok_per_sec"] == pytest.approx(sum(per_copy) / 2)
    assert row["steps"] == 5 and row["global_batch"] == 512  # counts stay whole numbers
    assert row["wall_to_first_step_s"] > 0 and row["wall_steps_s"] > 0


def test_zero_copies_is_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="copies must be >= 1"):
        run_trainer_variant("tiny", "x", [], steps=2, warmup=0, nproc=1, runs_dir=tmp_path, copies=0)
    assert not os.listdir(tmp_path)
