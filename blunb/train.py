"""The training loop: `python -m blunb.train` single-process, the same flags under torchrun.

    python -m blunb.train --preset tiny --max-steps 50 --run-dir results/quickstart/run0 \
        [--optimizer adamw|muon] [--data FOLDER] [--set key=value ...]
    torchrun --standalone --nproc_per_node=2 -m blunb.train ...

Per step: gradient accumulation to the global batch, a clipped optimizer step on the
rank-averaged gradient, the seed's step line on rank 0, one metrics.csv row. Validation
every val_freq steps and on the last step, over a fixed set of val_tokens split across
ranks (the same number at every world size). A non-finite loss stops the run with an error
naming the step (its row is written first); a non-finite gradient norm skips the step
(nan_policy). Every collective times out after collective_timeout_s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from blunb import kernels
from blunb.config import ConfigError, TrainConfig, apply_overrides, preset
from blunb.data import (
    DataError,
    ShardLoader,
    ValidationSet,
    check_token_ids,
    corpus_meta,
    ensure_default_corpus,
    find_shards,
)
from blunb.mfu import MFUMeter
from blunb.model import BLU
from blunb.optim.build import build_optimizers, check_replicas
from blunb.runs import MetricsWriter, environment, write_status


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, a stalled rank); the message names the cause.
    `everywhere`: every rank raised it at the same point (the process group can be torn down)."""

    def __init__(self, message: str, everywhere: bool = True):
        super().__init__(message)
        self.everywhere = everywhere


class RunKilled(Exception):
    """SIGTERM (torchrun stopping the job, a notebook interrupt): the run folder says 'killed'."""


