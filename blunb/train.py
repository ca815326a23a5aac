"""The trainer: `python -m blunb.train` single-process, the same flags under torchrun.

    python -m blunb.train --preset tiny --max-steps 50 --run-dir results/quickstart/run0 [--set key=value ...]

train() reads as setup -> loop -> finish. setup() checks the config, data and checkpoint before it touches
the run folder (a bad setting leaves no trace), then builds the model and optimizer set; per step,
train_step() queues the micro-batches and the optimizer step, and finish_step() of the previous step reads
its scalars back (one batched copy), writes its metrics row and step line and runs the health checks. That
read comes during the next step, after its first backward is queued, so the steady-state step never waits
for the device: dt is host wall-clock between step starts (the seed's definition) and step N's line appears
during N+1. A non-finite loss stops the run naming the step; a non-finite gradient norm skips the step
(nan_policy); every collective times out after collective_timeout_s. The start-of-run report and step line
are in blunb.report, the metrics.csv columns in blunb.metrics, deterministic=true in blunb.determinism, the
fault injection in blunb.faults, the run's logger in blunb.run_log.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from blunb import checkpoint, cuda_graph, fp8, kernels, memory
from blunb.cli import prog_name
from blunb.config import ConfigError, TrainConfig, apply_overrides, preset, settings_help
from blunb.data import (
    DataError,
    ShardLoader,
    ValidationSet,
    WindowLoader,
    build_train_loader,
    check_token_ids,
    checked_shards,
    corpus_meta,
    ensure_default_corpus,
    find_shards,
)
from blunb.determinism import Determinism
from blunb.faults import Faults
from blunb.launch import torchrun_command
from blunb.metrics import Schema, group_cells
from blunb.mfu import MFUMeter
from blunb.model import BLU
from blunb.optim.build import OPTIMIZERS, build_optimizers
from blunb.optim.interface import OptimizerSet, StepRecord, StepStats
from blunb.report import run_facts, start_lines, step_line
from blunb.run_log import RunLog
from blunb.runs import (
    FolderLock,
    MetricsWriter,
    RunWriteError,
    environment,
    gpu_sharing,
    process_age_s,
    process_info,
    set_aside_rows_from,
    write_status,
)

log = logging.getLogger("blunb.train")  # not __name__: it is "__main__" under python -m


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, a stalled rank); the message names the cause.
    `everywhere`: every rank raised it at the same point (the process group can be torn down)."""

    def __init__(self, message: str, everywhere: bool = True):
        super().__init__(message)
        self.everywhere = everywhere


class RunKilled(BaseException):
    """SIGTERM or SIGINT (torchrun stopping the job, Ctrl-C, a notebook interrupt): the run folder
    says 'killed' with the signal's name; the CLI prints one line and exits 128 + the signal.
    A BaseException, like KeyboardInterrupt: no `except Exception` (a checkpoint save's) swallows it."""



_STATUS_EVERY_S = 2.0       # status.json's "running" record, updated at most this often as steps finish
_stop_signal: str | None = None  # the signal that is stopping this process's run (the first one)


# ---------------------------------------------------------------- the run

def train(cfg: TrainConfig, run_dir: str | Path, overwrite: bool = False, resume: str | Path | None = None) -> Path:
    """Train `cfg`, writing the run folder; returns run_dir. Works single-process and under torchrun.

    resume: "auto" continues from the newest valid checkpoint in the run folder (a fresh start when
    there is none), a path continues from that checkpoint; metrics.csv and diag.csv rows of the
    steps it re-runs are set aside first. Config, checkpoint, run-folder and data errors are raised
    before the run folder is touched, and so is another live run's hold on the folder (FolderLock, held
    by rank 0 for the run's life). The folder's status.json says how the run stands: running (kept
    current as steps finish), completed, diverged (more than diverged_skip_frac of the steps skipped),
    failed (with the error) or killed (with the signal).
    """
    if resume is not None and not str(resume).strip():
        raise ConfigError("resume needs 'auto' or a checkpoint folder, got an empty string")
    run_dir = Path(run_dir)
    rank, world_size, local_rank = _dist_env()
    device = _preflight(cfg, run_dir, overwrite or resume is not None, world_size, local_rank)
    auto_settings = cfg.resolve_auto(device.type)  # before anything reads them (Determinism reads compile)
    determinism = Determinism(cfg)
    determinism.apply()  # before CUDA is initialized (CUBLAS_WORKSPACE_CONFIG); put back in the finally below
    try:
        if cfg.model.fp8 != "off":  # torchao, CUDA >= 8.9; after apply(): the capability query initializes CUDA
            fp8.check(cfg.model.fp8, device)
        _init_distributed(cfg, device, world_size)
    except BaseException:
        determinism.restore()
        raise
    previous_handlers = _catch_stop_signals()
    run_log = RunLog(rank)
    lock = FolderLock(run_dir, "run", hint="wait for it to end, or choose another --run-dir") if rank == 0 else None
    run = None
    try:
        stale = _rank0_decides(lambda: lock.acquire().stale_note(), rank, world_size)  # before anything is touched
        if stale:
            log.warning(stale)
        run = setup(cfg, run_dir, rank, world_size, device, run_log, None if resume is None else str(resume),
                    determinism, auto_settings)
        _loop(run)
        _finish_run(run)
        return run_dir
    except (RuntimeError, RunKilled, KeyboardInterrupt) as err:
        stop = _stop_error(err, cfg, run)
        if isinstance(stop, RunKilled) and lock is not None:
            lock.mark_stopping()  # a re-issued command waits for the release rather than failing
        _record_end(rank, run, err if stop is None else stop)
        if stop is not None:
            raise stop from None
        if isinstance(err, TrainingError) and err.everywhere:
            if run is not None:
                run.opt = run.model = run.scalar_group = None  # torch DDP's reducer holds the process group
            _destroy_process_group(world_size)  # every rank stopped at the same point: nothing is pending
        raise
    except BaseException as err:
        _record_end(rank, run, err)
        raise
    finally:
        if run is not None and run.metrics is not None:
            run.metrics.close()
        if run is not None and run.diag is not None:
            run.diag.close()
        run_log.close()
        if lock is not None:
            lock.release()
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)
        determinism.restore()


