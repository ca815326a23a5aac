"""Studies: a grid of real training runs (arms x seeds), run in parallel, cached, summarized.

A study notebook describes its grid and runs it; every run is a `blunb.train` launch of its own
(torchrun when nproc > 1) into `<root>/<study>/<arm>-s<seed>/`, so a study's runs are complete run
folders, the same a user would launch by hand. Every run's arguments are checked before anything starts
(a typo in the last arm costs nothing); runs are cached by their resolved config, so a study resumes and
re-runs at no cost; a failed run is reported with its root cause while the others go on.

    study = Study("warmup", arms={"base": [], "long": ["warmup_steps=20"]}, seeds=[0, 1, 2], preset="tiny")
    summary = study.run()        # pandas, one row per run; also <study>/summary.csv

CLI: `python -m blunb.study NOTEBOOK [-p KEY VALUE ...] [-o OUTPUT | --script]` runs a study notebook
headless (papermill), or with --script its code cells in-process (no Jupyter: a GPU machine).

Details (parallel runs, clusters, caching, publishing, failures, the CLI): docs/architecture.md, "blunb/study.py".
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import logging
import numbers
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from blunb.cli import prog_name
from blunb.config import AUTO_VALUED, ConfigError, predated_defaults
from blunb.launch import check_train_args, parse_failure, torchrun_command
from blunb.runs import (
    GPU_SHARE_ENV,
    FolderLock,
    git_state,
    load_run,
    process_alive,
    read_status,
    repo_root,
    results_root,
    settle_status,
    source_digest,
    summarize,
)
from blunb.study_job import command_env, run_command, terminate
from blunb.study_job import start as start_process

log = logging.getLogger("blunb.study")  # not __name__: it is "__main__" under python -m

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")  # one folder name, no path tricks
_POLL_S = 0.5
# A file of this name in a study's folder or any folder above it drains the study: it starts no more runs, lets
# those running finish, and reports the rest as not started (a rerun trains them). Why: on a machine lent for a
# known time, a run started too late to finish is GPU time lost (tools/gpu_study.sh collect's DRAIN_AFTER_S).
DRAIN_FILE = ".drain"
_LOG_EVERY_S = 30.0
_RECANCEL_S = 5.0     # the cancel is sent again this often while a cancelled job is still going
_JOB_GRACE_S = 60.0  # a cancelled job's run gets this long to stop (a queue's cancel takes a while to land)
SUMMARY_COLUMNS = ["arm", "seed", "run", "status", "action", "error", "steps_done", "steps_total",
                   "final_val_loss", "best_val_loss", "final_train_loss", "steady_tok_per_sec", "steady_mfu",
                   "peak_mem_gib", "device", "world_size", "run_dir"]
LONG_COLUMNS = ["arm", "seed", "step", "metric", "value"]


class StudyError(RuntimeError):
    """Some runs of a study failed (or, with render_only, were not there to render; or it may not
    publish from a dirty tree). `summary`:
    the study's table (the failed runs included); `failures`: (run name, root cause) pairs."""

    def __init__(self, message: str, summary: pd.DataFrame | None = None,
                 failures: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.summary, self.failures = summary, failures or []


@dataclass
class _Planned:
    """One run of the grid: where it goes, its arguments, and what this call does with it."""

    arm: str
    seed: int
    name: str
    run_dir: Path
    args: list[str]       # blunb.train's arguments, without --resume / --overwrite
    config: dict          # the config.json this run gets
    action: str = "new"   # cached | new | resume | overwrite
    seed_index: int = 0   # the seed's place in its arm's list: launches go by it (see _launch_all)


@dataclass
class _Active:
    plan: _Planned
    slot: str | None      # CUDA_VISIBLE_DEVICES of this run (None on the CPU and for jobs)
    started: float        # time.time() at launch (a job's submission): newer files in the folder are this launch's
    handle: _LocalRun | _JobRun  # the launcher's own: poll() -> (exit code, why none) once ended, else None


@dataclass
class _Outcome:
    status: str                 # completed | failed | killed | diverged | not started (drained: DRAIN_FILE)
    error: str | None = None
    current: bool = True        # the folder holds this run (False: it failed before touching it)


@dataclass
class Study:
    """A grid of `arms` (name -> list of "key=value" overrides) x `seeds` on one preset.

    arm_seeds: per-arm seed lists that replace `seeds` for those arms (e.g. three seeds for an A/B's
    two arms, one for side arms). steps: --max-steps (None: the preset's schedule). nproc: ranks per
    run. common: overrides every arm gets before its own. root: the folder studies go in (default
    results_root()); the study's own folder is root/name. max_parallel: runs at a time (default: see
    the module docstring).
    runs_per_gpu: runs sharing one group of nproc GPUs (ignored on the CPU; each run's env.json records
    how many shared its group: gpu_sharing, blunb.runs.gpu_shared). env: extra environment
    for every run. allow_failures: warn instead of raising StudyError. progress: the tqdm bar / log lines.
    render_only: train nothing; raise StudyError naming every run that is not cached (e.g. to render
    GPU results on a laptop without ever starting a 124m run there by accident).
    allow_dirty: publish into the committed results/ even from a git tree with uncommitted changes
    (recorded in study.json); without it run() refuses before any work.
    replace_completed: retrain a completed run of the committed results/ whose config differs from the
    plan's; without it run() refuses before any work, naming each run and what differs (elsewhere such a
    run is retrained with a warning, unless $BLUNB_KEEP_COMPLETED is 1: tools/gpu_study.sh sets it, since
    there the folder holds the committed runs copied over).
    executor: None or "local" (this machine's processes), or a submitit executor (AutoExecutor for SLURM,
    LocalExecutor): one job per run, GPUs / partition / time limit from its parameters (see the module
    docstring); runs_per_gpu and the GPU slots do not apply there, max_parallel caps the jobs in flight.
    """

    name: str
    arms: dict[str, Sequence[str]]
    seeds: Sequence[int]
    preset: str = "tiny"
    arm_seeds: dict[str, Sequence[int]] = field(default_factory=dict)
    steps: int | None = None
    nproc: int = 1
    common: Sequence[str] = ()
    root: str | Path | None = None
    max_parallel: int | None = None
    runs_per_gpu: int = 1
    env: dict[str, str] = field(default_factory=dict)
    allow_failures: bool = False
    progress: bool = True
    render_only: bool = False
    allow_dirty: bool = False
    replace_completed: bool = False
    executor: Any = None

    @property
    def folder(self) -> Path:
        return (Path(self.root) if self.root is not None else results_root()).absolute() / self.name

    def metrics_long(self) -> pd.DataFrame:
        """The study's metrics_long.csv (written by run())."""
        path = self.folder / "metrics_long.csv"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist yet: run the study first (Study.run())")
        return pd.read_csv(path)

    def check(self) -> None:
        """The checks run() makes before it launches anything (every run's settings and data, publishing from a
        clean tree), launching nothing: a study that runs after another one (a timing pass after a grid) fails
        now on a bad setting, not after the other's hours."""
        self._plan()
        check_publish(self.folder, self.allow_dirty)

    def run(self) -> pd.DataFrame:
        """Check every run, launch the ones not cached, write summary.csv and metrics_long.csv and
        return the summary table; raise StudyError for failed runs unless allow_failures."""
        plans = self._plan()
        provenance = check_publish(self.folder, self.allow_dirty)
        lock = FolderLock(self.folder, "study", hint="wait for it to end, or give this study another name or root")
        with lock:
            if lock.stale_note():
                log.warning(f"{self.name}: {lock.stale_note()}")
            for p in plans:  # again, now that no one else writes here: another study may have finished runs
                p.action = _cache_action(p, self.nproc)
            self._check_replacements(plans, provenance["published"])
            self._check_none_running(plans)
            return self._run_planned(plans, provenance)

    def _check_none_running(self, plans: list[_Planned]) -> None:
        """A run whose processes still go (a study killed without its runs, which live in sessions of their own)
        is not launched again: the second launch would fail on the run's lock, after emptying its console.txt."""
        running = {}
        for p in plans:
            status = (read_status(p.run_dir) or {}) if p.action != "cached" else {}
            if status.get("state") != "running":
                continue
            alive = [q for q in status.get("processes") or []
                     if q.get("host") == socket.gethostname() and process_alive(q)]
            if alive:
                running[p.name] = ", ".join(str(q["pid"]) for q in alive)
        if running and not self.render_only:
            listing = "; ".join(f"{name} (pids {pids})" for name, pids in running.items())
            raise StudyError(f"study {self.name!r}: {len(running)} run(s) are still running from an earlier launch: "
                             f"{listing}. Wait for them to end, or stop them, then run the study again")

    def _check_replacements(self, plans: list[_Planned], published: bool) -> None:
        """Finished runs this study would retrain because their config differs, or cannot be read (a config.json
        or env.json missing or cut short): refused in the committed results/ (a changed notebook parameter would
        silently replace the committed evidence), a warning elsewhere."""
        replaced = [(p.name, _config_change(p, self.nproc)) for p in plans
                    if p.action in ("overwrite", "new") and (read_status(p.run_dir) or {}).get("state") in FINISHED]
        if not replaced or self.render_only:
            return
        listing = "; ".join(f"{name} ({change})" for name, change in replaced)
        keep = published or os.environ.get(KEEP_COMPLETED_ENV) == "1"
        if keep and not self.replace_completed:
            where = "the committed" if published else f"{KEEP_COMPLETED_ENV}=1:"
            raise StudyError(f"study {self.name!r} would replace {len(replaced)} finished run(s) of {where} "
                             f"{self.folder} whose config differs from this plan's: {listing}. Give the study "
                             "another name, delete those run folders (git keeps them), or pass replace_completed=True")
        log.warning(f"{self.name}: retraining {len(replaced)} finished run(s) whose config changed: {listing}")

    def _run_planned(self, plans: list[_Planned], provenance: dict) -> pd.DataFrame:
        cached = [p.name for p in plans if p.action == "cached"]
        if cached:
            log.info(f"{self.name}: {len(cached)} run(s) already finished with this config, skipped: "
                     f"{', '.join(cached)}")
        todo = [p for p in plans if p.action != "cached"]
        if todo and self.render_only:
            raise StudyError(f"study {self.name!r} is render_only, but {len(todo)} of {len(plans)} run(s) are not "
                             f"finished with this config in {self.folder}: "
                             + ", ".join(f"{p.name} ({p.action})" for p in todo))
        outcomes = {p.name: _cached_outcome(p) for p in plans if p.action == "cached"}
        if any(p.config["data"] == "default" for p in todo):
            from blunb.data import ensure_default_corpus

            ensure_default_corpus(progress=False)  # once, here: parallel first uses would race to create it
        outcomes.update(self._launch_all(todo, len(plans)))

        summary = pd.DataFrame([_summary_row(p, outcomes[p.name]) for p in plans], columns=SUMMARY_COLUMNS)
        parts = [t for t in (_long_rows(p) for p in plans if outcomes[p.name].current) if len(t)]
        long = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=LONG_COLUMNS)
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_csv(summary, self.folder / "summary.csv")
        _write_csv(long, self.folder / "metrics_long.csv")
        _write_json({"study": self.name, **provenance, "runs": len(plans),
                     "states": summary["status"].value_counts().to_dict()}, self.folder / "study.json")

        failures = [(p.name, outcomes[p.name].error or outcomes[p.name].status) for p in plans
                    if outcomes[p.name].status != "completed"]
        if failures:
            msg = (f"{len(failures)} of {len(plans)} run(s) of study {self.name!r} did not complete:\n"
                   + "\n".join(f"  {name}: {why}" for name, why in failures)
                   + f"\n(each run's output: {self.folder}/<run>/console.txt)")
            if not self.allow_failures:
                raise StudyError(msg, summary, failures)
            warnings.warn(msg, stacklevel=2)
        return summary

    # ------------------------------------------------------------ planning

    def _plan(self) -> list[_Planned]:
        """Every run of the grid, checked, with what to do with it; raises before anything runs."""
        from blunb.data import checked_shards  # lazy, as parse_args: pulls in torch
        from blunb.train import parse_args  # lazy: pulls in torch

        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"study name must be one folder name (letters, digits, . _ + = -), got {self.name!r}")
        if not isinstance(self.arms, dict) or not self.arms:
            raise ValueError(f"study {self.name!r}: arms must be a non-empty dict of name -> list of "
                             f"'key=value' overrides, got {self.arms!r}")
        seeds = self._checked_seeds(self.seeds)
        if not isinstance(self.arm_seeds, dict):
            raise ValueError(f"study {self.name!r}: arm_seeds must be a dict of arm name -> seeds, "
                             f"got {self.arm_seeds!r}")
        if unknown := sorted(set(self.arm_seeds) - set(self.arms)):
            raise ValueError(f"study {self.name!r}: arm_seeds names arms that are not in arms: {unknown}")
        seeds_of = {arm: self._checked_seeds(s) for arm, s in self.arm_seeds.items()}
        for what, value, optional in (("nproc", self.nproc, False), ("runs_per_gpu", self.runs_per_gpu, False),
                                      ("max_parallel", self.max_parallel, True)):
            if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, int)
                                                        or value < 1):
                raise ValueError(f"{what} must be an integer >= 1" + (" or None" if optional else "") +
                                 f", got {value!r}")
        common = _checked_overrides("common", self.common)
        self._executor = _checked_executor(self.executor)
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in self.env.items()):
            raise ValueError(f"study {self.name!r}: env must be a dict of str -> str, got {self.env!r}")
        env = {**os.environ, **self.env}
        plans, data_checked = [], set()
        for arm, overrides in self.arms.items():
            if not isinstance(arm, str) or not _NAME.match(arm):
                raise ValueError(f"arm name must be one folder name (letters, digits, . _ + = -), got {arm!r}")
            overrides = common + _checked_overrides(f"arm {arm!r}", overrides)
            for seed_index, seed in enumerate(seeds_of.get(arm, seeds)):
                name = f"{arm}-s{seed}"
                run_dir = self.folder / name
                args = ["--preset", self.preset, "--run-dir", str(run_dir)]
                if self.steps is not None:
                    args += ["--max-steps", str(self.steps)]
                for item in [*overrides, f"seed={seed}"]:
                    args += ["--set", item]
                try:
                    check_train_args(args, self.nproc, env)
                except ConfigError as err:
                    raise ConfigError(f"study {self.name!r}, run {name}: {err}") from None
                cfg, _ = parse_args(args)
                # The data folder as the trainer checks it at its start: a typo in the last arm's data stops the
                # study before its first run. render_only trains nothing: a GPU study's data folder need not be
                # on the machine rendering it.
                data = (cfg.data, cfg.model.vocab_size)
                if not self.render_only and cfg.data != "default" and data not in data_checked:
                    try:
                        checked_shards(*data)
                    except ValueError as err:  # DataError, ConfigError
                        raise ConfigError(f"study {self.name!r}, run {name}: {err}") from None
                    data_checked.add(data)
                plan = _Planned(arm, seed, name, run_dir, args, json.loads(cfg.to_json()), seed_index=seed_index)
                plan.action = _cache_action(plan, self.nproc)
                plans.append(plan)
        return plans

    def _checked_seeds(self, given) -> list[int]:
        try:
            seeds = [] if isinstance(given, (str, bytes)) else list(given)
        except TypeError:  # a bare number
            seeds = []
        if not seeds:
            raise ValueError(f"study {self.name!r}: seeds must be a non-empty list of integers, got {given!r}")
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < 2**32:
                raise ValueError(f"study {self.name!r}: every seed must be an integer in [0, 2**32), got {s!r}")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"study {self.name!r}: seeds repeat: {seeds}")
        return [int(s) for s in seeds]

    # ------------------------------------------------------------ running

    def _launch_all(self, todo: list[_Planned], total: int) -> dict[str, _Outcome]:
        """Run `todo`, as many at a time as the launcher has slots; every run's outcome. The loop is the
        same for local processes and submitted jobs: only the launcher differs. Runs start seed by seed
        (every arm's first seed, then every arm's second, ...), so a study cut off part way leaves
        whole pairs of its A/B arms rather than one arm's seeds without their partners."""
        if not todo:
            return {}
        launcher = _JobLauncher(self, self._executor) if self._executor is not None else _LocalLauncher(self)
        slots = launcher.slots(len(todo))
        log.info(f"{self.name}: {len(todo)} run(s) to train, {min(len(slots), len(todo))} at a time "
                 f"{launcher.where}, in {self.folder}")
        pending, active, outcomes = sorted(todo, key=lambda p: p.seed_index), [], {}  # stable: arms keep order
        progress = _Progress(self.name, total, total - len(todo), self.progress)
        try:
            while pending or active:
                drain = _drain_file(self.folder) if pending else None
                if drain is not None:
                    log.warning(f"{self.name}: {drain} exists: starting none of the {len(pending)} run(s) left, "
                                f"{len(active)} running finish; run the study again (without it) to train the rest")
                    outcomes.update({p.name: _Outcome("not started", f"the study was drained ({drain}) before it "
                                                      "started this run", current=False) for p in pending})
                    pending = []
                while pending and slots:
                    plan = pending.pop(0)
                    active.append(launcher.start(plan, _command(plan, self.nproc), slots.pop(0)))
                for a in list(active):
                    ended = a.handle.poll()
                    if ended is None:
                        continue
                    active.remove(a)
                    slots.append(a.slot)
                    outcomes[a.plan.name] = out = _outcome(a.plan, a.started, *ended)
                    if out.status == "completed":
                        log.info(f"{self.name}: {a.plan.name} completed")
                    else:
                        log.warning(f"{self.name}: {a.plan.name} {out.status}: {out.error}")
                    progress.finished()
                progress.show(active)
                if active:
                    time.sleep(_POLL_S)
        except BaseException:
            launcher.stop(active)  # an interrupt or error here: no run is left going
            raise
        finally:
            progress.close()
        return outcomes