class Console:
    """Rank 0 prints and mirrors to log.txt (once the run folder exists); other ranks stay quiet."""

    def __init__(self, rank: int):
        self.rank = rank
        self._f = None

    def open(self, path: Path) -> None:
        if self.rank == 0:
            self._f = open(path, "a")

    def __call__(self, msg: str = "") -> None:
        if self.rank != 0:
            return
        print(msg, flush=True)
        if self._f:
            self._f.write(msg + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


def _dist_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for but torch sees no CUDA device")
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


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
    this run has written its first step), so the folder never mixes two runs and a rerun that
    fails early loses nothing."""
    run_dir.mkdir(parents=True, exist_ok=True)
    old = [run_dir / name for name in (*_RUN_FILES, "checkpoints") if (run_dir / name).exists()]
    if not old:
        return None
    previous = run_dir / ".previous"
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir()
    for path in old:
        os.replace(path, previous / path.name)
    return previous


def _rank0_decides(fn, rank: int, world_size: int):
    """Run fn on rank 0 only (data preparation and checks: one scan, one message) and make every
    rank raise the same ConfigError / DataError when it failed, instead of waiting for rank 0."""
    result, failure = None, None
    if rank == 0:
        try:
            result = fn()
        except (ConfigError, DataError) as err:
            failure = err
    if world_size > 1:
        box = [None if failure is None else (type(failure).__name__, str(failure))]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and rank != 0:
            raise {"ConfigError": ConfigError, "DataError": DataError}[box[0][0]](box[0][1])
    if failure is not None:
        raise failure
    return result


def _resolve_data(cfg: TrainConfig, rank: int, world_size: int) -> tuple[Path, list[Path], list[Path]]:
    """The data folder and its train / val shards, checked (ids < vocab_size) before step 0."""
    def prepare_and_check():
        folder = ensure_default_corpus(progress=True) if cfg.data == "default" else Path(cfg.data)
        train_shards, val_shards = find_shards(folder, "train"), find_shards(folder, "val")
        meta = corpus_meta(folder)
        if meta.get("vocab_size", 0) > cfg.model.vocab_size:
            raise ConfigError(f"the corpus tokenizer has {meta['vocab_size']} symbols but model.vocab_size is "
                              f"{cfg.model.vocab_size}")
        check_token_ids(train_shards + val_shards, cfg.model.vocab_size)
        ValidationSet(val_shards, cfg.resolved_val_tokens(), cfg.T)  # enough val tokens?
        return folder

    folder = _rank0_decides(prepare_and_check, rank, world_size)
    if rank != 0:
        folder = ensure_default_corpus(progress=False) if cfg.data == "default" else Path(cfg.data)
    return folder, find_shards(folder, "train"), find_shards(folder, "val")


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


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: fault_nan_grad's poison, applied to the embedding output
    so the loss stays finite and only the gradients reduced afterwards are non-finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _poison_next_forward(model: torch.nn.Module):
    """Make the next forward's embedding output poison this rank's gradient (one micro-batch)."""
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    handle = None

    def hook(module, args, out):
        handle.remove()
        return _NanGradient.apply(out)
    handle = embedding.register_forward_hook(hook)


def _is_timeout(err: BaseException) -> bool:
    return "timed out" in str(err).lower() or "timeout" in str(err).lower()


def train(cfg: TrainConfig, run_dir: str | Path, overwrite: bool = False) -> Path:
    """Train `cfg`, writing the run folder; returns run_dir. Works single-process and under torchrun.

    Config, run-folder and data errors are raised before the run folder is touched. The folder's
    status.json says how the run ended: completed, failed (with the error) or killed.
    """
    run_dir = Path(run_dir)
    rank, world_size, local_rank = _dist_env()
    cfg.validate(world_size)
    check_run_dir(run_dir, overwrite)
    device = _pick_device(cfg, local_rank)
    meter = MFUMeter.build(cfg.model, seq_len=cfg.T, world_size=world_size, warmup_steps=cfg.mfu_warmup,
                           device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    if cfg.kernels != "auto":
        os.environ["BLUNB_KERNELS"] = cfg.kernels
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=cfg.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_killed) \
        if threading.current_thread() is threading.main_thread() else None
    log = Console(rank)
    metrics = opt = None
    step = 0
    started = False
    try:
        data_dir, train_shards, val_shards = _resolve_data(cfg, rank, world_size)
        meta = corpus_meta(data_dir)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        # Shard order comes from the seed: every rank permutes identically.
        order = np.random.default_rng(cfg.seed).permutation(len(train_shards))
        train_loader = ShardLoader([train_shards[i] for i in order], cfg.B, cfg.T, rank, world_size)
        val_set = ValidationSet(val_shards, cfg.resolved_val_tokens(), cfg.T, rank, world_size)

        # Everything is checked: from here on the run folder belongs to this run.
        previous = None
        if rank == 0:
            previous = _start_run_dir(run_dir)
            write_status(run_dir, "running", 0, cfg.max_steps)
            (run_dir / "config.json").write_text(cfg.to_json())
            env = environment(world_size, device, shards=None if cfg.data == "default" else train_shards + val_shards)
            env["corpus"] = {"dir": str(data_dir), **meta}
            (run_dir / "env.json").write_text(json.dumps(env, indent=2))
            log.open(run_dir / "log.txt")
            metrics = MetricsWriter(run_dir / "metrics.csv", ["tokens", "grad_accum", "skipped", "lr_muon",
                                                               "nsratio", "group_norms", "peak_mem_gib"])
        started = True
        if previous is not None:
            log(f"the earlier run in {run_dir} was moved to {previous} (removed after this run's first step)")

        model = BLU(cfg.model, device=device, seed=cfg.seed)
        opt = build_optimizers(model, cfg, device, world_size)
        accum = cfg.grad_accum_steps(world_size)
        tokens_per_step = cfg.B * cfg.T * accum * world_size
        nan_at, stall_at = cfg.fault_nan_grad_at(), cfg.fault_stall_at()

        log(f"blunb {cfg.preset}: {model.num_params():,} params | world {world_size} x {device} | "
            f"B {cfg.B} T {cfg.T} accum {accum} -> {tokens_per_step:,} tokens/step")
        log(opt.describe())
        log("kernels: " + " ".join(f"{op}={b}" for op, b in kernels.describe(device).items()))
        log(f"data: {data_dir} ({meta.get('tokenizer')}, {meta.get('train_tokens', '?')} train tokens); "
            f"validation: {val_set.n_seq * cfg.T:,} tokens split over {world_size} rank(s)")
        log(f"non-finite gradient norm: nan_policy={cfg.nan_policy} "
            + ("(the whole step is skipped on every rank)" if cfg.nan_policy == "step"
               else "(only the group whose norm is non-finite skips, as the reference trainer)"))
        if nan_at or stall_at:
            log(f"FAULT INJECTION (testing aid): fault_nan_grad={cfg.fault_nan_grad!r} fault_stall={cfg.fault_stall!r}")
        log(meter.banner(model.num_params(), tokens_per_step))

        start = time.perf_counter()
        last_val = None
        skipped_total = skipped_run = 0
        for step in range(cfg.max_steps):
            if (step, rank) in stall_at:
                os.kill(os.getpid(), signal.SIGSTOP)
            last_step = step == cfg.max_steps - 1
            val_this_step = None
            if step % cfg.val_freq == 0 or last_step:
                opt.drain()  # install any staged parameter refresh before reading the weights
                last_val = val_this_step = evaluate(model, val_set, cfg.B, device, world_size)
                if cfg.diag:
                    log(f"[diag] replicas bit-identical: {check_replicas(model, world_size)}")
                if rank == 0:
                    write_status(run_dir, "running", step, cfg.max_steps)
            t0 = time.perf_counter()
            lrs = opt.set_lr(step)
            loss_accum = torch.zeros((), device=device)
            for micro in range(accum):
                if micro == 0 and (step, rank) in nan_at:
                    _poison_next_forward(model)
                x, y = train_loader.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with opt.micro_step(last=micro == accum - 1):
                    _, loss = opt.forward_model(x, y)
                    (loss / accum).backward()
                loss_accum += loss.detach().float() / accum
            stats = opt.step()
            train_loss = float(_all_reduce_mean(loss_accum, world_size))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            meter.observe(dt, tokens_per_step)
            skipped_total += stats["skipped"]
            skipped_run = skipped_run + 1 if stats["skipped"] else 0
            groups = stats.get("group_norms", {})
            row = {"step": step, "train_loss": train_loss, "val_loss": val_this_step,
                   "tok_per_sec": tokens_per_step / dt, "grad_norm": stats["grad_norm"], "dt_ms": dt * 1e3,
                   "lr": lrs["lr"], "elapsed_min": (time.perf_counter() - start) / 60,
                   "mfu": meter.mfu(dt, tokens_per_step), "mfu_palm": meter.mfu_palm(dt, tokens_per_step),
                   "tflops_per_gpu": meter.tflops_per_gpu(dt, tokens_per_step),
                   "tokens": (step + 1) * tokens_per_step, "grad_accum": accum, "skipped": stats["skipped"],
                   "lr_muon": lrs.get("lr_muon"), "nsratio": stats.get("nsratio"),
                   "group_norms": " ".join(f"{k}={v:.4g}" for k, v in groups.items()) or None,
                   "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
            if metrics:
                metrics.write(row)
                if previous is not None:
                    shutil.rmtree(previous, ignore_errors=True)
                    previous = None
            log(_step_line(step, train_loss, last_val, row, stats, lrs, groups, skipped_total, cfg.nan_policy))
            if not math.isfinite(train_loss):
                raise TrainingError(f"non-finite training loss ({train_loss}) at step {step}; stopping the run")
            if skipped_run >= cfg.max_consecutive_skips:
                raise TrainingError(f"the gradient norm was non-finite for {skipped_run} steps in a row (through "
                                    f"step {step}); stopping the run (max_consecutive_skips)")
        step = cfg.max_steps
        opt.drain()
        if cfg.diag:
            log(f"[diag] replicas bit-identical after the last step: {check_replicas(model, world_size)}")
        if skipped_total:
            log(f"{skipped_total} step(s) skipped for a non-finite gradient norm")
        log()
        log(meter.summary())
        log("=== Training complete ===")
        if rank == 0:
            write_status(run_dir, "completed", step, cfg.max_steps)
        opt = None
        _destroy_process_group(world_size)
        return run_dir
    except (RuntimeError, RunKilled, KeyboardInterrupt) as err:
        if isinstance(err, RuntimeError) and not isinstance(err, TrainingError) and _is_timeout(err):
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            err = TrainingError(f"a collective did not finish within collective_timeout_s={cfg.collective_timeout_s:g} "
                                f"s at step {step} (a rank stalled or died): {first}", everywhere=False)
            _record_end(rank, started, run_dir, step, cfg, err)
            raise err from None
        _record_end(rank, started, run_dir, step, cfg, err)
        if isinstance(err, TrainingError) and err.everywhere:
            opt = None
            _destroy_process_group(world_size)  # every rank stopped at the same point: nothing is pending
        raise
    except BaseException as err:
        _record_end(rank, started, run_dir, step, cfg, err)
        raise
    finally:
        if metrics:
            metrics.close()
        log.close()
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


def _destroy_process_group(world_size: int) -> None:
    """Destroy the process group once nothing holds it: torch DDP's reducer keeps a reference
    (and its hooks may sit in reference cycles), which would let the group's gloo threads run on
    into interpreter exit, where they abort or deadlock the process. The caller drops its optimizer
    set first; collecting the cycles here frees the DDP wrapper."""
    if world_size > 1 and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _raise_killed(signum, frame):
    raise RunKilled(f"stopped by signal {signal.Signals(signum).name}")


def _record_end(rank: int, started: bool, run_dir: Path, step: int, cfg: TrainConfig, err: BaseException) -> None:
    if rank == 0 and started:
        killed = isinstance(err, (RunKilled, KeyboardInterrupt))
        write_status(run_dir, "killed" if killed else "failed", step, cfg.max_steps,
                     error=f"{type(err).__name__}: {err}")


def _all_reduce_mean(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= world_size
    return t


def _step_line(step, train_loss, last_val, row, stats, lrs, groups, skipped_total, nan_policy) -> str:
    """The reference trainer's step line, plus blunb's group norms and skip notes."""
    val_txt = f"{last_val:.6f}" if last_val is not None else "n/a"
    mfu_txt = "n/a" if math.isnan(row["mfu"]) else f"{row['mfu'] * 100:.2f}%"
    line = (f"step {step:6d} | train {train_loss:.6f} | val {val_txt} | tok/s {row['tok_per_sec']:.2f} | "
            f"norm {stats['grad_norm']:.4f} | dt {row['dt_ms']:.2f} ms | mfu {mfu_txt} | "
            f"TF/gpu {row['tflops_per_gpu']:.1f} | lr {lrs['lr']:.4e}")
    line += "".join(f" | {k} {v:.4f}" for k, v in groups.items())
    if "global_clip" in stats:
        line += f" | globalclip {stats['global_clip']:.4f}"
    if "nsrej" in stats:
        line += f" | nsrej {stats['nsrej'][0]}/{stats['nsrej'][1]} | nsratio {stats['nsratio']:.3f}"
    if stats["skipped"]:
        bad = [k for k, v in groups.items() if not math.isfinite(v)]
        where = f" in {', '.join(bad)}" if bad else ""
        if nan_policy == "group" and stats.get("skipped_groups"):
            line += f" | SKIPPED {', '.join(stats['skipped_groups'])} only (non-finite norm; nan_policy=group"
        else:
            line += f" | SKIPPED (non-finite gradient norm{where}; every group skipped"
        line += f"; {skipped_total} so far)"
    return line


def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m blunb.train", description="Train a BLU model; writes a run folder.")
    ap.add_argument("--preset", default="tiny", help="tiny | 124m | 1b | seed-4b")
    ap.add_argument("--max-steps", type=int, help="steps to run; rescales the WSD schedule like BLU_MAX_STEPS")
    ap.add_argument("--run-dir", help="run folder (default: results/adhoc/<preset>-<time>)")
    ap.add_argument("--optimizer", choices=["adamw", "muon", "ddp_adamw"],
                    help="adamw: ZeRO-1 ShardedAdamW (default); muon: ShardedMuon body + ShardedAdamW rest; "
                         "ddp_adamw: torch DDP + AdamW baseline")
    ap.add_argument("--data", help="folder of *train*.bin / *val*.bin shards (default: the embedded corpus)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override any TrainConfig / ModelConfig field (repeatable)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    args = ap.parse_args(argv)
    cfg = preset(args.preset)
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


def main(argv=None) -> None:
    try:
        cfg, args = parse_args(argv)
        train(cfg, args.run_dir, overwrite=args.overwrite)
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
