"""One owner per run folder (issue 28, cases 5 and 6): FolderLock, the trainer's hold on its run
folder and a study's on its folder."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pandas as pd
import pytest

import blunb.runs
import blunb.study
from blunb.launch import torchrun_command
from blunb.runs import LOCK_NAME, FolderInUse, FolderLock, process_alive, read_status
from blunb.study import Study
from tests.distributed import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _wait_for(predicate, what: str, timeout: float = 240, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc is None or proc.poll() is None, f"the process ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _holder(folder, *, die: bool = False) -> subprocess.Popen:
    """Another process that takes the folder's lock, then holds it until its stdin closes (and releases
    it), or (die) SIGKILLs itself while holding it."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from blunb.runs import FolderLock
        lock = FolderLock({str(folder)!r}, "run").acquire()
        print("locked", flush=True)
        if {die}:
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.read()
        lock.release()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=ENV, cwd=REPO)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_a_held_folder_is_refused_naming_its_holder_and_freed_on_release(tmp_path):
    folder = tmp_path / "run"
    holder = _holder(folder)
    try:
        record = json.loads((folder / LOCK_NAME).read_text())
        assert record["pid"] == holder.pid and record["what"] == "run"
        with pytest.raises(FolderInUse, match=rf"{folder} is in use: another run holds its lock \(pid {holder.pid} "
                                              r"on .*started .*; choose another"):
            FolderLock(folder, "run", hint="choose another --run-dir").acquire()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not folder.exists()  # the holder created it, and it stayed empty: nothing is left behind
    with FolderLock(folder) as lock:
        assert lock.taken_over is None and lock.stale_note() is None
        (folder / "kept.txt").write_text("x")
    assert sorted(p.name for p in folder.iterdir()) == ["kept.txt"]  # the lock file goes, the folder's files stay


@pytest.mark.slow
def test_a_dead_holders_lock_is_taken_over_and_named(tmp_path):
    folder = tmp_path / "run"
    dead = _holder(folder, die=True)
    dead.wait(timeout=60)
    assert dead.returncode == -signal.SIGKILL and (folder / LOCK_NAME).is_file()  # it never released it
    lock = FolderLock(folder).acquire()
    try:
        assert lock.taken_over["pid"] == dead.pid
        assert f"took over the stale lock of {folder}: its holder is gone (pid {dead.pid} on" in lock.stale_note()
    finally:
        lock.release()


def test_a_holder_still_writing_its_record_is_named_once_it_is_written(tmp_path, monkeypatch):
    """Between a holder's flock and its record a second process finds the lock file empty: it waits for the
    record (a bounded wait) rather than naming nobody, which is how two runs started at once once lost
    the holder's name on a loaded machine."""
    folder = tmp_path / "run"
    folder.mkdir()
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its own open file: FolderLock's flock in this process conflicts with it
    record = {"pid": 4242, "host": "elsewhere", "started": "2026-12-02T00:00:00+00:00", "argv": ["train.py"]}
    writer = threading.Timer(0.5, lambda: os.pwrite(fd, json.dumps(record).encode(), 0))
    writer.start()
    try:
        with pytest.raises(FolderInUse, match=r"holds its lock \(pid 4242 on elsewhere, started .*train.py"):
            FolderLock(folder).acquire()
        os.ftruncate(fd, 0)  # a holder that never writes one is still refused, once the wait is over
        monkeypatch.setattr(blunb.runs, "LOCK_RECORD_WAIT_S", 0.3)
        with pytest.raises(FolderInUse, match=r"another run holds its lock \(no record of its holder\)"):
            FolderLock(folder).acquire()
    finally:
        writer.join()
        os.close(fd)


def _train(run_dir, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "blunb.train", "--preset", "tiny", "--run-dir", str(run_dir),
                             "--overwrite", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=REPO)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two trainings on a loaded 2-core machine