def _drain_file(folder: Path) -> Path | None:
    """The DRAIN_FILE in `folder` or a folder above it, if there is one."""
    for d in (folder, *folder.parents):
        if (d / DRAIN_FILE).exists():
            return d / DRAIN_FILE
    return None


def _command(plan: _Planned, nproc: int) -> list[str]:
    """The run's command: blunb.train (under torchrun for nproc > 1), resuming or starting afresh."""
    extra = ["--resume", "auto"] if plan.action == "resume" else ["--overwrite"]  # new: any leftovers go
    target = ["-m", "blunb.train", *plan.args, *extra]
    return torchrun_command(target, nproc) if nproc > 1 else [sys.executable, *target]


# ---------------------------------------------------------------- launchers
# A launcher starts a run's command and watches it: slots() says how many go at once, start() returns the
# run's _Active (its handle's poll() gives (exit code, why there is none) once it has ended, else None),
# stop() ends every active run (interrupt or error). _LocalLauncher: this machine's processes;
# _JobLauncher: one submitit job per run.

class _LocalLauncher:
    where = "as local processes"

    def __init__(self, study: Study):
        self.study, self.env = study, {**os.environ, **study.env}

    def slots(self, runs: int) -> list[str | None]:
        s = self.study
        # No more slots than runs: a GPU that fewer runs than runs_per_gpu will use is not recorded as shared.
        slots = _slots(_visible_gpus(self.env), s.nproc, s.runs_per_gpu, s.max_parallel, _cores())[:runs]
        self.sharing = {slot: slots.count(slot) for slot in slots if slot is not None}
        # The CPU's cores shared among the runs at once (launch's own default assumes one run).
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // (len(slots) * s.nproc))))
        return slots

    def start(self, plan: _Planned, cmd: list[str], slot: str | None) -> _Active:
        run_env = command_env(self.env, str(repo_root()))
        run_env.pop(GPU_SHARE_ENV, None)  # only this launch's own count is recorded (none on the CPU)
        if slot is not None:
            run_env["CUDA_VISIBLE_DEVICES"] = slot
            run_env[GPU_SHARE_ENV] = str(self.sharing[slot])  # env.json's gpu_sharing (blunb.runs.gpu_sharing)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        console = open(plan.run_dir / "console.txt", "w")
        try:
            proc = start_process(cmd, console, run_env)
        except BaseException:
            console.close()
            raise
        log.info(f"{self.study.name}: started {plan.name} ({plan.action}" + (f", GPUs {slot}" if slot else "") + ")")
        return _Active(plan, slot, started, _LocalRun(proc, console))

    def stop(self, active: list[_Active]) -> None:
        terminate([a.handle.proc for a in active])
        for a in active:
            a.handle.console.close()


