"""End to end: the real CLI under a real 2-rank torchrun (gloo), and its run folder."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from blunb.launch import torchrun_command
from blunb.runs import METRIC_COLUMNS, load_run, read_status, summarize
from tests.distributed import REPO

pytestmark = pytest.mark.slow


def _train_cli(*args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "blunb.train", "--preset", "tiny", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-4000:])
    return proc


def _torchrun_train(nproc, *args, check=True):
    cmd = torchrun_command(["-m", "blunb.train", *args], nproc)
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
    # Tidy: every column numeric (no packed strings), one per group fact; last_val_loss carried.
    assert all(m[c].dtype.kind in "fiu" for c in m.columns if m[c].notna().any()), m.dtypes
    assert m["norm_adamw_fp32"].tolist() == pytest.approx(m["grad_norm"].tolist(), rel=1e-6)
    assert m["clip_adamw_fp32"].between(0, 1).all() and (m["skipped_adamw_fp32"] == 0).all()
    assert (m["clip_covered_frac"] == 1.0).all() and m["last_val_loss"].notna().all()
    assert m["last_val_loss"].iloc[1] == m["val_loss"].iloc[0]
    facts = run.env["training"]
    assert facts["precision"]["qk_norm_rope"] == "fp32 (always)" and facts["optimizer"]["groups"][0]["name"] == \
        "adamw_fp32"
    # compile and the chunked loss at "auto": the CPU decided both off, config.json records what ran
    assert facts["auto_settings"] == {"compile": False, "model.chunked_ce": False}
    assert run.config["compile"] is False and run.config["model"]["chunked_ce"] is False
    assert "auto settings on cpu: compile=false model.chunked_ce=false (the eager path" in \
        (run_dir / "log.txt").read_text()


def test_single_process_matches_two_and_four_ranks_at_step_zero(tmp_path):
    """Same global batch, same seed: W=1, 2 and 4 see the same tokens at step 0 and agree on the
    training loss; the validation set is a fixed number of tokens split across ranks, so the
    validation loss agrees too (to fp32 reduction noise), whatever B is."""
    _torchrun_train(2, "--preset", "tiny", "--max-steps", "3", "--run-dir", str(tmp_path / "w2"))
    _torchrun_train(4, "--preset", "tiny", "--max-steps", "3", "--run-dir", str(tmp_path / "w4"), "--set", "B=4",
                    "--set", "global_batch=4096")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", "3", "--run-dir",
                    str(tmp_path / "w1"), "--set", "B=16"], check=True, capture_output=True, timeout=300, env=env,
                   cwd=REPO)
    w1, w2, w4 = (pd.read_csv(tmp_path / w / "metrics.csv") for w in ("w1", "w2", "w4"))
    for other in (w2, w4):
        assert w1["train_loss"][0] == pytest.approx(other["train_loss"][0], rel=1e-5)
        assert w1["val_loss"][0] == pytest.approx(other["val_loss"][0], rel=1e-6)


def test_diverging_run_skips_steps_then_stops(tmp_path):
    """lr 1e30 blows the weights up: every later gradient is non-finite, each step is skipped on
    every rank (parameters untouched), and the run stops after max_consecutive_skips."""
    run_dir = tmp_path / "diverge"
    proc = _torchrun_train(2, "--preset", "tiny", "--max-steps", "20", "--run-dir", str(run_dir),
                           "--set", "max_lr=1e30", "--set", "grad_clip=0", "--set", "max_consecutive_skips=3",
                           check=False)
    assert proc.returncode != 0
    assert "non-finite for 3 steps in a row (through step 3)" in proc.stderr
    m = pd.read_csv(run_dir / "metrics.csv")
    assert list(m["skipped"]) == [0, 1, 1, 1]
    assert m["train_loss"].iloc[1] == m["train_loss"].iloc[3]  # skipped steps left the weights alone


def test_non_finite_loss_stops_with_the_step(tmp_path, monkeypatch):
    import blunb.train as train_mod
    from blunb.config import preset

    calls = {"n": 0}

    class PoisonedAtStep2(train_mod.BLU):
        def forward(self, idx, targets=None):
            logits, loss = super().forward(idx, targets)
            if self.training:
                calls["n"] += 1
            return logits, loss * float("nan") if calls["n"] > 2 * accum else loss

    cfg = preset("tiny")
    cfg.rescale_schedule(6)
    accum = cfg.grad_accum_steps(1)
    monkeypatch.setattr(train_mod, "BLU", PoisonedAtStep2)
    with pytest.raises(train_mod.TrainingError, match="non-finite training loss .* at step 2"):
        train_mod.train(cfg, tmp_path / "nan")
    m = pd.read_csv(tmp_path / "nan" / "metrics.csv")
    assert len(m) == 3 and not math.isfinite(m["train_loss"].iloc[-1])  # the failing step's row was written


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


def test_zero1_adamw_matches_torch_ddp_adamw(tmp_path):
    """The default ZeRO-1 ShardedAdamW path and torch DDP + AdamW train the same trajectory
    (fp32 Linears, so DDP's AdamW is not stepping bf16 weights; gloo here, NCCL on GPUs)."""
    common = ["--preset", "tiny", "--max-steps", "5", "--set", "diag=true", "--set", "val_freq=2",
              "--set", "linear_dtype=fp32"]
    zero = _torchrun_train(2, *common, "--run-dir", str(tmp_path / "zero"), "--optimizer", "adamw",
                           "--set", "overlap_backward=true", "--set", "overlap_refresh=true")
    _torchrun_train(2, *common, "--run-dir", str(tmp_path / "ddp"), "--optimizer", "ddp_adamw")
    assert "ZeRO-1 adamw_fp32 over 2 rank(s)" in zero.stdout
    # diag compares a bit-level checksum of the replicas every step
    assert len(re.findall(r"\[replica\] 2 rank\(s\) bit-identical", zero.stdout)) == 5
    assert "[replica] ERROR" not in zero.stdout and zero.stdout.count("[micro] med") == 5
    assert (tmp_path / "zero" / "diag.csv").is_file()
    z = pd.read_csv(tmp_path / "zero" / "metrics.csv")
    d = pd.read_csv(tmp_path / "ddp" / "metrics.csv")
    # CPU: fp32 throughout, only the reduction order differs. CUDA: TF32 matmuls and kernels
    # autotuned per process; measured on 2 x H200 (NCCL): loss within 1e-5, norm within 2.1e-4.
    loss_rel, norm_rel = (1e-4, 1e-3) if torch.cuda.is_available() else (2e-5, 2e-4)
    assert z["train_loss"].tolist() == pytest.approx(d["train_loss"].tolist(), rel=loss_rel)
    assert z["grad_norm"].tolist() == pytest.approx(d["grad_norm"].tolist(), rel=norm_rel)


def test_muon_run_trains_with_whole_matrix_owners(tmp_path):
    proc = _torchrun_train(2, "--preset", "tiny", "--max-steps", "12", "--run-dir", str(tmp_path / "muon"),
                           "--optimizer", "muon", "--set", "diag=true", "--set", "global_clip=true")
    out = proc.stdout
    assert "G1 muon: 737,280 params" in out and "covers 42,368 / 779,648 params (5.43%)" in out
    assert "WARNING: the clip leaves 94.57%" in out
    assert out.count("[replica] 2 rank(s) bit-identical") == 12 and "[replica] ERROR" not in out
    assert "nsrej 0/0" in out and "globalclip" in out
    m = pd.read_csv(tmp_path / "muon" / "metrics.csv")
    assert m["train_loss"].iloc[-3:].mean() < m["train_loss"].iloc[:3].mean() - 0.5
    assert m["nsratio"].between(0.5, 1.5).all() and m["lr_muon"].notna().all()
    assert m["norm_muon"].notna().all() and m["global_clip_coef"].between(0, 1).all()
    assert m["clip_muon"].tolist() == m["global_clip_coef"].tolist()  # one coefficient for every group
    assert (m["ns_rejected_total"] == 0).all() and m["clip_covered_frac"].iloc[0] == pytest.approx(42368 / 779648)


def test_status_records_how_each_run_ended(tmp_path):
    ok = tmp_path / "ok"
    _torchrun_train(2, "--preset", "tiny", "--max-steps", "3", "--run-dir", str(ok))
    st = read_status(ok)
    assert set(st.pop("wall_s")) == {"to_first_step", "steps", "validation", "validations", "checkpoints"}
    assert st | {"updated": None} == {"state": "completed", "steps_done": 3, "steps_total": 3, "error": None,
                                      "updated": None}
    bad = tmp_path / "bad"
    proc = _torchrun_train(2, "--preset", "tiny", "--max-steps", "8", "--run-dir", str(bad), "--set", "max_lr=1e30",
                           "--set", "grad_clip=0", "--set", "max_consecutive_skips=2", check=False)
    assert proc.returncode != 0
    st = read_status(bad)
    assert st["state"] == "failed" and "non-finite for 2 steps" in st["error"] and st["steps_done"] == 2
    summary = summarize([load_run(ok), load_run(bad)])
    assert summary["complete"].tolist() == [True, False]


def test_a_completed_run_says_where_its_wall_clock_went(tmp_path):
    run = tmp_path / "r"
    proc = _train_cli("--max-steps", "6", "--run-dir", str(run), "--set", "val_freq=2", "--set", "ckpt_freq=3")
    wall = read_status(run)["wall_s"]
    assert wall["validations"] == 4  # steps 0, 2, 4 and the last
    assert 0 < wall["to_first_step"] < 600 and wall["steps"] > 0 and wall["validation"] > 0
    assert wall["checkpoints"] > 0  # the one at step 3
    line = next(li for li in proc.stdout.splitlines() if li.startswith("wall clock:"))
    assert f"{wall['steps']:.1f} s of steps" in line and "(4 passes)" in line
    assert line in (run / "log.txt").read_text()


def test_a_failure_right_after_the_folder_is_claimed_is_recorded(tmp_path, monkeypatch):
    """status.json says "running" as soon as the folder is this run's; a failure in what setup writes
    next (here the metrics file: a full disk) must turn it into "failed", not leave it running."""
    import blunb.train as train_mod
    from blunb.config import preset

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train_mod, "MetricsWriter", no_space)
    cfg = preset("tiny")
    cfg.rescale_schedule(3)
    with pytest.raises(OSError, match="No space left"):
        train_mod.train(cfg, tmp_path / "r")
    st = read_status(tmp_path / "r")
    assert st["state"] == "failed" and "No space left on device" in st["error"] and st["steps_done"] == 0


