"""blunb's trainer against a plain PyTorch model of the same shape, eager and torch.compile'd,
all in one call on one GPU: tokens/s, MFU (causal and PaLM), peak memory and the ratios.

    PYTHONPATH=. python3 bench/speed.py --presets 1b,124m --out results/bench/speed.csv
    PYTHONPATH=. python3 bench/speed.py --presets 1b --blunb adamw=optimizer=adamw \
        --blunb adamw-compile=optimizer=adamw,compile=true --out /tmp/speed.csv
    PYTHONPATH=. python3 bench/speed.py --presets 1b --baselines compile --blunb adamw=optimizer=adamw \
        --fp8 tensorwise,rowwise --out /tmp/speed_fp8.csv     # needs torchao (pyproject's fp8 extra)

    PYTHONPATH=. python3 bench/speed.py --presets 124m --baselines compile,compile_graph \
        --blunb adamw=optimizer=adamw --blunb muon=optimizer=muon --cuda-graph both --out /tmp/speed_graph.csv

Baselines: bench/plain_llama.py (plain_eager, plain_compile, and plain_compile_graph: plain compile with the
whole step in one CUDA graph). `--cuda-graph both` runs every blunb variant twice, as <name>-graph
(cuda_graph=true) and <name>-nograph (cuda_graph=false); `given` (the default) runs each as its overrides
say (cuda_graph=auto unless they set it: on for one CUDA rank). blunb rows are real `blunb.train`
runs at the preset's micro-batch with one optimizer step per micro-batch (global_batch = B x T),
no validation or checkpoints inside the timed steps. Every process is separate, so one's peak
memory and compile caches do not leak into the next; the CSV is rewritten after every row, so a
call cut short keeps what it measured. Each blunb row carries tok/s and peak memory relative to
plain_compile of the same preset, measured in this call.

`--fp8 R1,R2`: per recipe (model.fp8, blunb/fp8.py) the plain baselines converted with torchao's same
recipe (plain_compile-fp8-R) and the blunb row adamw-fp8-R (optimizer=adamw, model.fp8=R). Every row
says its fp8 and carries tok/s against the plain_compile of the same fp8 (the same torchao conversion
on both sides) and against blunb's `adamw` row (the default flags: bf16 body GEMMs), of the same call.
MFU stays counted against the device's bf16 peak (an fp8 row's tensor cores peak at twice that).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from bench.plain_llama import variant_name
from bench.train_presets import run_trainer_variant
from blunb.config import FP8_RECIPES, apply_overrides, preset
from blunb.kernels import OPS
from blunb.runs import environment

log = logging.getLogger("speed")

# blunb with no flags (on CUDA: compiled with the chunked loss, config.AUTO_SWITCHES), eager, compiled (with
# the fused kernels, with none, with Inductor's SwiGLU and QK-norm + RoPE), compiled with the chunked lm_head
# + loss (with torch._fused_adamw_ in place of the fused shard update)
DEFAULT_BLUNB = {
    "adamw": "optimizer=adamw",
    "adamw-eager": "optimizer=adamw,compile=false,model.chunked_ce=false",
    "adamw-compile": "optimizer=adamw,compile=true",
    "adamw-compile-torchkernels": "optimizer=adamw,compile=true,kernels=torch",
    "adamw-compile-inductor-elementwise": "optimizer=adamw,compile=true,kernels=swiglu=torch,qk_norm_rope=torch",
    "adamw-compile-chunked": "optimizer=adamw,compile=true,model.chunked_ce=true",
    "adamw-compile-chunked-torchadamw": "optimizer=adamw,compile=true,model.chunked_ce=true,kernels=adamw=torch",
    "muon": "optimizer=muon",
    "muon-compile-chunked": "optimizer=muon,compile=true,model.chunked_ce=true",
}
# The blunb row the fp8 rows are measured against (tok_per_s_vs_blunb_bf16): the default flags, bf16 body GEMMs.
BF16_REFERENCE = "adamw"


def _overrides(spec: str) -> list[str]:
    """"k=v,k=v" -> ["k=v", ...], keeping a per-op kernels value whole: "kernels=swiglu=torch,qk_norm_rope=torch"."""
    out: list[str] = []
    for item in spec.split(","):
        if out and out[-1].startswith("kernels=") and item.split("=", 1)[0] in OPS:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def _profile(csv: Path, preset_name: str, variant: str) -> tuple[list[dict], list[dict]]:
    """A row's profile: its categories (csv) and its top kernels (the `_kernels` file write_profile puts beside
    it), each row labelled with the preset and variant."""
    tables = []
    for path in (csv, csv.with_name(csv.stem + "_kernels.csv")):
        records = pd.read_csv(path).to_dict("records") if path.is_file() else []
        tables.append([{"preset": preset_name, "variant": variant, **r} for r in records])
    return tables[0], tables[1]


def _plain_row(preset_name: str, compile_model: bool, steps: int, warmup: int, profile_steps: int,
               work: Path, fp8: str = "off", cuda_graph: bool = False) -> tuple[dict, tuple[list[dict], list[dict]]]:
    name = variant_name(compile_model, fp8, cuda_graph)
    out = work / f"{name}-{preset_name}.json"
    cmd = [sys.executable, "bench/plain_llama.py", "--preset", preset_name, "--steps", str(steps),
           "--warmup", str(warmup), "--json", str(out), "--profile-steps", str(profile_steps), "--fp8", fp8]
    cmd += (["--compile"] if compile_model else []) + (["--cuda-graph"] if cuda_graph else [])
    if subprocess.run(cmd).returncode != 0 or not out.exists():
        return {"variant": name, "preset": preset_name, "status": "failed", "fp8": fp8}, ([], [])
    row = json.loads(out.read_text())
    return {**row, "status": "ok", "kind": "baseline"}, _profile(out.with_name(out.stem + "-profile.csv"),
                                                                    preset_name, name)


def _blunb_row(preset_name: str, name: str, overrides: list[str], steps: int, warmup: int, profile_steps: int,
               work: Path) -> tuple[dict, tuple[list[dict], list[dict]]]:
    cfg = preset(preset_name)
    fp8 = apply_overrides(preset(preset_name), overrides).model.fp8
    # val_tokens: four micro-batches, which the random-token val shards hold at every preset (the trainer's default
    # asks seed-4b's T = 4096 for more windows than they have); the timed steps read no validation
    common = [f"global_batch={cfg.B * cfg.T}", f"val_freq={10 * steps}", f"val_tokens={4 * cfg.B * cfg.T}",
              "ckpt_freq=0", f"mfu_warmup={warmup}"]
    r = run_trainer_variant(preset_name, name, common + overrides, steps=steps, warmup=warmup, nproc=1,
                            runs_dir=work / "runs", profile_steps=profile_steps)
    if r["status"] != "ok":
        return {**r, "preset": preset_name, "kind": "blunb", "fp8": fp8}, ([], [])
    row = {"variant": name, "preset": preset_name, "status": "ok", "kind": "blunb", "fp8": fp8, "B": cfg.B, "T": cfg.T,
           "ms_per_step": r["steady_ms_per_step"], "tok_per_s": r["steady_tok_per_sec"],
           "mfu_causal": r["steady_mfu"], "mfu_palm": r["steady_mfu_palm"], "peak_mem_gib": r["peak_mem_gib"],
           "run_peak_mem_gib": r["run_peak_mem_gib"],
           "opt_step_ms": r["opt_step_ms"], "timed_steps": r["steady_steps"], "final_loss": r["final_loss"],
           "overrides": r["overrides"]}
    return row, _profile(Path(r["run_dir"]) / "profile.csv", preset_name, name)


def _plot_profiles(profiles: pd.DataFrame, path: Path, facts: dict) -> None:
    """One horizontal stacked bar per variant and preset: ms per step by category."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(profiles["preset"]))
    fig, axes = plt.subplots(len(presets), 1, figsize=(10, 1.2 + 0.6 * profiles[["preset", "variant"]]
                                                      .drop_duplicates().shape[0]), squeeze=False)
    categories = profiles.groupby("category")["ms_per_step"].sum().sort_values(ascending=False).index
    colors = dict(zip(categories, plt.get_cmap("tab20").colors))
    for ax, preset_name in zip(axes[:, 0], presets):
        table = profiles[profiles["preset"] == preset_name].pivot_table(
            index="variant", columns="category", values="ms_per_step", aggfunc="sum", fill_value=0.0)
        left = pd.Series(0.0, index=table.index)
        for cat in [c for c in categories if c in table]:
            ax.barh(table.index, table[cat], left=left, color=colors[cat], label=cat)
            left += table[cat]
        ax.set_title(f"{preset_name}: GPU time per step by category (torch.profiler), {facts['device']}")
        ax.set_xlabel("ms per step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".svg"))


def _with_ratios(rows: list[dict]) -> pd.DataFrame:
    """The rows with their ratios to the same call's baselines, per preset: plain_compile (bf16), the
    plain_compile of the row's own fp8 (itself for plain_compile) and blunb's `adamw` row (BF16_REFERENCE)."""
    table = pd.DataFrame(rows)
    for col in ("tok_per_s", "peak_mem_gib"):
        if col not in table:
            table[col] = float("nan")
    table["fp8"] = table["fp8"].fillna("off") if "fp8" in table else "off"
    ok = table[table["status"] == "ok"]
    base = ok[ok["variant"] == "plain_compile"].set_index("preset")
    table["tok_per_s_vs_plain_compile"] = table["tok_per_s"] / table["preset"].map(base["tok_per_s"])
    graphed = ok[ok["variant"] == "plain_compile_graph"].set_index("preset")
    table["tok_per_s_vs_plain_compile_graph"] = table["tok_per_s"] / table["preset"].map(graphed["tok_per_s"])
    table["mem_vs_plain_compile"] = table["peak_mem_gib"] / table["preset"].map(base["peak_mem_gib"])
    same = ok[ok["variant"] == ok["fp8"].map(lambda f: variant_name(True, f))].set_index(["preset", "fp8"])
    key = pd.MultiIndex.from_frame(table[["preset", "fp8"]])
    table["tok_per_s_vs_plain_compile_same_fp8"] = table["tok_per_s"].to_numpy() / \
        same["tok_per_s"].reindex(key).to_numpy()
    table["mem_vs_plain_compile_same_fp8"] = table["peak_mem_gib"].to_numpy() / \
        same["peak_mem_gib"].reindex(key).to_numpy()
    bf16 = ok[ok["variant"] == BF16_REFERENCE].set_index("preset")
    table["tok_per_s_vs_blunb_bf16"] = table["tok_per_s"] / table["preset"].map(bf16["tok_per_s"])
    return table


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="1b,124m")
    ap.add_argument("--steps", type=int, default=15, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures (compile, autotune)")
    ap.add_argument("--blunb", action="append", metavar="NAME=K=V,K=V",
                    help="a blunb variant (repeatable); default: " + ", ".join(DEFAULT_BLUNB))
    ap.add_argument("--baselines", default="compile,compile_graph,eager",
                    help="which plain baselines to run, comma-separated: compile, compile_graph (the whole step in one "
                         "CUDA graph), eager (default: all three) or none")
    ap.add_argument("--cuda-graph", choices=("given", "both"), default="given",
                    help="both: every blunb variant as <name>-graph (cuda_graph=true) and <name>-nograph "
                         "(cuda_graph=false) in this call; given: as its overrides say")
    ap.add_argument("--fp8", default="",
                    help="comma-separated model.fp8 recipes (tensorwise, rowwise): per recipe the plain baselines "
                         "converted with it and the blunb row adamw-fp8-<recipe> (needs torchao)")
    ap.add_argument("--profile-steps", type=int, default=3,
                    help="steps profiled after the timed ones (0: none); <out stem>_profile.csv and .png (categories), "
                         "_profile_kernels.csv (each row's top kernels)")
    ap.add_argument("--work", default="/tmp/blunb_speed")
    ap.add_argument("--out", default="results/bench/speed.csv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/speed.py measures GPU throughput: no CUDA device here")
    variants = dict(v.split("=", 1) for v in args.blunb) if args.blunb else dict(DEFAULT_BLUNB)
    if args.cuda_graph == "both":
        variants = {f"{name}-{arm}": f"{spec},cuda_graph={str(arm == 'graph').lower()}"
                    for name, spec in variants.items() for arm in ("graph", "nograph")}
    recipes = [r for r in args.fp8.split(",") if r]
    unknown = [r for r in recipes if r not in FP8_RECIPES]
    if unknown:
        sys.exit(f"--fp8: unknown recipe(s) {', '.join(unknown)}; choose from {', '.join(FP8_RECIPES)}")
    variants.update({f"adamw-fp8-{r}": f"{DEFAULT_BLUNB[BF16_REFERENCE]},model.fp8={r}" for r in recipes})
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(1, "cuda")   # what every run folder's env.json records, the git sha included
    facts = {**{k: env[k] for k in ("device", "torch", "triton", "cuda", "git_sha")},
             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows: list[dict] = []
    profiles: list[dict] = []
    top_kernels: list[dict] = []   # each row's largest kernels by name: what a category's time is made of
    profile_csv = out.with_name(out.stem + "_profile.csv")
    kernels_csv = out.with_name(out.stem + "_profile_kernels.csv")
    for preset_name in args.presets.split(","):
        modes = [(mode != "eager", mode == "compile_graph") for mode in ("compile", "compile_graph", "eager")
                 if mode in args.baselines.split(",")]
        jobs = [("plain", (compiled, fp8, graph)) for fp8 in ("off", *recipes) for compiled, graph in modes
                if not (graph and fp8 != "off")]
        jobs += [(name, spec) for name, spec in variants.items()]
        for name, spec in jobs:
            t0 = time.perf_counter()
            if name == "plain":
                row, prof = _plain_row(preset_name, spec[0], args.steps - args.warmup, args.warmup, args.profile_steps,
                                       work, fp8=spec[1], cuda_graph=spec[2])
            else:
                row, prof = _blunb_row(preset_name, name, _overrides(spec), args.steps, args.warmup,
                                       args.profile_steps, work)
            rows.append({**row, **facts, "wall_s": round(time.perf_counter() - t0, 1)})
            table = _with_ratios(rows)
            table.to_csv(out, index=False)
            profiles += [{**r, **facts} for r in prof[0]]
            top_kernels += [{**r, **facts} for r in prof[1]]
            if profiles:
                pd.DataFrame(profiles).to_csv(profile_csv, index=False)
            if top_kernels:
                pd.DataFrame(top_kernels).to_csv(kernels_csv, index=False)
            log.info("%s %s: %s", preset_name, row["variant"], table.iloc[-1].to_dict())
    cols = ["preset", "variant", "fp8", "status", "ms_per_step", "tok_per_s", "mfu_causal", "mfu_palm", "peak_mem_gib",
            "tok_per_s_vs_plain_compile", "tok_per_s_vs_plain_compile_graph", "mem_vs_plain_compile",
            "tok_per_s_vs_plain_compile_same_fp8", "tok_per_s_vs_blunb_bf16"]
    log.info("\n%s", _with_ratios(rows).reindex(columns=cols).to_string(index=False))
    if profiles:
        _plot_profiles(pd.DataFrame(profiles), profile_csv.with_suffix(".png"), facts)


if __name__ == "__main__":
    main()