class _LocalRun:
    def __init__(self, proc: subprocess.Popen, console):
        self.proc, self.console = proc, console

    def poll(self) -> tuple[int | None, str | None] | None:
        if self.proc.poll() is None:
            return None
        self.console.close()
        return self.proc.returncode, None


class _JobLauncher:
    """One submitit job per run, running the command the local path would (blunb.study_job.run_command,
    which writes console.txt); the cluster's scheduler places it (GPUs, partition, time: the executor's
    parameters), so there are no GPU slots here, only max_parallel jobs in flight (default: all)."""

    def __init__(self, study: Study, executor):
        self.study, self.executor = study, executor
        self.where = f"as {type(executor).__name__} jobs"

    def slots(self, runs: int) -> list[str | None]:
        return [None] * min(runs, self.study.max_parallel or runs)

    def start(self, plan: _Planned, cmd: list[str], slot: str | None) -> _Active:
        started = time.time()
        # self.env only: the job's own environment (its node's GPUs, the scheduler's variables) is the base.
        job = self.executor.submit(run_command, cmd, str(plan.run_dir / "console.txt"), dict(self.study.env),
                                   str(repo_root()))
        log.info(f"{self.study.name}: submitted {plan.name} ({plan.action}, job {job.job_id})")
        return _Active(plan, slot, started, _JobRun(job))

    def stop(self, active: list[_Active], grace_s: float = _JOB_GRACE_S) -> None:
        """Cancel every job, then wait (up to grace_s) until each has ended and its run no longer says
        running: the study's lock is let go only once its runs have stopped, as locally."""
        def cancel(jobs: list[_Active], warn: bool) -> None:
            for a in jobs:
                try:
                    a.handle.job.cancel(check=False)
                except Exception as err:  # an unreachable scheduler must not hide the interrupt
                    if warn:
                        log.warning(f"{self.study.name}: could not cancel job {a.handle.job.job_id} ({a.plan.name}): "
                                    f"{err}")

        cancel(active, warn=True)
        deadline = time.monotonic() + grace_s
        recancel_at = time.monotonic() + _RECANCEL_S
        going = list(active)
        while going and time.monotonic() < deadline:
            going = [a for a in going if not _job_stopped(a)]
            if going and time.monotonic() >= recancel_at:  # a cancel can be lost (a job still starting up)
                cancel(going, warn=False)
                recancel_at = time.monotonic() + _RECANCEL_S
            if going:
                time.sleep(_POLL_S)
        if going:
            log.warning(f"{self.study.name}: cancelled, but still going after {grace_s:g} s: "
                        + ", ".join(f"{a.plan.name} (job {a.handle.job.job_id})" for a in going))


