"""Muon benchmarks: Newton-Schulz engine, Triton SYRK, and the whole optimizer step.

  1 GPU:   PYTHONPATH=. python3 bench/muon.py --out results/bench/muon.csv
  2 GPUs:  PYTHONPATH=. torchrun --standalone --nproc_per_node=2 bench/muon.py --sharded --out results/bench/muon.csv
  CPU:     PYTHONPATH=. python3 bench/muon.py --smoke --out /tmp/muon.csv   (tiny shapes: checks it runs)
  Coefficient schedules (muon_ns_schedule, each at its own step count) and starts (muon_ns_precondition) at the
  presets' own shapes, 1 GPU:
           PYTHONPATH=. python3 bench/muon.py --schedules fixed:5,fixed:4,polar_express:4 --preconditions none,aol \
               --presets 124m,1b --out results/bench/muon_schedules.csv

(a) NS5 per call, bf16, on 1024^2, 2048x8192, 8192x2048 (tall: run in its own layout; compare
    with its transpose), 3072^2, 3072x8192: eager cuBLAS vs CUDA-graph replay vs graph +
    Triton SYRK (forced), each as host enqueue time per call (GPU kept busy by a sleep
    kernel, so this is pure Python + launch cost) and GPU time per call (kernels queued
    back to back behind the same sleep). With --presets, the shapes are each preset's body
    matrices instead, one NS call per shape group with the batch ShardedMuon runs at W = 1
    (case "<preset> <count>x<rows>x<cols>").
(b) SYRK vs cuBLAS X @ X^T, X [n, n] bf16, n = 1024..8192, kernel time; the Triton number is
    the best autotuned config (which passed the cuBLAS cross-check).
(c) The optimizer step on the 1b preset's 96 body matrices (--presets: each preset's; bf16
    weights, shapes built from ModelConfig): torch.optim.Muon vs ShardedMuon (eager NS, and
    graphs + auto SYRK) on 1 GPU, fused torch AdamW for scale; with --sharded, ShardedMuon on
    every rank of the torchrun (rows appended to the same CSV, with the ratio to the 1-GPU row
    of the same case and schedule when present). Step time is wall-clock per step over several
    synchronized steps, after two warm-up steps (eager, then capture).
Every ShardedMuon / NS row runs once per --schedules entry (newton_schulz.NS_SCHEDULES, "name" at --ns-steps or
"name:steps"; default fixed) and --preconditions entry (default none), named in the ns_schedule, ns_steps and
ns_precondition columns; torch.optim.Muon's rows are its own fixed coefficients at --ns-steps.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blunb.config import PRESETS, preset
from blunb.optim import ShardedMuon
from blunb.optim.newton_schulz import NS_SCHEDULES, PRECONDITIONS, NewtonSchulz

log = logging.getLogger("bench.muon")

COLUMNS = ["section", "case", "shape", "impl", "ns_schedule", "ns_steps", "ns_precondition", "world",
           "host_us_per_call", "gpu_ms", "step_ms", "speedup_vs_baseline", "note",
           "device", "torch", "triton", "python"]


@dataclass(frozen=True)
class Variant:
    """One Newton-Schulz setting to time: what muon_ns_schedule, muon_ns_steps and muon_ns_precondition select."""
    schedule: str
    steps: int
    precondition: str = "none"

    @property
    def label(self) -> str:
        return f"NS{self.steps} {self.schedule}" + ("" if self.precondition == "none" else f"+{self.precondition}")

    def columns(self) -> dict:
        return {"ns_schedule": self.schedule, "ns_steps": self.steps, "ns_precondition": self.precondition}


def parse_variants(schedules: str, ns_steps: int, preconditions: str = "none") -> list[Variant]:
    """--schedules x --preconditions: "fixed,polar_express" (each at ns_steps) or "fixed:5,polar_express:4" (each at
    its own count; forms mix), times every precondition, in the order given. ValueError names what is wrong."""
    pairs = []
    for entry in (e.strip() for e in schedules.split(",")):
        if not entry:
            continue
        name, _, steps = entry.partition(":")
        if name not in NS_SCHEDULES:
            raise ValueError(f"--schedules: unknown schedule {name!r} (known: {', '.join(NS_SCHEDULES)})")
        if steps and not steps.isdigit():
            raise ValueError(f"--schedules: {entry!r} is not name or name:steps")
        pairs.append((name, int(steps) if steps else ns_steps))
    precs = [p.strip() for p in preconditions.split(",") if p.strip()]
    unknown = [p for p in precs if p not in PRECONDITIONS]
    if unknown:
        raise ValueError(f"--preconditions: unknown {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(PRECONDITIONS)})")
    if not pairs or not precs:
        raise ValueError("--schedules and --preconditions each need at least one entry")
    if any(steps < 1 for _, steps in pairs):
        raise ValueError(f"Newton-Schulz steps must be >= 1 (--ns-steps or name:steps), got {schedules!r} with "
                         f"--ns-steps {ns_steps}")
    variants = [Variant(name, steps, prec) for name, steps in pairs for prec in precs]
    if len(set(variants)) != len(variants):
        raise ValueError(f"--schedules / --preconditions repeat a setting: {[v.label for v in variants]}")
    return variants


def _env(device: torch.device) -> dict:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "triton": tv, "python": platform.python_version()}


def host_and_gpu(fn, device, iters: int = 20) -> tuple[float, float]:
    """(host µs per call, GPU ms per call). On CPU both are the wall time of a call."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dt = (time.perf_counter() - t0) / iters
        return dt * 1e6, dt * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hasattr(torch.cuda, "_sleep"):  # private API: keeps the GPU busy while the host enqueues
        torch.cuda._sleep(100_000_000)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / iters
    end.synchronize()
    return host * 1e6, start.elapsed_time(end) / iters