def _loop(run: _Run) -> None:
    """Steps start_step .. max_steps - 1: per step, a checkpoint and a validation where due, then
    train_step(), which reads the previous step back once its own first backward is queued."""
    cfg, device = run.cfg, run.device
    run.start += time.perf_counter()
    loop_start = time.perf_counter()
    run.wall["to_first_step"] = process_age_s()
    pending = None                      # the previous step, until its scalars are read
    profiler, profile_window = None, (_profile_window(cfg, run.start_step) if run.rank == 0 else range(0))
    for step in range(run.start_step, cfg.max_steps):
        run.step = step
        run.faults.stall(step, run.rank)
        if pending is not None:
            pending.end = time.perf_counter()
        if profiler is not None and step == profile_window.stop:
            _stop_profiler(profiler, run, profile_window)
            profiler = None
        if cfg.ckpt_freq and step > run.start_step and step % cfg.ckpt_freq == 0:
            if pending is not None:  # the checkpoint holds only steps that passed the health checks
                finish_step(run, pending)
                pending = None
            with _timed(run, "checkpoints"):
                _save_checkpoint(run, step)
        val_loss = _validate_if_due(run, step)
        if step == profile_window.start and len(profile_window):
            profiler = _start_profiler(device)
        previous = pending
        pending = train_step(run, step, val_loss,
                             finish_previous=(lambda p=previous: finish_step(run, p)) if previous else None)
    run.opt.drain()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if pending is not None:  # None when a resumed run had nothing left to do
        pending.end = time.perf_counter()
        finish_step(run, pending)
    run.wall["steps"] = time.perf_counter() - loop_start - run.wall["validation"] - run.wall["checkpoints"]


@contextlib.contextmanager
def _timed(run: _Run, what: str):
    """Add the block's wall time to run.wall[what]; the device is synced first, so the step in flight
    is not counted as the block's."""
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        run.wall[what] += time.perf_counter() - t0


def _stop_error(err: BaseException, cfg: TrainConfig, run: _Run | None) -> BaseException | None:
    """What a run that stopped on `err` raises in its place, or None for `err` itself: RunKilled for
    whatever a stop signal interrupted; a TrainingError naming the step for a run file rank 0 could not
    write (the other ranks learn of it from torchrun) and for a collective that timed out."""
    step = 0 if run is None else run.step
    if _stop_signal is not None or not isinstance(err, RuntimeError):
        return RunKilled(_stopped_line(run, _stop_signal or "SIGINT"))
    if isinstance(err, RunWriteError):
        return TrainingError(f"{err}; stopped at step {step}", everywhere=False)
    if not isinstance(err, TrainingError) and _is_timeout(err):
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return TrainingError(f"a collective did not finish within collective_timeout_s={cfg.collective_timeout_s:g} "
                             f"s at step {step} (a rank stalled or died): {first}", everywhere=False)
    return None


# ---------------------------------------------------------------- setup

@dataclass
class _Run:
    """Everything the loop reads, built once by setup()."""

    cfg: TrainConfig
    run_dir: Path
    rank: int
    world_size: int
    device: torch.device
    model: BLU
    opt: OptimizerSet
    train_loader: WindowLoader | ShardLoader
    val_set: ValidationSet
    meter: MFUMeter
    metrics: MetricsWriter | None    # rank 0 only
    schema: Schema                   # metrics.csv's columns (every rank checks its rows against them)
    scalar_group: object             # a second process group for the loss (None at W=1)
    accum: int
    tokens_per_step: int
    covered_frac: float
    faults: Faults
    diag: object | None = None       # blunb.diag.Diagnostics with diag=true
    graph: cuda_graph.StepGraph | None = None   # the captured step, with cuda_graph on
    previous: Path | None = None     # an earlier run's files, removed after the first metrics row
    start: float = 0.0
    step: int = 0                    # the step the loop is at (a stopped run's error names it)
    last_val: float | None = None
    skipped_total: int = 0
    processes: list = field(default_factory=list)  # process_info() of every rank, for status.json
    status_at: float = 0.0           # time.monotonic() of the last "running" status
    skipped_in_a_row: int = 0
    steps_done: int = 0              # steps finished and passed the health checks
    start_step: int = 0              # > 0 when resumed from a checkpoint
    resumed_from: Path | None = None
    # where the run's wall-clock time went (status.json's wall_s): on a shared GPU, what a study pays
    # besides its steps
    wall: dict = field(default_factory=lambda: {"to_first_step": None, "steps": 0.0, "validation": 0.0,
                                                "validations": 0, "checkpoints": 0.0})


