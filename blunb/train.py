"""The training loop: `python -m blunb.train` single-process, the same flags under torchrun.

    python -m blunb.train --preset tiny --max-steps 50 --run-dir results/quickstart/run0 \
        [--optimizer adamw|muon] [--data FOLDER] [--set key=value ...]
    torchrun --standalone --nproc_per_node=2 -m blunb.train ...

Per step: gradient accumulation to the global batch, a clipped optimizer step on the
rank-averaged gradient, the seed's step line on rank 0, one metrics.csv row. Validation
every val_freq steps and on the last step, averaged over ranks. A non-finite loss stops
the run with an error naming the step (its row is written first).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from blunb import kernels
from blunb.config import ConfigError, TrainConfig, apply_overrides, preset
from blunb.data import DataError, ShardLoader, corpus_meta, ensure_default_corpus, find_shards
from blunb.mfu import MFUMeter
from blunb.model import BLU
from blunb.optim.build import build_optimizers, check_replicas
from blunb.runs import MetricsWriter, environment


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss); the message names the step."""


class Console:
    """Rank 0 prints and mirrors to log.txt; other ranks stay quiet."""

    def __init__(self, rank: int, path: Path | None):
        self.rank = rank
        self._f = open(path, "a") if (rank == 0 and path is not None) else None

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


def _resolve_data(cfg: TrainConfig, rank: int, world_size: int) -> Path:
    if cfg.data != "default":
        folder = Path(cfg.data)
        find_shards(folder, "train"), find_shards(folder, "val")  # fail now, naming what is missing
        return folder
    if rank == 0:
        folder = ensure_default_corpus(progress=True)
    if world_size > 1:
        dist.barrier()
    return ensure_default_corpus(progress=False) if rank != 0 else folder


