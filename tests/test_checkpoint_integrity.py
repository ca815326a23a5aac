"""Checkpoints that catch corruption (issue 28, cases 1-4 and 9), on real 2-rank gloo runs of the
trainer and in process.

One W = 2 run of the trainer (the `trained` fixture: checkpoints at steps 2, 4 and 6) is copied
and damaged per test: 256 flipped bytes inside an fp32 master, random bytes for DCP's .metadata,
a deleted or edited checkpoint.json. The other multi-process tests run the trainer themselves:
SIGTERM while rank 0 waits to commit a save, a disk that fills up on rank 1 in the middle of a
save, a resume with another model size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

from blunb import checkpoint as ckpt
from blunb.checkpoint import CheckpointError
from blunb.config import apply_overrides, preset
from blunb.launch import torchrun_command
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.train import RunKilled
from tests.distributed import REPO
from tests.workers.checkpoint_worker import make_cfg, make_run, train_steps, weights, write_data

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

TIMEOUT = 900   # seconds per launch: generous, the machine may be loaded
# A small batch (one micro-batch per step at W = 2) and no validation before the last step: fast runs.
COMMON = ["B=4", "global_batch=1024", "val_freq=100", "ckpt_freq=2", "ckpt_keep=3"]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **extra}


def _train_cmd(run_dir: Path, *sets: str, steps: int = 8, extra=()) -> list[str]:
    args = ["-m", "blunb.train", "--preset", "tiny", "--max-steps", str(steps), "--run-dir", str(run_dir)]
    for kv in (*COMMON, *sets):
        args += ["--set", kv]
    return torchrun_command([*args, *extra], 2)


def _train(run_dir: Path, *sets: str, steps: int = 8, extra=(), env=None, check: bool = True):
    proc = subprocess.run(_train_cmd(run_dir, *sets, steps=steps, extra=extra), capture_output=True, text=True,
                          timeout=TIMEOUT, env=env or _env(), cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-4000:])
    return proc


def _one_line_error(proc, message: str) -> None:
    """The run failed with `message` as one `error:` line (rank 0 speaks for both), no traceback of
    blunb's or DCP's."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and message in proc.stderr, out[-4000:]
    assert proc.stderr.count("error: ") == 1, proc.stderr[-4000:]
    for leak in ("CheckpointException", "blunb/checkpoint.py", "blunb/train.py", "UnicodeDecodeError"):
        assert leak not in out, f"{leak} in the output:\n{out[-4000:]}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A W = 2 run of 8 steps with checkpoints at steps 2, 4 and 6 (copy it before damaging it)."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    _train(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _flip_master(folder: Path) -> str:
    """Flip 256 bytes in the middle of the largest fp32 master's data (its file's size unchanged);
    the name of the file."""
    md = FileSystemReader(str(folder)).read_metadata()
    info = max((s for i, s in md.storage_data.items() if i.fqn.endswith(".master")), key=lambda s: s.length)
    at = info.offset + info.length // 2
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(at)
        block = f.read(256)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in block))
    return info.relative_path


def _scramble_metadata(folder: Path) -> None:
    target = folder / ".metadata"
    target.write_bytes(os.urandom(target.stat().st_size))


def _edit_record(folder: Path, **changes) -> None:
    record = json.loads((folder / ckpt.META_FILE).read_text())
    (folder / ckpt.META_FILE).write_text(json.dumps({**record, **changes}))


def _tiny_run(**model):
    """Model and optimizer set of the fixture's settings (model fields overridden), at W = 1."""
    cfg = apply_overrides(preset("tiny"), [*COMMON, *(f"{k}={v}" for k, v in model.items())])
    net = BLU(cfg.model)
    return net, build_optimizers(net, cfg, torch.device("cpu"), 1)


