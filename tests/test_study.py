"""blunb.study: grid checks before any launch, parallel runs, caching, failure reports, the CLI
(its statistics moved to blunb.stats: tests/test_stats.py)."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import traceback

import nbformat
import pandas as pd
import pytest

import blunb.runs
import blunb.study
from blunb.config import ConfigError
from blunb.runs import GPU_SHARE_ENV, gpu_shared, write_status
from blunb.study import (
    LONG_COLUMNS,
    SUMMARY_COLUMNS,
    Study,
    StudyError,
    _slots,
    run_study,
)
from tests.distributed import REPO
from tests.run_folders import write_completed

SKIPS = ["max_lr=1e30", "grad_clip=0", "max_consecutive_skips=1"]  # fails at step 1, every time
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def no_launch(monkeypatch):
    """Any attempt to start a process fails the test."""
    def popen(*a, **k):
        raise AssertionError(f"a process was started: {a}")
    monkeypatch.setattr(blunb.study.subprocess, "Popen", popen)


# ---------------------------------------------------------------- the grid, checked first

@pytest.mark.parametrize("kwargs, error, match", [
    ({"arms": {}}, ValueError, "arms must be a non-empty dict"),
    ({"arms": ["a"]}, ValueError, "arms must be a non-empty dict"),
    ({"seeds": []}, ValueError, "seeds must be a non-empty list"),
    ({"seeds": 3}, ValueError, "seeds must be a non-empty list"),
    ({"seeds": [0, 0]}, ValueError, "seeds repeat"),
    ({"seeds": [-1]}, ValueError, r"integer in \[0, 2\*\*32\)"),
    ({"seeds": [True]}, ValueError, "integer in"),
    ({"seeds": ["1"]}, ValueError, "integer in"),
    ({"arms": {"a/b": []}}, ValueError, "arm name must be one folder name"),
    ({"arms": {"": []}}, ValueError, "arm name must be one folder name"),
    ({"name": "../up"}, ValueError, "study name must be one folder name"),
    ({"arms": {"a": "max_lr=1e-3"}}, ValueError, "overrides must be a list"),
    ({"arms": {"a": ["max_lr"]}}, ValueError, "not a 'key=value' string"),
    ({"arms": {"a": ["seed=3"]}}, ValueError, "the seed comes from the study's seeds"),
    ({"common": ["seed=3"]}, ValueError, "common: 'seed=3'"),
    ({"nproc": 0}, ValueError, "nproc must be an integer >= 1"),
    ({"max_parallel": 0}, ValueError, "max_parallel must be"),
    ({"runs_per_gpu": 1.5}, ValueError, "runs_per_gpu must be"),
    ({"arm_seeds": {"b": [1]}}, ValueError, r"arm_seeds names arms that are not in arms: \['b'\]"),
    ({"arm_seeds": {"a": []}}, ValueError, "seeds must be a non-empty list"),
    ({"arm_seeds": [0]}, ValueError, "arm_seeds must be a dict"),
    # blunb.train's own checks, run for every run, named by the run
    ({"arms": {"ok": [], "typo": ["max_lrr=1"]}}, ConfigError, "run typo-s0: unknown setting 'max_lrr'"),
    ({"arms": {"a": ["fault_nan_grad=1:1"]}}, ConfigError, "run a-s0: .*world_size 1"),
    ({"preset": "huge"}, ConfigError, "unknown preset 'huge'"),
    ({"steps": 2}, ConfigError, "--max-steps must be >= 3"),
    ({"arms": {"a": ["kv_heads=3"]}, "nproc": 2}, ConfigError, "divisible by model.kv_heads"),
    # the data folder, as the trainer checks it at its start: the last arm's typo before the first run
    ({"arms": {"ok": [], "typo": ["data=/no/such/corpus"]}}, ConfigError,
     "run typo-s0: data folder not found: /no/such/corpus"),
    ({"env": {"OMP_NUM_THREADS": 1}}, ValueError, "env must be a dict of str -> str"),
])
def test_bad_grids_are_clear_errors_before_anything_launches(tmp_path, no_launch, kwargs, error, match):
    study = {"name": "s", "arms": {"a": []}, "seeds": [0], "steps": 4, "root": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        Study(**study).run()
    assert list(tmp_path.iterdir()) == []  # not even the study folder


def test_cache_actions_follow_the_run_folder(tmp_path):
    study = Study("s", {"a": ["max_lr=1e-3"]}, seeds=[0], steps=4, root=tmp_path)
    (plan,) = study._plan()
    assert plan.action == "new" and plan.run_dir == tmp_path / "s" / "a-s0" and plan.config["seed"] == 0
    assert plan.config["max_lr"] == 1e-3 and plan.config["max_steps"] == 4  # parse_args's config, overrides applied
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    write_completed(plan.run_dir, 4)
    assert study._plan()[0].action == "cached"
    write_status(plan.run_dir, "diverged", 4, 4)  # trained to the end: it would diverge again
    assert study._plan()[0].action == "cached"
    for state in ("running", "failed", "killed"):
        write_status(plan.run_dir, state, 2, 4)
        assert study._plan()[0].action == "resume"
    write_completed(plan.run_dir, 4)
    assert Study("s", {"a": ["max_lr=2e-3"]}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "overwrite"
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 2}))  # same config, another world size
    assert study._plan()[0].action == "overwrite"



def test_a_completed_run_whose_metrics_stop_short_is_refused_not_summarized(tmp_path):
    """status.json says completed over a metrics.csv cut short (a partial copy): the summary would read the rows
    that are left as the run's result. A clear error before any work, naming the run and what its file holds."""
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path)
    (plan,) = study._plan()
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    write_completed(plan.run_dir, 4)
    assert study._plan()[0].action == "cached"
    metrics = plan.run_dir / "metrics.csv"
    whole = metrics.read_text()
    for cut, found in ((whole.rsplit("\n", 2)[0] + "\n", "its last row is step 2"),
                       (whole.rsplit("\n", 2)[0] + "\n3", "no readable last row"),  # the last row cut mid-line
                       (whole.split("\n", 1)[0] + "\n", "no readable last row"), (None, "no readable last row")):
        if cut is None:
            metrics.unlink()
        else:
            metrics.write_text(cut)
        with pytest.raises(StudyError, match=rf"run a-s0: status.json says completed, but .*metrics.csv ends short "
                                             rf"of step 3 \({found}\): the folder is damaged"):
            study._plan()
    write_status(plan.run_dir, "failed", 2, 4)  # an unfinished run is resumed, whatever its metrics hold
    assert study._plan()[0].action == "resume"


