"""Train a preset under several settings in one go and tabulate throughput, MFU and memory.

    PYTHONPATH=. python3 bench/train_presets.py --preset 1b --steps 15 --nproc 1 \
        --variant adamw-torch-kernels optimizer=adamw kernels=torch \
        --variant adamw-fused-kernels optimizer=adamw kernels=auto --out results/bench/train_1b.csv

Each variant is a real `blunb.train` run (under torchrun when --nproc > 1) writing its own
run folder; steady-state figures drop the first --warmup steps (total tokens / total time).
With --copies N, each variant is N identical runs started together (several study runs sharing one
GPU): the row adds their summed tok/s and its ratio to the first variant's. E.g. the studies' 124m
runs two at a time, micro-batch 16 x 2 against 32 x 1:

    PYTHONPATH=. python3 bench/train_presets.py --preset 124m --steps 150 --copies 2 \
        --set data=/data/sp-bpe16k --set model.vocab_size=16384 --set global_batch=32768 \
        --set model.linear_dtype=bf16 --variant B16x2 B=16 --variant B32x1 B=32 \
        --out results/bench/study_throughput_124m.csv
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from blunb.launch import torchrun_command
from blunb.runs import load_run, steady_aggregates


def run_trainer_variant(preset: str, name: str, overrides: list[str], *, steps: int, warmup: int, nproc: int,
                        runs_dir: str | Path, profile_steps: int = 0, copies: int = 1) -> dict:
    """One real `blunb.train` run (under torchrun when nproc > 1) -> its steady-state row. With
    profile_steps, that many more steps run under the profiler (run folder's profile.csv), then the
    last one (which the trainer keeps out of the profile), all outside the steady window. With
    copies > 1, that many identical runs start together on the same device(s), as a study's runs
    share a GPU: the row's figures are their mean, aggregate_tok_per_sec their sum."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    timed = steps
    if profile_steps:
        overrides = [*overrides, f"profile_steps={profile_steps}"]
        steps += profile_steps + 1
    run_dirs = [Path(runs_dir) / (f"{preset}-w{nproc}-{name}" + (f"-copy{i}" if copies > 1 else ""))
                for i in range(copies)]
    procs = []
    for run_dir in run_dirs:
        train_args = ["--preset", preset, "--max-steps", str(steps), "--run-dir", str(run_dir),
                      "--overwrite"] + [a for kv in overrides for a in ("--set", kv)]
        cmd = torchrun_command(["-m", "blunb.train", *train_args], nproc) if nproc > 1 else \
            [sys.executable, "-m", "blunb.train", *train_args]
        print(f"=== {name}: {' '.join(train_args)}", flush=True)
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    codes = [proc.wait() for proc in procs]
    if any(codes):
        return {"variant": name, "status": f"failed ({', '.join(map(str, codes))})", "overrides": " ".join(overrides)}
    rows = pd.DataFrame([_steady_row(run_dir, warmup, timed) for run_dir in run_dirs])
    row = {"variant": name, "status": "ok", "preset": preset, "nproc": nproc, "copies": copies,
           **rows.iloc[0].to_dict(), **rows.select_dtypes("float").mean().to_dict()}
    row["aggregate_tok_per_sec"] = rows["steady_tok_per_sec"].sum()
    return {**row, "overrides": " ".join(overrides), "run_dir": str(run_dirs[0])}


def _steady_row(run_dir: Path, warmup: int, timed: int) -> dict:
    run = load_run(run_dir)
    m = run.metrics
    steady = m[(m["step"] >= warmup) & (m["step"] < timed)]
    return {
        "optimizer": run.config["optimizer"], "kernels": run.config["kernels"],
        "global_batch": run.config["global_batch"], "steps": len(m), "steady_steps": len(steady),
        "steady_ms_per_step": steady["dt_ms"].mean(), **steady_aggregates(steady),
        "steady_mfu_palm": (steady["mfu_palm"] * steady["dt_ms"]).sum() / steady["dt_ms"].sum(),
        "opt_step_ms": steady["opt_step_ms"].median(),
        "best_mfu": steady["mfu"].max(), "first_loss": m["train_loss"].iloc[0],
        # the timed steps' peak, as plain_llama.py measures the baseline's (after its warm-up)
        "final_loss": m["train_loss"].iloc[-1], "peak_mem_gib": steady["peak_mem_gib"].max(),
        "run_peak_mem_gib": m["peak_mem_gib"].max(),
        # where the rest of the run's wall clock went (process start, validation, checkpoints)
        **{f"wall_{k}_s": v for k, v in (run.status or {}).get("wall_s", {}).items() if k != "validations"},
        "device": run.env["device"], "torch": run.env["torch"], "triton": run.env["triton"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--set", dest="common", action="append", default=[], help="override for every variant")
    ap.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "KEY=VALUE"))
    ap.add_argument("--copies", type=int, default=1, help="identical runs started together per variant (a shared GPU)")
    ap.add_argument("--runs-dir", default="/tmp/blunb_bench_runs")
    ap.add_argument("--out", default="results/bench/train_presets.csv")
    args = ap.parse_args()

    rows = []
    for name, *overrides in args.variant:
        rows.append(run_trainer_variant(args.preset, name, args.common + overrides, steps=args.steps,
                                        warmup=args.warmup, nproc=args.nproc, runs_dir=args.runs_dir,
                                        copies=args.copies))
        print(pd.DataFrame(rows[-1:]).T.to_string(header=False), flush=True)
    table = pd.DataFrame(rows)
    if "aggregate_tok_per_sec" in table:  # against the first variant, measured in this call
        table["aggregate_vs_first"] = table["aggregate_tok_per_sec"] / table["aggregate_tok_per_sec"].iloc[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
