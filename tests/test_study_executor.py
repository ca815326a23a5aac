"""Study(executor=...): each run as one submitit job (issue 32), here through submitit's LocalExecutor,
a real subprocess job per run: the same results as the local pool, caching and resume, root causes,
cancellation on interrupt, and bad executor values refused before any work."""

import json
import signal
import sys

import pandas as pd
import pytest

import blunb.study
from blunb.config import ConfigError
from blunb.runs import LOCK_NAME, process_alive, read_status, write_status
from blunb.study import Study, StudyError
from blunb.study_job import run_command

submitit = pytest.importorskip("submitit")

ENV = {"OMP_NUM_THREADS": "1"}
ARMS = {"a": [], "b": ["max_lr=1e-3"]}
SKIPS = ["max_lr=1e30", "grad_clip=0", "max_consecutive_skips=1"]  # fails at step 1, every time
# What two identical grids must agree on (the timing columns and run_dir differ by nature).
SAME = ["arm", "seed", "run", "status", "action", "error", "steps_done", "steps_total", "final_val_loss",
        "best_val_loss", "final_train_loss", "device", "world_size"]


def _executor(folder):
    ex = submitit.LocalExecutor(folder=folder)
    ex.update_parameters(timeout_min=20)  # LocalExecutor's default is 2 minutes: short on a loaded machine
    return ex


def _spy(monkeypatch, ex) -> list:
    """Record every submission (function, its arguments and the job) and let it go through."""
    calls, submit = [], ex.submit

    def recording(fn, *args, **kwargs):
        job = submit(fn, *args, **kwargs)
        calls.append((fn, args, job))
        return job
    monkeypatch.setattr(ex, "submit", recording)
    return calls


