"""End to end: the real CLI under a real 2-rank torchrun (gloo), and its run folder."""

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from blunb.runs import METRIC_COLUMNS, load_run
from tests.distributed import REPO, free_port

pytestmark = pytest.mark.slow


def _torchrun_train(nproc, *args, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "blunb.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-4000:])
    return proc


def test_two_rank_tiny_run_learns_and_writes_a_complete_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    proc = _torchrun_train(2, "--preset", "tiny", "--max-steps", "40", "--run-dir", str(run_dir))
    assert "=== Training complete ===" in proc.stdout
    run = load_run(run_dir)
    m = run.metrics
    assert list(m.columns[: len(METRIC_COLUMNS)]) == METRIC_COLUMNS
    assert list(m["step"]) == list(range(40))
    assert m["train_loss"].iloc[-5:].mean() < m["train_loss"].iloc[:5].mean() - 0.5
    assert m["val_loss"].notna().sum() >= 2 and m["val_loss"].dropna().iloc[-1] < m["val_loss"].dropna().iloc[0]
    assert run.env["world_size"] == 2 and run.env["torch"] and run.env["git_sha"]
    assert run.env["corpus"]["tokenizer"] == "bytes-v1" and len(run.env["corpus"]["sha256"]) == 64
    assert run.config["preset"] == "tiny" and run.config["max_steps"] == 40
    assert (run_dir / "log.txt").read_text().count("step ") >= 40
    assert m["mfu"].isna().all()  # CPU: no peak, so no invented MFU


def test_single_process_matches_two_rank_step_zero(tmp_path):
    """Same global batch, same seed: W=1 and W=2 see the same tokens at step 0 and agree on the loss."""
    _torchrun_train(2, "--preset", "tiny", "--max-steps", "3", "--run-dir", str(tmp_path / "w2"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", "3", "--run-dir",
                    str(tmp_path / "w1"), "--set", "B=16"], check=True, capture_output=True, timeout=300, env=env,
                   cwd=REPO)
    w1 = pd.read_csv(tmp_path / "w1" / "metrics.csv")
    w2 = pd.read_csv(tmp_path / "w2" / "metrics.csv")
    assert w1["train_loss"][0] == pytest.approx(w2["train_loss"][0], rel=1e-5)
    assert w1["val_loss"][0] == pytest.approx(w2["val_loss"][0], rel=1e-5)


def test_non_finite_loss_stops_with_the_step(tmp_path):
    run_dir = tmp_path / "nan"
    proc = _torchrun_train(2, "--preset", "tiny", "--max-steps", "20", "--run-dir", str(run_dir),
                           "--set", "max_lr=1e30", "--set", "grad_clip=0", check=False)
    assert proc.returncode != 0
    assert "non-finite training loss" in proc.stderr and "at step" in proc.stderr
    m = pd.read_csv(run_dir / "metrics.csv")
    assert not math.isfinite(m["train_loss"].iloc[-1])  # the failing step's row was written


def test_existing_run_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "blunb.train", "--run-dir", str(run_dir)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (run_dir / "metrics.csv").read_text() == "keep me"


def test_config_json_round_trips(tmp_path):
    run_dir = tmp_path / "r"
    _torchrun_train(1, "--preset", "tiny", "--max-steps", "3", "--run-dir", str(run_dir), "--set", "max_lr=2e-3")
    from blunb.config import TrainConfig

    cfg = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    assert cfg.max_lr == 2e-3 and cfg.max_steps == 3