def ns_cases(smoke, presets):
    """(case, batch, rows, cols) per NS call: the fixed list, or each preset's body grouped by shape."""
    if presets:
        cases = []
        for name in presets:
            counts: dict[tuple[int, int], int] = {}
            for shape in body_shapes(name):
                counts[shape] = counts.get(shape, 0) + 1
            cases += [(f"{name} {b}x{m}x{n}", b, m, n) for (m, n), b in counts.items()]
        return cases
    shapes = [(64, 64), (32, 128), (128, 32)] if smoke else \
        [(1024, 1024), (2048, 8192), (8192, 2048), (3072, 3072), (3072, 8192)]
    return [(f"{m}x{n}", 1, m, n) for m, n in shapes]


def bench_ns(rows, device, smoke, presets, variants):
    impls = [("eager", dict(graphs=False, syrk=False))]
    if device.type == "cuda":
        impls += [("graph", dict(graphs=True, syrk=False)), ("graph+syrk", dict(graphs=True, syrk=True))]
    for case, b, m, n in ns_cases(smoke, presets):
        base = None  # the first variant's eager call, so variants compare within a shape
        for v in variants:
            for impl, kw in impls:
                ns = NewtonSchulz(v.steps, v.schedule, precondition=v.precondition, **kw)
                stage = ns.stage(b, m, n, device)
                stage.copy_(torch.randn(b, m, n, device=device))
                for _ in range(3):  # eager/autotune, capture, replay
                    ns.run(stage)
                host, gpu = host_and_gpu(lambda ns=ns, stage=stage: ns.run(stage), device)
                base = base or gpu
                rows.append(dict(section=f"ns{v.steps}", case=case, shape=f"{b}x{m}x{n}", impl=impl, **v.columns(),
                                 host_us_per_call=host, gpu_ms=gpu, speedup_vs_baseline=base / gpu,
                                 note=f"baseline: eager cuBLAS, {variants[0].label}"))
                log.info("%s %s %-11s host %8.1f us  gpu %7.3f ms", v.label, case, impl, host, gpu)