def _verify(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blunb.ckpt_cli", "verify", str(path)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=_env(), cwd=REPO)


# ---------------------------------------------------------------- 1: a kill during a save

def _kill_if_alive(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_sigterm_during_a_two_rank_save_ends_the_run_killed(tmp_path):
    run = tmp_path / "run"
    console = tmp_path / "console.txt"
    with open(console, "w") as out:
        proc = subprocess.Popen(_train_cmd(run), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=_env(**{ckpt.DELAY_ENV: "600"}), start_new_session=True)
        try:
            deadline = time.monotonic() + TIMEOUT
            while "waiting before the commit" not in console.read_text():
                assert proc.poll() is None, f"the run ended early:\n{console.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "the save at step 2 never reached its delay"
                time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)   # torchrun stops the job: SIGTERM to every rank
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            _kill_if_alive(proc.pid)
    text = console.read_text()
    status = json.loads((run / "status.json").read_text())
    assert proc.returncode != 0 and status["state"] == "killed", (status, text[-4000:])
    assert "Training complete" not in text and "committing" not in text, text[-4000:]
    root = run / "checkpoints"
    assert not (root / "step_2").exists() and not (root / ".step_2.tmp").exists(), sorted(os.listdir(root))
    assert ckpt.find_resume(run) is None


@pytest.fixture
def data(tmp_path):
    write_data(tmp_path / "data")
    return tmp_path / "data"


@contextmanager
def _streams_failing(exc_factory, where):
    """DCP's file streams raise exc_factory() after writing a little, in the threads `where` picks."""
    real = FileSystem.create_stream

    @contextmanager
    def failing(self, path, mode):
        with real(self, path, mode) as stream:
            if str(path).endswith(".distcp") and where(threading.current_thread() is threading.main_thread()):
                stream.write(b"\0" * 100)
                raise exc_factory()
            yield stream

    FileSystem.create_stream = failing
    try:
        yield
    finally:
        FileSystem.create_stream = real


@pytest.mark.parametrize("where", ["commit", "dcp-write"])
def test_a_kill_inside_a_save_propagates_and_leaves_no_folder(tmp_path, data, monkeypatch, where):
    """Single process: a RunKilled raised by the commit, or inside DCP's writer (which wraps it in its
    CheckpointException), reaches the caller as RunKilled; the unfinished folder is removed."""
    cfg = make_cfg("adamw")
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, 1)

    def killed(*_):
        raise RunKilled("stopped by SIGTERM")
    if where == "commit":
        monkeypatch.setattr(ckpt, "_commit", killed)
        with pytest.raises(RunKilled):
            ckpt.save(tmp_path / "run", 1, model, opt, {"train": loader})
    else:
        with _streams_failing(lambda: RunKilled("stopped by SIGTERM"), where=lambda main: main), \
                pytest.raises(RunKilled):
            ckpt.save(tmp_path / "run", 1, model, opt, {"train": loader})
    assert not any((tmp_path / "run" / "checkpoints").iterdir())
    assert ckpt.find_resume(tmp_path / "run") is None


# ---------------------------------------------------------------- 2: content checksums

def test_every_file_of_a_two_rank_save_has_its_sha256(trained):
    for folder in ckpt.step_folders(trained):
        record = json.loads((folder / ckpt.META_FILE).read_text())
        assert record["sha256"].keys() == record["files"].keys()
        assert {n[:4] for n in record["files"] if n.endswith(".distcp")} == {"__0_", "__1_"}, record["files"]
        for name, digest in record["sha256"].items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


def test_flipped_bytes_are_named_quarantined_and_skipped(run, caplog):
    newest = run / "checkpoints" / "step_6"
    victim = _flip_master(newest)
    with pytest.raises(CheckpointError, match=rf"file {victim} is corrupt"):
        ckpt.validate(newest)
    ckpt.validate(newest, checksums=False)   # the sizes alone cannot tell
    model, opt = _tiny_run()
    before = weights(model)
    with pytest.raises(CheckpointError, match=rf"file {victim} is corrupt"):   # --resume PATH: an error
        ckpt.load(newest, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in weights(model).items()), "a failed load changed the model"

    proc = _verify(run)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("corrupt: ") and victim in lines[0], lines
    assert all(line.startswith("ok: ") for line in lines[1:]), lines

    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert ckpt.find_resume(run) == run / "checkpoints" / "step_4"
    assert victim in caplog.text and "step_6" in caplog.text
    moved = run / "checkpoints" / ckpt.INVALID_DIR / "step_6"
    assert not newest.exists() and (moved / victim).is_file(), "quarantined, not deleted"
    assert _verify(run).returncode == 0 and _verify(moved).returncode == 1


