import json
import math
import subprocess

import numpy as np
import pandas as pd
import pytest

from blunb.config import ConfigError, preset
from blunb.data import write_shard
from blunb.runs import (
    GPU_SHARE_ENV,
    MetricsWriter,
    Run,
    environment,
    git_state,
    gpu_shared,
    gpu_sharing,
    load_run,
    load_study,
    machine,
    read_status,
    summarize,
    write_status,
)


def _run_folder(path, steps, max_steps=10, status=None):
    """A run folder as train writes it: config, env, `steps` metric rows, optionally a status."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"preset": "tiny", "optimizer": "adamw", "max_steps": max_steps,
                                                  "mfu_warmup": 2}))
    (path / "env.json").write_text(json.dumps({"world_size": 1, "device": "cpu"}))
    w = MetricsWriter(path / "metrics.csv", [])
    for s in range(steps):
        w.write({"step": s, "train_loss": 5.0 - s / 10, "val_loss": 4.0 if s == steps - 1 else None,
                 "tok_per_sec": 1000.0, "grad_norm": 1.0, "dt_ms": 10.0, "lr": 1e-3, "elapsed_min": s / 60,
                 "mfu": float("nan"), "mfu_palm": float("nan"), "tflops_per_gpu": 0.0})
    w.close()
    if status:
        write_status(path, *status)
    return path


def test_status_round_trip_is_atomic(tmp_path):
    assert read_status(tmp_path) is None
    write_status(tmp_path, "running", 3, 10, world_size=2)
    write_status(tmp_path, "failed", 4, 10, error=RuntimeError("boom"), world_size=2)
    st = read_status(tmp_path)
    assert {k: st[k] for k in ("state", "steps_done", "steps_total", "error", "world_size")} == {
        "state": "failed", "steps_done": 4, "steps_total": 10, "error": "boom", "world_size": 2}
    assert pd.Timestamp(st["updated"]).tzinfo is not None
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left
    with pytest.raises(ValueError, match="run state"):
        write_status(tmp_path, "done", 1, 1)


def test_load_run_attaches_status_and_run_stays_positional(tmp_path):
    run = load_run(_run_folder(tmp_path / "a-s0", 10, status=("completed", 10, 10)))
    assert run.status["state"] == "completed"
    assert load_run(_run_folder(tmp_path / "b-s0", 3)).status is None
    assert Run(tmp_path, {}, {}, pd.DataFrame()).status is None


def test_summarize_flags_unfinished_runs_and_survives_header_only_metrics(tmp_path):
    _run_folder(tmp_path / "done", 10, status=("completed", 10, 10))
    _run_folder(tmp_path / "failed", 4, status=("failed", 4, 10, "non-finite loss"))
    _run_folder(tmp_path / "no-status", 6)
    _run_folder(tmp_path / "died-at-start", 0, max_steps=50)  # header-only metrics.csv
    (tmp_path / "not-a-run").mkdir()
    runs = load_study(tmp_path)
    assert [r.run_id for r in runs] == ["died-at-start", "done", "failed", "no-status"]
    s = summarize(runs).set_index("run")
    assert list(s.columns[:10]) == ["preset", "optimizer", "world_size", "device", "steps", "first_train_loss",
                                    "final_train_loss", "final_val_loss", "steady_tok_per_sec", "steady_mfu"]
    assert s.loc["done", "complete"] and s.loc["done", "status"] == "completed"
    assert s.loc["failed", ["status", "steps_done", "steps_total", "complete"]].tolist() == ["failed", 4, 10, False]
    assert s.loc["no-status", ["status", "steps_done", "steps_total", "complete"]].tolist() == ["unknown", 6, 10,
                                                                                                 False]
    dead = s.loc["died-at-start"]
    assert dead["steps"] == 0 and dead["steps_done"] == 0 and dead["steps_total"] == 50 and not dead["complete"]
    assert all(math.isnan(dead[c]) for c in ("first_train_loss", "final_train_loss", "final_val_loss",
                                             "steady_tok_per_sec", "steady_mfu"))
    assert s.loc["done", "steps"] == 10 and s.loc["done", "final_val_loss"] == 4.0


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_git_state_ignores_changes_under_results(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # tmp_path is no checkout of its own
    assert git_state(tmp_path) == ("unknown", None, [])
    (tmp_path / "results" / "quickstart").mkdir(parents=True)
    nb = tmp_path / "results" / "quickstart" / "run.ipynb"
    nb.write_text("{}")
    (tmp_path / "train.py").write_text("a = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "init")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked.py").write_text("")
    nb.write_text('{"papermill": 1}')
    assert git_state(tmp_path) == (head, False, [])
    # code no commit holds: an untracked module or study notebook (not an untracked file elsewhere)
    for new in ("blunb/new_module.py", "notebooks/14_new_study.ipynb"):
        (tmp_path / new).parent.mkdir(exist_ok=True)
        (tmp_path / new).write_text("{}")
        assert git_state(tmp_path) == (head, True, [new])
        (tmp_path / new).unlink()
    (tmp_path / "train.py").write_text("a = 2\n")
    assert git_state(tmp_path / "results") == (head, True, ["train.py"])  # any folder of the checkout
    _git(tmp_path, "mv", "train.py", "main.py")  # a rename is one entry (two paths under -z)
    assert git_state(tmp_path, max_files=5) == (head, True, ["main.py"])


def test_environment_records_threads_versions_and_shards(tmp_path):
    shard = tmp_path / "train_000000.bin"
    write_shard(shard, np.arange(100))
    env = environment(1, "cpu", shards=[shard])
    for key in ("python", "torch", "triton", "cuda", "device", "world_size", "git_sha", "blunb", "platform", "argv",
                "git_dirty", "git_dirty_files", "cpu", "cpu_count", "torch_threads", "torch_interop_threads",
                "omp_num_threads", "numpy", "pandas", "hostname"):
        assert key in env, key
    assert not env["git_sha"].endswith("-dirty") and len(env["git_dirty_files"]) <= 20
    assert env["torch_threads"] >= 1 and env["numpy"] == np.__version__ and env["pandas"] == pd.__version__
    assert [s["name"] for s in env["shards"]] == ["train_000000.bin"] and len(env["shards"][0]["sha256"]) == 64
    assert "shards" not in environment(1, "cpu")
    assert env["gpu_sharing"] == {"shared": False, "runs_per_gpu": None}  # the CPU shares no GPU
    json.dumps(env)


@pytest.mark.parametrize("device, given, record", [
    ("cuda:0", "1", {"shared": False, "runs_per_gpu": 1}),
    ("cuda:0", "2", {"shared": True, "runs_per_gpu": 2}),
    ("cuda", None, {"shared": None, "runs_per_gpu": None}),     # not launched by blunb.study: unknown
    ("cuda", "", {"shared": None, "runs_per_gpu": None}),
    ("cpu", "2", {"shared": False, "runs_per_gpu": None}),      # a CPU run shares no GPU, whatever it was told
    ("cpu", None, {"shared": False, "runs_per_gpu": None}),
])
def test_gpu_sharing_records_what_the_study_runner_said(device, given, record):
    environ = {} if given is None else {GPU_SHARE_ENV: given}
    assert gpu_sharing(device, environ) == record


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", " 2x"])
def test_a_bad_runs_per_gpu_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match=f"{GPU_SHARE_ENV} must be an integer >= 1"):
        gpu_sharing("cuda:0", {GPU_SHARE_ENV: bad})


def test_the_trainer_refuses_a_bad_runs_per_gpu_before_the_run_folder(tmp_path, monkeypatch):
    from blunb.train import train

    monkeypatch.setenv(GPU_SHARE_ENV, "two")
    with pytest.raises(ConfigError, match=GPU_SHARE_ENV):
        train(preset("tiny"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _env(shared, earlier=None):
    env = {"world_size": 1} if shared == "no record" else {"gpu_sharing": {"shared": shared}}
    if earlier is not None:
        env["resumed"] = {"step": 2, "earlier_env": earlier}
    return env


def test_machine_names_the_card_where_env_json_records_it():
    h100 = "NVIDIA H100 80GB HBM3"
    assert machine({"device": "cpu", "device_uuid": None}) == "cpu"
    assert machine({"device": h100}) == h100   # a run from before device_uuid: the model alone
    first = {"device": h100, "device_uuid": "GPU-aaaa"}
    assert machine(first) == f"{h100} (GPU-aaaa)"
    again = {"device": h100, "device_uuid": "GPU-aaaa", "resumed": {"earlier_env": first}}
    assert machine(again) == f"{h100} (GPU-aaaa)"   # resumed on the same card: one machine
    moved = {"device": h100, "device_uuid": "GPU-bbbb", "resumed": {"earlier_env": first}}
    assert machine(moved) == f"{h100} (GPU-aaaa) + {h100} (GPU-bbbb)"   # launch order
    assert machine(moved) != machine(first)   # never pooled with either card's runs


def test_gpu_shared_reads_the_record_and_an_old_run_as_unknown():
    assert gpu_shared(_env(False)) is False
    assert gpu_shared(_env(True)) is True
    assert gpu_shared(_env(None)) is None
    assert gpu_shared(_env("no record")) is None  # a run made before the record: unknown, never solo
    # a resumed run's steps come from every launch of its chain
    assert gpu_shared(_env(False, _env(False, _env(False)))) is False
    assert gpu_shared(_env(False, _env("no record"))) is None
    assert gpu_shared(_env(False, _env(None, _env(True)))) is True
    for bad in ({"gpu_sharing": "alone"}, {"gpu_sharing": {"shared": "no"}}, {"gpu_sharing": {"shared": 0}}):
        with pytest.raises(ValueError, match="gpu_sharing must be"):
            gpu_shared(bad)


def test_summarize_reports_steady_aggregates_not_medians(tmp_path):
    path = tmp_path / "uneven"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"preset": "tiny", "optimizer": "adamw", "max_steps": 6,
                                                  "mfu_warmup": 2}))
    (path / "env.json").write_text(json.dumps({"world_size": 1, "device": "cpu"}))
    w = MetricsWriter(path / "metrics.csv", [])
    tokens = 1000.0
    dts = [500.0, 400.0, 10.0, 10.0, 10.0, 970.0]   # ms; the first two are warm-up
    mfus = [0.1, 0.1, 0.5, 0.5, 0.5, 0.1]
    for s, (dt, mfu) in enumerate(zip(dts, mfus)):
        w.write({"step": s, "train_loss": 5.0, "val_loss": None, "tok_per_sec": tokens / (dt / 1e3), "grad_norm": 1.0,
                 "dt_ms": dt, "lr": 1e-3, "elapsed_min": 0.0, "mfu": mfu, "mfu_palm": mfu, "tflops_per_gpu": 0.0})
    w.close()
    row = summarize([load_run(path)]).iloc[0]
    # 4 steady steps, 4000 tokens in 1.0 s: the median step (100 k tok/s) would overstate it 25x.
    assert row["steady_tok_per_sec"] == pytest.approx(4000.0)
    assert row["steady_mfu"] == pytest.approx((3 * 0.5 * 10 + 0.1 * 970) / 1000)
