"""The ZeRO-1 overlap grid on W GPUs in one launch: every overlap x layout x reduce-dtype variant of
both optimizer sets plus torch's baselines, same model, same batches. Writes the measured CSV that
blunb.studies.overlap.load_measured (notebooks/12_overlap.ipynb, section 4) reads.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 bench/overlap_grid.py --preset 1b \\
        --out results/overlap/multi_gpu_1b_w2.csv
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 bench/overlap_grid.py --preset seed-4b --B 1 --T 4096 \\
        --out results/overlap/multi_gpu_seed-4b_w2.csv
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 bench/overlap_grid.py --smoke   # CPU gloo, tiny: logic

(PYTHONPATH=. makes bench/zero.py importable.) Variants, baselines first; --variants NAME,... and
--optimizers adamw,muon,ddp_adamw,torch_zero (the CSV's optimizer column) pick a subset:
  ddp_adamw       the trainer's optimizer=ddp_adamw: torch DDP + fused AdamW, fp32 params, autocast bf16
  torch_zero      torch ZeroRedundancyOptimizer + DDP on the model's own dtypes (bench/zero.py's)
  <opt>.<tokens>  the trainer's ZeRO-1 set for optimizer=adamw|muon (build_optimizers on the preset's
                  TrainConfig), named as the equivalence study's arms (blunb.studies.overlap.SWITCHES): ob
                  overlap_backward, or overlap_refresh, rb collective=reduce_bcast (the AdamW groups), mrb
                  muon_collective=reduce_bcast (the Muon group), fp32 / bf16 reduce_dtype; "serial": none.
The default grid, per optimizer: {serial, ob, or, ob+or} x {rs_ag, reduce_bcast} x {param, fp32, bf16}
= 24, 50 variants in all. Its layout axis is rb for adamw and mrb for muon: the Muon group holds most of
a muon set's bytes, and its AdamW groups keep the trainer's default rs_ag. Other layouts run by name,
e.g. the seed's Muon arm muon.ob+or+rb (AdamW groups reduce_bcast, Muon rs_ag) or muon.rb+mrb.

Per variant: a fresh model, B x T random tokens per rank (seeded per rank), one micro-step per
optimizer step (global_batch = B T W), driven as blunb/train.py's train_step drives it; `warmup`
steps, then the mean step time over `steps` (one device sync at each end, as bench/zero.py: the
refresh pipelined across steps is measured, not hidden), tok/s, MFU (causal and PaLM), peak allocated
memory per GPU (max over ranks, reset between variants), the last loss; then `profile_steps` more
steps under torch.profiler on rank 0 (after a barrier, closed by the next step's forward without
gradients, so each step's refresh overlaps a forward as in training): communication kernel time
(names containing "nccl") and the part of it no compute kernel overlaps (exposed_comm_ms), per step,
waits for late ranks included; NaN on the CPU (no kernels).
W = 1 reference: before the process group exists every rank runs adamw.serial and muon.serial alone
on its own device (build_optimizers' sets use the default process group, so no one-rank group can
stand in; all ranks at once load the host as the W-rank run does); the mean over ranks gives
speedup_vs_w1 = tok/s / W=1 tok/s (muon rows against muon, the rest against adamw) and
scaling_efficiency = speedup / W. step_vs_ddp = step_ms / ddp_adamw's step_ms.

Columns: blunb.studies.overlap.MEASURED_KEYS, step_ms, device, torch (load_measured's), then variant,
tok_per_s, tok_per_s_per_gpu, mfu, mfu_palm, peak_mem_gib, loss_last, comm_ms, exposed_comm_ms,
w1_tok_per_s, speedup_vs_w1, scaling_efficiency, step_vs_ddp, warmup_steps, timed_steps,
profiled_steps, cuda, nccl, date. Baseline rows say what torch does: collective all_reduce
(+broadcast), overlap_backward True (DDP's bucket hooks), bucket_mb DDP's cap. The CSV is rewritten
after every variant, so a run cut short keeps what it measured; split a long grid over launches
with --optimizers or --variants into several multi_gpu_*.csv files (load_measured reads them all).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import itertools
import json
import logging
import math
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from blunb.config import ConfigError, TrainConfig, apply_overrides, preset
from blunb.mfu import MFUMeter
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.studies.overlap import MEASURED_KEYS, MIB, SWITCHES, arm_name, arm_tokens
from blunb.train import _init_distributed, _model_config

log = logging.getLogger("overlap_grid")

BASELINES = ("ddp_adamw", "torch_zero")
OPTIMIZERS = ("adamw", "muon", *BASELINES)
LAYOUT = {"adamw": "rb", "muon": "mrb"}            # the grid's layout token per optimizer set
DTYPE_TOKENS = ("fp32", "bf16")
COLUMNS = [*MEASURED_KEYS, "step_ms", "device", "torch", "variant", "tok_per_s", "tok_per_s_per_gpu", "mfu",
           "mfu_palm", "peak_mem_gib", "loss_last", "comm_ms", "exposed_comm_ms", "w1_tok_per_s", "speedup_vs_w1",
           "scaling_efficiency", "step_vs_ddp", "warmup_steps", "timed_steps", "profiled_steps", "cuda", "nccl",
           "date"]


def default_grid() -> list[str]:
    names = list(BASELINES)
    for opt in ("adamw", "muon"):
        for ov, lay, dt in itertools.product([(), ("ob",), ("or",), ("ob", "or")], [(), (LAYOUT[opt],)],
                                             [()] + [(t,) for t in DTYPE_TOKENS]):
            names.append(arm_name(opt, ov + lay + dt))
    return names


def optimizer_of(name: str) -> str:
    return name if name in BASELINES else arm_tokens(name)[0]


def variant_config(name: str, base: TrainConfig, world: int, bucket_mb: float | None) -> TrainConfig:
    """The TrainConfig a variant runs with (ConfigError naming the problem when it cannot)."""
    cfg = copy.deepcopy(base)
    cfg.global_batch = cfg.B * cfg.T * world          # one micro-step per optimizer step
    if name in BASELINES:
        cfg.optimizer = "ddp_adamw" if name == "ddp_adamw" else "adamw"  # torch_zero reads the model, bucket_mb
        tokens = ()
    else:
        if "." not in name:
            raise ConfigError(f"unknown: not a baseline ({', '.join(BASELINES)}) nor <adamw|muon>.<tokens joined "
                              "by +> (or .serial)")
        cfg.optimizer, tokens = arm_tokens(name)
        if cfg.optimizer not in LAYOUT:
            raise ConfigError(f"the optimizer must be adamw or muon, got {cfg.optimizer!r}")
        bad = [t for t in tokens if t not in SWITCHES or (t == "mrb" and cfg.optimizer != "muon")]
        if bad or len(set(tokens)) < len(tokens) or sum(t in DTYPE_TOKENS for t in tokens) > 1:
            raise ConfigError(f"tokens must be distinct, at most one of {DTYPE_TOKENS}, from {sorted(SWITCHES)} "
                              f"(mrb for muon only); bad: {bad or tokens}")
    if bucket_mb is not None and name != "ddp_adamw":  # ddp_adamw keeps torch DDP's own bucket cap
        cfg.bucket_mb = bucket_mb
    apply_overrides(cfg, [SWITCHES[t] for t in tokens])
    cfg.validate(world)
    return cfg


# ------------------------------------------------------------------ exposed communication

def merge(intervals) -> list[list[float]]:
    """Union of (start, end) intervals as sorted, disjoint [start, end] pairs."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def exposed_time(comm, compute) -> tuple[float, float]:
    """(busy, exposed): how long at least one `comm` interval runs, and the part of that time no
    `compute` interval covers. Intervals are (start, end) pairs in any order, overlaps allowed."""
    comm, cover = merge(comm), merge(compute)
    busy = sum(end - start for start, end in comm)
    hidden, j = 0.0, 0
    for start, end in comm:
        while j < len(cover) and cover[j][1] <= start:   # both lists are sorted: never look back
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            hidden += min(end, cover[k][1]) - max(start, cover[k][0])
            k += 1
    return busy, busy - hidden