def test_a_run_is_cached_only_on_the_data_it_read(tmp_path, monkeypatch, no_launch):
    """The data folder is named by its path in the config; its shards' bytes are what the run read (env.json): a
    shard rewritten in place (same name and size) makes the run stale, refused where completed runs are kept. A
    study rendered where its data folder is not (a GPU study at home) takes its runs as they are."""
    import numpy as np

    from blunb.data import find_shards, shard_manifest, write_shard

    data = tmp_path / "corpus"
    data.mkdir()
    for name in ("train_000000.bin", "train_000001.bin", "val_000000.bin"):
        write_shard(data / name, np.arange(4096) % 250)
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path, common=[f"data={data}"])
    (plan,) = study._plan()
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
    shards = shard_manifest(find_shards(data, "train") + find_shards(data, "val"))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1, "shards": shards}))
    write_completed(plan.run_dir, 4)
    assert study._plan()[0].action == "cached"
    write_shard(data / "train_000001.bin", (np.arange(4096) % 250)[::-1])  # same name and size, other tokens
    assert study._plan()[0].action == "overwrite"
    monkeypatch.setenv("BLUNB_KEEP_COMPLETED", "1")
    with pytest.raises(StudyError, match=r"a-s0 \(data .*corpus: 1 shard\(s\) differ from those the run read "
                                         r"\(train_000001.bin\)\)"):
        study.run()
    shutil.rmtree(data)
    rendered = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path, common=[f"data={data}"], render_only=True)
    assert rendered.run().set_index("run")["status"].to_dict() == {"a-s0": "completed"}