def test_verify_command(trained, tmp_path):
    proc = _verify(trained)
    assert proc.returncode == 0 and proc.stdout.count("ok: ") == 3, proc.stdout + proc.stderr
    proc = _verify(trained / "checkpoints" / "step_4")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].startswith(f"ok: {trained}/checkpoints/step_4")
    proc = _verify(tmp_path)
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["blunb-ckpt"] == "blunb.ckpt_cli:main"


# ---------------------------------------------------------------- 3: a corrupt .metadata

def test_corrupt_metadata_is_an_invalid_checkpoint(run, caplog):
    newest = run / "checkpoints" / "step_6"
    _scramble_metadata(newest)
    with pytest.raises(CheckpointError, match=r"file \.metadata is corrupt"):
        ckpt.validate(newest)
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable"):   # even without the checksums
        ckpt.validate(newest, checksums=False)
    model, opt = _tiny_run()
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        ckpt.load(newest, model, opt, verify=False)
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert ckpt.find_resume(run) == run / "checkpoints" / "step_4"
    assert ".metadata" in caplog.text
    assert (run / "checkpoints" / ckpt.INVALID_DIR / "step_6" / ".metadata").is_file()


@pytest.mark.slow
def test_the_trainer_fails_on_a_corrupt_path_and_auto_falls_back(run):
    """Through the trainer at W = 2: step_6 with flipped bytes, step_4 with a random .metadata.
    --resume PATH fails naming the file; --resume auto skips both (quarantined) and resumes at 2."""
    root = run / "checkpoints"
    victim = _flip_master(root / "step_6")
    _scramble_metadata(root / "step_4")
    _one_line_error(_train(run, extra=("--resume", str(root / "step_6")), check=False), f"file {victim} is corrupt")
    _one_line_error(_train(run, extra=("--resume", str(root / "step_4")), check=False), ".metadata is corrupt")
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6"], "PATH moves nothing"

    proc = _train(run, extra=("--resume", "auto"))
    out = proc.stdout + proc.stderr
    assert "skipping a corrupt checkpoint" in out and victim in out and "file .metadata is corrupt" in out, out[-4000:]
    assert "resumed at step 2" in proc.stdout, proc.stdout[-3000:]
    assert sorted(p.name for p in (root / ckpt.INVALID_DIR).iterdir()) == ["step_4", "step_6"]
    assert json.loads((run / "status.json").read_text())["state"] == "completed"


# ---------------------------------------------------------------- 4: DCP's errors

def test_another_model_size_is_named_before_any_load(run):
    path = run / "checkpoints" / "step_6"
    model, opt = _tiny_run(d_model=256)
    before = weights(model)
    with pytest.raises(CheckpointError, match=r"saved d_model=128, this run 256"):
        ckpt.load(path, model, opt)
    with pytest.raises(CheckpointError, match=r"saved d_model=128, this run 256"):
        ckpt.load_weights(path, model)
    assert all(torch.equal(v, before[k]) for k, v in weights(model).items())
    _edit_record(path, config=None)   # no config to compare: the weights' shapes still say it
    with pytest.raises(CheckpointError, match=r"model\.wte\.weight: saved \[320, 128\], this model \[320, 256\]"):
        ckpt.load_weights(path, model)


@pytest.mark.slow
def test_the_trainer_names_another_model_size_in_one_line(run):
    proc = _train(run, "d_model=256", extra=("--resume", "auto"), check=False)
    _one_line_error(proc, "saved d_model=128, this run 256")
    assert len((run / "metrics.csv").read_text().splitlines()) == 1 + 8, "the run folder is untouched"