def setup(cfg: TrainConfig, run_dir: Path, rank: int, world_size: int, device: torch.device,
          run_log: RunLog, resume: str | None = None, determinism: Determinism | None = None,
          auto_settings: dict | None = None) -> _Run:
    """Data and checkpoint (checked before anything else), model, optimizers, the resumed state,
    then the run folder and its records (determinism: the settings train() applied, recorded;
    auto_settings: the "auto" settings train() decided for the device, recorded and logged)."""
    auto_settings = {**(auto_settings or {}), **cfg.resolve_auto(device.type)}
    memory_line = _rank0_decides(lambda: memory.check(cfg, world_size, device), rank, world_size)
    data_dir, train_shards, val_shards = _resolve_data(cfg, rank, world_size)
    resume_from = (_rank0_decides(lambda: _find_checkpoint(run_dir, resume, cfg.max_steps), rank, world_size)
                   if resume else None)
    meta = corpus_meta(data_dir)
    init_seed = cfg.resolved_init_seed()
    torch.manual_seed(init_seed)
    np.random.seed(init_seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Every rank builds the same stream from data_seed; init_seed does not touch it.
    train_loader = build_train_loader(train_shards, cfg.B, cfg.T, rank, world_size, order=cfg.data_order,
                                      data_seed=cfg.resolved_data_seed())
    val_set = ValidationSet(val_shards, cfg.resolved_val_tokens(), cfg.T, rank, world_size)

    model = BLU(_model_config(cfg), device=device, seed=init_seed)
    if cfg.compile:
        # In place (nn.Module.compile): the model's forward is compiled and, through AOT autograd, its
        # backward, with the fused kernels as opaque custom ops; parameter names, hooks, DDP and
        # checkpoints see the same module. The optimizers' steps stay eager.
        model.compile()
    diag = None
    if cfg.diag:  # before the optimizers: its gradient hooks must see the gradients before they are reduced
        from blunb.diag import Diagnostics

        diag = Diagnostics(model, rank, world_size)
    opt = build_optimizers(model, cfg, device, world_size)
    graph_decision = cuda_graph.decide(cfg, device.type, world_size)
    graph_setting, cfg.cuda_graph = cfg.cuda_graph, graph_decision.on   # config.json records what ran
    if graph_decision.on:
        opt.keep_lr_on_device()
    accum = cfg.grad_accum_steps(world_size)
    meter = MFUMeter.build(cfg.model, seq_len=cfg.T, world_size=world_size, warmup_steps=cfg.mfu_warmup,
                           device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    facts = run_facts(cfg, model, opt, device)
    facts["determinism"] = (determinism or Determinism(cfg)).facts()
    facts["auto_settings"] = auto_settings
    facts["cuda_graph"] = graph_decision.facts(graph_setting)
    facts["data"] = {**train_loader.describe(), "data_seed": cfg.resolved_data_seed(), "init_seed": init_seed}
    clip = facts["optimizer"]["clip"]
    run = _Run(cfg=cfg, run_dir=run_dir, rank=rank, world_size=world_size, device=device, model=model, opt=opt,
               train_loader=train_loader, val_set=val_set, meter=meter, metrics=None,
               schema=Schema(name for name, _, _ in opt.groups),
               scalar_group=dist.new_group(timeout=timedelta(seconds=cfg.collective_timeout_s))
               if world_size > 1 else None, accum=accum,
               tokens_per_step=cfg.B * cfg.T * accum * world_size,
               covered_frac=clip["covered_params"] / max(clip["total_params"], 1), faults=Faults(cfg), diag=diag,
               graph=cuda_graph.StepGraph(device) if graph_decision.on else None)
    run.processes = _all_processes(world_size)
    saved = _resume_state(run, resume_from) if resume_from is not None else None

    # Everything is checked and built: from here on the run folder belongs to this run.
    if rank == 0:
        env = environment(world_size, device, shards=None if cfg.data == "default" else train_shards + val_shards)
        env["corpus"] = {"dir": str(data_dir), **meta}
        env["training"] = facts
        _claim_run_dir(run, env, saved, run_log)
    if run.previous is not None:
        log.info(f"the earlier run in {run_dir} was moved to {run.previous} (removed after this run's first step)")
    if saved is not None:
        changed = {k: (v, cfg.to_dict().get(k)) for k, v in (saved.get("config") or {}).items()
                   if cfg.to_dict().get(k) != v}
        log.info(f"resumed at step {run.start_step} from {resume_from} (saved at world size {saved['world_size']})"
                 + (f"; settings changed since: {changed}" if changed else ""))
    for line in start_lines(run, facts, data_dir, meta):
        log.info(line)
    log.info(memory_line)
    return run


def _resume_state(run: _Run, resume_from: Path) -> dict:
    """Load the checkpoint into the model, optimizers and loader, and the loop's counters from it."""
    # rank 0 has just verified every file's sha256 (_find_checkpoint): no second full read here
    saved = checkpoint.load(resume_from, run.model, run.opt, {"train": run.train_loader}, verify=False)
    run.start_step = run.steps_done = saved["step"]
    run.resumed_from = resume_from
    extra = saved.get("extra", {})
    run.last_val = extra.get("last_val_loss")
    run.skipped_total, run.skipped_in_a_row = extra.get("skipped_total", 0), extra.get("skipped_in_a_row", 0)
    run.start = -60.0 * extra.get("elapsed_min", 0.0)  # made absolute when the loop starts
    return saved


def _claim_run_dir(run: _Run, env: dict, saved: dict | None, run_log: RunLog) -> None:
    """Rank 0 makes the folder this run's: an earlier run's files moved aside (a fresh start) or the rows
    after the checkpoint set aside (a resume), then status.json, config.json, env.json, log.txt,
    metrics.csv and diag.csv."""
    run_dir = run.run_dir
    if saved is None:
        run.previous = _start_run_dir(run_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)  # a checkpoint from elsewhere may start a new folder
        aside = [set_aside_rows_from(run_dir / name, run.start_step) for name in ("metrics.csv", "diag.csv")]
        left = checkpoint.set_aside_later(run_dir, run.start_step, run.resumed_from)
        if left:
            log.warning(f"resumed at step {run.start_step}: this folder's later checkpoints (a timeline this run "
                        f"leaves) moved to {left[0].parent}: {', '.join(p.name for p in left)}")
        env["resumed"] = {"from": str(run.resumed_from), "step": run.start_step,
                          "saved_world_size": saved["world_size"],
                          "rows_set_aside": [str(p) for p in aside if p is not None],
                          "checkpoints_set_aside": [str(p) for p in left]}
        earlier = run_dir / "env.json"
        if earlier.is_file():
            env["resumed"]["earlier_env"] = json.loads(earlier.read_text())
    _write_running(run)
    try:
        (run_dir / "config.json").write_text(run.cfg.to_json())
        (run_dir / "env.json").write_text(json.dumps(env, indent=2, default=str))
        run_log.to_file(run_dir / "log.txt")
        run.metrics = MetricsWriter(run_dir / "metrics.csv", run.schema.extra, append=saved is not None)
        if run.diag is not None:
            run.diag.open_csv(run_dir)
    except BaseException as err:  # the folder says "running" already: it must not keep saying so
        _record_end(run.rank, run, err)
        raise


# ---------------------------------------------------------------- one step

class _HostCopy:
    """A device vector copied to pinned host memory without blocking; read() waits for that copy
    only (an event), so the host never stalls on the device's queue and no sync is issued."""

    def __init__(self, values: torch.Tensor):
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = values, None

    def read(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class _OptTimer:
    """How long the optimizer step took, without a sync: CUDA events around it on the GPU (read once the
    step's scalars have arrived, by which time both have completed), the wall clock on the CPU, where
    the step runs synchronously. What overlap_backward moved into the backward is not in it."""

    def __init__(self, device: torch.device):
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()
        self._ms = None

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._ms = (time.perf_counter() - self._t0) * 1e3

    def ms(self) -> float:
        return self._events[0].elapsed_time(self._events[1]) if self._events is not None else self._ms


@dataclass
class _PendingStep:
    """A step whose scalars are still on their way to the host."""

    step: int
    t0: float
    lrs: dict
    val_loss: float | None
    last_val: float | None          # the latest validation loss when the step ran
    stats: StepStats
    scalars: _HostCopy
    opt_timer: _OptTimer | None      # None for a replayed step (the update is inside the graph)
    peak_mem_gib: float | None      # the step's own peak allocation (CUDA), not the run's so far
    end: float = 0.0



def train_step(run: _Run, step: int, val_loss: float | None, finish_previous=None) -> _PendingStep:
    """Queue one optimizer step (accum micro-batches); `finish_previous` runs once the first
    backward is queued, so reading the previous step's scalars never idles the device. With
    cuda_graph on: the first steps run eagerly on the capture's stream, then the step is captured
    once and replayed (blunb.cuda_graph)."""
    t0 = time.perf_counter()
    if run.device.type == "cuda":
        # the allocator's statistics are host-side: this costs no sync; compile, autotuning and
        # validation between steps then stay out of every step's peak
        torch.cuda.reset_peak_memory_stats(run.device)
    lrs = run.opt.set_lr(step)
    if run.graph is not None and (run.graph.captured or run.graph.capture_due()):
        return _replay_step(run, step, t0, lrs, val_loss, finish_previous)
    with run.graph.warmup() if run.graph is not None else contextlib.nullcontext():
        return _eager_step(run, step, t0, lrs, val_loss, finish_previous)


def _forward_backward(run: _Run, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
    """One micro-batch's forward and backward; returns its loss (detached, fp32)."""
    with run.opt.micro_step(last=last):
        _, loss = run.opt.forward_model(x, y)
        (loss / run.accum).backward()
    return loss.detach().float()


def _eager_step(run: _Run, step: int, t0: float, lrs: dict, val_loss: float | None, finish_previous):
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        if micro == 0:
            run.faults.poison(run.model, step, run.rank)
        origin = run.train_loader.where()
        x, y = run.train_loader.next_batch()
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        loss = _forward_backward(run, x, y, last=micro == run.accum - 1)
        loss_sum += loss / run.accum
        if run.diag is not None:
            run.diag.record_micro(loss, origin)
        if micro == 0 and finish_previous is not None:
            finish_previous()
    work = dist.all_reduce(loss_sum, group=run.scalar_group, async_op=True) if run.world_size > 1 else None
    opt_timer = _OptTimer(run.device)
    stats = run.opt.step()
    opt_timer.stop()
    if work is not None:
        work.wait()  # on NCCL a stream wait, not a host wait
        loss_sum /= run.world_size
    if run.diag is not None:  # a collective with one batched read of its own: diag costs a sync per step
        for line in run.diag.end_step(step):
            log.info(line)
    scalars = _HostCopy(torch.cat([loss_sum.reshape(1), stats.values()]))
    peak = torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == "cuda" else None
    return _PendingStep(step, t0, lrs, val_loss, run.last_val, stats, scalars, opt_timer, peak)


def _captured_body(run: _Run, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, StepStats]:
    """What the graph holds (world size 1: no loss all-reduce): the eager step's math on the static inputs, its
    scalars gathered as the eager step gathers them."""
    loss_sum = torch.zeros((), device=run.device)
    for micro, (x, y) in enumerate(inputs):
        loss_sum += _forward_backward(run, x, y, last=micro == run.accum - 1) / run.accum
    stats = run.opt.step()
    return torch.cat([loss_sum.reshape(1), stats.values()]), stats


def _replay_step(run: _Run, step: int, t0: float, lrs: dict, val_loss: float | None, finish_previous):
    """The step as a replay of the captured graph (captured first, at the first step due)."""
    for micro in range(run.accum):
        run.graph.load(micro, *run.train_loader.next_batch())
    if not run.graph.captured:
        try:
            run.graph.capture(lambda inputs: _captured_body(run, inputs))
        except Exception as err:  # an op that cannot be captured: the optimizer's host bookkeeping is mid-step now
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise TrainingError(f"cuda_graph: capturing the training step at step {step} failed "
                                f"({type(err).__name__}: {first}); run it with cuda_graph=false") from err
        log.info(f"cuda_graph: the training step was captured at step {step}; every step from here on replays it")
    values, stats = run.graph.replay()
    if finish_previous is not None:
        finish_previous()
    # the graph's pool holds the step's activations: the capture's peak is part of every replayed step's
    peak = max(torch.cuda.max_memory_allocated(run.device), run.graph.capture_peak) / 2**30
    # no optimizer timing: the update runs inside the graph
    return _PendingStep(step, t0, lrs, val_loss, run.last_val, stats, _HostCopy(values), None, peak)


def finish_step(run: _Run, p: _PendingStep) -> None:
    """Read a queued step's scalars (one transfer), write its metrics row and step line, and stop
    the run on a non-finite loss or too many skipped steps in a row."""
    values = p.scalars.read()
    train_loss, rec = values[0], StepRecord.from_values(p.stats, values[1:])
    dt = p.end - p.t0
    run.meter.observe(dt, run.tokens_per_step)
    run.skipped_total += rec.skipped
    run.skipped_in_a_row = run.skipped_in_a_row + 1 if rec.skipped else 0
    row = _metrics_row(run, p, train_loss, rec, dt)
    if run.metrics is not None:
        run.metrics.write(row)
        if run.previous is not None:
            _drop_previous(run.previous)
            run.previous = None
    line = step_line(p.step, train_loss, p.last_val, row, rec, p.lrs, run.skipped_total, run.cfg.nan_policy)
    log.info(line + (f" | resumed at {p.step}" if run.resumed_from is not None and p.step == run.start_step else ""))
    if not math.isfinite(train_loss):
        raise TrainingError(f"non-finite training loss ({train_loss}) at step {p.step}; stopping the run")
    if run.skipped_in_a_row >= run.cfg.max_consecutive_skips:
        raise TrainingError(f"the gradient norm was non-finite for {run.skipped_in_a_row} steps in a row (through "
                            f"step {p.step}); stopping the run (max_consecutive_skips)")
    run.steps_done = p.step + 1
    if run.rank == 0 and time.monotonic() - run.status_at >= _STATUS_EVERY_S:
        _write_running(run)


def _metrics_row(run: _Run, p: _PendingStep, train_loss: float, rec: StepRecord, dt: float) -> dict:
    """The step's metrics.csv row, by the column names blunb.metrics declares (checked against them)."""
    meter, tps = run.meter, run.tokens_per_step
    row = {"step": p.step, "train_loss": train_loss, "val_loss": p.val_loss, "tok_per_sec": tps / dt,
           "grad_norm": rec.grad_norm, "dt_ms": dt * 1e3, "lr": p.lrs["lr"], "elapsed_min": (p.end - run.start) / 60,
           "mfu": meter.mfu(dt, tps), "mfu_palm": meter.mfu_palm(dt, tps),
           "tflops_per_gpu": meter.tflops_per_gpu(dt, tps),
           "opt_step_ms": p.opt_timer.ms() if p.opt_timer is not None else None,
           "tokens": (p.step + 1) * tps, "grad_accum": run.accum, "skipped": int(rec.skipped),
           "last_val_loss": p.last_val, "lr_muon": p.lrs.get("lr_muon"), "clip_covered_frac": run.covered_frac,
           "global_clip_coef": rec.scalars.get("global_clip_coef"), "ns_rejected": rec.scalars.get("ns_rejected"),
           "ns_rejected_total": rec.scalars.get("ns_rejected_total"), "nsratio": rec.scalars.get("ns_ratio"),
           "peak_mem_gib": p.peak_mem_gib}
    for name in rec.group_norms:
        row.update(group_cells(name, norm=rec.group_norms[name], clip=rec.group_clip[name],
                               skipped=int(rec.group_skipped[name])))
    return run.schema.check(row)


# ---------------------------------------------------------------- finish

def _finish_run(run: _Run) -> None:
    """The closing lines and status, then tear the process group down."""
    if run.skipped_total:
        log.info(f"{run.skipped_total} step(s) skipped for a non-finite gradient norm")
    log.info("")
    log.info(run.meter.summary())
    log.info(_wall_line(run.wall))
    log.info("=== Training complete ===")
    skipped_frac = run.skipped_total / run.cfg.max_steps
    diverged = skipped_frac > run.cfg.diverged_skip_frac
    if diverged:
        log.warning(f"the run diverged: {run.skipped_total} of {run.cfg.max_steps} steps skipped "
                    f"({skipped_frac:.0%} > diverged_skip_frac={run.cfg.diverged_skip_frac:g})")
    if run.rank == 0:
        write_status(run.run_dir, "diverged" if diverged else "completed", run.cfg.max_steps, run.cfg.max_steps,
                     error=f"{run.skipped_total} of {run.cfg.max_steps} steps skipped for a non-finite gradient norm "
                           f"(more than diverged_skip_frac={run.cfg.diverged_skip_frac:g})" if diverged else None,
                     wall_s=run.wall)
    if run.metrics is not None:
        run.metrics.close()
        run.metrics = None
    if run.diag is not None:
        run.diag.close()
        run.diag = None
    world_size = run.world_size
    run.opt = run.model = run.scalar_group = None  # torch DDP's reducer holds the process group
    _destroy_process_group(world_size)


def _wall_line(wall: dict) -> str:
    first = "unknown" if wall["to_first_step"] is None else f"{wall['to_first_step']:.1f} s"
    return (f"wall clock: {first} from process start to the first step, {wall['steps']:.1f} s of steps, "
            f"{wall['validation']:.1f} s of validation ({wall['validations']} passes), "
            f"{wall['checkpoints']:.1f} s of checkpoints")


def _destroy_process_group(world_size: int) -> None:
    """Destroy the process group once nothing holds it: torch DDP's reducer keeps a reference
    (and its hooks may sit in reference cycles), which would let the group's gloo threads run on
    into interpreter exit, where they abort or deadlock the process. The caller drops its optimizer
    set first; collecting the cycles here frees the DDP wrapper."""
    if world_size > 1 and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _record_end(rank: int, run: _Run | None, err: BaseException) -> None:
    """status.json for a run that did not complete: rank 0's, or another rank's for an error only that rank
    saw (a collective that timed out there: rank 0 may be the rank that stalled, and never write again)."""
    if run is None or not (rank == 0 or isinstance(err, TrainingError) and not err.everywhere):
        return
    if isinstance(err, RunKilled):
        state, extra = "killed", {"signal": _stop_signal or "SIGINT"}
    else:
        state, extra = "failed", {} if rank == 0 else {"reported_by_rank": rank}
    try:
        write_status(run.run_dir, state, run.steps_done, run.cfg.max_steps, error=f"{type(err).__name__}: {err}",
                     **extra)
    except RunWriteError as write_err:
        log.error(f"{write_err} (recording how the run ended: {err})")



# ---------------------------------------------------------------- helpers

def _dist_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but torch sees no CUDA device")
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)



def _preflight(cfg: TrainConfig, run_dir: Path, overwrite: bool, world_size: int, local_rank: int) -> torch.device:
    """The checks that need neither data nor a process group (settings, run folder, kernels on this
    device), then the device; kernels= goes into BLUNB_KERNELS for every op's dispatch."""
    cfg.validate(world_size)
    check_run_dir(run_dir, overwrite)
    device = _pick_device(cfg, local_rank)
    cuda_graph.check(cfg, device.type, world_size)
    gpu_sharing(device)  # a bad BLUNB_RUNS_PER_GPU stops here; env.json records it once the run is built
    if cfg.kernels != "auto":
        os.environ["BLUNB_KERNELS"] = cfg.kernels
    if "triton" in kernels.parse_backends(cfg.kernels).values() and device.type == "cpu" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"kernels={cfg.kernels} on the CPU: Triton runs there only under the interpreter, "
                          "set TRITON_INTERPRET=1")
    return device


_RUN_FILES = ("config.json", "env.json", "metrics.csv", "log.txt", "status.json", "diag.csv")


def check_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Every reason the run folder cannot take this run, as a ConfigError, before any work."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a folder")
    if any((run_dir / name).exists() for name in _RUN_FILES) and not overwrite:
        raise ConfigError(f"{run_dir} already holds a run; choose a new --run-dir or pass --overwrite")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {run_dir}: {existing} is not a writable folder")


def _start_run_dir(run_dir: Path) -> Path | None:
    """Create the run folder; an earlier run's files move to <run_dir>/.previous/ (removed once
    this run has written its first step: _drop_previous), so the folder never mixes two runs and a
    rerun that fails early loses nothing. A .previous/ already there is the run an earlier rerun
    replaced and stopped before its first step: it stays, and that rerun's own files (no step) go."""
    run_dir.mkdir(parents=True, exist_ok=True)
    old = [run_dir / name for name in (*_RUN_FILES, "checkpoints") if (run_dir / name).exists()]
    previous = run_dir / ".previous"
    if previous.is_dir():
        for path in old:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        return previous
    if not old:
        return None
    previous.mkdir()
    for path in old:
        os.replace(path, previous / path.name)
    return previous


def _drop_previous(previous: Path) -> None:
    """The replaced run's files, once this run has written a step: removed, but for its quarantined checkpoints
    (kept for inspection, as find_resume says), which move under this run's checkpoints/.invalid/."""
    invalid = previous / "checkpoints" / checkpoint.INVALID_DIR
    if invalid.is_dir():
        kept = previous.parent / "checkpoints" / checkpoint.INVALID_DIR
        kept.parent.mkdir(exist_ok=True)
        for path in sorted(invalid.iterdir()):
            checkpoint.move_into(path, kept)
    shutil.rmtree(previous, ignore_errors=True)


def _rank0_decides(fn, rank: int, world_size: int):
    """Run fn on rank 0 only (data preparation, checkpoint discovery: one scan, one message) and
    hand its result to every rank, or make every rank raise the same ConfigError / DataError when
    it failed, instead of waiting for rank 0."""
    result, failure = None, None
    if rank == 0:
        try:
            result = fn()
        except (ConfigError, DataError) as err:
            failure = err
    if world_size > 1:
        box = [(result, None if failure is None else (isinstance(failure, DataError), str(failure)))]
        dist.broadcast_object_list(box, src=0)
        result, failed = box[0]
        if failed is not None and rank != 0:
            raise (DataError if failed[0] else ConfigError)(failed[1])
    if failure is not None:
        raise failure
    return result


def _resolve_data(cfg: TrainConfig, rank: int, world_size: int) -> tuple[Path, list[Path], list[Path]]:
    """The data folder and its train / val shards, checked (ids < vocab_size) before step 0."""
    def prepare_and_check():
        folder = ensure_default_corpus(progress=True) if cfg.data == "default" else Path(cfg.data)
        train_shards, val_shards = checked_shards(folder, cfg.model.vocab_size)
        check_token_ids(train_shards + val_shards, cfg.model.vocab_size)
        ValidationSet(val_shards, cfg.resolved_val_tokens(), cfg.T)  # enough val tokens?
        return folder

    folder = _rank0_decides(prepare_and_check, rank, world_size)
    return folder, find_shards(folder, "train"), find_shards(folder, "val")


def _init_distributed(cfg: TrainConfig, device: torch.device, world_size: int) -> None:
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=cfg.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)