def test_two_runs_started_at_once_into_one_folder_one_runs_the_other_fails_fast(tmp_path):
    from blunb.data import ensure_default_corpus

    ensure_default_corpus(progress=False)
    run_dir = tmp_path / "r"
    # Each says which it is through a setting config.json records; both may replace what is there.
    procs = {lr: _train(run_dir, "--max-steps", "12", "--set", f"max_lr={lr}") for lr in ("0.001", "0.002")}
    outs = {lr: p.communicate(timeout=1100) for lr, p in procs.items()}
    codes = {lr: p.returncode for lr, p in procs.items()}
    assert sorted(codes.values()) == [0, 2], {lr: (codes[lr], outs[lr][1][-2000:]) for lr in procs}
    winner = next(lr for lr, c in codes.items() if c == 0)
    loser = next(lr for lr, c in codes.items() if c == 2)
    err = outs[loser][1].strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {run_dir} is in use: another run holds its lock "
                                               f"(pid {procs[winner].pid} on "), err
    assert "train.py" in err[0] and "choose another --run-dir" in err[0]  # its command
    assert "step " not in outs[loser][0]  # it did no work
    # The folder holds the winner's run, whole: its config, its log, every one of its steps once.
    assert json.loads((run_dir / "config.json").read_text())["max_lr"] == float(winner)
    assert pd.read_csv(run_dir / "metrics.csv")["step"].tolist() == list(range(12))
    log = (run_dir / "log.txt").read_text()
    assert log.count("=== Training complete ===") == 1 and log.count("step      0 |") == 1
    assert read_status(run_dir)["state"] == "completed"
    assert not (run_dir / ".previous").exists() and not (run_dir / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_overwrite_cannot_move_a_live_runs_files(tmp_path):
    run_dir = tmp_path / "r"
    live = _train(run_dir, "--max-steps", "100000")
    try:
        _wait_for(lambda: (run_dir / "metrics.csv").is_file()
                  and len((run_dir / "metrics.csv").read_text().splitlines()) > 2, "the first run's steps", proc=live)
        before = (run_dir / "config.json").read_bytes()
        second = _train(run_dir, "--max-steps", "3", "--set", "max_lr=0.002")
        out, err = second.communicate(timeout=600)
        assert second.returncode == 2 and f"is in use: another run holds its lock (pid {live.pid} " in err, err
        assert not (run_dir / ".previous").exists() and (run_dir / "config.json").read_bytes() == before
        assert read_status(run_dir)["state"] == "running" and live.poll() is None
    finally:
        live.send_signal(signal.SIGTERM)
        live.communicate(timeout=120)
    assert read_status(run_dir)["state"] == "killed"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ranks_stop_and_free_the_folder_when_their_launcher_is_killed_outright(tmp_path):
    """torchrun starts its ranks in sessions of their own: a SIGKILL of torchrun alone must not leave them
    training on, holding the folder (each asks for SIGTERM on its parent's death)."""
    run_dir = tmp_path / "r"
    cmd = torchrun_command(["-m", "blunb.train", "--preset", "tiny", "--max-steps", "100000", "--run-dir",
                            str(run_dir), "--set", "val_freq=100000"], 2)
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    try:
        _wait_for(lambda: (run_dir / "metrics.csv").is_file()
                  and len((run_dir / "metrics.csv").read_text().splitlines()) > 2, "the run's steps", proc=launcher)
        ranks = read_status(run_dir)["processes"]
        assert len(ranks) == 2
    finally:
        launcher.kill()
        launcher.communicate(timeout=60)
    _wait_for(lambda: not (run_dir / LOCK_NAME).exists(), "the ranks to let go of the folder", timeout=120)
    status = read_status(run_dir)
    assert status["state"] == "killed" and status["signal"] == "SIGTERM", status
    _wait_for(lambda: not any(process_alive(r) for r in ranks), "the ranks to exit", timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_second_study_into_one_folder_fails_before_any_work_naming_the_first(tmp_path, monkeypatch):
    code = textwrap.dedent(f"""
        from blunb.study import Study
        Study("s", {{"a": []}}, seeds=[0], steps=12, root={str(tmp_path)!r}, progress=False,
              env={{"OMP_NUM_THREADS": "1"}}).run()
    """)
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=ENV, cwd=REPO)
    try:
        lock_file = tmp_path / "s" / LOCK_NAME
        _wait_for(lambda: lock_file.is_file() and lock_file.stat().st_size > 0, "the first study's lock", proc=first)

        def popen(*a, **k):
            raise AssertionError(f"the second study started a process: {a}")
        monkeypatch.setattr(blunb.study.subprocess, "Popen", popen)
        second = Study("s", {"a": [], "b": ["max_lr=1e-3"]}, seeds=[0], steps=12, root=tmp_path, progress=False)
        with pytest.raises(FolderInUse, match=rf"{tmp_path / 's'} is in use: another study holds its lock "
                                              rf"\(pid {first.pid} on "):
            second.run()
        monkeypatch.undo()
    finally:
        out = first.communicate(timeout=1100)[0]
    assert first.returncode == 0, out[-4000:]
    summary = pd.read_csv(tmp_path / "s" / "summary.csv")
    assert summary["run"].tolist() == ["a-s0"] and summary["status"].tolist() == ["completed"]  # the first's, whole
    assert not (tmp_path / "s" / "b-s0").exists() and not lock_file.exists()
