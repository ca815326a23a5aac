"""Checkpoint and resume through the real trainer (torchrun, gloo): a run killed with SIGKILL and
re-issued with --resume auto continues bit-exactly; a checkpoint resumes at another world size;
bad checkpoints stop before any work. blunb/checkpoint.py's own tests are in test_checkpoint.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pandas as pd
import pytest

from blunb.launch import torchrun_command
from tests.distributed import REPO

pytestmark = pytest.mark.slow

STEPS, FREQ = 16, 4
# Columns that measure time differ between any two runs; everything else must be equal.
TIMING = {"tok_per_sec", "dt_ms", "elapsed_min", "mfu", "mfu_palm", "tflops_per_gpu", "opt_step_ms", "peak_mem_gib"}
CASES = {
    "adamw": ["optimizer=adamw"],
    "adamw-overlaps-globalclip": ["optimizer=adamw", "overlap_backward=true", "overlap_refresh=true",
                                  "global_clip=true", "linear_dtype=bf16"],
    "muon": ["optimizer=muon"],
    "muon-overlaps-globalclip": ["optimizer=muon", "overlap_backward=true", "overlap_refresh=true",
                                 "global_clip=true"],
}


def _cmd(nproc, run_dir, overrides, *extra):
    args = ["-m", "blunb.train", "--preset", "tiny", "--max-steps", str(STEPS), "--run-dir", str(run_dir),
            *[a for kv in [f"ckpt_freq={FREQ}", "val_freq=6", *overrides] for a in ("--set", kv)], *extra]
    return torchrun_command(args, nproc)


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def _run(nproc, run_dir, overrides, *extra, check=True):
    proc = subprocess.run(_cmd(nproc, run_dir, overrides, *extra), capture_output=True, text=True, timeout=900,
                          env=_env(), cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-4000:])
    return proc


def _run_and_kill_after(nproc, run_dir, overrides, checkpoint_step):
    """Start the run and SIGKILL the launcher's process group once checkpoints/step_<N> exists (torchrun's
    ranks, in sessions of their own, stop with it: SIGTERM on their parent's death)."""
    proc = subprocess.Popen(_cmd(nproc, run_dir, overrides), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO, start_new_session=True)
    target = run_dir / "checkpoints" / f"step_{checkpoint_step}"
    deadline = time.monotonic() + 600
    try:
        while not (target / "checkpoint.json").is_file():
            assert proc.poll() is None, f"the run ended before {target} appeared: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"{target} did not appear"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _comparable(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[[c for c in metrics.columns if c not in TIMING]]


@pytest.mark.parametrize("case", list(CASES))
def test_killed_run_resumes_bit_exactly(case, tmp_path):
    overrides = CASES[case]
    _run(2, tmp_path / "whole", overrides)
    killed = tmp_path / "killed"
    _run_and_kill_after(2, killed, overrides, checkpoint_step=8)
    proc = _run(2, killed, overrides, "--resume", "auto")   # the same command, re-issued
    assert "resumed at step" in proc.stdout and "| resumed at " in proc.stdout
    whole = pd.read_csv(tmp_path / "whole" / "metrics.csv")
    resumed = pd.read_csv(killed / "metrics.csv")
    assert list(resumed["step"]) == list(range(STEPS))          # one row per step
    pd.testing.assert_frame_equal(_comparable(resumed), _comparable(whole), check_exact=True)
    assert json.loads((killed / "status.json").read_text())["state"] == "completed"
    # keep-N: saves at 4, 8, 12; the newest two remain.
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step_12", "step_8"]


