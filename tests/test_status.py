"""status.json never lies (issue 28 case 8) and a stop signal is one line (issue 32, Ctrl-C): a run's
status is kept current while it goes, a run whose processes are gone reads as killed, a mostly
skipped run ends diverged, a failed write of a run file stops the run naming it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pandas as pd
import pytest

from blunb.config import ConfigError, preset
from blunb.launch import torchrun_command
from blunb.runs import RunWriteError, process_info, read_status, settle_status, summarize, write_status
from tests.distributed import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _start(cmd, extra_env=None) -> subprocess.Popen:
    # Its own session: a signal to the group reaches torchrun and every rank, as Ctrl-C in a terminal does.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **(extra_env or {})}, cwd=REPO, start_new_session=True)


def _train_cmd(run_dir, *args):
    return [sys.executable, "-m", "blunb.train", "--preset", "tiny", "--run-dir", str(run_dir), *args]


def _wait_for(predicate, what, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _status_steps(run_dir) -> int:
    try:
        return read_status(run_dir)["steps_done"]
    except (TypeError, ValueError):  # not written yet
        return 0


def test_a_status_naming_dead_processes_reads_killed_and_settles(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_status(tmp_path, "running", 4, 10, processes=[{**process_info(), "pid": dead.pid, "start": 1}])
    st = read_status(tmp_path)
    assert st["state"] == "killed" and st["process_gone"] and st["steps_done"] == 4
    assert st["error"].startswith(f"process gone: the run's process(es) {dead.pid} on {socket.gethostname()}")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "running"  # reading writes nothing
    settle_status(tmp_path)
    on_disk = json.loads((tmp_path / "status.json").read_text())
    assert on_disk["state"] == "killed" and on_disk["steps_done"] == 4 and "processes" not in on_disk
    write_status(tmp_path, "running", 4, 10, processes=[process_info()])  # this process: alive
    assert read_status(tmp_path)["state"] == "running" and settle_status(tmp_path)["state"] == "running"
    elsewhere = {**process_info(), "host": "another-host", "pid": dead.pid}  # another host's: not judged here
    write_status(tmp_path, "running", 4, 10, processes=[elsewhere])
    assert read_status(tmp_path)["state"] == "running"


@pytest.mark.slow
def test_status_is_kept_current_and_a_sigkilled_run_reads_killed(tmp_path):
    run_dir = tmp_path / "r"
    proc = _start(_train_cmd(run_dir, "--max-steps", "100000"))
    try:
        _wait_for(lambda: _status_steps(run_dir) >= 3, "status.json to count steps", proc)
        st = read_status(run_dir)
        assert st["state"] == "running" and [p["pid"] for p in st["processes"]] == [proc.pid]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    rows = len(pd.read_csv(run_dir / "metrics.csv"))
    st = read_status(run_dir)
    assert st["state"] == "killed" and st["error"].startswith("process gone") and 3 <= st["steps_done"] <= rows
    assert summarize_status(run_dir) == "killed"


def summarize_status(run_dir) -> str:
    from blunb.runs import load_run

    return summarize([load_run(run_dir)])["status"].iloc[0]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the collective timeout, then torchrun's grace before it SIGKILLs the stopped rank
def test_a_stopped_rank_0_ends_failed_with_the_cause_not_running(tmp_path):
    """SIGSTOP of rank 0: rank 1's collective times out, torchrun ends the job (the stopped rank 0 by
    SIGKILL), and the status says what happened, although rank 0 never wrote again."""
    from blunb.data import ensure_default_corpus

    ensure_default_corpus(progress=False)
    run_dir = tmp_path / "r"
    proc = _start(torchrun_command(["-m", "blunb.train", "--preset", "tiny", "--max-steps", "100000", "--run-dir",
                                    str(run_dir), "--set", "collective_timeout_s=20"], 2))
    stopped = None
    try:
        _wait_for(lambda: _status_steps(run_dir) >= 2, "status.json to count steps", proc)
        stopped = read_status(run_dir)["processes"][0]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    st = read_status(run_dir)
    assert st["state"] in ("failed", "killed") and st["steps_done"] >= 2, st
    assert "collective_timeout_s=20" in st["error"] or st["error"].startswith("process gone"), st


def _nan_steps(steps):
    return ",".join(f"{s}:0" for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("skipped, expected", [(range(1, 12), "diverged"), (range(1, 6), "completed")])
def test_a_run_that_skipped_most_of_its_steps_ends_diverged(tmp_path, skipped, expected):
    run_dir = tmp_path / "r"
    proc = subprocess.run(_train_cmd(run_dir, "--max-steps", "12", "--set", f"fault_nan_grad={_nan_steps(skipped)}"),
                          capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    st = read_status(run_dir)
    assert st["state"] == expected and st["steps_done"] == 12
    assert int(pd.read_csv(run_dir / "metrics.csv")["skipped"].sum()) == len(skipped)
    if expected == "diverged":
        assert st["error"] == "11 of 12 steps skipped for a non-finite gradient norm (more than diverged_skip_frac=0.5)"
        assert "the run diverged: 11 of 12 steps skipped" in proc.stdout


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_diverged_skip_frac_is_checked(bad):
    cfg = preset("tiny")
    cfg.diverged_skip_frac = bad
    with pytest.raises(ConfigError, match="diverged_skip_frac"):
        cfg.validate(1)


@pytest.mark.slow
@pytest.mark.parametrize("name, n", [("metrics.csv", 5), ("log.txt", 25), ("status.json", 3)])
def test_a_failed_write_of_a_run_file_stops_the_run_naming_it(tmp_path, name, n):
    run_dir = tmp_path / "r"
    proc = subprocess.run(_train_cmd(run_dir, "--max-steps", "40", "--set", "val_freq=5"), capture_output=True,
                          text=True, env={**ENV, "BLUNB_TEST_FAIL_WRITE": f"{name}:{n}"}, cwd=REPO, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: writing {run_dir / name} failed (No space left on device"), err
    assert "Logging error" not in proc.stderr and "Traceback" not in proc.stderr
    st = read_status(run_dir)
    assert st["state"] != "running" and st["steps_done"] < 40
    if name != "status.json":  # the last status written says why it stopped
        assert st["state"] == "failed" and f"writing {run_dir / name} failed" in st["error"]
    else:  # status.json itself cannot be written: its processes are gone, so it reads killed
        assert st["state"] == "killed" and st["error"].startswith("process gone")
    if name == "metrics.csv":
        assert pd.read_csv(run_dir / "metrics.csv")["step"].tolist() == [0, 1, 2, 3]  # rows 1-4 written, 5th failed


def test_the_fault_injection_spec_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("BLUNB_TEST_FAIL_WRITE", "metrics.csv")
    with pytest.raises(ValueError, match="expected FILE_NAME:N"):
        write_status(tmp_path, "running", 0, 1)
    monkeypatch.setenv("BLUNB_TEST_FAIL_WRITE", "status.json:1")
    with pytest.raises(RunWriteError, match=f"writing {tmp_path / 'status.json'} failed"):
        write_status(tmp_path, "running", 0, 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ckpt", [False, True])
def test_ctrl_c_of_a_two_rank_run_is_one_line_and_recorded(tmp_path, ckpt):
    """SIGINT to the whole job (a terminal's Ctrl-C reaches torchrun and both ranks): one line on the
    console after the step lines, exit status 130, status.json killed with the signal's name."""
    from blunb.data import ensure_default_corpus

    ensure_default_corpus(progress=False)
    run_dir = tmp_path / "r"
    args = ["--set", "ckpt_freq=3"] if ckpt else []
    proc = _start(torchrun_command(["-m", "blunb.train", "--preset", "tiny", "--max-steps", "300", "--run-dir",
                                    str(run_dir), *args], 2))
    try:
        _wait_for(lambda: (run_dir / "metrics.csv").is_file()
                  and len((run_dir / "metrics.csv").read_text().splitlines()) > 5, "five steps", proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-4000:]
    st = read_status(run_dir)
    assert st["state"] == "killed" and st["signal"] == "SIGINT" and 5 <= st["steps_done"] < 300
    line = f"stopped by SIGINT at step {st['steps_done']} of 300" + ("; continue with --resume auto" if ckpt else "")
    assert st["error"] == f"RunKilled: {line}"
    assert err.strip().splitlines() == [line], err[-4000:]  # no traceback, no torchrun warnings
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
