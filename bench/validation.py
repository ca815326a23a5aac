"""What a validation pass costs against a training step: the trainer's own evaluate() over a ValidationSet,
timed beside the training step of the same model, optimizer set and micro-batch, single process.

    PYTHONPATH=. python3 bench/validation.py --preset 124m --set model.linear_dtype=bf16 --profile \
        --out results/bench/validation_124m.csv
    PYTHONPATH=. python3 bench/validation.py --preset tiny --steps 2 --passes 1 --out /tmp/v.csv   # CPU smoke test

Why: the GPU studies' runs spend 19-25 s of ~100 s of steps on 9 validation passes of 1,048,576 tokens
(124m alone on an H100, status.json's wall_s), i.e. a forward-only pass at about a training step's tok/s,
where a forward is about a third of a step's FLOPs. The variants split where a pass's time goes:
 - `train_step`: the trainer's step (micro_step, forward, backward, the optimizer step), tok/s;
 - `evaluate_first_pass`: evaluate's first pass, which compiles the no_grad / eval graphs (once per run);
 - `evaluate`: blunb.train.evaluate over a ValidationSet of --val-tokens random tokens in a temporary shard
   (the memmap reads, host batches and their copies to the device included);
 - `eval_device_batches`: the same model calls over the same batches already on the device, no_grad, eval
   mode: the pass without its host side.
Each row: tok/s, ms per micro-batch, the ratio to train_step, and the mean loss (evaluate's and the device
batches' must agree: the same tokens). --profile adds the top CUDA kernels of one evaluate pass to
<out>_profile.csv. The CSV carries the device, versions and git sha (blunb.runs.environment).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from blunb.config import apply_overrides, preset
from blunb.data import ValidationSet, write_shard
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.runs import environment
from blunb.train import _model_config, evaluate

log = logging.getLogger("validation")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Seconds per call over `repeats` calls after the device is idle, and the last call's result."""
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    _sync(device)
    return (time.perf_counter() - started) / repeats, result


def _device_batches_loss(model, batches, device: torch.device) -> float:
    """evaluate()'s token-weighted mean over batches already on the device."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in batches:
            total[0] += model(x, y)[1].double() * y.numel()
            total[1] += y.numel()
    model.train()
    return float(total[0] / total[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="124m")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a TrainConfig / ModelConfig field (repeatable), e.g. model.linear_dtype=bf16")
    ap.add_argument("--steps", type=int, default=20, help="timed training steps (after 3 untimed)")
    ap.add_argument("--passes", type=int, default=3, help="timed validation passes per variant (after 1 untimed)")
    ap.add_argument("--val-tokens", type=int, default=1 << 20)
    ap.add_argument("--profile", action="store_true", help="profile one evaluate pass (CUDA kernels)")
    ap.add_argument("--out", default="results/bench/validation.csv")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.steps < 1 or args.passes < 1:
        ap.error("--steps and --passes must be >= 1")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = apply_overrides(preset(args.preset), args.overrides)
    cfg.resolve_auto(device.type)   # compile and the chunked loss as the trainer decides them on this device
    if args.val_tokens < cfg.T:
        ap.error(f"--val-tokens must hold one window of T = {cfg.T} tokens")
    env = environment(1, device)
    facts = {"preset": args.preset, "overrides": " ".join(args.overrides), "B": cfg.B, "T": cfg.T,
             "compile": cfg.compile, "val_tokens": args.val_tokens,
             **{k: env[k] for k in ("device", "torch", "triton", "cuda", "git_sha", "git_dirty")},
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    torch.manual_seed(cfg.seed)
    model = BLU(_model_config(cfg), device=device, seed=cfg.seed)
    if cfg.compile:
        model.compile()   # as the trainer does: the forward (and through AOT autograd the backward) compiled
    opt = build_optimizers(model, cfg, device, 1)
    opt.set_lr(cfg.max_lr)
    x, y = torch.randint(0, cfg.model.vocab_size, (2, cfg.B, cfg.T), device=device)

    def train_step():
        with opt.micro_step(last=True):
            loss = opt.forward_model(x, y)[1]
            loss.backward()
        opt.step()
        return loss

    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(variant: str, seconds: float, tokens: int, micro_batches: int, loss: float) -> None:
        rows.append({**facts, "variant": variant, "tok_per_s": tokens / seconds,
                     "ms_per_micro_batch": seconds / micro_batches * 1e3, "loss": loss})
        table = pd.DataFrame(rows)
        table["vs_train_step"] = table["tok_per_s"] / table.loc[table["variant"] == "train_step", "tok_per_s"].iloc[0]
        table.to_csv(out, index=False)
        log.info("%-20s %12.0f tok/s  %8.2f ms per micro-batch  loss %.6f", variant, rows[-1]["tok_per_s"],
                 rows[-1]["ms_per_micro_batch"], loss)

    _timed(train_step, device, 3)   # compile, autotune, allocator
    seconds, loss = _timed(train_step, device, args.steps)
    record("train_step", seconds, cfg.B * cfg.T, 1, float(loss.detach()))

    with tempfile.TemporaryDirectory(prefix="blunb-validation-") as tmp:
        shard = Path(tmp) / "val_000000.bin"
        rng = np.random.default_rng(cfg.seed)
        write_shard(shard, rng.integers(0, cfg.model.vocab_size, args.val_tokens + cfg.T + 1))
        val_set = ValidationSet([shard], args.val_tokens, cfg.T)
        micro_batches = -(-val_set.n_seq // cfg.B)
        tokens = val_set.n_seq * cfg.T
        pass_ = lambda: evaluate(model, val_set, cfg.B, device, 1)  # noqa: E731
        # The first pass compiles the no_grad / eval graphs: once per run in the trainer, so its cost counts.
        seconds, loss = _timed(pass_, device, 1)
        record("evaluate_first_pass", seconds, tokens, micro_batches, loss)
        seconds, loss = _timed(pass_, device, args.passes)
        record("evaluate", seconds, tokens, micro_batches, loss)

        batches = [(bx.to(device), by.to(device)) for bx, by in val_set.batches(cfg.B)]
        device_pass = lambda: _device_batches_loss(model, batches, device)  # noqa: E731
        _timed(device_pass, device, 1)
        seconds, device_loss = _timed(device_pass, device, args.passes)
        record("eval_device_batches", seconds, tokens, micro_batches, device_loss)
        if not np.isclose(device_loss, loss, rtol=1e-6, atol=0):
            raise SystemExit(f"evaluate's loss {loss} and the device batches' {device_loss} differ: "
                             "not the same tokens")

        if args.profile and device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                pass_()
                _sync(device)
            kernels = pd.DataFrame([{"kernel": e.key, "calls": e.count, "cuda_ms": e.device_time_total / 1e3}
                                    for e in prof.key_averages()]).sort_values("cuda_ms", ascending=False)
            kernels.head(25).assign(**facts).to_csv(out.with_name(out.stem + "_profile.csv"), index=False)
            log.info("top kernels of one evaluate pass:\n%s", kernels.head(12).to_string(index=False))
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