def test_config_error_under_torchrun_is_printed_once(tmp_path):
    proc = _torchrun_train(2, "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--set", "kv_heads=3",
                           check=False)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("error: model.q_heads") == 1, proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_failed_rerun_loses_nothing(tmp_path):
    """--overwrite replaces a run only once the new one has started: a rerun stopped by a config
    or data error leaves the old run as it was; the old files wait in .previous/ until the new run
    has written its first step, and the folder never mixes the two runs."""
    run_dir = tmp_path / "r"
    _train_cli("--max-steps", "3", "--run-dir", str(run_dir))
    old = {name: (run_dir / name).read_bytes() for name in ("config.json", "metrics.csv", "log.txt")}
    for bad in (["--set", "max_lr=nan"], ["--data", str(tmp_path / "missing")]):
        proc = _train_cli("--max-steps", "3", "--run-dir", str(run_dir), "--overwrite", *bad, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith("error:")
        assert {name: (run_dir / name).read_bytes() for name in old} == old
    proc = _train_cli("--max-steps", "3", "--run-dir", str(run_dir), "--overwrite", "--set", "max_lr=1e30",
                      "--set", "grad_clip=0", "--set", "max_consecutive_skips=1", check=False)
    assert proc.returncode == 2
    assert json.loads((run_dir / "config.json").read_text())["max_lr"] == 1e30
    assert read_status(run_dir)["state"] == "failed"
    assert "moved to" in (run_dir / "log.txt").read_text() and not (run_dir / ".previous").exists()
    assert pd.read_csv(run_dir / "metrics.csv")["step"].tolist() == [0, 1]   # only the new run's rows


def test_bad_token_ids_stop_before_the_run_starts(tmp_path):
    from blunb.data import write_shard

    data = tmp_path / "data"
    data.mkdir()
    tokens = np.arange(20000) % 256
    tokens[12345] = 50256                     # one GPT-2 id in a byte-level model's data
    write_shard(data / "train_000.bin", tokens)
    write_shard(data / "val_000.bin", np.arange(20000) % 256)
    proc = _train_cli("--max-steps", "3", "--run-dir", str(tmp_path / "r"), "--data", str(data), check=False)
    assert proc.returncode == 2
    assert "train_000.bin: token id 50256 at offset 12345" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_unusable_run_dir_is_a_config_error(tmp_path, kind):
    from blunb.config import ConfigError
    from blunb.train import check_run_dir

    target = tmp_path / "target"
    if kind == "file":
        target.write_text("x")
        run_dir = target
    else:
        target.mkdir()
        target.chmod(0o500)
        run_dir = target / "run"
        if os.access(target, os.W_OK):  # root ignores permissions
            pytest.skip("running as root: a read-only folder is still writable")
    with pytest.raises(ConfigError, match="--run-dir"):
        check_run_dir(run_dir, overwrite=False)


def test_a_stalled_rank_ends_the_job_naming_the_timeout(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at step 2; rank 0's next collective times out after
    collective_timeout_s, the job ends with a message naming it, and the run says failed."""
    from blunb.data import ensure_default_corpus

    ensure_default_corpus(progress=False)  # rank 0 must not spend the timeout preparing it
    run_dir = tmp_path / "r"
    # The timeout also bounds the ranks' start-up skew on a loaded machine: 20 s, not less.
    proc = _torchrun_train(2, "--preset", "tiny", "--max-steps", "6", "--run-dir", str(run_dir),
                           "--set", "fault_stall=2:1", "--set", "collective_timeout_s=20", check=False)
    assert proc.returncode != 0
    assert "collective_timeout_s=20" in proc.stderr
    st = read_status(run_dir)
    assert st["state"] == "failed" and "collective_timeout_s" in st["error"]


def test_an_earlier_run_waits_aside_until_the_new_one_starts(tmp_path):
    from blunb.train import _start_run_dir

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    for name in ("config.json", "metrics.csv", "log.txt", "run.ipynb"):
        (run_dir / name).write_text(name)
    previous = _start_run_dir(run_dir)
    assert sorted(p.name for p in previous.iterdir()) == ["config.json", "log.txt", "metrics.csv"]
    assert sorted(p.name for p in run_dir.iterdir()) == [".previous", "run.ipynb"]  # papermill's output stays
    # A rerun that stopped before its first step left its own files beside .previous/: the next one keeps the
    # run it replaced (in .previous/) and drops the failed attempt's.
    for name in ("config.json", "status.json"):
        (run_dir / name).write_text("failed attempt")
    assert _start_run_dir(run_dir) == previous
    assert (previous / "config.json").read_text() == "config.json"
    assert sorted(p.name for p in run_dir.iterdir()) == [".previous", "run.ipynb"]


def test_a_killed_run_says_so(tmp_path):
    """SIGTERM (torchrun stopping a job, a notebook interrupt) ends the run with status killed."""
    import signal
    import time

    run_dir = tmp_path / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", "100000",
                             "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    deadline = time.monotonic() + 240
    while not ((run_dir / "metrics.csv").is_file() and len((run_dir / "metrics.csv").read_text().splitlines()) > 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    st = read_status(run_dir)
    assert st["state"] == "killed" and "SIGTERM" in st["error"] and 0 < st["steps_done"] < 100000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
@pytest.mark.parametrize("optimizer", ["ddp_adamw", "adamw"])
def test_the_trainer_leaves_no_gloo_thread_behind(tmp_path, optimizer):
    """torch DDP's reducer holds the process group: the trainer must free it before destroying
    the group, or gloo's threads run on into interpreter exit (an abort or a hang there)."""
    from tests.distributed import torchrun

    proc = torchrun(REPO / "tests" / "workers" / "train_exit.py", 2, optimizer, str(tmp_path))
    assert proc.stdout.count("left no gloo thread") == 2, proc.stdout + proc.stderr