class _JobRun:
    def __init__(self, job):
        self.job = job

    def poll(self) -> tuple[int | None, str | None] | None:
        if not self.job.done():
            return None
        try:
            return int(self.job.result()), None
        except Exception as err:  # the job itself failed: cancelled, timed out, lost with its node
            return None, _job_failure(self.job, err)


def _job_failure(job, err: Exception) -> str:
    """One line on why a job gave no exit code, from submitit's error (a traceback dump or a log excerpt)."""
    text = str(err)
    if "Traceback" in text:  # FailedJobError: the job's function raised; the quoted trace ends with the exception
        trace = [line.strip() for line in text.split("Traceback", 1)[1].split("\n---", 1)[0].splitlines()]
        return f"job {job.job_id} raised {[line for line in trace if line][-1]}"
    state = re.search(r"\(state: ([^)]*)\)", text)  # UncompletedJobError: no result (cancelled, node lost, ...)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"job {job.job_id} ended without a result" + (f" (state: {state.group(1)})" if state else f": {first}")


def _job_stopped(a: _Active) -> bool:
    """Whether a cancelled job has ended and its run no longer says running (a status this launch wrote)."""
    try:
        if not a.handle.job.done():
            return False
    except Exception:  # the scheduler cannot say: the grace period decides
        return False
    try:
        status = read_status(a.plan.run_dir) or {}
        fresh = (a.plan.run_dir / "status.json").stat().st_mtime >= a.started - 1
    except (OSError, ValueError):
        return True  # no status of this launch: nothing of it holds the folder
    return not (fresh and status.get("state") == "running")


