"""Bit-reproducible GPU runs: two identical trainer runs per variant, metrics.csv compared exactly, and the cost
of deterministic=true, in one call on one GPU (<= 8 minutes on an H200 with the defaults).

    PYTHONPATH=. python3 bench/determinism.py --out results/bench/determinism.csv
    PYTHONPATH=. python3 bench/determinism.py --presets 124m --steps 50 --variants deterministic,muon-deterministic
    PYTHONPATH=. python3 bench/determinism.py --quick --out /tmp/determinism.csv   (CPU smoke test: tiny, a few steps)

Every run is its own `blunb.train` process (a second run in one process would reuse the first one's
autotuning and backend choices, hiding exactly what differs between two fresh runs), with its own empty
BLUNB_CACHE_DIR (so the SYRK verdicts are timed afresh, as on a new machine). Triton's and Inductor's on-disk
caches are shared between the runs: compiling every kernel per run would not fit the time; the flash
attention autotuner keeps its timed choice there (cache_results), so two default runs on one machine share
that one choice, which deterministic mode does not rely on (its configs are fixed).

Phases, each variant recorded as it ends (the CSV is rewritten after every variant, so a call cut short
keeps what it measured; one that fails is recorded with its error and the rest go on; a variant that would
not fit the --budget-s left is skipped, saying so):
 1. step-0 probes: pairs of 3-step runs started together (default and deterministic, AdamW and Muon); they
    also compile every kernel into the shared caches, so the timed runs after them measure steady steps.
 2. timed variants at each preset, the two runs of a pair one after the other (their steady tok/s from the
    trainer's own metrics is the variant's, against the default of the same optimizer):
    default / deterministic, muon-default / muon-deterministic, default-torchkernels /
    deterministic-torchkernels (kernels=torch), compile-default / compile-deterministic. At 1b, default
    (one run: its speed only) and deterministic (a pair).
 3. the bisection, when a default pair differs: pairs of 3-step deterministic=true runs, started --parallel
    at a time, each with one thing let go (bisection_probes): one part of the setting left out
    ("except:<part>", blunb.determinism.PARTS), or the kernels' timed configs back for one fused op with
    every other op on torch ("timed:<op>"); syrk under Muon. The summary reads them only where the full
    setting's own pair was identical.

Compared: every metrics.csv column but the timings (blunb.runs.TIMING_COLUMNS), with pandas' check_exact;
the first differing step and column are recorded. The log (<out>.log) holds the device and versions, each
variant's verdict, the timed choices the default runs made (Triton's autotuner and the flash attention
backend, from their console), the deterministic runs' start lines, and a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from blunb import kernels
from blunb.config import preset as get_preset
from blunb.data import ensure_default_corpus
from blunb.determinism import EXCEPT_ENV, PARTS
from blunb.runs import TIMING_COLUMNS, environment, read_status, steady_aggregates

PROBE_STEPS = 3  # the fewest the trainer takes (a decay tail): step 0 and two optimizer steps after it


@dataclass
class Variant:
    name: str
    preset: str
    overrides: list[str]
    runs: int = 2                # 2: compared; 1: speed only
    steps: int = 30
    together: bool = False       # the runs start at once (probes: no speed is read from them)
    baseline: str | None = None  # the variant whose tok/s the ratio is against
    kind: str = "variant"        # variant | probe
    env: dict[str, str] = field(default_factory=dict)  # the runs' extra environment (the bisection's parts)
    results: list[dict] = field(default_factory=list)

    @property
    def optimizer(self) -> str:
        return next((o.split("=", 1)[1] for o in self.overrides if o.startswith("optimizer=")), "adamw")

    @property
    def compiled(self) -> bool:
        return "compile=true" in self.overrides


# ---------------------------------------------------------------- comparing two runs

def first_difference(a: pd.DataFrame, b: pd.DataFrame) -> tuple[int, str] | None:
    """None when every non-timing column of two metrics tables is identical (pandas check_exact, NaN equal to
    NaN); else (the first step that differs, its first differing column): 'rows' when one run has fewer rows,
    'columns: ...' when the column sets differ (step 0)."""
    cols_a = [c for c in a.columns if c not in TIMING_COLUMNS]
    cols_b = [c for c in b.columns if c not in TIMING_COLUMNS]
    if cols_a != cols_b:
        return 0, "columns: " + ", ".join(sorted(set(cols_a) ^ set(cols_b)) or cols_b)
    n = min(len(a), len(b))
    x, y = a[cols_a].iloc[:n].reset_index(drop=True), b[cols_a].iloc[:n].reset_index(drop=True)
    try:
        pd.testing.assert_frame_equal(x, y, check_exact=True, check_dtype=False)
    except AssertionError:
        same = (x == y) | (x.isna() & y.isna())
        row = int((~same.all(axis=1)).to_numpy().argmax())
        return int(x["step"].iloc[row]) if "step" in x else row, str(same.columns[~same.iloc[row].to_numpy()][0])
    if len(a) != len(b):
        return n, "rows"
    return None


# ---------------------------------------------------------------- running the trainer

class Runner:
    def __init__(self, work: Path, log_path: Path, budget_s: float, device_arg: str):
        self.work, self.log_path, self.budget_s, self.device_arg = work, log_path, budget_s, device_arg
        self.t0 = time.monotonic()
        self.wall: dict[tuple, list[float]] = {}   # (preset, compiled, together) -> wall seconds of its runs
        self.serial = 0

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        with open(self.log_path, "a") as f:
            f.write(msg + "\n")

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def estimate_s(self, v: Variant) -> float:
        """A variant's expected wall time, from the runs of its kind so far (a guess before the first)."""
        seen = self.wall.get((v.preset, v.compiled, v.together))
        per_run = (sum(seen) / len(seen)) if seen else {"tiny": 15.0, "124m": 25.0, "1b": 50.0}.get(v.preset, 60.0)
        if v.compiled and not seen:
            per_run *= 3  # Inductor's first compile
        return per_run if v.together else per_run * v.runs

    def start(self, v: Variant, index: int) -> dict:
        self.serial += 1
        tag = f"{v.preset}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', v.name)}-r{index}"
        run_dir = self.work / "runs" / tag
        cache = self.work / "cache" / tag   # fresh SYRK verdicts per run
        shutil.rmtree(cache, ignore_errors=True)
        console = self.work / "console" / f"{tag}.txt"
        console.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "blunb.train", "--preset", v.preset, "--max-steps", str(v.steps),
               "--run-dir", str(run_dir), "--overwrite"]
        for kv in _common_overrides(v, self.device_arg) + v.overrides:
            cmd += ["--set", kv]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "BLUNB_CACHE_DIR": str(cache), **v.env}
        if "deterministic=true" not in v.overrides or "kernels" in v.env.get(EXCEPT_ENV, ""):
            env["TRITON_PRINT_AUTOTUNING"] = "1"  # the timed choices, for the log (changes no choice)
        f = open(console, "w")
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        return {"proc": proc, "file": f, "console": console, "run_dir": run_dir, "t0": time.monotonic(),
                "cmd": cmd}

    def wait(self, v: Variant, r: dict) -> dict:
        timeout = max(30.0, self.left_s() + 30.0)  # a run that overruns the budget by more is stopped
        try:
            rc = r["proc"].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            r["proc"].kill()
            rc = r["proc"].wait()
            r["timeout"] = timeout
        r["file"].close()
        wall = time.monotonic() - r["t0"]
        self.wall.setdefault((v.preset, v.compiled, v.together), []).append(wall)
        out = {"rc": rc, "wall_s": wall, "console": r["console"], "run_dir": r["run_dir"]}
        metrics = r["run_dir"] / "metrics.csv"
        if rc == 0 and metrics.is_file():
            out["metrics"] = pd.read_csv(metrics)
        else:
            out["error"] = _error_of(r, rc)
        return out

    def run_variant(self, v: Variant) -> None:
        if self.left_s() < self.estimate_s(v):
            v.results = [{"skipped": f"skipped (time budget: ~{self.estimate_s(v):.0f} s needed, "
                                     f"{max(self.left_s(), 0):.0f} s left)"}]
            return
        if v.together:
            started = [self.start(v, i) for i in range(v.runs)]
            v.results = [self.wait(v, r) for r in started]
        else:
            v.results = []
            for i in range(v.runs):
                v.results.append(self.wait(v, self.start(v, i)))
                if "error" in v.results[-1]:
                    break

    def run_together(self, variants: list[Variant], parallel: int) -> None:
        """Variants whose runs start at once, as many runs at a time as `parallel` allows."""
        queue = list(variants)
        while queue:
            wave, n = [], 0
            while queue and n + queue[0].runs <= max(parallel, queue[0].runs):
                wave.append(queue.pop(0))
                n += wave[-1].runs
            fits = [v for v in wave if self.left_s() >= self.estimate_s(v)]
            for v in wave:
                if v not in fits:
                    v.results = [{"skipped": f"skipped (time budget: {max(self.left_s(), 0):.0f} s left)"}]
            started = {v.name: [self.start(v, i) for i in range(v.runs)] for v in fits}
            for v in fits:
                v.results = [self.wait(v, r) for r in started[v.name]]