def _study(name, root, **kwargs):
    return Study(name, kwargs.pop("arms", ARMS), seeds=[0], steps=4, root=root, progress=False, env=ENV, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_jobs_give_the_local_pools_results_then_cache_and_resume(tmp_path, monkeypatch):
    local = _study("s", tmp_path / "local").run()
    ex = _executor(tmp_path / "jobs")
    calls = _spy(monkeypatch, ex)
    jobs = _study("s", tmp_path / "cluster", executor=ex).run()

    assert [fn for fn, _, _ in calls] == [run_command, run_command]  # one job per run
    cmd, console = calls[0][1][:2]
    assert cmd[1:3] == ["-m", "blunb.train"] and "--overwrite" in cmd and console.endswith("a-s0/console.txt")
    pd.testing.assert_frame_equal(jobs[SAME], local[SAME])
    assert (jobs["status"] == "completed").all() and (jobs["action"] == "new").all()
    for run in ("a-s0", "b-s0"):  # deterministic on the CPU: bit for bit
        mine = pd.read_csv(tmp_path / "cluster" / "s" / run / "metrics.csv")
        theirs = pd.read_csv(tmp_path / "local" / "s" / run / "metrics.csv")
        assert mine["train_loss"].tolist() == theirs["train_loss"].tolist()
        assert "Training complete" in (tmp_path / "cluster" / "s" / run / "console.txt").read_text()
    on_disk = pd.read_csv(tmp_path / "cluster" / "s" / "summary.csv")
    assert on_disk["final_val_loss"].tolist() == jobs["final_val_loss"].tolist()

    # The same study again: everything cached, no job submitted.
    with monkeypatch.context() as m:
        m.setattr(ex, "submit", lambda *a, **k: pytest.fail("a cached run was submitted"))
        again = _study("s", tmp_path / "cluster", executor=ex).run()
    assert (again["action"] == "cached").all() and again["final_val_loss"].tolist() == jobs["final_val_loss"].tolist()

    # An unfinished run resumes with --resume auto, as locally; the completed one is not submitted.
    folder = tmp_path / "cluster" / "s" / "a-s0"
    write_status(folder, "killed", 2, 4, error="RunKilled: stopped by signal SIGTERM")
    calls.clear()
    resumed = _study("s", tmp_path / "cluster", executor=ex).run()
    assert resumed[["run", "action", "status"]].values.tolist() == [["a-s0", "resume", "completed"],
                                                                   ["b-s0", "cached", "completed"]]
    assert len(calls) == 1 and calls[0][1][0][-2:] == ["--resume", "auto"]
    assert "--resume auto" in " ".join(json.loads((folder / "env.json").read_text())["argv"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failing_job_is_reported_with_the_runs_own_root_cause(tmp_path):
    study = _study("fail", tmp_path, arms={"bad": SKIPS}, nproc=2, executor=_executor(tmp_path / "jobs"))
    with pytest.raises(StudyError) as info:
        study.run()
    cause = "the gradient norm was non-finite for 1 steps in a row (through step 1)"
    ((name, why),) = info.value.failures
    assert name == "bad-s0" and why.startswith(f"error: {cause}")
    assert "rank " in why and "exit code" in why  # torchrun's root cause, read from console.txt
    assert "Traceback" not in why and "submitit" not in why
    row = info.value.summary.set_index("run").loc["bad-s0"]
    assert row["status"] == "failed" and row["steps_done"] == 1 and row["world_size"] == 2
    assert cause in (tmp_path / "fail" / "bad-s0" / "console.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_interrupted_study_cancels_its_jobs_and_their_runs_stop(tmp_path, monkeypatch):
    # LocalExecutor cancels by SIGINT, which its job ignores when this process ignores it (a shell's background
    # job has SIGINT set to SIG_IGN, inherited across exec): a Python handler here gives the job the default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_and_check(tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_and_check(tmp_path, monkeypatch):
    ex = _executor(tmp_path / "jobs")
    calls = _spy(monkeypatch, ex)
    run_dir = tmp_path / "stop" / "a-s0"

    def interrupt_once_training(self, active):  # a Ctrl-C as soon as the job's run has done a step
        if any(blunb.study._latest_step(a.plan.run_dir, a.started) is not None for a in active):
            raise KeyboardInterrupt
    monkeypatch.setattr(blunb.study._Progress, "show", interrupt_once_training)
    study = Study("stop", {"a": []}, seeds=[0], steps=300, root=tmp_path, progress=False, env=ENV, executor=ex)
    with pytest.raises(KeyboardInterrupt):
        study.run()

    ((_, _, job),) = calls
    assert job.done(), _signal_dispositions(job)
    status = read_status(run_dir)
    assert status["state"] == "killed" and "stopped by SIG" in status["error"] and status["steps_done"] < 300, status
    assert not any(process_alive(p) for p in status.get("processes", []))
    assert not (run_dir / LOCK_NAME).exists() and not (tmp_path / "stop" / LOCK_NAME).exists()


def _signal_dispositions(job) -> str:
    """What a still-running job's controller does with signals (a SIGINT it ignores or blocks explains why
    the cancel did not land): its /proc status lines."""
    pid = getattr(getattr(job, "_process", None), "pid", None)
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except (OSError, TypeError):
        return f"job {job.job_id}: no /proc status for pid {pid}"
    return f"job {job.job_id} (pid {pid}) still running: " + "; ".join(
        line for line in lines if line.startswith(("State", "SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")))


class _NotSubmitit:
    def submit(self, fn, *args):
        raise AssertionError("submitted")


@pytest.mark.parametrize("executor, match", [
    ("slurm", r"executor must be None or 'local' .*got 'slurm'"),
    (3, r"executor must be None or 'local' .*got 3"),
    (object(), r"executor must be None or 'local' .*got <object object"),
    (_NotSubmitit(), r"got a (tests\.)?test_study_executor\._NotSubmitit"),
])
def test_bad_executors_are_refused_before_any_work(tmp_path, monkeypatch, executor, match):
    monkeypatch.setattr(blunb.study.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match=match):
        _study("s", tmp_path, executor=executor).run()
    assert list(tmp_path.iterdir()) == []  # not even the study folder


def test_a_submitit_executor_without_submitit_installed_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit now raises ImportError
    with pytest.raises(ConfigError, match=r"needs submitit, which is not installed: pip install 'blunb\[cluster\]'"):
        _study("s", tmp_path, executor=_NotSubmitit()).run()
    assert list(tmp_path.iterdir()) == []


def test_local_is_the_default_pool(tmp_path):
    for executor in (None, "local"):
        study = _study("s", tmp_path, executor=executor)
        study._plan()
        assert study._executor is None