def bench_syrk(rows, device, smoke):
    if device.type != "cuda":
        return  # the Triton kernel runs only under the interpreter on CPU: nothing to time
    from blunb.kernels.fused import syrk as fused
    for n in [1024, 2048, 4096, 8192]:
        x = (torch.randn(n, n, device=device) / n ** 0.5).bfloat16()
        v = fused.verdict(x, has_c=False)
        cublas = fused.gpu_time_ms(lambda x=x: x @ x.mT)
        if v["config"] is None:
            tri, note = float("nan"), "no config passed the cross-check"
        else:
            cfg = tuple(v["config"])
            tri = fused.gpu_time_ms(lambda x=x, cfg=cfg: fused.triton_syrk(x, config=cfg))
            note = f"config {cfg}, verdict {v['backend']}"
        flop = 2.0 * n ** 3
        for impl, ms in (("cublas", cublas), ("triton_syrk", tri)):
            rows.append(dict(section="syrk", case=f"n={n}", shape=f"{n}x{n}", impl=impl, gpu_ms=ms,
                             speedup_vs_baseline=cublas / ms,
                             note=f"{note}; {flop / ms / 1e9:.0f} TFLOP/s-equivalent (full GEMM flops)"))
        log.info("SYRK n=%d: cuBLAS %.4f ms, Triton %.4f ms -> x%.2f (%s)", n, cublas, tri, cublas / tri, note)


def body_shapes(name):
    m = preset(name).model
    d, q, kv, F = m.d_model, m.q_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_hidden
    per_layer = [(q, d), (kv, d), (kv, d), (d, q), (2 * F, d), (d, F)]  # wq wk wv wo gate_up down
    return per_layer * m.n_layers


def step_ms(make, device, shapes, steps):
    """Wall ms per optimizer step (synchronized), after 2 warm-up steps."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen).mul_(0.02).to(DTYPE[device.type]))
              for s in shapes]
    grads = [torch.randn(s, device=device, generator=gen).to(DTYPE[device.type]) for s in shapes]
    opt = make(params)
    for p, g in zip(params, grads):
        p.grad = g
    for _ in range(2):
        opt.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if dist.is_initialized():
        dist.barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    del opt, params, grads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}


def sharded_muon(variant: Variant, **kw):
    """A ShardedMuon factory running `variant`'s Newton-Schulz setting."""
    def make(ps):
        return ShardedMuon(ps, lr=8e-4, weight_decay=0.1, ns_steps=variant.steps, ns_coefficients=variant.schedule,
                           ns_precondition=variant.precondition, verbose=False, **kw)
    return make


def bench_step(rows, device, name, world, variants, ns_steps):
    shapes = body_shapes(name)
    n = sum(a * b for a, b in shapes)
    case, steps = f"{name} body: {len(shapes)} matrices, {n / 1e6:.0f}M params", 2 if name == "tiny" else 5
    impls = []  # (impl, Variant or None, make)
    for v in variants:
        if world == 1:
            impls += [("ShardedMuon eager NS", v, sharded_muon(v, ns_graphs=False, ns_syrk=False)),
                      ("ShardedMuon graphs+syrk(auto)", v, sharded_muon(v))]
        else:
            impls += [(f"ShardedMuon {coll} x{world}", v, sharded_muon(v, collective=coll))
                      for coll in ("rs_ag", "reduce_bcast")]
    if world == 1:
        impls.insert(0, ("torch.optim.Muon", Variant("fixed", ns_steps), lambda ps: torch.optim.Muon(
            ps, lr=8e-4, weight_decay=0.1, ns_steps=ns_steps, adjust_lr_fn="match_rms_adamw")))
        if device.type == "cuda":
            impls.append(("torch.optim.AdamW fused (scale)", None,
                          lambda ps: torch.optim.AdamW(ps, lr=8e-4, fused=True)))
    base = None
    for impl, v, make in impls:
        ms = step_ms(make, device, shapes, steps)
        base = base or ms
        rows.append(dict(section="step", case=case, shape=f"{name} body", impl=impl, **(v.columns() if v else {}),
                         world=world, step_ms=ms, speedup_vs_baseline=base / ms,
                         note="baseline: " + impls[0][0]))
        if (not dist.is_initialized()) or dist.get_rank() == 0:
            log.info("step %s %-34s %-18s %8.2f ms  (x%.2f)", name, impl, v.label if v else "", ms, base / ms)