@pytest.mark.parametrize("where", ["another-thread", "every-thread"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # DCP's writer threads print it
def test_a_full_disk_fails_the_save_and_the_run_goes_on(tmp_path, data, caplog, monkeypatch, where):
    """ENOSPC in the middle of writing, in DCP's main writer thread (DCP raises its CheckpointException)
    or only in another one (DCP prints the exception and records a checkpoint without that thread's
    data): the save returns False, no folder stays behind, and the next save works."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)   # several writer threads even on a small machine
    cfg = make_cfg("adamw")
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, 1)
    full = (lambda main: not main) if where == "another-thread" else (lambda main: True)
    with _streams_failing(lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), full), \
            caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert not ckpt.save(tmp_path / "run", 1, model, opt, {"train": loader})
    assert "No space left on device" in caplog.text
    assert not any((tmp_path / "run" / "checkpoints").iterdir())
    assert ckpt.save(tmp_path / "run", 2, model, opt, {"train": loader})
    assert ckpt.find_resume(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_2"


@pytest.mark.slow
def test_a_full_disk_on_one_rank_during_a_save_is_logged_and_the_run_completes(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, env=_env(**{ckpt.ENOSPC_ENV: "4:1"}))   # rank 1's save of step 4
    assert "step 4: not saved" in proc.stdout and "rank 1: OSError: [Errno 28] No space left on device" in proc.stdout
    assert "step 4: not saved" in (run / "log.txt").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_6"]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["steps_done"] == 8, status


# ---------------------------------------------------------------- 9: checkpoint.json deleted or edited

def test_a_checkpoint_without_its_record_is_quarantined_not_deleted(run, caplog):
    newest = run / "checkpoints" / "step_6"
    files = sorted(p.name for p in newest.iterdir() if p.name != ckpt.META_FILE)
    (newest / ckpt.META_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert ckpt.find_resume(run) == run / "checkpoints" / "step_4"
    moved = run / "checkpoints" / ckpt.INVALID_DIR / "step_6"
    assert sorted(p.name for p in moved.iterdir()) == files
    assert f"moved {newest} to {moved}" in caplog.text


def test_an_edited_step_is_refused(run, caplog):
    newest = run / "checkpoints" / "step_6"
    _edit_record(newest, step=5)
    with pytest.raises(CheckpointError, match=r"says step 5 but its data was saved at step 6"):
        ckpt.validate(newest, checksums=False)
    model, opt = _tiny_run()
    with pytest.raises(CheckpointError, match=r"says step 5"):
        ckpt.load(newest, model, opt)
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert ckpt.find_resume(run) == run / "checkpoints" / "step_4"
    assert "says step 5" in caplog.text


def test_a_data_file_left_out_of_the_record_is_refused(run):
    """checkpoint.json lists every file of the save: a list trimmed to .metadata would leave a corrupt data file
    unchecked (DCP reads it all the same)."""
    newest = run / "checkpoints" / "step_6"
    record = json.loads((newest / ckpt.META_FILE).read_text())
    _edit_record(newest, files={".metadata": record["files"][".metadata"]},
                 sha256={".metadata": record["sha256"][".metadata"]})
    data_files = sorted(n for n in record["files"] if n != ".metadata")
    with pytest.raises(CheckpointError, match=rf"does not list {', '.join(data_files)} \(its list was edited"):
        ckpt.validate(newest)


# ---------------------------------------------------------------- the cost of verification

def test_checkpoint_io_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "checkpoint_io.csv"
    proc = subprocess.run([sys.executable, "bench/checkpoint_io.py", "--preset", "tiny", "--repeats", "1",
                           "--out", str(out), "--dir", str(tmp_path / "work")], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pd.read_csv(out)
    assert list(rows["cache"]) == ["warm", "cold"] and (rows["device"] == "cpu").all()
    record = json.loads((tmp_path / "work" / "checkpoints" / "step_1" / ckpt.META_FILE).read_text())
    assert (rows["bytes"] == sum(record["files"].values())).all()
    for column in ("save_s", "write_s", "sha256_s", "verify_s", "load_s", "load_verified_s"):
        assert (rows[column] > 0).all(), column
