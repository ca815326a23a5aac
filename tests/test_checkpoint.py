"""blunb.checkpoint: DCP save / find_resume / validate / load on real gloo runs, plus in-process cases.

One W = 2 training run per optimizer kind (tests/workers/checkpoint_worker.py save) is resumed at
W = 2 (losses and weights bit-exact), W = 1 (no torch.distributed at all) and W = 3 with another
collective and bucket layout (optimizer state reassembled equal exactly, losses to 1e-5). The
in-process cases (W = 1) cover pruning, failed saves, cross-kind errors, DDPAdamW, weights-only
loads and the loader's position.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from blunb import checkpoint as ckpt
from blunb.checkpoint import CheckpointError
from blunb.data import DataError, ShardLoader, write_shard
from blunb.launch import torchrun_command
from tests.distributed import REPO, torchrun
from tests.workers.checkpoint_worker import make_cfg, make_run, train_steps, weights, write_data

WORKER = REPO / "tests" / "workers" / "checkpoint_worker.py"
TIMEOUT = 900   # seconds per launch: generous, the machine may be loaded
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run root, data folder) of the W = 2 run: <root>/<kind>/checkpoints/step_2, step_3."""
    root = tmp_path_factory.mktemp("ckpt")
    write_data(root / "data")
    proc = torchrun(WORKER, 2, "save", str(root / "run"), str(root / "data"), timeout=TIMEOUT)
    assert proc.stdout.count("OK save") == 2, proc.stdout
    return root / "run", root / "data"


@pytest.fixture
def one_thread():
    """Two loaded cores: torch's intra-op threads only contend (the workers run with one too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("world, overrides", [
    (2, []),
    (1, ["bucket_mb=1"]),
    (3, ["collective=reduce_bcast", "bucket_mb=0.02", "muon_collective=reduce_bcast"]),
], ids=["W2-same-layout", "W1-no-process-group", "W3-other-layout"])
def test_resume_reproduces_the_run(saved, world, overrides):
    run, data = saved
    args = ("resume", str(run), str(data), *overrides)
    if world == 1:
        proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                              timeout=TIMEOUT, env=ENV, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    else:
        proc = torchrun(WORKER, world, *args, timeout=TIMEOUT)
    assert proc.stdout.count(f"W={world}") == 2, proc.stdout


def test_truncated_file_is_named_and_skipped(saved, tmp_path, caplog, one_thread):
    run = tmp_path / "run"
    shutil.copytree(saved[0] / "adamw" / "checkpoints", run / "checkpoints")
    newest = run / "checkpoints" / "step_3"
    victim = newest / "__1_0.distcp"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp has \d+ bytes.*truncated"):
        ckpt.validate(newest)
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert ckpt.find_resume(run) == run / "checkpoints" / "step_2"
    assert "step_3" in caplog.text and "__1_0.distcp" in caplog.text
    newest = run / "checkpoints" / ckpt.INVALID_DIR / "step_3"
    assert newest.is_dir(), "a corrupt checkpoint is quarantined for inspection, not deleted"
    cfg = make_cfg("adamw")
    model, opt, loader = make_run(cfg, saved[1], cfg.seed)
    with pytest.raises(CheckpointError, match="truncated"):   # an explicit --resume PATH: an error
        ckpt.load(newest, model, opt, {"train": loader})
    with pytest.raises(CheckpointError, match="no such folder"):
        ckpt.validate(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="never finished"):
        ckpt.validate(tmp_path)


def _kill_if_worker(pid: int) -> None:
    """SIGKILL a worker of this test that torchrun did not take down (its pid, checked first)."""
    try:
        if "checkpoint_worker.py" in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def test_sigkill_during_a_save_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    write_data(tmp_path / "data")
    run = tmp_path / "run"
    root = run / "checkpoints"
    written = root / ".step_6.tmp" / ".metadata"     # DCP has finished; rank 0 waits before its commit
    with open(tmp_path / "log.txt", "w") as out:
        proc = subprocess.Popen(torchrun_command([str(WORKER), "kill", str(run), str(tmp_path / "data")], 2),
                                stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
        try:
            deadline = time.monotonic() + TIMEOUT
            while not (written.exists() and (run / "rank0.pid").exists()):
                assert proc.poll() is None, f"the worker ended early:\n{(tmp_path / 'log.txt').read_text()[-6000:]}"
                assert time.monotonic() < deadline, "the save at step 6 never reached its delay"
                time.sleep(0.5)
            os.kill(int((run / "rank0.pid").read_text()), signal.SIGKILL)
            assert proc.wait(timeout=300) != 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid_file in run.glob("rank*.pid"):
                _kill_if_worker(int(pid_file.read_text()))
    assert not (root / "step_6").exists() and written.parent.is_dir()
    with pytest.raises(CheckpointError, match="never finished"):
        ckpt.validate(written.parent)
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert ckpt.find_resume(run) == root / "step_3"
    assert ".step_6.tmp" in caplog.text
    assert not written.parent.exists(), "the unfinished save is pruned"


# ---------------------------------------------------------------- in process (W = 1)

@pytest.fixture
def data(tmp_path):
    write_data(tmp_path / "data")
    return tmp_path / "data"


def test_keep_n_pruning_and_leftovers(tmp_path, data, one_thread):
    cfg = make_cfg("adamw")
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, 1)
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3, 4):
        assert ckpt.save(tmp_path / "run", step, model, opt, {"train": loader}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]
    (root / ".step_9.tmp").mkdir()                 # a killed save
    (root / "step_8").mkdir()                      # no checkpoint.json: never finished
    shutil.copytree(root / "step_4", root / "step_7")   # valid, but past the next save: another timeline
    assert ckpt.save(tmp_path / "run", 5, model, opt, {"train": loader}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5"]
    assert ckpt.save(tmp_path / "run", 6, model, opt, {"train": loader}, keep=0)   # 0: keep all
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5", "step_6"]


def test_a_failed_save_returns_false_and_leaves_nothing_valid(tmp_path, data, caplog, monkeypatch, one_thread):
    cfg = make_cfg("muon")
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, 1)
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert not ckpt.save(tmp_path, 1, model, opt, {"train": loader}, {"not json": object()})

    def broken(*_):
        raise OSError("disk full")
    monkeypatch.setattr(ckpt, "_dcp_save", broken)
    with caplog.at_level(logging.WARNING, logger="blunb.checkpoint"):
        assert not ckpt.save(tmp_path, 1, model, opt, {"train": loader})
    assert "disk full" in caplog.text
    assert ckpt.find_resume(tmp_path) is None
    assert not any((tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("saved_kind, loaded_kind", [("adamw", "muon"), ("muon", "adamw"), ("adamw", "ddp_adamw")])
def test_another_optimizer_kind_is_a_clear_error(tmp_path, data, saved_kind, loaded_kind, one_thread):
    cfg = make_cfg(saved_kind)
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, 1)
    assert ckpt.save(tmp_path, 1, model, opt, {"train": loader})
    cfg = make_cfg(loaded_kind)
    model, opt, loader = make_run(cfg, data, cfg.seed)
    with pytest.raises(CheckpointError, match=rf"optimizer={saved_kind} run .* optimizer={loaded_kind}"):
        ckpt.load(ckpt.find_resume(tmp_path), model, opt, {"train": loader})


def test_ddp_adamw_round_trip(tmp_path, data, one_thread):
    """DDPAdamW: torch's AdamW state, full on every rank, keyed by FQN."""
    cfg = make_cfg("ddp_adamw")
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, 2)
    assert ckpt.save(tmp_path, 2, model, opt, {"train": loader})
    want = train_steps(cfg, model, opt, loader, 2, 2)
    final = weights(model)
    model, opt, loader = make_run(cfg, data, cfg.seed + 1)
    assert ckpt.load(ckpt.find_resume(tmp_path), model, opt, {"train": loader})["step"] == 2
    assert train_steps(cfg, model, opt, loader, 2, 2) == want
    assert all(torch.equal(v, final[k]) for k, v in weights(model).items())