def reference_key(row: dict) -> tuple:
    """What a sharded row is compared on with the 1-GPU row: case and the Newton-Schulz setting (CSV cells are
    strings, so the steps are too)."""
    return row["case"], row["ns_schedule"], str(row["ns_steps"]), row["ns_precondition"]


def one_gpu_reference(path) -> dict[tuple, float]:
    """The 1-GPU graphs+syrk step times in an existing CSV by reference_key, for the sharded ratio."""
    try:
        with open(path) as f:
            return {reference_key(r): float(r["step_ms"]) for r in csv.DictReader(f)
                    if r["section"] == "step" and r["impl"] == "ShardedMuon graphs+syrk(auto)"}
    except (OSError, KeyError, ValueError):
        return {}


def parse_args(argv=None) -> tuple[argparse.Namespace, list[Variant], list[str]]:
    """The options, the Newton-Schulz variants to time and the presets; a bad value exits with a usage error."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench/muon.csv")
    ap.add_argument("--sharded", action="store_true", help="under torchrun: the sharded optimizer step only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (or GPU): checks the script runs")
    ap.add_argument("--schedules", default="fixed",
                    help=f"comma-separated Newton-Schulz coefficient schedules, of {', '.join(NS_SCHEDULES)}, each "
                         "at --ns-steps or at its own count as name:steps (fixed:5,polar_express:4)")
    ap.add_argument("--preconditions", default="none",
                    help=f"comma-separated Newton-Schulz starts (muon_ns_precondition), of {', '.join(PRECONDITIONS)}; "
                         "each schedule entry runs with each")
    ap.add_argument("--presets", default="",
                    help="comma-separated presets whose body shapes the NS and step sections use "
                         "(default: the fixed NS shapes and the 1b body; tiny under --smoke)")
    ap.add_argument("--ns-steps", type=int, default=5,
                    help="Newton-Schulz iterations (muon_ns_steps) of a schedule given without :steps, and of "
                         "torch.optim.Muon's row")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        ap.error(f"--presets takes {', '.join(PRESETS)}; got unknown {', '.join(unknown)}")
    if args.ns_steps < 1:
        ap.error(f"--ns-steps must be >= 1, got {args.ns_steps}")
    try:
        variants = parse_variants(args.schedules, args.ns_steps, args.preconditions)
    except ValueError as exc:
        ap.error(str(exc))
    return args, variants, presets


def main():
    args, variants, presets = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    world, rank = 1, 0
    if args.sharded:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    elif device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)

    rows: list[dict] = []
    t0 = time.time()
    step_presets = presets or ["tiny" if args.smoke else "1b"]
    if args.sharded:
        for name in step_presets:
            bench_step(rows, device, name, world, variants, args.ns_steps)
        refs = one_gpu_reference(args.out)
        for r in rows:
            ref = refs.get(reference_key(r))
            if ref is not None:
                r["note"] += f"; ratio to the 1-GPU graphs+syrk step ({ref:.2f} ms): {r['step_ms'] / ref:.3f}"
    else:
        bench_ns(rows, device, args.smoke, presets, variants)
        bench_syrk(rows, device, args.smoke)
        for name in step_presets:
            bench_step(rows, device, name, 1, variants, args.ns_steps)

    if rank == 0:
        env = _env(device)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        append = args.sharded and os.path.exists(args.out)
        if append:
            with open(args.out, newline="") as f:
                header = next(csv.reader(f), [])
            if header != COLUMNS:
                raise SystemExit(f"{args.out} has other columns ({', '.join(header)}): written by an older "
                                 "bench/muon.py; run the 1-GPU bench into it again first, or give another --out")
        with open(args.out, "a" if append else "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            if not append:
                w.writeheader()
            for r in rows:
                w.writerow({"world": world, **env, **r})
        log.info("wrote %d rows to %s in %.0f s", len(rows), args.out, time.time() - t0)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
