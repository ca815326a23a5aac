"""One-GPU compute timelines for the overlap study (notebooks/12_overlap.ipynb, blunb/studies/overlap.py).

    PYTHONPATH=. python3 bench/overlap_timeline.py                 # 1b and seed-4b on one GPU -> results/overlap/
    PYTHONPATH=. python3 bench/overlap_timeline.py --device cpu --presets tiny --out /tmp/ovl   # smoke test

Per preset and optimizer set (adamw, muon), `warmup + iters` steps of one micro-batch at the preset's
B x T (random tokens) with the trainer's own optimizer set at W = 1 (no process group): when each
parameter's gradient is ready in the backward and when each refresh stage is first needed in the
forward (CUDA events from autograd hooks, blunb.studies.overlap.measure_timeline), forward / backward /
optimizer-step times and peak memory. When a preset does not fit, B is halved until it does (the rows
say which B ran). Also the collective units of every layout at W = 2, 4, 8, 16 (buckets.csv; parameter
shapes only). Writes backward_timeline.csv, forward_timeline.csv, compute.csv, buckets.csv and
meta.json (device, versions, command, B per preset) into --out, after each preset.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from blunb.config import preset
from blunb.runs import environment
from blunb.studies import overlap


def timelines_that_fit(name: str, optimizer: str, device: torch.device, args, notes: list[str]):
    """measure_timeline at the preset's B, halving B on out-of-memory."""
    cfg = preset(name)
    cfg.optimizer, cfg.device = optimizer, device.type
    if args.n_layers:
        cfg.model.n_layers = args.n_layers
    cfg.B, cfg.T = args.B or cfg.B, args.T or cfg.T
    while True:
        try:
            return overlap.measure_timeline(cfg, device, iters=args.iters, warmup=args.warmup)
        except torch.cuda.OutOfMemoryError:
            if cfg.B == 1:
                raise
        # outside the except block: the failed attempt's frames (its model, optimizers) are released
        notes.append(f"{name} {optimizer}: B={cfg.B} ran out of memory; retried with B={cfg.B // 2}")
        print(notes[-1], flush=True)
        cfg.B //= 2
        gc.collect()          # its optimizers' hooks hold the model in reference cycles
        torch.cuda.empty_cache()


def bucket_rows(name: str, n_layers: int | None, device_type: str) -> pd.DataFrame:
    model = overlap.shapes_model(name, device_type, n_layers)
    parts = []
    for optimizer, world, collective, reduce_dtype in itertools.product(
            ("adamw", "muon"), (2, 4, 8, 16), ("rs_ag", "reduce_bcast"), ("param", "fp32", "bf16")):
        cfg = preset(name)
        cfg.optimizer, cfg.collective, cfg.muon_collective, cfg.reduce_dtype = optimizer, collective, collective, \
            reduce_dtype
        units = overlap.bucket_csv(overlap.comm_units(model, cfg, world))
        parts.append(units.assign(preset=name, optimizer=optimizer, world_size=world, bucket_mb=cfg.bucket_mb,
                                  muon_buckets=cfg.muon_buckets))
    return pd.concat(parts, ignore_index=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="1b,seed-4b")
    ap.add_argument("--optimizers", default="adamw,muon")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of the logic")
    ap.add_argument("--iters", type=int, default=3, help="measured steps (medians are reported)")
    ap.add_argument("--warmup", type=int, default=2, help="steps before (kernel compilation, graph capture)")
    ap.add_argument("--n-layers", type=int, default=0, help="a layer-sliced model (0: the preset's layers)")
    ap.add_argument("--B", type=int, default=0, help="micro-batch per step (0: the preset's)")
    ap.add_argument("--T", type=int, default=0, help="sequence length (0: the preset's)")
    ap.add_argument("--out", default="results/overlap")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/overlap_timeline.py measures GPU timelines and needs CUDA, which this machine lacks; "
                 "`--device cpu --presets tiny --out /tmp/ovl` runs its logic on the CPU as a smoke test")
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timelines, notes, buckets = [], [], []
    meta = {**environment(1, device), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "iters": args.iters, "warmup": args.warmup, "notes": notes}
    for name in args.presets.split(","):
        for optimizer in args.optimizers.split(","):
            t = timelines_that_fit(name, optimizer, device, args, notes)
            timelines.append(t)
            print(f"{name} {optimizer}: B={t.B} T={t.T} layers={t.n_layers} fwd {t.fwd_ms:.1f} ms, bwd {t.bwd_ms:.1f} "
                  f"ms, optimizer step {t.opt_step_ms:.1f} ms, peak {t.peak_mem_gib:.1f} GiB", flush=True)
        buckets.append(bucket_rows(name, args.n_layers or None, device.type))
        overlap.save_timelines(timelines, out)
        pd.concat(buckets, ignore_index=True).to_csv(out / "buckets.csv", index=False)
        meta["presets"] = {t.preset: {"B": t.B, "T": t.T, "n_layers": t.n_layers} for t in timelines}
        (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {', '.join(f'{n}.csv' for n in (*overlap.TIMELINE_FILES, 'buckets'))} and meta.json to {out}")


if __name__ == "__main__":
    main()