def test_completed_committed_runs_are_not_replaced_by_a_changed_plan(tmp_path, monkeypatch, no_launch, caplog):
    """A changed notebook parameter (here max_lr, and the world size) would retrain a completed run in place:
    in the committed results/ that is refused before any work, naming the run and what changed; elsewhere
    it is retrained with a warning; replace_completed=True allows it."""
    study = Study("s", {"a": ["max_lr=1e-3"], "b": []}, seeds=[0], steps=4, root=tmp_path)
    for plan in study._plan():
        plan.run_dir.mkdir(parents=True)
        (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
        (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
        write_completed(plan.run_dir, 4)
    published = {"published": True}
    monkeypatch.setattr(blunb.study, "check_publish", lambda folder, allow_dirty: dict(published))
    changed = Study("s", {"a": ["max_lr=2e-3"], "b": []}, seeds=[0], steps=4, root=tmp_path)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "s").rglob("*")}
    with pytest.raises(StudyError, match=r"would replace 1 finished run\(s\) of the committed .*: "
                                         r"a-s0 \(max_lr: 0.001 -> 0.002\)\. .*replace_completed=True"):
        changed.run()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "s").rglob("*")} == before  # nothing touched
    (tmp_path / "s" / "b-s0" / "env.json").write_text(json.dumps({"world_size": 2}))
    with pytest.raises(StudyError, match=r"replace 2 .*b-s0 \(world size: 2 -> 1\)"):
        changed.run()
    write_status(tmp_path / "s" / "a-s0", "failed", 2, 4)  # an unfinished run holds no result: retrained
    with pytest.raises(StudyError, match=r"replace 1 finished .*: b-s0 "):
        changed.run()
    # Not committed results: retrained, with a warning saying which and why (no_launch stops the launch).
    published["published"] = False
    monkeypatch.setenv("BLUNB_KEEP_COMPLETED", "1")  # tools/gpu_study.sh: the committed runs copied to a GPU machine
    with pytest.raises(StudyError, match=r"replace 1 finished run\(s\) of BLUNB_KEEP_COMPLETED=1: .*b-s0 "):
        changed.run()
    # A finished run whose config.json or env.json is gone or cut short (a partial copy) is not "new": refused too.
    (tmp_path / "s" / "b-s0" / "env.json").unlink()
    write_status(tmp_path / "s" / "b-s0", "diverged", 4, 4)
    with pytest.raises(StudyError, match=r"replace 1 finished .*b-s0 \(its config cannot be read: .*env.json"):
        changed.run()
    (tmp_path / "s" / "b-s0" / "env.json").write_text(json.dumps({"world_size": 2}))
    write_completed(tmp_path / "s" / "b-s0", 4)
    monkeypatch.delenv("BLUNB_KEEP_COMPLETED")
    with pytest.raises(AssertionError, match="a process was started"):
        changed.run()
    assert any("retraining 1 finished run(s) whose config changed: b-s0 (world size: 2 -> 1)" in r.getMessage()
               for r in caplog.records)
    published["published"] = True
    with pytest.raises(AssertionError, match="a process was started"):
        Study("s", {"a": ["max_lr=2e-3"], "b": []}, seeds=[0], steps=4, root=tmp_path,
              replace_completed=True).run()