def comm_ms(prof, steps: int) -> tuple[float, float]:
    """(communication, exposed communication) ms per step from a profile's device kernels (the
    Chrome trace's "kernel" events; memcpy / memset and annotations are other categories); NaN when
    there are none (the CPU). A compute kernel and a NCCL one overlap only on different streams."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    comm, compute = [], []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            (comm if "nccl" in e["name"].lower() else compute).append((e["ts"], e["ts"] + e["dur"]))
    if not comm and not compute:
        return math.nan, math.nan
    busy, exposed = exposed_time(comm, compute)
    return busy / 1e3 / steps, exposed / 1e3 / steps


# ------------------------------------------------------------------ one variant

def build(name: str, cfg: TrainConfig, device: torch.device, world: int):
    """-> (model, step(x, y) -> loss, drain(), row fields describing what the variant runs)."""
    if name == "torch_zero":
        from bench.zero import build as build_bench_zero  # lazy: torch.distributed.optim warns on import

        model = BLU(cfg.model, device=device, seed=cfg.seed)
        step, _, drain = build_bench_zero("torch_zero", {}, model, device, None, cfg.bucket_mb)
        return model, step, drain, dict(collective="all_reduce+broadcast", muon_collective="", reduce_dtype="param",
                                        overlap_backward=True, overlap_refresh=False, bucket_mb=cfg.bucket_mb,
                                        muon_buckets="")
    model = BLU(_model_config(cfg), device=device, seed=cfg.seed)
    opt = build_optimizers(model, cfg, device, world)

    def step(x, y):  # blunb/train.py's train_step with one micro-step; the lr stays at its peak
        with opt.micro_step(last=True):
            _, loss = opt.forward_model(x, y)
            loss.backward()
        opt.step()
        return loss

    if name == "ddp_adamw":
        cap = getattr(opt.forward_model, "bucket_bytes_cap", math.nan)     # W > 1: torch DDP
        fields = dict(collective="all_reduce", muon_collective="", reduce_dtype="param", overlap_backward=True,
                      overlap_refresh=False, bucket_mb=cap / MIB, muon_buckets="")
    else:
        fields = {k: getattr(cfg, k) for k in ("collective", "muon_collective", "reduce_dtype", "overlap_backward",
                                               "overlap_refresh", "bucket_mb", "muon_buckets")}
    return model, step, opt.drain, fields


def measure(name: str, cfg: TrainConfig, args, device: torch.device, world: int, rank: int) -> dict:
    """Time one variant on every rank of the current process group (or alone before there is one)."""
    cuda = device.type == "cuda"
    grouped = dist.is_initialized()
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    barrier = dist.barrier if grouped else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model, step, drain, fields = build(name, cfg, device, world)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    batches = [torch.randint(cfg.model.vocab_size, (2, cfg.B, cfg.T), device=device, generator=gen)
               for _ in range(4)]
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sync()
            barrier()
            t0 = time.perf_counter()
        x, y = batches[i % len(batches)]
        loss = step(x, y)
    drain()          # the last refresh belongs to the timed steps
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    loss_last = loss.item()
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) if cuda else math.nan, dtype=torch.float64,
                        device=device)
    if grouped:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    comm = exposed = math.nan
    if args.profile_steps and grouped:     # every rank steps (the collectives), rank 0 profiles
        barrier()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        prof = torch.profiler.profile(activities=activities) if rank == 0 else None
        if prof is not None:
            prof.start()
        for i in range(args.profile_steps):
            x, y = batches[i % len(batches)]
            step(x, y)
        with torch.no_grad():   # the next forward: the last refresh has its steady-state cover, not none
            model(x, y)
        drain()
        sync()
        if prof is not None:
            prof.stop()
            comm, exposed = comm_ms(prof, args.profile_steps)
    tokens = cfg.B * cfg.T * world
    meter = MFUMeter.build(cfg.model, seq_len=cfg.T, world_size=world,
                           device_name=torch.cuda.get_device_name(device) if cuda else "cpu")
    row = dict(variant=name, optimizer=optimizer_of(name), world_size=world, **fields, B=cfg.B, T=cfg.T,
               global_batch=tokens, step_ms=round(dt * 1e3, 3), tok_per_s=round(tokens / dt),
               tok_per_s_per_gpu=round(tokens / dt / world), mfu=round(meter.mfu(dt, tokens), 4),
               mfu_palm=round(meter.mfu_palm(dt, tokens), 4), peak_mem_gib=round(peak.item() / 2**30, 3),
               loss_last=round(loss_last, 4), comm_ms=round(comm, 3), exposed_comm_ms=round(exposed, 3))
    del model, step, drain, batches, loss
    gc.collect()                  # the optimizers' hooks make reference cycles with the model
    if cuda:
        torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------ the launch

def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)     # a reader never sees a half-written file


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: results/overlap/multi_gpu_<preset>_w<W>.csv "
                    "(--smoke: /tmp/blunb_overlap_grid_smoke.csv)")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--B", type=int, default=None, help="micro-batch per GPU (default: the preset's)")
    ap.add_argument("--T", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--profile-steps", type=int, default=2, help="extra profiled steps on rank 0 (0: none)")
    ap.add_argument("--bucket-mb", type=float, default=None, help="ZeRO AdamW / torch_zero DDP buckets "
                    "(default: the preset's bucket_mb); ddp_adamw keeps torch's")
    ap.add_argument("--variants", default=",".join(default_grid()), help="comma-separated variant names")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="keep the variants of these optimizer sets")
    ap.add_argument("--no-w1", action="store_true", help="skip the W = 1 reference (speedup columns empty)")
    ap.add_argument("--smoke", action="store_true", help="tiny preset on CPU gloo, 2 timed steps (logic check)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.warmup, args.steps = "tiny", 1, 2
        args.B, args.T = args.B or 2, args.T or 64
        args.bucket_mb = args.bucket_mb or 0.25       # several AdamW buckets on the tiny model
        args.out = args.out or "/tmp/blunb_overlap_grid_smoke.csv"
    return ap, args


def plan(ap, args, world: int, local_world: int) -> tuple[dict[str, TrainConfig], dict[str, TrainConfig]]:
    """(variant -> TrainConfig at W, W = 1 reference -> TrainConfig at 1), every one checked before any
    work (ap.error on bad input). ddp_adamw runs first: every later row divides by its step time."""
    if world < 2:
        ap.error(f"needs W >= 2 ranks under torchrun (got WORLD_SIZE={world}); W = 1 is the reference it "
                 "measures itself")
    if world % local_world:
        ap.error(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world} (ranks per node)")
    if args.steps < 1 or args.warmup < 0 or args.profile_steps < 0:
        ap.error("need --steps >= 1, --warmup >= 0 and --profile-steps >= 0")
    optimizers = [o for o in args.optimizers.split(",") if o]
    if set(optimizers) - set(OPTIMIZERS):
        ap.error(f"unknown optimizers {sorted(set(optimizers) - set(OPTIMIZERS))}; known: {', '.join(OPTIMIZERS)}")
    try:
        base = preset(args.preset)
        base.device = "cpu" if args.smoke else "cuda"
        base.B, base.T = args.B or base.B, args.T or base.T
        plans = {}
        names = sorted(dict.fromkeys(n for n in args.variants.split(",") if n), key=lambda n: n != "ddp_adamw")
        for name in names:
            try:
                cfg = variant_config(name, base, world, args.bucket_mb)
            except ConfigError as err:
                ap.error(f"variant {name}: {err}")
            if optimizer_of(name) in optimizers:
                plans[name] = cfg
        if not plans:
            ap.error("no variant left: --variants and --optimizers select nothing in common")
        # the W = 1 ZeRO set each row is compared with: muon rows with muon, the others with adamw
        refs = {"muon" if optimizer_of(n) == "muon" else "adamw" for n in plans} if not args.no_w1 else set()
        w1 = {opt: variant_config(arm_name(opt, ()), base, 1, args.bucket_mb) for opt in sorted(refs)}
    except ConfigError as err:
        ap.error(str(err))
    return plans, w1


def w1_references(w1: dict[str, TrainConfig], args, device: torch.device, rank: int) -> dict[str, float]:
    """optimizer -> this rank's tok/s at W = 1 (no process group: the trainer's single-process path)."""
    out = {}
    for opt, cfg in w1.items():
        row = measure(arm_name(opt, ()), cfg, args, device, 1, rank)
        log.info(f"W=1 {row['variant']}: {row['step_ms']:.2f} ms/step, {row['tok_per_s']} tok/s (rank {rank})")
        out[opt] = row["tok_per_s"]
    return out


def main(argv=None) -> None:
    ap, args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    plans, w1_plans = plan(ap, args, world, local_world)
    use_cuda = not args.smoke
    if use_cuda and not torch.cuda.is_available():
        ap.error("no CUDA device: run on GPUs, or --smoke on the CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    out = Path(args.out or f"results/overlap/multi_gpu_{args.preset}_w{world}.csv")
    first = next(iter(plans.values()))
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info(f"{len(plans)} variants at W={world} ({world // local_world} node(s)), {args.preset} "
                 f"B={first.B} T={first.T} -> {out}")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True      # as blunb/train.py's setup
        torch.backends.cudnn.allow_tf32 = True

    w1 = w1_references(w1_plans, args, device, rank)       # before the process group exists
    _init_distributed(first, device, world)
    if w1:
        mean = torch.tensor(list(w1.values()), dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        w1 = {k: v / world for k, v in zip(w1, mean.tolist())}
        log.info("W=1 tok/s, mean over ranks: " + ", ".join(f"{k} {v:.0f}" for k, v in w1.items()))
    env = dict(nodes=world // local_world, device=torch.cuda.get_device_name(device) if use_cuda else "cpu",
               torch=torch.__version__, cuda=torch.version.cuda or "",
               nccl=".".join(map(str, torch.cuda.nccl.version())) if use_cuda else "",
               date=datetime.now(timezone.utc).isoformat(timespec="seconds"), warmup_steps=args.warmup,
               timed_steps=args.steps, profiled_steps=args.profile_steps, preset=args.preset)
    rows: list[dict] = []
    ddp_ms = math.nan
    for i, (name, cfg) in enumerate(plans.items()):
        t0 = time.perf_counter()
        row = {**measure(name, cfg, args, device, world, rank), **env}
        ref = w1.get("muon" if row["optimizer"] == "muon" else "adamw", math.nan)
        speedup = row["tok_per_s"] / ref
        if name == "ddp_adamw":
            ddp_ms = row["step_ms"]
        row.update(w1_tok_per_s=round(ref, 1), speedup_vs_w1=round(speedup, 3),
                   scaling_efficiency=round(speedup / world, 3),
                   step_vs_ddp="" if name == "ddp_adamw" else round(row["step_ms"] / ddp_ms, 3))
        rows.append(row)
        if rank == 0:
            write_csv(out, rows)
            log.info(f"[{i + 1}/{len(plans)}] {name}: {row['step_ms']:.2f} ms/step, {row['tok_per_s']} tok/s, "
                     f"MFU {row['mfu']}, peak {row['peak_mem_gib']} GiB, comm {row['comm_ms']} ms "
                     f"(exposed {row['exposed_comm_ms']}), x{row['speedup_vs_w1']} vs W=1, step/DDP "
                     f"{row['step_vs_ddp'] or '-'} ({time.perf_counter() - t0:.0f} s)")
    if rank == 0:
        log.info(f"wrote {out} ({len(rows)} rows)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