# --quick on a CPU: the tiny preset cut to one layer and 64-token steps (a smoke test of this script only)
QUICK_MODEL = ["n_layers=1", "B=2", "T=32"]


def _common_overrides(v: Variant, device_arg: str) -> list[str]:
    """One validation at step 0 and one at the end over 4 micro-batches, no checkpoints; at 124m the studies'
    32,768-token step (2 micro-batches), elsewhere one micro-batch per step."""
    cfg = get_preset(v.preset)
    out = QUICK_MODEL.copy() if device_arg == "cpu" else []
    B, T = (2, 32) if device_arg == "cpu" else (cfg.B, cfg.T)
    accum = 2 if v.preset == "124m" else 1
    out += [f"global_batch={accum * B * T}", f"val_freq={10 * v.steps}", f"val_tokens={4 * B * T}", "ckpt_freq=0",
            f"mfu_warmup={_warmup(v.steps)}"]
    return out + ([f"device={device_arg}"] if device_arg != "auto" else [])


def _warmup(steps: int) -> int:
    """Steps left out of the steady tok/s (compile, autotuning), leaving at least 3 timed ones where possible."""
    return min(5, max(steps - 3, 1))


def _error_of(r: dict, rc: int) -> str:
    if "timeout" in r:
        return f"timed out after {r['timeout']:.0f} s"
    status = read_status(r["run_dir"]) if r["run_dir"].is_dir() else None
    if status and status.get("error"):
        return f"rc {rc}: {status['error']}"[:400]
    lines = [ln for ln in r["console"].read_text(errors="replace").splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return f"rc {rc}: {(named or lines or ['(no output)'])[-1].strip()}"[:400]


# ---------------------------------------------------------------- the variants

def timed_variants(preset_name: str, steps: int, quick: bool) -> tuple[list[Variant], list[Variant]]:
    """(the variants the verdict and the cost rest on, the ones that isolate causes: run after every preset's
    first list and the bisection)."""
    det = "deterministic=true"
    if quick:
        return [Variant("deterministic", preset_name, [det], steps=steps, baseline="default"),
                Variant("default", preset_name, [], steps=steps)], []
    if preset_name == "1b":
        return [Variant("default", "1b", [], runs=1, steps=steps),
                Variant("deterministic", "1b", [det], steps=steps, baseline="default")], []
    core = [Variant("deterministic", preset_name, [det], steps=steps, baseline="default"),
            Variant("muon-deterministic", preset_name, ["optimizer=muon", det], steps=steps, baseline="muon-default"),
            Variant("default", preset_name, [], steps=steps),
            Variant("muon-default", preset_name, ["optimizer=muon"], steps=steps)]
    extra = [Variant("deterministic-torchkernels", preset_name, [det, "kernels=torch"], steps=steps,
                     baseline="default"),
             Variant("default-torchkernels", preset_name, ["kernels=torch"], steps=steps, baseline="default"),
             Variant("compile-default", preset_name, ["compile=true"], steps=steps, baseline="default"),
             Variant("compile-deterministic", preset_name, ["compile=true", det], steps=steps,
                     baseline="compile-default")]
    return core, extra


def step0_probes(preset_name: str, quick: bool) -> list[Variant]:
    names = [("probe default", [])]
    if not quick:
        names += [("probe deterministic", ["deterministic=true"]), ("probe muon-default", ["optimizer=muon"]),
                  ("probe muon-deterministic", ["optimizer=muon", "deterministic=true"])]
    return [Variant(n, preset_name, o, steps=PROBE_STEPS, together=True, kind="probe") for n, o in names]


# The parts of deterministic=true the bisection leaves out one at a time, per optimizer: Muon's own additions
# are its Newton-Schulz GEMMs (cuBLAS) and SYRK (a kernel).
EXCEPT_PARTS = {"adamw": PARTS, "muon": ("cublas", "kernels")}


def bisection_probes(preset_name: str, muon: bool, adamw: bool) -> list[Variant]:
    """Pairs of deterministic=true runs, each with one thing let go, so that a pair that differs names a cause
    (the full setting's own pair is identical; every other source stays fixed):
    except:<part>  one part of deterministic=true left at its default ($BLUNB_DETERMINISM_EXCEPT);
    timed:<op>     the kernels' timed configs back (except=kernels) with one fused op on auto and every other on
                   torch, whose ops stay deterministic under torch's flag; syrk (Newton-Schulz) under Muon.
    (A pair of default runs with one op on auto and the rest on torch says nothing: torch's own ops already
    make two such runs differ.)"""
    det = "deterministic=true"
    out = []
    for opt, wanted in (("adamw", adamw), ("muon", muon)):
        extra = ["optimizer=muon"] if opt == "muon" else []
        out += [Variant(f"probe except:{part}" + (" (muon)" if extra else ""), preset_name, [*extra, det],
                        steps=PROBE_STEPS, together=True, kind="probe", env={EXCEPT_ENV: part})
                for part in EXCEPT_PARTS[opt] if wanted]
    ops = [op for op in kernels.OPS if kernels.has_auto_kernel(op)]
    plans = [(op, []) for op in ops if op != "syrk"] if adamw else []
    plans += [("syrk", ["optimizer=muon"])] if muon and "syrk" in ops else []
    for op, extra in plans:
        spec = ",".join(f"{o}=torch" for o in kernels.OPS if o != op)
        out.append(Variant(f"probe timed:{op}" + (" (muon)" if extra else ""), preset_name,
                           [*extra, det, f"kernels={spec}"], steps=PROBE_STEPS, together=True, kind="probe",
                           env={EXCEPT_ENV: "kernels"}))
    return out


# ---------------------------------------------------------------- the table and the log

def row_of(v: Variant, facts: dict) -> dict:
    row = {"variant": v.name, "kind": v.kind, "preset": v.preset, "optimizer": v.optimizer,
           "overrides": " ".join(v.overrides), "runs": v.runs, "steps": v.steps, "identical": None,
           "first_diff_step": None, "first_diff_column": None, "step0_grad_norm_identical": None,
           "steady_tok_per_sec": math.nan, "baseline": v.baseline, "tok_per_sec_vs_default": math.nan,
           "status": "ok", "error": None, **facts,
           "wall_s": round((max if v.together else sum)([r.get("wall_s", 0.0) for r in v.results] or [0.0]), 1)}
    skipped = next((r["skipped"] for r in v.results if "skipped" in r), None)
    failed = next((r["error"] for r in v.results if "error" in r), None)
    if skipped or failed or not v.results:
        row.update(status=skipped or "failed", error=failed)
        return row
    tables = [r["metrics"] for r in v.results]
    if len(tables) >= 2:
        diff = first_difference(tables[0], tables[1])
        row["identical"] = diff is None
        if diff is not None:
            row["first_diff_step"], row["first_diff_column"] = diff
        g = [t.loc[t["step"] == 0, "grad_norm"] for t in tables[:2]]
        row["step0_grad_norm_identical"] = bool(len(g[0]) and len(g[1]) and g[0].iloc[0] == g[1].iloc[0])
    if not v.together:
        speeds = [steady_aggregates(t[t["step"] >= _warmup(v.steps)])["steady_tok_per_sec"] for t in tables]
        row["steady_tok_per_sec"] = sum(speeds) / len(speeds)
    return row


def with_ratios(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(rows)
    speed = {(r["preset"], r["variant"]): r["steady_tok_per_sec"] for r in rows}
    table["tok_per_sec_vs_default"] = [
        r["steady_tok_per_sec"] / speed.get((r["preset"], r["baseline"] or r["variant"]), math.nan)
        if r["kind"] == "variant" else math.nan for r in rows]
    return table


def _console_lines(console: Path) -> list[str]:
    """What a run's console says about its choices: the kernels and determinism start lines, the flash
    attention backend (with its timings), SYRK notes and every config Triton's autotuner picked."""
    text = console.read_text(errors="replace")
    out = [ln for ln in text.splitlines() if ln.startswith(("kernels:", "determinism:", "  WARNING:", "[syrk]"))
           or "kernels.flash_attention:" in ln]
    for m in re.finditer(r"Triton autotuning for function (\S+),\s*with key as (.*?),\s*finished after .*?,\s*"
                         r"best config selected: (.*?);", text, re.S):
        out.append(f"autotuned {m.group(1)} key {m.group(2).strip()}: {m.group(3).strip()}")
    return list(dict.fromkeys(out))


def console_record(v: Variant) -> list[str]:
    """The runs' choices: lines every run printed once, then each run's own (where two default runs part)."""
    per_run = [_console_lines(Path(r["console"])) for r in v.results if Path(r.get("console", "")).is_file()]
    if not per_run:
        return []
    common = [ln for ln in per_run[0] if all(ln in other for other in per_run[1:])]
    own = [f"run {i}: {ln}" for i, lines in enumerate(per_run) for ln in lines if ln not in common]
    return common + own


def _different(r) -> bool:
    """A compared variant whose two runs differ (not one that failed, was skipped or ran once)."""
    return r["status"] == "ok" and r["identical"] is not None and not r["identical"]


def summary_lines(table: pd.DataFrame) -> list[str]:
    lines = []
    for preset_name, t in table.groupby("preset", sort=False):
        for opt, det, base in (("adamw", "deterministic", "default"), ("muon", "muon-deterministic", "muon-default"),
                               ("adamw", "compile-deterministic", "compile-default")):
            rows = t[t["variant"] == det]
            if len(rows) and rows.iloc[0]["status"] == "ok":
                r = rows.iloc[0]
                cost = (f"{r['tok_per_sec_vs_default']:.3f}x {base}" if not math.isnan(r["tok_per_sec_vs_default"])
                        else f"{base} not measured")
                lines.append(f"{preset_name} {det}: {'IDENTICAL' if r['identical'] else 'DIFFERENT'} over "
                             f"{r['steps']} steps ({opt}); steady {r['steady_tok_per_sec']:,.0f} tok/s = {cost}")
        for _, r in t.iterrows():
            if _different(r):
                lines.append(f"{preset_name} {r['variant']}: differs first at step {r['first_diff_step']} in "
                             f"{r['first_diff_column']} (step-0 grad_norm "
                             f"{'identical' if r['step0_grad_norm_identical'] else 'different'})")
        lines += _bisection_lines(preset_name, t)
    return lines


def _bisection_lines(preset_name: str, t: pd.DataFrame) -> list[str]:
    """What the bisection probes show, per optimizer: sound only where that optimizer's full deterministic=true
    pair (probe or timed variant) was identical."""
    lines = []
    for opt, suffix, bases in (("adamw", "", ("probe deterministic", "deterministic")),
                               ("muon", " (muon)", ("probe muon-deterministic", "muon-deterministic"))):
        probes = t[t["variant"].str.startswith(("probe except:", "probe timed:"))
                   & t["variant"].str.endswith(suffix) & (t["optimizer"] == opt) & (t["status"] == "ok")]
        if not len(probes):
            continue
        base = t[t["variant"].isin(bases) & (t["status"] == "ok")]
        if not len(base) or not base["identical"].all():
            lines.append(f"{preset_name} bisection ({opt}): inconclusive, the full deterministic=true pair "
                         + ("did not run" if not len(base) else "itself differed"))
            continue
        for kind, what in (("except", "deterministic=true without"), ("timed", "timed configs of")):
            mine = probes[probes["variant"].str.startswith(f"probe {kind}:")]
            names = [r["variant"].split(":", 1)[1].removesuffix(suffix) for _, r in mine.iterrows()]
            differ = [n for n, (_, r) in zip(names, mine.iterrows()) if _different(r)]
            if names:
                lines.append(f"{preset_name} bisection ({opt}): {what} " + ", ".join(
                    f"{n}: {'DIFFERS' if n in differ else 'identical'}" for n in names))
    return lines


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="124m,1b")
    ap.add_argument("--steps", type=int, default=30, help="steps per timed run at 124m (tiny in --quick)")
    ap.add_argument("--steps-1b", type=int, default=12, help="steps per run at 1b")
    ap.add_argument("--variants", help="comma-separated variant names to run (default: all); probes by name too")
    ap.add_argument("--no-probes", action="store_true", help="skip the step-0 probes and the bisection")
    ap.add_argument("--parallel", type=int, default=4,
                    help="probe runs started at once (8 ran out of the H200's memory at 124m)")
    ap.add_argument("--budget-s", type=float,
                    help="stop starting variants that would not finish within this many seconds of the start "
                         "(default 420; --quick: 1800)")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny preset cut to one layer, 6 steps, few variants, 2 runs at a time (a smoke test)")
    ap.add_argument("--work", default="/tmp/blunb_determinism")
    ap.add_argument("--out", default="results/bench/determinism.csv")
    args = ap.parse_args()
    if args.steps < PROBE_STEPS or args.steps_1b < PROBE_STEPS:
        sys.exit(f"--steps and --steps-1b must be >= {PROBE_STEPS} (the trainer's fewest)")
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("bench/determinism.py measures GPU runs: no CUDA device here (--quick runs the CPU smoke test)")
    presets = ["tiny"] if args.quick else args.presets.split(",")
    steps = 6 if args.quick else args.steps
    out, work = Path(args.out), Path(args.work)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log_path = out.with_suffix(".log")
    log_path.write_text("")
    budget_s = args.budget_s if args.budget_s is not None else 1800.0 if args.quick else 420.0
    parallel = 2 if args.quick else args.parallel
    runner = Runner(work, log_path, budget_s, "auto" if cuda else "cpu")
    env = environment(1, "cuda" if cuda else "cpu")
    facts = {**{k: env[k] for k in ("device", "torch", "triton", "cuda", "git_sha", "git_dirty")},
             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    runner.say(f"bench/determinism.py on {facts['device']}: torch {facts['torch']}, triton {facts['triton']}, cuda "
               f"{facts['cuda']}, git {facts['git_sha']}{' (dirty)' if facts['git_dirty'] else ''}, {facts['date']}")
    runner.say(f"argv: {' '.join(sys.argv)}; budget {budget_s:.0f} s; timings excluded from the comparison: "
               f"{', '.join(TIMING_COLUMNS)}")
    t = time.monotonic()
    ensure_default_corpus(progress=False)
    runner.say(f"corpus ready in {time.monotonic() - t:.1f} s")
    wanted = set(args.variants.split(",")) if args.variants else None
    rows: list[dict] = []

    def record(vs: list[Variant]) -> None:
        for v in vs:
            rows.append(row_of(v, facts))
            r = rows[-1]
            verdict = r["status"] if r["status"] != "ok" else (
                "speed only" if r["identical"] is None else "identical" if r["identical"] else
                f"DIFFERENT from step {r['first_diff_step']} ({r['first_diff_column']})")
            speed = "" if math.isnan(r["steady_tok_per_sec"]) else f", steady {r['steady_tok_per_sec']:,.0f} tok/s"
            runner.say(f"[{time.monotonic() - runner.t0:5.0f} s] {v.preset} {v.name}: {verdict}{speed}"
                       + (f" -- {r['error']}" if r["error"] else "") + f" ({r['wall_s']:.0f} s)")
            for line in console_record(v):
                runner.say(f"    {line}")
        with_ratios(rows).to_csv(out, index=False)

    def chosen(vs: list[Variant]) -> list[Variant]:
        return [v for v in vs if wanted is None or v.name in wanted]

    later: list[Variant] = []
    for preset_name in presets:
        n_steps = args.steps_1b if preset_name == "1b" else steps
        core, extra = timed_variants(preset_name, n_steps, args.quick)
        later += chosen(extra)
        probing = not args.no_probes and preset_name != "1b"
        probes = chosen(step0_probes(preset_name, args.quick)) if probing else []
        runner.run_together(probes, parallel)
        record(probes)
        for v in chosen(core):
            runner.run_variant(v)
            record([v])
        if not probing:
            continue
        every = bisection_probes(preset_name, muon=True, adamw=True)
        asked = [v for v in every if wanted and v.name in wanted]
        differs = {r["variant"].removeprefix("probe ") for r in rows if r["preset"] == preset_name and _different(r)}
        adamw, muon = "default" in differs, "muon-default" in differs
        bisect = asked or bisection_probes(preset_name, muon=muon, adamw=adamw)
        if args.quick and not bisect:
            bisect = every[:1]  # the smoke test runs one probe, whatever the verdicts
        if bisect:
            runner.say(f"bisection at {preset_name}: {len(bisect)} probe pairs (differing: "
                       f"{', '.join(sorted(differs)) or 'none'})")
        runner.run_together(bisect, parallel)
        record(bisect)
    for v in later:
        runner.run_variant(v)
        record([v])

    table = with_ratios(rows)
    table.to_csv(out, index=False)
    runner.say("")
    runner.say("summary:")
    for line in summary_lines(table):
        runner.say(f"  {line}")
    cols = ["preset", "variant", "status", "identical", "first_diff_step", "first_diff_column",
            "step0_grad_norm_identical", "steady_tok_per_sec", "tok_per_sec_vs_default", "wall_s"]
    runner.say(table[cols].to_string(index=False))
    runner.say(f"total {time.monotonic() - runner.t0:.0f} s; {out} and {log_path}")
    (work / "rows.json").write_text(json.dumps(rows, default=str))


if __name__ == "__main__":
    main()