def test_a_config_field_added_after_the_run_keeps_it_cached_at_its_default(tmp_path):
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path)
    (plan,) = study._plan()
    older = json.loads(json.dumps(plan.config))
    del older["ckpt_keep"], older["model"]["rope_interleaved"]   # as if both fields came in a later version
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(older))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    write_completed(plan.run_dir, 4)
    assert study._plan()[0].action == "cached"
    # ... but not when the run asks for a non-default value of the field the stored run predates
    assert Study("s", {"a": ["ckpt_keep=5"]}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "overwrite"
    assert Study("s", {"a": ["model.rope_interleaved=true"]}, seeds=[0], steps=4,
                 root=tmp_path)._plan()[0].action == "overwrite"

def test_a_run_whose_device_decided_the_auto_settings_stays_cached_under_auto(tmp_path):
    """config.json records what "auto" became on the run's device (a GPU run: compile and the chunked loss
    on); a plan that leaves them at auto takes it, one that names a value must match it, and a run from
    before the two fields (which ran without them) matches an explicit false."""
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path)
    (plan,) = study._plan()
    assert plan.config["compile"] == "auto" and plan.config["model"]["chunked_ce"] == "auto"
    gpu_run = json.loads(json.dumps(plan.config))
    gpu_run["compile"] = gpu_run["model"]["chunked_ce"] = True
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(gpu_run))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    write_completed(plan.run_dir, 4)
    assert study._plan()[0].action == "cached"
    assert Study("s", {"a": ["compile=true"]}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "cached"
    assert Study("s", {"a": ["compile=false"]}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "overwrite"
    del gpu_run["compile"], gpu_run["model"]["chunked_ce"]
    (plan.run_dir / "config.json").write_text(json.dumps(gpu_run))
    explicit_off = ["compile=false", "model.chunked_ce=false"]
    assert Study("s", {"a": explicit_off}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "cached"
    assert Study("s", {"a": ["compile=true"]}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "overwrite"


def test_arm_seeds_replace_the_study_seeds_for_their_arms(tmp_path):
    study = Study("s", {"ab": [], "side": ["max_lr=1e-3"]}, seeds=[0], arm_seeds={"ab": [3, 4, 5]}, steps=4,
                  root=tmp_path)
    assert [p.name for p in study._plan()] == ["ab-s3", "ab-s4", "ab-s5", "side-s0"]


def test_runs_launch_seed_by_seed_so_a_cut_off_study_leaves_whole_pairs(tmp_path, monkeypatch):
    """One run at a time: the A/B arms' seeds alternate (a-s0, b-s0, side-s0, a-s1, b-s1, ...)."""
    started = []

    class Ended:
        def poll(self):
            return 0, None

    def start(self, plan, command, slot):
        started.append(plan.name)
        return blunb.study._Active(plan, slot, 0.0, Ended())

    monkeypatch.setattr(blunb.study._LocalLauncher, "start", start)
    monkeypatch.setattr(blunb.study, "_outcome", lambda plan, *ended: blunb.study._Outcome("failed", "not run"))
    study = Study("s", {"a": [], "b": ["max_lr=1e-3"], "side": ["max_lr=2e-3"]}, seeds=[0],
                  arm_seeds={"a": [0, 1, 2], "b": [0, 1, 2]}, steps=4, root=tmp_path, max_parallel=1,
                  allow_failures=True, progress=False)
    with pytest.warns(UserWarning, match="7 of 7 run"):
        study.run()
    assert started == ["a-s0", "b-s0", "side-s0", "a-s1", "b-s1", "a-s2", "b-s2"]


def test_a_drained_study_starts_no_more_runs_and_lets_those_running_finish(tmp_path, monkeypatch):
    """The drain file (in the study's folder or above it) appears while the first run trains: it finishes, the
    others are reported as not started, and a study started while the file is there launches nothing."""
    started, polls = [], []

    class EndsOnSecondPoll:
        def poll(self):
            polls.append(1)
            return (0, None) if len(polls) >= 2 else None

    def start(self, plan, command, slot):
        started.append(plan.name)
        (tmp_path / blunb.study.DRAIN_FILE).touch()   # above the study's folder, as tools/gpu_study.sh drain puts it
        return blunb.study._Active(plan, slot, 0.0, EndsOnSecondPoll())

    monkeypatch.setattr(blunb.study._LocalLauncher, "start", start)
    monkeypatch.setattr(blunb.study, "_outcome", lambda plan, *ended: blunb.study._Outcome("completed"))
    study = Study("s", {"a": [], "b": ["max_lr=1e-3"]}, seeds=[0, 1], steps=4, root=tmp_path, max_parallel=1,
                  progress=False)
    with pytest.raises(StudyError, match=r"(?s)3 of 4 run\(s\).*a-s1: the study was drained") as err:
        study.run()
    assert started == ["a-s0"] and len(polls) == 2   # the run in flight was waited for, not abandoned
    summary = err.value.summary
    assert summary.set_index("run")["status"].to_dict() == {"a-s0": "completed", "b-s0": "not started",
                                                             "a-s1": "not started", "b-s1": "not started"}
    with pytest.raises(StudyError, match="4 of 4"):
        study.run()
    assert started == ["a-s0"]
    (tmp_path / blunb.study.DRAIN_FILE).unlink()
    monkeypatch.setattr(blunb.study._LocalLauncher, "start",
                        lambda self, plan, command, slot: started.append(plan.name) or
                        blunb.study._Active(plan, slot, 0.0, EndsOnSecondPoll()))
    study.run()
    assert started == ["a-s0", "a-s0", "b-s0", "a-s1", "b-s1"]


def test_render_only_refuses_to_train_and_names_the_missing_runs(tmp_path, no_launch):
    study = Study("s", {"a": [], "b": ["max_lr=1e-3"]}, seeds=[0], steps=4, root=tmp_path, render_only=True)
    with pytest.raises(StudyError, match=r"render_only, but 2 of 2 run\(s\).*a-s0 \(new\), b-s0 \(new\)"):
        study.run()


@pytest.fixture
def live_process():
    """A process that runs until the test ends (started before no_launch stops any more)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield live
    live.kill()
    live.wait()


def test_a_run_still_going_from_an_earlier_launch_is_not_launched_again(tmp_path, live_process, no_launch):
    """A study killed without its runs (each in a session of its own) leaves them going: the next launch stops,
    naming them, before it touches their folders (a second trainer would fail on the lock, after its launcher
    emptied the live run's console.txt)."""
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path)
    (plan,) = study._plan()
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    (plan.run_dir / "console.txt").write_text("step 1 of the live run\n")
    pid = live_process.pid
    write_status(plan.run_dir, "running", 2, 4,
                 processes=[{"pid": pid, "host": socket.gethostname(), "start": blunb.runs._process_start(pid)}])
    with pytest.raises(StudyError, match=rf"1 run\(s\) are still running from an earlier launch: a-s0 \(pids {pid}\)"):
        study.run()
    assert (plan.run_dir / "console.txt").read_text() == "step 1 of the live run\n"
    live_process.kill()
    live_process.wait()
    with pytest.raises(AssertionError, match="a process was started"):  # its process gone: resumed
        study.run()


def test_a_diverged_run_is_rendered_as_it_ended_and_not_retrained(tmp_path, no_launch):
    """A diverged run trained to the end: a rerun (or render_only) takes it as it is and reports it diverged."""
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path, render_only=True, allow_failures=True)
    (plan,) = study._plan()
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    write_status(plan.run_dir, "diverged", 4, 4, error="3 of 4 steps skipped")
    with pytest.warns(UserWarning, match="a-s0: 3 of 4 steps skipped"):
        summary = study.run()
    assert summary.set_index("run")["status"].to_dict() == {"a-s0": "diverged"}


def test_slots_cut_gpus_into_groups_of_nproc():
    assert _slots([], nproc=1, runs_per_gpu=4, max_parallel=None, cores=2) == [None, None]  # CPU: runs_per_gpu ignored
    assert _slots([], nproc=2, runs_per_gpu=1, max_parallel=None, cores=2) == [None]
    assert _slots([], nproc=4, runs_per_gpu=1, max_parallel=None, cores=2) == [None]
    assert _slots([], nproc=1, runs_per_gpu=1, max_parallel=3, cores=2) == [None] * 3
    gpus = ["0", "1", "2", "3"]
    assert _slots(gpus, 1, 1, None, 64) == gpus
    assert _slots(gpus, 2, 1, None, 64) == ["0,1", "2,3"]
    assert _slots(gpus, 2, 2, None, 64) == ["0,1", "2,3", "0,1", "2,3"]  # spread first, then share
    assert _slots(gpus[:3], 2, 1, None, 64) == ["0,1"]
    assert _slots(gpus, 1, 2, 3, 64) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="nproc=2 needs 2 GPUs per run, but 1 are visible"):
        _slots(["7"], 2, 1, None, 64)


def test_each_gpu_launch_says_how_many_runs_share_its_gpu(tmp_path, fake_gpu_runs, monkeypatch):
    monkeypatch.setenv(GPU_SHARE_ENV, "1")  # inherited: never passed on as this study's count
    three = {"a": [], "b": ["max_lr=1e-3"], "c": ["max_lr=2e-3"]}
    Study("shared", three, seeds=[0], steps=4, root=tmp_path, runs_per_gpu=2, progress=False).run()
    assert fake_gpu_runs == [("a-s0", "2", "0"), ("b-s0", "2", "0"), ("c-s0", "2", "0")]
    assert gpu_shared(json.loads((tmp_path / "shared" / "c-s0" / "env.json").read_text())) is True
    fake_gpu_runs.clear()
    # Fewer runs to train than runs_per_gpu allows, or max_parallel 1: each run has the GPU to itself.
    Study("one", {"a": []}, seeds=[0], steps=4, root=tmp_path, runs_per_gpu=2, progress=False).run()
    Study("capped", three, seeds=[0], steps=4, root=tmp_path, runs_per_gpu=2, max_parallel=1, progress=False).run()
    assert fake_gpu_runs == [("a-s0", "1", "0"), ("a-s0", "1", "0"), ("b-s0", "1", "0"), ("c-s0", "1", "0")]
    assert gpu_shared(json.loads((tmp_path / "capped" / "c-s0" / "env.json").read_text())) is False
    fake_gpu_runs.clear()
    monkeypatch.setattr(blunb.study, "_visible_gpus", lambda env: [])  # the CPU: no GPU slots, no count
    Study("cpu", {"a": []}, seeds=[0], steps=4, root=tmp_path, runs_per_gpu=2, progress=False).run()
    assert fake_gpu_runs == [("a-s0", None, None)]


# ---------------------------------------------------------------- real runs

def _metrics(run_dir):
    return pd.read_csv(run_dir / "metrics.csv")


@pytest.mark.slow
def test_parallel_runs_then_cache_resume_and_overwrite(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="blunb.study")
    arms = {"base": [], "lowlr": ["max_lr=1e-3"]}
    study = Study("grid", arms, seeds=[0], steps=4, root=tmp_path, max_parallel=2, env=ENV)
    summary = study.run()
    folder = tmp_path / "grid"

    # Both were started before either finished: they ran side by side.
    events = [r.getMessage() for r in caplog.records if "started" in r.getMessage() or "completed" in r.getMessage()]
    assert [e.split(": ", 1)[1].split()[0] for e in events[:2]] == ["started", "started"], events

    assert list(summary.columns) == SUMMARY_COLUMNS
    assert summary[["arm", "seed", "run", "status", "action"]].values.tolist() == [
        ["base", 0, "base-s0", "completed", "new"], ["lowlr", 0, "lowlr-s0", "completed", "new"]]
    assert (summary["steps_done"] == 4).all() and (summary["steps_total"] == 4).all()
    assert (summary["device"] == "cpu").all() and (summary["world_size"] == 1).all()
    assert summary["error"].isna().all() and summary["peak_mem_gib"].isna().all()  # CPU: no peak memory
    assert (summary["steady_tok_per_sec"] > 0).all()
    on_disk = pd.read_csv(folder / "summary.csv")
    pd.testing.assert_frame_equal(on_disk[["arm", "seed", "status", "final_val_loss", "best_val_loss"]],
                                  summary[["arm", "seed", "status", "final_val_loss", "best_val_loss"]])
    for arm in arms:  # a CPU run records that it shared no GPU: its timings are its own as far as GPUs go
        env = json.loads((folder / f"{arm}-s0" / "env.json").read_text())
        assert env["gpu_sharing"] == {"shared": False, "runs_per_gpu": None} and gpu_shared(env) is False
    configs = {a: json.loads((folder / f"{a}-s0" / "config.json").read_text()) for a in arms}
    assert configs["base"]["seed"] == 0 and configs["lowlr"]["max_lr"] == 1e-3 and configs["base"]["max_lr"] == 3e-3

    long = study.metrics_long()
    assert list(long.columns) == LONG_COLUMNS
    for arm in arms:
        m = _metrics(folder / f"{arm}-s0")
        mine = long[long["arm"] == arm]
        train = mine[mine["metric"] == "train_loss"]
        assert train["step"].tolist() == [0, 1, 2, 3]
        assert train["value"].tolist() == pytest.approx(m["train_loss"].tolist())
        val = mine[mine["metric"] == "val_loss"]
        assert val["step"].tolist() == m.dropna(subset=["val_loss"])["step"].tolist() == [0, 3]
        row = summary.set_index("arm").loc[arm]
        assert row["final_val_loss"] == pytest.approx(val["value"].iloc[-1])
        assert row["best_val_loss"] == pytest.approx(val["value"].min())
    assert not long["value"].isna().any()

    # Re-running the same study launches nothing.
    mtimes = {a: (folder / f"{a}-s0" / "metrics.csv").stat().st_mtime_ns for a in arms}
    caplog.clear()
    with monkeypatch.context() as m:
        m.setattr(blunb.study.subprocess, "Popen", lambda *a, **k: pytest.fail("a cached run was launched"))
        again = study.run()
    assert (again["action"] == "cached").all() and (again["status"] == "completed").all()
    assert {a: (folder / f"{a}-s0" / "metrics.csv").stat().st_mtime_ns for a in arms} == mtimes
    assert any("skipped: base-s0, lowlr-s0" in r.getMessage() for r in caplog.records)
    assert again["final_val_loss"].tolist() == summary["final_val_loss"].tolist()

    # An unfinished run resumes; a changed config overwrites; both complete.
    write_status(folder / "base-s0", "killed", 2, 4, error="RunKilled: stopped by signal SIGTERM")
    changed = run_study("grid", {**arms, "lowlr": ["max_lr=2e-3"]}, seeds=[0], steps=4, root=tmp_path,
                        max_parallel=2, env=ENV, progress=False)
    assert changed[["run", "action", "status"]].values.tolist() == [["base-s0", "resume", "completed"],
                                                                   ["lowlr-s0", "overwrite", "completed"]]
    assert json.loads((folder / "lowlr-s0" / "config.json").read_text())["max_lr"] == 2e-3
    assert "--resume auto" in " ".join(json.loads((folder / "base-s0" / "env.json").read_text())["argv"])
    assert "--overwrite" in json.loads((folder / "lowlr-s0" / "env.json").read_text())["argv"]
    for arm in arms:
        assert _metrics(folder / f"{arm}-s0")["step"].tolist() == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_failing_arm_is_reported_with_its_root_cause_and_the_other_completes(tmp_path):
    study = Study("fail", {"ok": [], "bad": SKIPS}, seeds=[0], steps=4, nproc=2, root=tmp_path, max_parallel=2,
                  env=ENV)
    with pytest.raises(StudyError) as info:
        study.run()
    cause = "the gradient norm was non-finite for 1 steps in a row (through step 1)"
    msg = str(info.value)
    assert msg.startswith("1 of 2 run(s) of study 'fail' did not complete") and f"bad-s0: error: {cause}" in msg
    assert info.value.failures[0][0] == "bad-s0"
    s = info.value.summary.set_index("run")
    assert s.loc["ok-s0", "status"] == "completed" and s.loc["ok-s0", "world_size"] == 2
    assert s.loc["bad-s0", "status"] == "failed" and cause in s.loc["bad-s0", "error"]
    assert "rank " in s.loc["bad-s0", "error"] and "exit code" in s.loc["bad-s0", "error"]  # torchrun's root cause
    assert s.loc["bad-s0", "steps_done"] == 1
    on_disk = pd.read_csv(tmp_path / "fail" / "summary.csv").set_index("run")
    assert on_disk.loc["bad-s0", "status"] == "failed" and cause in on_disk.loc["bad-s0", "error"]
    assert (tmp_path / "fail" / "bad-s0" / "console.txt").read_text().count(cause) >= 1

    # allow_failures: the completed run is skipped, the failed one re-run (and failing again), a warning.
    study.allow_failures = True
    with pytest.warns(UserWarning, match="bad-s0: error: the gradient norm"):
        again = study.run()
    assert again.set_index("run")["action"].to_dict() == {"ok-s0": "cached", "bad-s0": "resume"}
    assert again.set_index("run")["status"].to_dict() == {"ok-s0": "completed", "bad-s0": "failed"}


@pytest.mark.slow
def test_cli_runs_a_notebook_with_parameters(tmp_path):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('study = "default"\nsteps = 3\nextra = []')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        'import json\nopen("seen.json", "w").write(json.dumps({"study": study, "steps": steps, "extra": extra}))')]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "s.ipynb")
    env = {**os.environ, "BLUNB_RESULTS": str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, "-m", "blunb.study", str(tmp_path / "s.ipynb"), "-p", "study", "lr",
                           "-p", "steps", "7", "-p", "extra", "['max_lr=1e-3']"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "seen.json").read_text()) == {"study": "lr", "steps": 7, "extra": ["max_lr=1e-3"]}
    assert (tmp_path / "results" / "scratch" / "s.ipynb").is_file()  # the executed notebook
    bad = subprocess.run([sys.executable, "-m", "blunb.study", str(tmp_path / "nope.ipynb")], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "no notebook at" in bad.stderr


def _script_notebook(path, *cells):
    params = nbformat.v4.new_code_cell('n = 1\nword = "a"')
    params.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [params, *(nbformat.v4.new_code_cell(c) for c in cells)]
    nbformat.write(nb, path)
    return path


def test_script_runs_the_cells_in_process_with_the_parameters_injected(tmp_path, monkeypatch):
    (tmp_path / "nb").mkdir()
    nb = _script_notebook(tmp_path / "nb" / "s.ipynb", 'display(n * 2)\nopen("seen.txt", "w").write(f"{n} {word}")')
    monkeypatch.chdir(tmp_path)
    blunb.study.main([str(nb), "--script", "-p", "n", "3", "-p", "word", "b"])
    assert (tmp_path / "nb" / "seen.txt").read_text() == "3 b"  # the notebook's folder as cwd, as in Jupyter
    assert os.getcwd() == str(tmp_path)
    assert not (tmp_path / "results").exists()  # no executed notebook


@pytest.mark.parametrize("argv, match", [
    (["-p", "nope", "1"], "nope"),
    (["-o", "out.ipynb"], "--script writes no notebook"),
    (["-p", "n", "'x'"], "n"),
])
def test_script_refuses_bad_input_before_any_cell_runs(tmp_path, capsys, argv, match):
    nb = _script_notebook(tmp_path / "s.ipynb", 'open("ran.txt", "w").write("x")')
    with pytest.raises(SystemExit) as exit_info:
        blunb.study.main([str(nb), "--script", *argv])
    assert exit_info.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "ran.txt").exists()