def _model_config(cfg: TrainConfig):
    """The baseline a user would write keeps fp32 parameters (autocast does the bf16 compute); the
    no-master counter-example needs bf16 Linears on every device (auto is fp32 on the CPU)."""
    linear_dtype = OPTIMIZERS[cfg.optimizer].linear_dtype
    if cfg.model.linear_dtype == "auto" and linear_dtype is not None:
        return replace(cfg.model, linear_dtype=linear_dtype)
    return cfg.model


def _find_checkpoint(run_dir: Path, resume: str, max_steps: int) -> Path | None:
    """--resume auto: the newest valid checkpoint in the run folder, or None (a fresh start);
    --resume PATH: that checkpoint, which must be valid (CheckpointError otherwise). One at or past
    max_steps (a shorter schedule than the one it was saved in) is a ConfigError: no step would run."""
    if resume == "auto":
        found = checkpoint.find_resume(run_dir)
        if found is None:
            log.info(f"--resume auto: no valid checkpoint in {run_dir / 'checkpoints'}; starting fresh")
            return None
    else:
        checkpoint.validate(resume)
        found = Path(resume)
    step = json.loads((found / checkpoint.META_FILE).read_text())["step"]
    if step >= max_steps:
        raise ConfigError(f"checkpoint {found} continues at step {step}, but --max-steps is {max_steps}: no step would "
                          f"run (and the rows from step {max_steps} on would be set aside); resume with --max-steps "
                          f"> {step}, or start a new run")
    return found