def run_study(name: str, arms: dict[str, Sequence[str]], seeds: Sequence[int], **kwargs) -> pd.DataFrame:
    """Study(name, arms, seeds, **kwargs).run()."""
    return Study(name, arms, seeds, **kwargs).run()


def _checked_executor(executor):
    """None for this machine's processes (executor None or "local"), else the submitit executor given;
    any other value is an error before any work. submitit is imported only here, for the check."""
    if executor is None or (isinstance(executor, str) and executor == "local"):
        return None
    expected = ("executor must be None or 'local' (this machine's processes) or a submitit executor, e.g. "
                "submitit.AutoExecutor(folder=...) for SLURM")
    if isinstance(executor, str) or not callable(getattr(executor, "submit", None)):
        raise ValueError(f"{expected}; got {executor!r}")
    try:
        import submitit
    except ImportError:
        raise ConfigError(f"executor={type(executor).__name__}(...): submitting runs as jobs needs submitit, which "
                          "is not installed: pip install 'blunb[cluster]' (or 'submitit>=1.5')") from None
    if not isinstance(executor, submitit.Executor):  # the study watches and cancels its jobs through submitit's Job
        raise ValueError(f"{expected}; got a {type(executor).__module__}.{type(executor).__name__}")
    return executor


def _checked_overrides(what: str, overrides) -> list[str]:
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence):
        raise ValueError(f"{what}: overrides must be a list of 'key=value' strings, got {overrides!r}")
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"{what}: override {item!r} is not a 'key=value' string")
        if item.split("=", 1)[0].strip() == "seed":
            raise ValueError(f"{what}: {item!r}: the seed comes from the study's seeds, not from overrides")
    return list(overrides)


def _with_new_fields(stored: dict, default: dict) -> dict:
    """`stored` with the config fields it predates added at `default` (config.predated_defaults): a field
    added to blunb after a run was made, left at its default, does not make the run's config differ (nor
    its result stale); one whose default changes what a run does (data_order) fills in what the old run did."""
    out = dict(stored)
    for key, value in default.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_new_fields(out[key], value)
    return out


def _as_planned_auto(stored: dict, planned: dict) -> dict:
    """`stored` with each config.AUTO_VALUED setting that the plan leaves at "auto" read as "auto": the
    run's device decided it (config.json records what it became), and on or off the run computes the same
    math; an explicit value in the plan must match."""
    out = {**stored, "model": dict(stored.get("model", {}))}
    for name in AUTO_VALUED:
        *parent, key = name.split(".")
        plan_part, out_part = (planned.get("model", {}), out["model"]) if parent else (planned, out)
        if plan_part.get(key) == "auto" and key in out_part:
            out_part[key] = "auto"
    return out


def _stored(plan: _Planned) -> tuple[dict, int | None, str | None]:
    """The run folder's config as the plan compares it (fields it predates at their old values, the plan's
    "auto" settings read as auto), its world size and how its data folder changed since it read it (None:
    unchanged or not comparable); OSError / ValueError where there is none usable."""
    stored = json.loads((plan.run_dir / "config.json").read_text())
    env = json.loads((plan.run_dir / "env.json").read_text())
    config = _as_planned_auto(_with_new_fields(stored, predated_defaults()), plan.config)
    return config, env.get("world_size"), _data_change(plan.config["data"], env.get("shards"))


def _data_change(folder: str, recorded: list[dict] | None) -> str | None:
    """Which shards of the data folder differ from those the run read (env.json's name, size and sha256 of each),
    or None. Not compared: the default corpus (it records none), runs before the record, and a folder not on this
    machine (a GPU study rendered at home)."""
    if folder == "default" or not recorded or not Path(folder).is_dir():
        return None
    from blunb.data import find_shards, shard_manifest

    try:
        now = {d["name"]: d for d in shard_manifest(find_shards(folder, "train") + find_shards(folder, "val"))}
    except (OSError, ValueError):
        return "its shards cannot be read"
    then = {d.get("name"): d for d in recorded}
    changed = sorted(name for name in now.keys() | then.keys() if now.get(name) != then.get(name))
    if not changed:
        return None
    return f"data {folder}: {len(changed)} shard(s) differ from those the run read ({', '.join(changed[:3])}" + \
        (", ...)" if len(changed) > 3 else ")")


# A run that ended one of these ways is not trained again with the same config: a diverged run trained to the
# end (most steps skipped), and would diverge again; the study reports it as it ended.
FINISHED = ("completed", "diverged")


def _cache_action(plan: _Planned, nproc: int) -> str:
    """cached | new | resume | overwrite, from what the run folder already holds."""
    try:
        stored, world_size, data_change = _stored(plan)
    except (OSError, ValueError):
        return "new"  # nothing usable there (passed --overwrite anyway, for any leftovers)
    if stored != plan.config or world_size != nproc or data_change:
        return "overwrite"
    status = read_status(plan.run_dir) or {}
    if status.get("state") == "completed":
        _check_metrics_reach_the_end(plan)
    return "cached" if status.get("state") in FINISHED else "resume"


def _check_metrics_reach_the_end(plan: _Planned) -> None:
    """A completed run's metrics.csv ends at its last step: a folder whose status says completed over metrics
    cut short (a partial copy, a file truncated by hand) would be summarized as finished from the rows it
    lost. Refused, naming the run, before any work."""
    last_step = plan.config["max_steps"] - 1
    path = plan.run_dir / "metrics.csv"
    try:
        with path.open("rb") as f:
            columns = f.readline().decode(errors="replace").count(",")
            f.seek(max(0, path.stat().st_size - 65536))
            last = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()][-1]
        step = int(last.split(",", 1)[0]) if last.count(",") == columns else None  # a row cut mid-line: unread
    except (OSError, IndexError, ValueError):
        step = None
    if step != last_step:
        found = "no readable last row" if step is None else f"its last row is step {step}"
        raise StudyError(f"run {plan.name}: status.json says completed, but {path} ends short of step {last_step} "
                         f"({found}): the folder is damaged (a cut-short copy?). Restore it, or remove it to retrain")