def test_resume_at_another_world_size_and_bad_checkpoints(tmp_path):
    common = ["optimizer=adamw", "B=4", "global_batch=3072"]   # 3072 tokens: whole micro-batches at W=1, 2, 3
    _run(2, tmp_path / "w2", common)
    ckpt = tmp_path / "w2" / "checkpoints" / "step_8"
    assert ckpt.is_dir()
    w2 = pd.read_csv(tmp_path / "w2" / "metrics.csv").set_index("step")
    for nproc in (1, 3):
        out = tmp_path / f"w{nproc}"
        proc = _run(nproc, out, common, "--resume", str(ckpt))
        assert "saved at world size 2" in proc.stdout
        m = pd.read_csv(out / "metrics.csv").set_index("step")
        assert list(m.index) == list(range(8, STEPS))
        # Another reduction order: equal to fp32 rounding, not bit for bit.
        assert m["train_loss"].loc[8:12].tolist() == pytest.approx(w2["train_loss"].loc[8:12].tolist(), rel=1e-5)

    # No checkpoints with ckpt_freq=0 (the default).
    _run(1, tmp_path / "off", ["optimizer=adamw", "ckpt_freq=0"])
    assert not (tmp_path / "off" / "checkpoints").exists()

    # An explicit path that is not a checkpoint, and an adamw checkpoint in a muon run: errors, no run folder.
    for bad_path, overrides, message in ((tmp_path / "nowhere", common, "no such folder"),
                                         (ckpt, ["optimizer=muon", "B=4", "global_batch=3072"],
                                          "saved by an optimizer=adamw run")):
        target = tmp_path / f"bad-{overrides[0]}"
        proc = _run(2, target, overrides, "--resume", str(bad_path), check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
        assert not (target / "metrics.csv").exists()

    # A truncated data file in the newest checkpoint: --resume auto falls back to the previous one.
    victim = next(p for p in (tmp_path / "w2" / "checkpoints" / "step_12").iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:10])
    proc = _run(2, tmp_path / "w2", common, "--resume", "auto")
    assert "skipping a corrupt checkpoint" in proc.stdout + proc.stderr and "resumed at step 8" in proc.stdout
    m = pd.read_csv(tmp_path / "w2" / "metrics.csv")
    assert list(m["step"]) == list(range(STEPS))
    assert (tmp_path / "w2" / "metrics.discarded_from_step_8.csv").is_file()


def test_resuming_from_an_older_checkpoint_leaves_the_later_timeline_aside(tmp_path):
    """--resume PATH to an older checkpoint: the folder's later checkpoints move to checkpoints/.abandoned/ at the
    start, so a later --resume auto cannot go back to them; a second resume at the same step keeps the first
    one's set-aside rows; a checkpoint past --max-steps, an empty --resume and a fresh start after only corrupt
    checkpoints lose nothing (the quarantined ones are kept)."""
    common = ["optimizer=adamw", "B=4", "global_batch=3072", "ckpt_keep=10"]
    run = tmp_path / "r"
    ckpts = run / "checkpoints"
    _run(1, run, common)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_12", "step_4", "step_8"]
    full = _comparable(pd.read_csv(run / "metrics.csv"))

    proc = _run(1, run, common, "--resume", str(ckpts / "step_4"))
    assert "later checkpoints (a timeline this run leaves) moved to" in proc.stdout + proc.stderr
    assert sorted(p.name for p in (ckpts / ".abandoned").iterdir()) == ["step_12", "step_8"]
    assert json.loads((run / "env.json").read_text())["resumed"]["checkpoints_set_aside"] == [
        str(ckpts / ".abandoned" / "step_12"), str(ckpts / ".abandoned" / "step_8")]
    pd.testing.assert_frame_equal(_comparable(pd.read_csv(run / "metrics.csv")), full, check_exact=True)
    first_aside = (run / "metrics.discarded_from_step_4.csv").read_text()
    _run(1, run, common, "--resume", str(ckpts / "step_4"))
    assert sorted(p.name for p in (ckpts / ".abandoned").iterdir()) == ["step_12", "step_12.1", "step_8", "step_8.1"]
    assert (run / "metrics.discarded_from_step_4.csv").read_text() == first_aside
    assert (run / "metrics.discarded_from_step_4.1.csv").is_file()

    before = (run / "metrics.csv").read_bytes()
    short = _run(1, run, [*common], "--resume", "auto", "--max-steps", "10", check=False)
    assert short.returncode != 0 and "continues at step 12, but --max-steps is 10" in short.stderr
    empty = _run(1, run, common, "--resume", "", check=False)
    assert empty.returncode != 0 and "--resume needs 'auto' or a checkpoint folder" in empty.stderr
    assert (run / "metrics.csv").read_bytes() == before

    for step_dir in [p for p in ckpts.iterdir() if p.name.startswith("step_")]:
        victim = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
        victim.write_bytes(victim.read_bytes()[:10])
    _run(1, run, common, "--resume", "auto")   # nothing valid left: a fresh start
    assert sorted(p.name for p in (ckpts / ".invalid").iterdir()) == ["step_12", "step_4", "step_8"]
    assert not (run / ".previous").exists()
    pd.testing.assert_frame_equal(_comparable(pd.read_csv(run / "metrics.csv")), full, check_exact=True)