@torch.no_grad()
def evaluate(model, val_set: ValidationSet, B: int, device, world_size: int) -> float:
    """Token-weighted mean loss over the fixed validation set (the same set at every W)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)   # loss sum, tokens
    for x, y in val_set.batches(B):
        _, loss = model(x.to(device), y.to(device))
        total[0] += loss.double() * y.numel()
        total[1] += y.numel()
    model.train()
    if world_size > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def _validation_due(cfg: TrainConfig, step: int) -> bool:
    return step % cfg.val_freq == 0 or step == cfg.max_steps - 1


def _validate_if_due(run: _Run, step: int) -> float | None:
    cfg = run.cfg
    if not _validation_due(cfg, step):
        return None
    run.opt.drain()  # install any staged parameter refresh before reading the weights
    with _timed(run, "validation"), run.opt.eval_context():
        run.last_val = evaluate(run.model, run.val_set, cfg.B, run.device, run.world_size)
    run.wall["validations"] += 1
    if run.rank == 0:
        _write_running(run)
    return run.last_val


def _profile_window(cfg: TrainConfig, start_step: int) -> range:
    """The steps profile_steps profiles: the ones before the last (whose validation would land in the
    profile), cut short at the first validation or checkpoint inside, so it holds training steps only."""
    first = max(start_step, cfg.max_steps - 1 - cfg.profile_steps)
    stop = next((s for s in range(first + 1, cfg.max_steps)
                 if _validation_due(cfg, s) or (cfg.ckpt_freq and s % cfg.ckpt_freq == 0)), cfg.max_steps - 1)
    return range(first, stop) if cfg.profile_steps else range(0)


def _start_profiler(device: torch.device):
    # the steps before are still on the device: let them finish, or their kernels land in the profile
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def _stop_profiler(profiler, run: _Run, window: range) -> None:
    from blunb.profiling import write_profile

    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)  # every stream: the last step's kernels belong in the profile
    profiler.stop()
    categories = write_profile(profiler, len(window), run.run_dir)
    log.info(f"profile of steps {window.start}-{window.stop - 1}, ms per step by category (profile.csv, "
             "profile_kernels.csv):\n" + categories.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


def _save_checkpoint(run: _Run, step: int) -> None:
    """checkpoints/step_<step>/ (the next step to run); a failed save is logged and the run goes on."""
    extra = {"last_val_loss": run.last_val, "skipped_total": run.skipped_total,
             "skipped_in_a_row": run.skipped_in_a_row, "elapsed_min": (time.perf_counter() - run.start) / 60}
    checkpoint.save(run.run_dir, step, run.model, run.opt, {"train": run.train_loader}, extra, keep=run.cfg.ckpt_keep)


def _all_processes(world_size: int) -> list[dict]:
    """process_info() of every rank, in rank order (one collective at setup)."""
    if world_size == 1:
        return [process_info()]
    out = [None] * world_size
    dist.all_gather_object(out, process_info())
    return out


def _write_running(run: _Run) -> None:
    """status.json while the run goes: steps done so far and the ranks' processes (read_status tells
    from them whether the run still lives)."""
    write_status(run.run_dir, "running", run.steps_done, run.cfg.max_steps, processes=run.processes)
    run.status_at = time.monotonic()


def _is_timeout(err: BaseException) -> bool:
    return "timed out" in str(err).lower() or "timeout" in str(err).lower()



# ---------------------------------------------------------------- stop signals

def _catch_stop_signals() -> dict:
    """SIGTERM and SIGINT raise RunKilled from here on (in the main thread: Python delivers signals only
    there) and the run stops with its launcher; returns the handlers to put back."""
    global _stop_signal
    _stop_signal = None
    _stop_with_the_launcher()
    return {s: signal.signal(s, _raise_killed) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}


def _stop_with_the_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a launcher killed outright (SIGKILL, the OOM
    killer) would leave its ranks training on, holding the run folder. On Linux the kernel is asked to send
    this rank SIGTERM when its parent dies, which stops it as any SIGTERM does (status 'killed')."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def _raise_killed(signum, frame):
    global _stop_signal
    if _stop_signal is not None:
        return  # stopping already (torchrun passes Ctrl-C on to ranks that got it): let the cleanup finish
    _stop_signal = signal.Signals(signum).name
    raise RunKilled(f"stopped by {_stop_signal}")



def _stopped_line(run: _Run | None, sig: str) -> str:
    """The one line a signal-stopped run prints: where it stopped and how to go on."""
    if run is None:
        return f"stopped by {sig} before the first step"
    ckpts = run.run_dir / "checkpoints"
    resumable = ckpts.is_dir() and any((p / checkpoint.META_FILE).is_file() for p in ckpts.glob("step_*"))
    return (f"stopped by {sig} at step {run.steps_done} of {run.cfg.max_steps}"
            + ("; continue with --resume auto" if resumable else ""))


# ---------------------------------------------------------------- command line

def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog=prog_name("blunb-train", "blunb.train"),
                                 description="Train a BLU model; writes a run folder.")
    ap.add_argument("--preset", default="tiny", help="tiny (the default) | 124m | 1b | seed-4b")
    ap.add_argument("--max-steps", type=int,
                    help="steps to run (>= 3: the first steps compile and warm up, the steady figures need the "
                         "rest); rescales the WSD schedule like BLU_MAX_STEPS")
    ap.add_argument("--run-dir", help="run folder (default: results/adhoc/<preset>-<time>)")
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS),
                    help="adamw: ZeRO-1 ShardedAdamW (default); muon: ShardedMuon body + ShardedAdamW rest; "
                         "ddp_adamw: torch DDP + AdamW baseline; adamw_bf16_nomaster: the precision study's "
                         "counter-example (torch AdamW on bf16 parameters, no fp32 masters)")
    ap.add_argument("--data", help="folder of *train*.bin / *val*.bin shards (default: the embedded corpus)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override any TrainConfig / ModelConfig field (repeatable)")
    ap.add_argument("--nproc", type=int, metavar="N",
                    help="start N local ranks (torchrun --standalone) once the settings are checked here, so a "
                         "config error is one line, not every rank's and torchrun's report")
    ap.add_argument("--help-settings", action="store_true",
                    help="list every --set key with its value in the chosen preset, then exit")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    ap.add_argument("--resume", metavar="auto|PATH",
                    help="auto: continue from the newest valid checkpoint in --run-dir (a fresh start when there "
                         "is none); PATH: continue from that checkpoint folder")
    args = ap.parse_args(argv)
    if args.resume is not None and not args.resume.strip():
        # "" must not read as "no resume" after it has let the run folder be replaced (a script's empty $CKPT)
        ap.error("--resume needs 'auto' or a checkpoint folder, got an empty string")
    cfg = preset(args.preset)
    if args.help_settings:
        print(settings_help(cfg))
        raise SystemExit(0)
    if args.max_steps is not None:
        cfg.rescale_schedule(args.max_steps)
    if args.optimizer:
        cfg.optimizer = args.optimizer
    if args.data:
        cfg.data = args.data
    apply_overrides(cfg, args.overrides)
    if args.run_dir is None:
        from blunb.runs import results_root

        args.run_dir = str(results_root() / "adhoc" / f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    return cfg, args


def _start_ranks(cfg: TrainConfig, nproc: int, argv: list[str]) -> None:
    """--nproc N: check the settings at world size N in this one process, then replace it by torchrun
    running this same command (without --nproc) on N ranks. Under torchrun it must agree with the job."""
    if "LOCAL_RANK" in os.environ:
        if nproc != _dist_env()[1]:
            raise ConfigError(f"--nproc {nproc} under a torchrun job of {_dist_env()[1]} ranks: leave --nproc out")
        return
    cfg.validate(world_size=nproc)
    device = _pick_device(cfg, 0)
    cuda_graph.check(cfg, device.type, nproc)
    if cfg.model.fp8 != "off":
        fp8.check(cfg.model.fp8, device)
    memory.check(cfg, nproc, device, local_ranks=nproc)
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    cmd = torchrun_command(["-m", "blunb.train", *rest], nproc)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


def main(argv=None) -> None:
    try:
        cfg, args = parse_args(argv)
        if args.nproc is not None:
            _start_ranks(cfg, args.nproc, sys.argv[1:] if argv is None else list(argv))
        train(cfg, args.run_dir, overwrite=args.overwrite, resume=args.resume)
    except RunKilled as err:
        # One line for the whole job, not a traceback per rank.
        if _dist_env()[0] == 0:
            print(err, file=sys.stderr, flush=True)
        sys.exit(128 + signal.Signals[_stop_signal or "SIGINT"])
    except (ConfigError, DataError, TrainingError) as err:
        # Every rank raises the same config, data or training error: rank 0 speaks for all.
        rank = _dist_env()[0]
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif isinstance(err, TrainingError) and not err.everywhere:
            print(f"error: [rank {rank}] {err}", file=sys.stderr, flush=True)
        sys.exit(2)



if __name__ == "__main__":
    main()