def _cached_outcome(plan: _Planned) -> _Outcome:
    status = read_status(plan.run_dir) or {}
    state = status.get("state", "completed")
    return _Outcome(state, status.get("error") if state != "completed" else None)


# Set to 1, a study refuses to retrain completed runs whose config changed wherever its folder is (see Study).
KEEP_COMPLETED_ENV = "BLUNB_KEEP_COMPLETED"


def _config_change(plan: _Planned, nproc: int, limit: int = 4) -> str:
    """What differs between a run folder's config (and world size) and the plan's, as 'key: old -> new'."""
    try:
        stored, world_size, data_change = _stored(plan)
    except (OSError, ValueError) as e:
        return f"its config cannot be read: {e}"
    flat = {}
    for side, cfg in (("old", stored), ("new", plan.config)):
        for key, value in cfg.items():
            for k, v in (value.items() if isinstance(value, dict) else [(None, value)]):
                flat.setdefault(f"{key}.{k}" if k else key, {})[side] = v
    changes = [f"{key}: {v.get('old')!r} -> {v.get('new')!r}" for key, v in flat.items()
               if v.get("old") != v.get("new")]
    if world_size != nproc:
        changes.append(f"world size: {world_size} -> {nproc}")
    if data_change:
        changes.append(data_change)
    return ", ".join(changes[:limit]) + (f", and {len(changes) - limit} more" if len(changes) > limit else "")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _visible_gpus(env: dict) -> list[str]:
    """The GPU ids runs can be given (CUDA_VISIBLE_DEVICES entries, else 0..n-1); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    listed = [s.strip() for s in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if s.strip()]
    return listed[:n] if listed else [str(i) for i in range(n)]


def _slots(gpus: list[str], nproc: int, runs_per_gpu: int, max_parallel: int | None, cores: int) -> list[str | None]:
    """One entry per run that may go at once: its CUDA_VISIBLE_DEVICES, or None on the CPU.
    GPUs are cut into groups of nproc, each shared by runs_per_gpu runs; groups alternate, so
    runs spread over the GPUs before they share one."""
    if not gpus:
        return [None] * (max_parallel or max(1, cores // nproc))
    if len(gpus) < nproc:
        raise ValueError(f"nproc={nproc} needs {nproc} GPUs per run, but {len(gpus)} are visible ({','.join(gpus)})")
    groups = [",".join(gpus[i:i + nproc]) for i in range(0, len(gpus) - nproc + 1, nproc)]
    slots = groups * runs_per_gpu
    return slots[:max_parallel] if max_parallel else slots


def _latest_step(run_dir: Path, since: float) -> int | None:
    """The last step in metrics.csv, when this launch has written one (a tail read, no parse)."""
    path = run_dir / "metrics.csv"
    try:
        if path.stat().st_mtime < since:
            return None  # still the previous run's file, until the trainer sets it aside
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        first = line.split(",", 1)[0]
        if first.isdigit():
            return int(first)
    return None


def _outcome(plan: _Planned, started: float, rc: int | None, lost: str | None = None) -> _Outcome:
    """How a finished launch ended, with its root cause when it did not complete: the run folder's
    own account (console.txt, status.json), whichever launcher ran it. rc: the command's exit status;
    None when there is none (a job that failed outside the command: `lost` says why)."""
    try:
        fresh = (plan.run_dir / "status.json").stat().st_mtime >= started - 1  # written by this launch
        status = settle_status(plan.run_dir) if fresh else None  # its processes have exited: no "running"
    except (OSError, ValueError):
        status = None
    state = (status or {}).get("state")
    if rc == 0 and state == "completed":
        return _Outcome("completed")
    if rc == 0 and state == "diverged":  # trained to the end, but mostly on skipped steps
        return _Outcome("diverged", status.get("error"))
    try:
        lines = (plan.run_dir / "console.txt").read_text(errors="replace").splitlines()
    except FileNotFoundError:  # a job that never started its command
        lines = []
    f = parse_failure(lines)
    cause = f.error_line or (status or {}).get("error") or (lines[-1].strip() if lines else lost or "no output")
    code = f.exit_code if f.exit_code is not None else rc
    where = ", ".join(part for part in (f"rank {f.rank}" if f.rank is not None else None,
                                        f"exit code {code}" if code is not None else None, f.signal,
                                        lost if lost and lost != cause else None) if part)
    if rc == 0:  # exited cleanly without saying completed: report it rather than trust it
        cause = f"the trainer exited 0 but status.json says {state or 'nothing'}"
    return _Outcome("killed" if state == "killed" else "failed", cause + (f" ({where})" if where else ""),
                    current=status is not None)


class _Progress:
    """A tqdm bar over runs (when tqdm is installed) naming each running run's latest step, else the
    same as a log line every _LOG_EVERY_S seconds; nothing with enabled=False."""

    def __init__(self, study: str, total: int, done: int, enabled: bool):
        self.study, self.total, self.done, self.enabled = study, total, done, enabled
        self.bar, self.last_log = None, 0.0
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            # mininterval: a papermill-run notebook stores every redraw
            self.bar = tqdm(total=total, initial=done, desc=study, unit="run", mininterval=5.0)

    def show(self, active: list[_Active]) -> None:
        if not self.enabled:
            return
        parts = []
        for a in active:
            step = _latest_step(a.plan.run_dir, a.started)
            parts.append(f"{a.plan.name} " + ("starting" if step is None else
                                              f"{step + 1}/{a.plan.config['max_steps']}"))
        text = ", ".join(parts)
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(0)  # redraws at most every mininterval
        elif time.monotonic() - self.last_log >= _LOG_EVERY_S:
            self.last_log = time.monotonic()
            log.info(f"{self.study}: {self.done}/{self.total} runs done" + (f"; running {text}" if text else ""))

    def finished(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            self.last_log = 0.0  # say so at the next show()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------- results

def _summary_row(plan: _Planned, out: _Outcome) -> dict:
    """One summary.csv row; the metrics only where the folder holds this run."""
    nan = float("nan")
    row = {"arm": plan.arm, "seed": plan.seed, "run": plan.name, "status": out.status, "action": plan.action,
           "error": out.error, "steps_done": 0, "steps_total": plan.config["max_steps"], "final_val_loss": nan,
           "best_val_loss": nan, "final_train_loss": nan, "steady_tok_per_sec": nan, "steady_mfu": nan,
           "peak_mem_gib": nan, "device": None, "world_size": None, "run_dir": str(plan.run_dir)}
    if not out.current:
        return row
    try:
        run = load_run(plan.run_dir)
    except FileNotFoundError:  # it died before writing its records
        return row
    s = summarize([run]).iloc[0]
    m = run.metrics
    peak = m["peak_mem_gib"].max() if "peak_mem_gib" in m else nan
    row.update({k: s[k] for k in ("final_val_loss", "final_train_loss", "steady_tok_per_sec", "steady_mfu",
                                  "device", "world_size", "steps_done")},
               best_val_loss=float(m["val_loss"].min()), peak_mem_gib=float(peak))
    return row


def _long_rows(plan: _Planned) -> pd.DataFrame:
    """The run's metrics.csv as arm, seed, step, metric, value rows (numeric columns, NaNs dropped)."""
    try:
        m = pd.read_csv(plan.run_dir / "metrics.csv")
    except FileNotFoundError:
        return pd.DataFrame(columns=LONG_COLUMNS)
    numeric = [c for c in m.columns if c != "step" and pd.api.types.is_numeric_dtype(m[c])]
    long = m.melt(id_vars="step", value_vars=numeric, var_name="metric").dropna(subset=["value"])
    long.insert(0, "seed", plan.seed)
    long.insert(0, "arm", plan.arm)
    return long[LONG_COLUMNS]


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")  # a reader never sees half a table
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def _write_json(obj: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------- publishing

def publishes(folder: str | Path) -> bool:
    """Whether writing into `folder` changes committed results: it lies in the repo's results/ and
    git does not ignore it (results/scratch/ and results/adhoc/ are ignored)."""
    folder, committed = Path(folder).resolve(), (repo_root() / "results").resolve()
    if not folder.is_relative_to(committed):
        return False
    try:  # a path inside the folder: git matches `dir/` patterns only against folders it can see
        ignored = subprocess.run(["git", "check-ignore", "-q", str(folder / "summary.csv")], cwd=repo_root(),
                                 capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ignored = False
    return not ignored


def check_publish(folder: str | Path, allow_dirty: bool = False) -> dict:
    """Refuse (StudyError) to write into the committed results/ (see publishes) from a git tree with
    uncommitted changes, unless allow_dirty; return the provenance record a study keeps (study.json:
    the git state where it publishes, blunb's source digest always; each run's env.json has both).
    Outside a git checkout the tree's state is unknown and nothing is refused."""
    if not isinstance(allow_dirty, bool):
        raise ValueError(f"allow_dirty must be True or False, got {allow_dirty!r}")
    record = {"folder": str(Path(folder).absolute()), "published": publishes(folder), "allow_dirty": allow_dirty}
    if record["published"]:
        sha, dirty, files = git_state(repo_root())
        if dirty and not allow_dirty:
            raise StudyError(f"refusing to publish into {folder}: the git tree has uncommitted changes "
                             f"({', '.join(files)}); commit them first, or pass allow_dirty=True (it is recorded)")
        record.update(git_sha=sha, git_dirty=dirty, git_dirty_files=files)
    return {**record, "blunb_sources": source_digest()}


# ---------------------------------------------------------------- notebook parameters

def code_cells(notebook: str | Path) -> list[tuple[dict, str]]:
    """`notebook`'s code cells, in order, as (cell, its source as one string)."""
    cells = [c for c in json.loads(Path(notebook).read_text()).get("cells", []) if c.get("cell_type") == "code"]
    return [(c, c["source"] if isinstance(c["source"], str) else "".join(c["source"])) for c in cells]


def _is_parameters(cell: dict) -> bool:
    return "parameters" in cell.get("metadata", {}).get("tags", [])


def notebook_defaults(notebook: str | Path) -> dict:
    """The defaults of a notebook's `parameters` cell: name -> value of each `name = <literal>`
    line (None for a value that is no literal: its type is not checked)."""
    path = Path(notebook)
    sources = [source for cell, source in code_cells(path) if _is_parameters(cell)]
    if not sources:
        raise ValueError(f"{path} has no cell tagged 'parameters'")
    defaults = {}
    for node in ast.parse(sources[0]).body:
        target, value = ((node.targets[0], node.value) if isinstance(node, ast.Assign) and len(node.targets) == 1
                         else (node.target, node.value) if isinstance(node, ast.AnnAssign) else (None, None))
        if isinstance(target, ast.Name) and value is not None:
            try:
                defaults[target.id] = ast.literal_eval(value)
            except ValueError:
                defaults[target.id] = None
    return defaults


def _typed(name: str, default, value):
    """`value` as the type of `default`, or ConfigError; strings are what papermill's CLI passes."""
    def bad(expected: str):
        return ConfigError(f"parameter {name}: expected {expected}, got {value!r}")

    if default is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise bad("true or false (in any case)")
    if isinstance(default, (int, float)):
        kind = int if isinstance(default, int) else float
        if value is None:  # a count's or a size's "not set" (max_parallel=None: the default number)
            return None
        if isinstance(value, str):
            try:
                value = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise bad(f"a number ({kind.__name__})") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"a number ({kind.__name__})")
        if kind is int and not float(value).is_integer():
            raise bad("an integer")
        return kind(value)
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # papermill's CLI makes `-p run_id 1` an int
        raise bad("a string")
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise bad(f"a list like {default!r}" + (" (a string is not a list: give a list literal, e.g. "
                                                    f"-p {name} \"['a', 'b']\")" if isinstance(value, str) else ""))
        kinds = {type(v) for v in default}
        if len(kinds) == 1:  # every default element has one type: hold the given ones to it
            return [_typed(f"{name}[{i}]", default[0], v) for i, v in enumerate(value)]
        return list(value)
    if not isinstance(value, type(default)):
        raise bad(f"a {type(default).__name__}")
    return value


def checked_parameters(defaults: dict, given: dict) -> dict:
    """`given` (parameter name -> value) with each value checked against, and converted to, the type
    of its default: a bool takes True/False or "true"/"false" in any case, an int or float a number,
    a numeric string or None, a str a string, a list a list (never a string) whose items match the
    default's, a None default anything. Unknown names and every bad value are one ConfigError."""
    errors, out = [], {}
    for name, value in given.items():
        if name not in defaults:
            near = difflib.get_close_matches(name, list(defaults), n=3)
            errors.append(f"unknown parameter {name!r}" + (f" (did you mean {' or '.join(near)}?)" if near else
                                                           f"; the notebook's parameters: {', '.join(defaults)}"))
            continue
        try:
            out[name] = _typed(name, defaults[name], value)
        except ConfigError as err:
            errors.append(str(err))
    if errors:
        raise ConfigError("; ".join(errors))
    return out


def check_parameters(namespace: dict, notebook: str | Path) -> None:
    """A notebook's own check, in the cell after its parameters cell (after papermill's injected
    one): `check_parameters(globals(), "10_clipping.ipynb")` type-checks every parameter in
    `namespace` against the defaults of `notebook`'s parameters cell (checked_parameters) and puts
    the converted values back ("false" becomes False). `notebook`: a path, looked up in the current
    folder (the notebook's own under Jupyter, papermill and nbval), else in the repo's notebooks/."""
    path = Path(notebook)
    if not path.is_file() and not path.is_absolute():
        path = repo_root() / "notebooks" / notebook
    check_same_checkout(path)
    defaults = notebook_defaults(path)
    namespace.update(checked_parameters(defaults, {k: namespace[k] for k in defaults if k in namespace}))


def check_same_checkout(notebook: str | Path) -> None:
    """ConfigError when `notebook` lies in the notebooks/ folder of another blunb checkout than the one
    this process imports blunb from. Why: a study writes into the imported checkout's results/, so
    running a second clone's notebook with the first's (editable) install would train and overwrite
    runs in the first clone's committed results."""
    folder = Path(notebook).resolve().parent
    checkout = folder.parent
    if folder.name == "notebooks" and (checkout / "blunb" / "__init__.py").is_file() and checkout != repo_root():
        raise ConfigError(f"{Path(notebook).name} belongs to the checkout {checkout}, but this Python imports blunb "
                          f"from {repo_root()}, whose results/ the study would write: run it with "
                          f"PYTHONPATH={checkout} or that checkout's own environment")


# ---------------------------------------------------------------- CLI

def _literal(raw: str):
    """A -p value: a Python literal (60, True, ['a=1']) where it parses as one, else the string."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def check_script_syntax(notebook: str | Path) -> list[tuple[dict, str]]:
    """`notebook`'s code cells as (cell, source); ValueError naming the first cell with IPython syntax
    (a %magic or !shell line), which only Jupyter runs."""
    path = Path(notebook)
    cells = code_cells(path)
    for index, (_, source) in enumerate(cells):
        if any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
            raise ValueError(f"{path.name}: code cell {index} uses IPython syntax (% or !), which runs only "
                             f"under Jupyter: run the notebook through papermill instead")
    return cells


def run_as_script(notebook: str | Path, params: dict) -> None:
    """Execute `notebook`'s code cells in this process, in order, with `params` assigned right after
    its parameters cell (where papermill injects them): the study without Jupyter or papermill, for a
    machine that has neither (the lent GPU machine). The cwd is the notebook's folder, as under
    Jupyter; figures and tables go where its cells write them; `display(x)` logs x; the notebook itself
    is not written: render it afterwards (render_only=True) where Jupyter is. A cell with IPython
    syntax is refused before any cell runs (check_script_syntax)."""
    path = Path(notebook).resolve()
    cells = check_script_syntax(path)
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display: figures are saved, never shown
    namespace = {"__name__": "__main__", "display": lambda *objs: [log.info(str(o)) for o in objs]}
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        for index, (cell, source) in enumerate(cells):
            log.info(f"{path.name}: code cell {index}")
            exec(compile(source, f"{path.name}, code cell {index}", "exec"), namespace)
            if _is_parameters(cell):
                namespace.update(params)
    finally:
        os.chdir(cwd)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog=prog_name("blunb-study", "blunb.study"),
                                 description="Run a study notebook headless (papermill), parameters injected.")
    ap.add_argument("notebook", type=Path)
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="a parameter of the notebook's `parameters` cell (repeatable)")
    ap.add_argument("-o", "--output", type=Path,
                    help="the executed notebook (default: <results>/scratch/<notebook name>)")
    ap.add_argument("-k", "--kernel", default="python3", help="Jupyter kernel (default: python3)")
    ap.add_argument("--script", action="store_true",
                    help="run the notebook's code cells in this process, without Jupyter or papermill (e.g. "
                         "to train a GPU study's runs on a machine without them); no executed notebook is "
                         "written: render it later with -p render_only True")
    args = ap.parse_args(argv)
    if not args.notebook.is_file():
        ap.error(f"no notebook at {args.notebook}")
    if args.script and (args.output or args.kernel != "python3"):
        ap.error("--script writes no notebook and uses no kernel: drop -o / -k")
    try:
        check_same_checkout(args.notebook)
        params = checked_parameters(notebook_defaults(args.notebook),
                                    {key: _literal(value) for key, value in args.parameter})
        if args.script:
            check_script_syntax(args.notebook)
    except (ConfigError, ValueError) as err:
        ap.error(str(err))
    if args.script:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        log.info(f"running {args.notebook} as a script with {params}")
        run_as_script(args.notebook, params)
        return
    try:
        import papermill
    except ImportError:
        ap.error("papermill is not installed: pip install -e .[notebook]")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    output = args.output or results_root() / "scratch" / args.notebook.name
    output.parent.mkdir(parents=True, exist_ok=True)
    log.info(f"running {args.notebook} -> {output} with {params}")
    # The kernel imports the blunb this process runs (from the notebook's folder it would otherwise find
    # whichever checkout is installed); the notebook's own folder as cwd: its relative paths mean what they
    # mean in Jupyter.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), saved]))
    try:
        papermill.execute_notebook(str(args.notebook), str(output), parameters=params, kernel_name=args.kernel,
                                   cwd=str(args.notebook.resolve().parent), log_output=True)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved


if __name__ == "__main__":
    main()
