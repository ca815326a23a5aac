"""What checkpoint verification costs: save, sha256, load and verify times of one model + optimizer
checkpoint of a preset, single process.

    PYTHONPATH=. python3 bench/checkpoint_io.py --preset 1b --out results/bench/checkpoint_io.csv
    PYTHONPATH=. python3 bench/checkpoint_io.py --preset tiny --out /tmp/checkpoint_io.csv   # CPU smoke test

The state is what blunb.train checkpoints: the preset's model and optimizer set (fp32 masters and
moments after one step on random tokens) and the RNG states. Per repeat, one blunb.checkpoint.save
(save_s; its write_s and sha256_s are the seconds checkpoint.json records: DCP's write, then every
file's sha256 read back from disk), then, once with the files in the page cache (warm) and once
evicted from it (cold: posix_fadvise DONTNEED, as a resume on a fresh host reads them), each timed
alone: validate() with its sha256 pass (verify_s), load(verify=False) (load_s, what the trainer runs
after rank 0's validate) and load(verify=True) (load_verified_s). The CSV is rewritten after every
row, with the device, the versions and the git sha of blunb.runs.environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from blunb import checkpoint
from blunb.config import apply_overrides, preset
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.runs import environment

log = logging.getLogger("checkpoint_io")


def _evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (they are fsync'd, so clean: no root needed)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn, device: torch.device) -> float:
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _trained_state(cfg, device: torch.device):
    """The preset's model and optimizer set after one optimizer step on random tokens (B = 1)."""
    model = BLU(cfg.model, device=device, seed=cfg.seed)
    opt = build_optimizers(model, cfg, device, 1)
    x, y = torch.randint(0, cfg.model.vocab_size, (2, 1, cfg.T), device=device)
    opt.set_lr(0)
    with opt.micro_step(last=True):
        opt.forward_model(x, y)[1].backward()
    opt.step()
    opt.drain()
    return model, opt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a TrainConfig / ModelConfig field (repeatable), e.g. optimizer=muon")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where the checkpoints go (default: a temporary folder, removed after)")
    ap.add_argument("--out", default="results/bench/checkpoint_io.csv")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    cfg = apply_overrides(preset(args.preset), args.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(1, device)
    facts = {"preset": args.preset, "optimizer": cfg.optimizer, "params": cfg.model.num_params(),
             **{k: env[k] for k in ("device", "torch", "triton", "cuda", "git_sha", "git_dirty", "cpu_count")},
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    model, opt = _trained_state(cfg, device)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="blunb-checkpoint-io-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for repeat in range(args.repeats):
            step = repeat + 1
            started = time.perf_counter()
            saved = checkpoint.save(work, step, model, opt, keep=1)   # keep=1: one checkpoint on disk at a time
            save_s = round(time.perf_counter() - started, 3)
            if not saved:
                raise SystemExit(f"the save of step {step} failed (see the warning above)")
            path = work / "checkpoints" / f"step_{step}"
            record = json.loads((path / checkpoint.META_FILE).read_text())
            for cache in ("warm", "cold"):
                row = {**facts, "repeat": repeat, "cache": cache, "bytes": sum(record["files"].values()),
                       "files": len(record["files"]), "save_s": save_s, "write_s": record["seconds"]["write"],
                       "sha256_s": record["seconds"]["sha256"]}
                for name, fn in (("verify_s", partial(checkpoint.validate, path)),
                                 ("load_s", partial(checkpoint.load, path, model, opt, verify=False)),
                                 ("load_verified_s", partial(checkpoint.load, path, model, opt))):
                    if cache == "cold":
                        _evict(path)
                    row[name] = round(_timed(fn, device), 3)
                row["verify_gb_per_s"] = round(row["bytes"] / 1e9 / row["verify_s"], 2)
                rows.append(row)
                pd.DataFrame(rows).to_csv(out, index=False)
                log.info("%s", {k: row[k] for k in ("repeat", "cache", "bytes", "save_s", "sha256_s", "verify_s",
                                                    "load_s", "load_verified_s")})
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