def test_script_refuses_ipython_syntax_before_any_cell_runs(tmp_path, capsys):
    nb = _script_notebook(tmp_path / "s.ipynb", 'open("ran.txt", "w").write("x")', "%matplotlib inline")
    with pytest.raises(SystemExit):
        blunb.study.main([str(nb), "--script"])
    assert "code cell 2 uses IPython syntax" in capsys.readouterr().err
    assert not (tmp_path / "ran.txt").exists()


def test_script_a_failing_cell_raises_naming_it(tmp_path):
    nb = _script_notebook(tmp_path / "s.ipynb", "x = 1", "raise RuntimeError('boom')")
    with pytest.raises(RuntimeError, match="boom") as err:
        blunb.study.run_as_script(nb, {})
    frames = traceback.extract_tb(err.value.__traceback__)
    assert any(frame.filename == "s.ipynb, code cell 2" for frame in frames)


def test_script_renders_a_committed_study_to_the_same_claims(tmp_path):
    """The clipping study's committed 124m runs, rendered render_only by --script (no Jupyter): the
    claims table is the committed one, byte for byte (the parameters: results/clipping/README.md)."""
    shutil.copytree(REPO / "results" / "clipping", tmp_path / "clipping",
                    ignore=shutil.ignore_patterns("*.png", "*.svg", "run.ipynb", "claims.csv"))
    common = '["global_batch=32768","val_freq=20","val_tokens=163840","data_order=shards"]'
    proc = subprocess.run([sys.executable, "-m", "blunb.study", "notebooks/10_clipping.ipynb", "--script",
                           "-p", "preset", "124m", "-p", "steps", "240", "-p", "runs_per_gpu", "3",
                           "-p", "publish", "True", "-p", "render_only", "True", "-p", "common", common],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "BLUNB_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "clipping" / "claims.csv").read_text() == (REPO / "results/clipping/claims.csv").read_text()
    assert (tmp_path / "clipping" / "loss_curves.png").is_file()


def test_script_renders_the_committed_overlap_study_to_the_same_claims(tmp_path):
    """The overlap study's committed equivalence runs (GPU_SCALE's seeds) and timelines, rendered render_only:
    claims.csv and equivalence.csv are the committed ones, byte for byte (the command: results/overlap/README.md)."""
    shutil.copytree(REPO / "results" / "overlap", tmp_path / "overlap",
                    ignore=shutil.ignore_patterns("*.png", "run.ipynb", "claims.csv", "equivalence*.csv"))
    proc = subprocess.run([sys.executable, "-m", "blunb.study", "notebooks/12_overlap.ipynb", "--script",
                           "-p", "noise_seeds", "[1, 2, 3, 4, 5]", "-p", "dtype_seeds", "[0, 1, 2, 3, 4, 5]",
                           "-p", "timeline_dir", str(tmp_path / "overlap"),
                           "-p", "publish", "True", "-p", "render_only", "True"],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "BLUNB_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("claims.csv", "equivalence.csv"):
        assert (tmp_path / "overlap" / name).read_text() == (REPO / "results" / "overlap" / name).read_text(), name