def _step_at_lr_zero(opt, loader) -> None:
    """One step that moves nothing (lr 0, so no decay either): the weights become the masters."""
    for _, o, _ in opt.groups:
        for g in o.param_groups:
            g["lr"] = 0.0
    x, y = loader.next_batch()
    with opt.micro_step(last=True):
        opt.forward_model(x, y)[1].backward()
    opt.step()


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_weights_only_load_resyncs_the_masters(tmp_path, data, kind, one_thread):
    """bf16 Linears, so their fp32 masters are copies beside the weights; the fp32 group's master at one
    rank is its weights themselves (ShardedAdamW), which a weights-only load cannot leave stale."""
    cfg = make_cfg(kind, ["model.linear_dtype=bf16"])
    source, source_opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, source, source_opt, loader, 0, 1)
    assert ckpt.save(tmp_path, 1, source, source_opt, {"train": loader})
    path, loaded = ckpt.find_resume(tmp_path), weights(source)

    model, opt, loader = make_run(cfg, data, cfg.seed + 7)   # its own weights and masters
    train_steps(cfg, model, opt, loader, 0, 1)
    ckpt.load_weights(path, model)        # no optimizer given: the bf16 group's masters stay stale
    _step_at_lr_zero(opt, loader)
    linear = "blocks.0.attn.wq.weight"
    assert not torch.equal(weights(model)[linear], loaded[linear]), "the stale master reverted it"
    assert torch.equal(weights(model)["wte.weight"], loaded["wte.weight"])   # its master is the weights

    ckpt.load_weights(path, model, opt)   # with the optimizer: masters re-seeded from the weights
    assert all(torch.equal(v, loaded[k]) for k, v in weights(model).items())
    _step_at_lr_zero(opt, loader)
    assert all(torch.equal(v, loaded[k]) for k, v in weights(model).items()), "the next step left the weights"


def _shards(folder: Path, n: int = 3, ntok: int = 1000) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        write_shard(folder / f"train_{i}.bin", np.arange(i * ntok, (i + 1) * ntok) % 60000)
        paths.append(folder / f"train_{i}.bin")
    return paths


def test_loader_state_continues_the_stream(tmp_path):
    shards = _shards(tmp_path)
    B, T = 2, 8

    def ranks(world):
        return [ShardLoader(shards, B, T, r, world) for r in range(world)]

    two = ranks(2)
    for ld in two:
        ld.skip_batches(35)               # past the first shard's end (a window of each rank is 16 tokens)
    saved = [ld.state_dict() for ld in two]
    assert saved[0]["shard_idx"] == 1
    again = ranks(2)
    for ld, st in zip(again, saved):
        ld.load_state_dict(st)
    for _ in range(40):                   # on across the next shard end: exactly the same batches
        for a, b in zip(two, again):
            assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))

    two = ranks(2)
    for ld in two:
        ld.skip_batches(5)
    four = ranks(4)                       # twice the ranks, half the micro-batches: the same windows
    for ld in four:
        ld.load_state_dict(two[0].state_dict())
    stream2 = [ld.next_batch()[0] for _ in range(2) for ld in two]
    stream4 = [ld.next_batch()[0] for ld in four]
    assert all(torch.equal(u, v) for u, v in zip(stream2, stream4))

    with pytest.raises(DataError, match="other data"):
        ShardLoader(shards[:2], B, T).load_state_dict(saved[0])