def _all_reduce_mean(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= world_size
    return t


@torch.no_grad()
def evaluate(model, loader: ShardLoader, steps: int, device, world_size: int) -> float:
    model.eval()
    loader.reset()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch()
        total += model(x.to(device), y.to(device))[1].float()
    model.train()
    return float(_all_reduce_mean(total / steps, world_size))


def _prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    if (run_dir / "metrics.csv").exists() and not overwrite:
        raise ConfigError(f"{run_dir} already holds a run (metrics.csv); choose a new --run-dir or pass --overwrite")
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.csv", "log.txt"):
        (run_dir / name).unlink(missing_ok=True)


def train(cfg: TrainConfig, run_dir: str | Path, overwrite: bool = False) -> Path:
    """Train `cfg`, writing the run folder; returns run_dir. Works single-process and under torchrun."""
    run_dir = Path(run_dir)
    rank, world_size, local_rank = _dist_env()
    cfg.validate(world_size)  # every config error before any work
    if cfg.kernels != "auto":
        os.environ["BLUNB_KERNELS"] = cfg.kernels
    device = _pick_device(cfg, local_rank)
    if rank == 0:
        _prepare_run_dir(run_dir, overwrite)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    log = Console(rank, run_dir / "log.txt")
    metrics = None
    try:
        data_dir = _resolve_data(cfg, rank, world_size)
        meta = corpus_meta(data_dir)
        if meta.get("vocab_size", 0) > cfg.model.vocab_size:
            raise ConfigError(f"the corpus tokenizer has {meta['vocab_size']} symbols but model.vocab_size is "
                              f"{cfg.model.vocab_size}")
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        # Shard order comes from the seed: every rank permutes identically.
        train_shards = find_shards(data_dir, "train")
        order = np.random.default_rng(cfg.seed).permutation(len(train_shards))
        train_loader = ShardLoader([train_shards[i] for i in order], cfg.B, cfg.T, rank, world_size)
        val_loader = ShardLoader(find_shards(data_dir, "val"), cfg.B, cfg.T, rank, world_size)

        model = BLU(cfg.model, device=device, seed=cfg.seed)
        opt = build_optimizers(model, cfg, device, world_size)
        accum = cfg.grad_accum_steps(world_size)
        tokens_per_step = cfg.B * cfg.T * accum * world_size
        meter = MFUMeter.build(cfg.model, seq_len=cfg.T, world_size=world_size, warmup_steps=cfg.mfu_warmup,
                               device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")

        if rank == 0:
            (run_dir / "config.json").write_text(cfg.to_json())
            env = environment(world_size, device)
            env["corpus"] = {"dir": str(data_dir), **meta}
            (run_dir / "env.json").write_text(json.dumps(env, indent=2))
            metrics = MetricsWriter(run_dir / "metrics.csv", ["tokens", "grad_accum", "skipped", "lr_muon",
                                                               "nsratio", "group_norms", "peak_mem_gib"])
        log(f"blunb {cfg.preset}: {model.num_params():,} params | world {world_size} x {device} | "
            f"B {cfg.B} T {cfg.T} accum {accum} -> {tokens_per_step:,} tokens/step")
        log(opt.describe())
        log("kernels: " + " ".join(f"{op}={b}" for op, b in kernels.describe(device).items()))
        log(f"data: {data_dir} ({meta.get('tokenizer')}, {meta.get('train_tokens', '?')} train tokens)")
        log(meter.banner(model.num_params(), tokens_per_step))

        start = time.perf_counter()
        last_val = None
        skipped_total = skipped_run = 0
        for step in range(cfg.max_steps):
            last_step = step == cfg.max_steps - 1
            val_this_step = None
            if step % cfg.val_freq == 0 or last_step:
                opt.drain()  # install any staged parameter refresh before reading the weights
                last_val = val_this_step = evaluate(model, val_loader, cfg.val_loss_steps, device, world_size)
                if cfg.diag:
                    log(f"[diag] replicas bit-identical: {check_replicas(model, world_size)}")
            t0 = time.perf_counter()
            lrs = opt.set_lr(step)
            loss_accum = torch.zeros((), device=device)
            for micro in range(accum):
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
            val_txt = f"{last_val:.6f}" if last_val is not None else "n/a"
            mfu_txt = "n/a" if math.isnan(row["mfu"]) else f"{row['mfu'] * 100:.2f}%"
            line = (f"step {step:6d} | train {train_loss:.6f} | val {val_txt} | tok/s {row['tok_per_sec']:.2f} | "
                    f"norm {stats['grad_norm']:.4f} | dt {dt * 1e3:.2f} ms | mfu {mfu_txt} | "
                    f"TF/gpu {row['tflops_per_gpu']:.1f} | lr {lrs['lr']:.4e}")
            line += "".join(f" | {k} {v:.4f}" for k, v in groups.items())
            if "global_clip" in stats:
                line += f" | globalclip {stats['global_clip']:.4f}"
            if "nsrej" in stats:
                line += f" | nsrej {stats['nsrej'][0]}/{stats['nsrej'][1]} | nsratio {stats['nsratio']:.3f}"
            if stats["skipped"]:
                line += f" | SKIPPED (non-finite gradient norm; {skipped_total} so far)"
            log(line)
            if not math.isfinite(train_loss):
                raise TrainingError(f"non-finite training loss ({train_loss}) at step {step}; stopping the run")
            if skipped_run >= cfg.max_consecutive_skips:
                raise TrainingError(f"the gradient norm was non-finite for {skipped_run} steps in a row (through "
                                    f"step {step}); stopping the run (max_consecutive_skips)")
        opt.drain()
        if cfg.diag:
            log(f"[diag] replicas bit-identical after the last step: {check_replicas(model, world_size)}")
        if skipped_total:
            log(f"{skipped_total} step(s) skipped for a non-finite gradient norm")
        log()
        log(meter.summary())
        log("=== Training complete ===")
        # Drop the model and optimizers now: their hooks form reference cycles that would
        # otherwise be collected at interpreter shutdown, where gloo work objects holding
        # tensors abort the process.
        del opt, model
        gc.collect()
        if world_size > 1:
            dist.barrier()
            dist.destroy_process_group()  # on success only: after a failure peers may be mid-collective
        return run_dir
    finally:
        if metrics:
            metrics.close()
        log.close()


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
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
