"""The overlap study's library (notebooks/12_overlap.ipynb): equivalence grid, timelines, communication model.

Three parts: the equivalence grid (`equivalence_arms`, `equivalence_table`: every overlap switch flipped
against the serial path, compared on losses, gradient norms and replica checksums), compute timelines
measured on one device (`measure_timeline`: when each gradient is ready, when each refresh stage is
needed), and a MODEL of the communication a W-rank run could hide behind them. The model's units come
from the optimizers' own layout functions (blunb.optim.layout), so it cannot drift from what the
optimizers issue; nothing in it is measured on more than one GPU, and `load_measured` /
`predict_measured` hold it against measured multi-GPU step times.

Details (the files, the cost model and its exposure rules, the measured tables): docs/architecture.md,
section "blunb/studies/overlap.py".
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from blunb.config import TrainConfig, preset
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.optim.layout import (
    REDUCE_DTYPES,
    backward_buckets,
    bucket_chunk,
    lpt_partition,
    muon_buckets,
    ns_cost,
    publish_order,
    refresh_stages,
    stage_index,
    stage_waits,
)
from blunb.optim.muon import muon_param_groups

_LABEL = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MIB = 2**20

# ------------------------------------------------------------------ 1. equivalence

# An arm is "<optimizer>.<tokens joined by +>" ("serial" when none): each token one override.
SWITCHES = {
    "ob": "overlap_backward=true",
    "or": "overlap_refresh=true",
    "rb": "collective=reduce_bcast",
    "mrb": "muon_collective=reduce_bcast",
    "fp32": "reduce_dtype=fp32",
    "bf16": "reduce_dtype=bf16",
}
# What a token changes: overlaps must never change the numbers; the others change the sums.
TOKEN_KIND = {"ob": "overlap", "or": "overlap", "rb": "layout", "mrb": "layout", "fp32": "reduce dtype",
              "bf16": "reduce dtype"}
_LAYOUT = {"adamw": ("rb",), "muon": ("rb", "mrb")}   # the other layout for every group of the set
GRIDS = ("quick", "cover", "full")


def arm_name(optimizer: str, tokens) -> str:
    return f"{optimizer}." + ("+".join(tokens) or "serial")


def arm_tokens(arm: str) -> tuple[str, tuple[str, ...]]:
    """(optimizer, tokens) of an arm name."""
    optimizer, rest = arm.split(".", 1)
    return optimizer, () if rest == "serial" else tuple(rest.split("+"))


def equivalence_arms(optimizers=("adamw", "muon"), grid: str = "cover") -> dict[str, list[str]]:
    """Study arms (name -> overrides), per optimizer:
    quick  serial, both overlaps, the other layout, bf16 reduce (4);
    cover  serial, each overlap, both, the other layout, it with both overlaps, bf16 reduce (7);
    full   every combination: AdamW 4 overlaps x 2 layouts x 3 reduce dtypes = 24, Muon with
           collective and muon_collective apart 48."""
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    arms = {}
    for opt in optimizers:
        other = _LAYOUT[opt]
        if grid == "full":
            layouts = [(), ("rb",)] if opt == "adamw" else [(), ("rb",), ("mrb",), ("rb", "mrb")]
            combos = [ov + lay + dt for ov in [(), ("ob",), ("or",), ("ob", "or")] for lay in layouts
                      for dt in [(), ("fp32",), ("bf16",)]]
        elif grid == "cover":
            combos = [(), ("ob",), ("or",), ("ob", "or"), other, ("ob", "or") + other, ("bf16",)]
        else:
            combos = [(), ("ob", "or"), other, ("bf16",)]
        for tokens in combos:
            arms[arm_name(opt, tokens)] = [f"optimizer={opt}"] + [SWITCHES[t] for t in tokens]
    return arms


def _read_exact(path: Path) -> pd.DataFrame:
    # The python engine parses with float(), exact on every pandas (pandas < 3's default C parser
    # could miss the last bit), and these comparisons are bit-level.
    return pd.read_csv(path, engine="python")


def _checksums(run_dir: Path) -> tuple[pd.Series, pd.Series]:
    """Per step (diag.csv): rank 0's parameter checksum, and 1 where every rank's agreed."""
    diag = pd.read_csv(Path(run_dir) / "diag.csv", dtype={"detail": str})
    rows = diag[diag["item"] == "replica_checksum_match"].set_index("step")
    return rows["detail"].str.split(" ").str[0].str.split("=").str[1], rows["value"].astype(float)


def equivalence_table(summary: pd.DataFrame, metrics=("train_loss", "val_loss", "grad_norm")) -> pd.DataFrame:
    """Each run vs the serial run of its optimizer, world size and seed.

    summary: blunb.study summary rows (arm, seed, world_size, run_dir, status), several studies
    concatenated. One row per run: world_size, optimizer, arm, seed, kind (what its switches
    change), metrics_identical (every step of `metrics` equal to the bit), params_identical (every
    step's replica checksum equal: the weights each step trained with, so every update but the
    last), replicas_consistent (all ranks held the same bits at every step), max_abs_loss_diff and
    mean_abs_loss_diff (train_loss over the steps).
    """
    runs = summary[summary["status"] == "completed"].copy()
    runs["optimizer"] = runs["arm"].map(lambda a: arm_tokens(a)[0])
    loaded = {r.run_dir: (_read_exact(Path(r.run_dir) / "metrics.csv").set_index("step"), *_checksums(r.run_dir))
              for r in runs.itertuples()}
    ref_of = {(r.world_size, r.optimizer, r.seed): r.run_dir for r in runs.itertuples()
              if arm_tokens(r.arm)[1] == ()}
    rows = []
    for r in runs.itertuples():
        ref = ref_of.get((r.world_size, r.optimizer, r.seed))
        if ref is None:
            continue
        (m, ck, agree), (m0, ck0, _) = loaded[r.run_dir], loaded[ref]
        cols = [c for c in metrics if c in m0.columns]
        same = all(m[c].equals(m0[c]) for c in cols)
        diff = (m["train_loss"] - m0["train_loss"]).abs()
        tokens = arm_tokens(r.arm)[1]
        rows.append({"world_size": int(r.world_size), "optimizer": r.optimizer, "arm": r.arm, "seed": int(r.seed),
                     "kind": " + ".join(dict.fromkeys(TOKEN_KIND[t] for t in tokens)) or "serial",
                     "metrics_identical": same, "params_identical": ck.equals(ck0),
                     "replicas_consistent": bool((agree == 1).all()),
                     "max_abs_loss_diff": float(diff.max()), "mean_abs_loss_diff": float(diff.mean())})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ 2. timelines

class _ShapesOnly(BLU):
    def init_weights(self, seed: int) -> None:  # meta tensors hold no values to initialize
        pass


@functools.lru_cache(maxsize=8)
def shapes_model(preset_name: str, device_type: str = "cuda", n_layers: int | None = None) -> BLU:
    """The preset's BLU on the meta device (no memory) with the dtypes it has on `device_type`:
    parameter names, shapes, dtypes and order, for layouts at any size."""
    mcfg = preset(preset_name).model
    if mcfg.linear_dtype == "auto":
        mcfg = dataclasses.replace(mcfg, linear_dtype="bf16" if device_type == "cuda" else "fp32")
    if n_layers is not None:
        mcfg = dataclasses.replace(mcfg, n_layers=n_layers)
    return _ShapesOnly(mcfg, device="meta")


def param_stages(model: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> its refresh stage (layout.refresh_stages: 0 = before the first layer)."""
    stage_of = stage_index(refresh_stages(model))
    return {n: stage_of[id(p)] for n, p in model.named_parameters() if id(p) in stage_of}


@dataclass
class Timeline:
    """One preset's measured compute timeline (module docstring, section 2)."""

    preset: str
    optimizer: str
    B: int
    T: int
    n_layers: int
    backward: pd.DataFrame     # param, numel, dtype, grad_ready_ms
    forward: pd.DataFrame      # stage, module, needed_ms
    fwd_ms: float
    bwd_ms: float
    opt_step_ms: float
    peak_mem_gib: float
    iters: int

    def scaled(self, B: int, T: int) -> "Timeline":
        """This timeline at another micro-batch: every forward / backward time scaled by the token
        ratio (linear: the attention core's T^2 term is not modelled); the optimizer step as it is."""
        f = B * T / (self.B * self.T)
        return dataclasses.replace(self, B=B, T=T, backward=self.backward.assign(grad_ready_ms=self.backward[
            "grad_ready_ms"] * f), forward=self.forward.assign(needed_ms=self.forward["needed_ms"] * f),
            fwd_ms=self.fwd_ms * f, bwd_ms=self.bwd_ms * f)

    def rows(self) -> dict[str, pd.DataFrame]:
        """The three CSV tables of this timeline (backward_timeline, forward_timeline, compute)."""
        key = {"preset": self.preset, "optimizer": self.optimizer, "B": self.B, "T": self.T,
               "n_layers": self.n_layers}
        bwd = self.backward.assign(backward_ms=self.bwd_ms)
        fwd = self.forward.assign(forward_ms=self.fwd_ms)
        compute = pd.DataFrame([{**key, "fwd_ms": self.fwd_ms, "bwd_ms": self.bwd_ms, "opt_step_ms": self.opt_step_ms,
                                 "peak_mem_gib": self.peak_mem_gib, "iters": self.iters}])
        return {"backward_timeline": pd.concat([pd.DataFrame([key] * len(bwd)), bwd], axis=1),
                "forward_timeline": pd.concat([pd.DataFrame([key] * len(fwd)), fwd], axis=1), "compute": compute}


class _Clock:
    """Marks on the device's timeline: CUDA events on a GPU, the host clock on the CPU (whose ops run
    synchronously, so the host reaching a hook is the op being done)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def measure_timeline(cfg: TrainConfig, device: torch.device, iters: int = 3, warmup: int = 2) -> Timeline:
    """Train `warmup + iters` steps of one micro-batch (cfg.B x cfg.T random tokens) with the
    trainer's optimizer set for cfg.optimizer at W = 1; return the medians of the measured steps."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = BLU(cfg.model, device=device, seed=cfg.seed)
    opt = build_optimizers(model, cfg, device, 1)
    clock = _Clock(device)
    names = [n for n, _ in model.named_parameters()]
    module_name = {id(m): n or "(model: embedding)" for n, m in model.named_modules()}
    stages = refresh_stages(model)
    grad_marks, stage_marks = {}, {}

    def marker(marks: dict, key):
        def hook(*_) -> None:         # returns None: a forward pre-hook's return value replaces the input
            marks.setdefault(key, clock.mark())
        return hook

    handles = [p.register_post_accumulate_grad_hook(marker(grad_marks, n)) for n, p in model.named_parameters()]
    handles += [m.register_forward_pre_hook(marker(stage_marks, s)) for s, (m, _) in enumerate(stages)]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    ready, needed, fwd, bwd, step = [], [], [], [], []
    try:
        for i in range(warmup + iters):
            tokens = torch.randint(cfg.model.vocab_size, (cfg.B, cfg.T + 1), device=device, generator=gen)
            grad_marks.clear()
            stage_marks.clear()
            t0 = clock.mark()
            with opt.micro_step(last=True):
                loss = opt.forward_model(tokens[:, :-1], tokens[:, 1:])[1]
                t1 = clock.mark()
                loss.backward()
            t2 = clock.mark()
            opt.step()
            t3 = clock.mark()
            if clock.cuda:
                torch.cuda.synchronize(device)
            if i < warmup:
                continue
            ready.append([clock.ms(t1, grad_marks[n]) if n in grad_marks else float("nan") for n in names])
            needed.append([clock.ms(t0, stage_marks[s]) for s in range(len(stages))])
            fwd.append(clock.ms(t0, t1))
            bwd.append(clock.ms(t1, t2))
            step.append(clock.ms(t2, t3))
        opt.drain()
    finally:
        for h in handles:
            h.remove()
    params = dict(model.named_parameters())
    backward = pd.DataFrame({"param": names, "numel": [params[n].numel() for n in names],
                             "dtype": [_LABEL[params[n].dtype] for n in names],
                             "grad_ready_ms": [statistics.median(col) for col in zip(*ready)]})
    forward = pd.DataFrame({"stage": range(len(stages)), "module": [module_name[id(m)] for m, _ in stages],
                            "needed_ms": [statistics.median(col) for col in zip(*needed)]})
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    timeline = Timeline(cfg.preset, cfg.optimizer, cfg.B, cfg.T, cfg.model.n_layers, backward, forward,
                        statistics.median(fwd), statistics.median(bwd), statistics.median(step), peak, iters)
    del model, opt
    gc.collect()                       # the optimizers' hooks hold the model in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timeline


def timeline_model(timeline: Timeline) -> BLU:
    """The shapes-only model a timeline was measured on (its layer count; bf16 Linears if it has any)."""
    device_type = "cuda" if (timeline.backward["dtype"] == "bf16").any() else "cpu"
    n_layers = None if timeline.n_layers == preset(timeline.preset).model.n_layers else timeline.n_layers
    return shapes_model(timeline.preset, device_type, n_layers)


TIMELINE_FILES = ("backward_timeline", "forward_timeline", "compute")


def save_timelines(timelines: list[Timeline], folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in TIMELINE_FILES:
        pd.concat([t.rows()[name] for t in timelines], ignore_index=True).to_csv(folder / f"{name}.csv", index=False)


def load_timelines(folder: str | Path) -> list[Timeline]:
    """The timelines bench/overlap_timeline.py wrote into `folder` ([] when there are none)."""
    folder = Path(folder)
    if not all((folder / f"{n}.csv").is_file() for n in TIMELINE_FILES):
        return []
    bwd, fwd, compute = (pd.read_csv(folder / f"{n}.csv") for n in TIMELINE_FILES)
    key = ["preset", "optimizer"]
    out = []
    for c in compute.itertuples():
        b = bwd[(bwd["preset"] == c.preset) & (bwd["optimizer"] == c.optimizer)]
        f = fwd[(fwd["preset"] == c.preset) & (fwd["optimizer"] == c.optimizer)]
        out.append(Timeline(c.preset, c.optimizer, int(c.B), int(c.T), int(c.n_layers),
                            b.drop(columns=key + ["B", "T", "n_layers", "backward_ms"]).reset_index(drop=True),
                            f.drop(columns=key + ["B", "T", "n_layers", "forward_ms"]).reset_index(drop=True),
                            float(c.fwd_ms), float(c.bwd_ms), float(c.opt_step_ms), float(c.peak_mem_gib),
                            int(c.iters)))
    return out


# ------------------------------------------------------------------ 3. the model: units

def optimizer_groups(model: torch.nn.Module, optimizer: str) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """[(group name, [(param name, param)])] in the trainer's step order (blunb.optim.build):
    one AdamW group per dtype, smallest first, then the Muon body last."""
    names = {id(p): n for n, p in model.named_parameters()}
    muon = muon_param_groups(model)[0]["params"] if optimizer == "muon" else []
    in_muon = {id(p) for p in muon}
    by_dtype: dict[torch.dtype, list] = {}
    for p in model.parameters():
        if p.requires_grad and id(p) not in in_muon:
            by_dtype.setdefault(p.dtype, []).append((names[id(p)], p))
    groups = sorted(by_dtype.items(), key=lambda kv: sum(p.numel() for _, p in kv[1]))
    out = [(f"adamw_{_LABEL[dt]}", ps) for dt, ps in groups]
    if muon:
        out.append(("muon", [(names[id(p)], p) for p in muon]))
    return out


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _adamw_units(params, world: int, collective: str, red_dtype: torch.dtype, bucket_mb: float) -> list[dict]:
    """ShardedAdamW._build_layout: whole tensors in backward order, ~bucket_mb of the REDUCE dtype each,
    every bucket padded to W of layout.bucket_chunk; reduced in bucket order."""
    cap = max(1, int(bucket_mb * MIB) // _elem(red_dtype))
    buckets = backward_buckets([p.numel() for _, p in params], cap)
    units = []
    for b, idx in enumerate(buckets):
        numel = sum(params[i][1].numel() for i in idx)
        units.append({"reduce_pos": b, "forward_key": b, "params": tuple(params[i][0] for i in idx), "numel": numel,
                      "wire_numel": bucket_chunk(numel, world) * world, "calls": 1 if collective == "rs_ag" else world,
                      "dtype": params[0][1].dtype, "red_dtype": red_dtype})
    return units


def _muon_units(params, world: int, collective: str, reduce_dtype: str, target: int, ns_steps: int) -> list[dict]:
    """ShardedMuon: LPT owners of the Newton-Schulz cost; rs_ag: per dtype, each rank's owned tensors cut
    into `target` runs, bucket k = every rank's k-th run, each padded to the largest; reduce_bcast: one
    tensor per unit. Reduced in reverse parameter order, published in forward order."""
    owners = lpt_partition([ns_cost(p.shape, ns_steps) for _, p in params], world)
    if collective == "reduce_bcast":
        groups = [([i], p.numel()) for i, (_, p) in enumerate(params)]
    else:
        plan = muon_buckets([p.numel() for _, p in params], [p.dtype for _, p in params], owners, world, target)
        groups = [([i for run in runs for i in run], world * chunk) for _, runs, chunk in plan]
    order = sorted(range(len(groups)), key=lambda u: -min(groups[u][0]))
    reduce_pos = {u: k for k, u in enumerate(order)}
    units = []
    for u, (idx, wire) in enumerate(groups):
        dtype = params[idx[0]][1].dtype          # one dtype per unit
        units.append({"reduce_pos": reduce_pos[u], "forward_key": min(idx), "params": tuple(params[i][0] for i in idx),
                      "numel": sum(params[i][1].numel() for i in idx), "wire_numel": wire, "calls": 1,
                      "dtype": dtype, "red_dtype": REDUCE_DTYPES[reduce_dtype] or dtype})
    return units


UNIT_COLUMNS = ["group", "group_pos", "kind", "reduce_pos", "publish_pos", "n_params", "params", "stages", "numel",
                "wire_numel", "param_dtype", "reduce_dtype", "reduce_bytes", "publish_bytes", "calls"]


def comm_units(model: torch.nn.Module, cfg: TrainConfig, world: int) -> pd.DataFrame:
    """Every collective unit of cfg's optimizer set (cfg.optimizer, collective, muon_collective,
    reduce_dtype, bucket_mb, muon_buckets) at `world` ranks, one row each (UNIT_COLUMNS): its group
    and the group's step position, the layout (kind), its position in the group's reduce order and in
    its publish order with overlap_refresh (forward order), its parameters and their refresh stages,
    numel, wire_numel (padding included), the parameter and reduce dtypes, the bytes each phase moves
    (reduce: reduce dtype, publish: parameter dtype) and the collective calls per phase. Empty at W = 1."""
    stage_of = param_stages(model)
    rows = []
    if world > 1:
        for g, (name, params) in enumerate(optimizer_groups(model, cfg.optimizer)):
            if name == "muon":
                kind = cfg.muon_collective
                units = _muon_units(params, world, kind, cfg.reduce_dtype, cfg.muon_buckets, cfg.muon_ns_steps)
            else:
                kind = cfg.collective
                red_dtype = REDUCE_DTYPES[cfg.reduce_dtype] or params[0][1].dtype
                units = _adamw_units(params, world, kind, red_dtype, cfg.bucket_mb)
            # overlap_refresh's publish order, as the optimizers plan it
            for u in units:
                u["stages"] = tuple(sorted({stage_of.get(n, 0) for n in u["params"]}))
            order = publish_order([u["stages"] for u in units], [u["forward_key"] for u in units])
            for pos, i in enumerate(order):
                units[i]["publish_pos"] = pos
            for u in units:
                rows.append({"group": name, "group_pos": g, "kind": kind, "reduce_pos": u["reduce_pos"],
                             "publish_pos": u["publish_pos"], "n_params": len(u["params"]), "params": u["params"],
                             "stages": u["stages"], "numel": u["numel"], "wire_numel": u["wire_numel"],
                             "param_dtype": _LABEL[u["dtype"]], "reduce_dtype": _LABEL[u["red_dtype"]],
                             "reduce_bytes": u["wire_numel"] * _elem(u["red_dtype"]),
                             "publish_bytes": u["wire_numel"] * _elem(u["dtype"]), "calls": u["calls"]})
    return pd.DataFrame(rows, columns=UNIT_COLUMNS)




_BYTES = {label: _elem(dtype) for dtype, label in _LABEL.items()}


def reduce_buffer_bytes(units: pd.DataFrame, world: int) -> dict[str, int]:
    """Per group, the bytes per rank its reduce dtype costs beyond reducing in the parameter dtype (on
    the same layout): ShardedAdamW's flat reduce buffer plus the change in its fp32 gradient staging of
    the largest chunk (none when the reduce dtype is fp32; this is the torch update path's: the fused
    CUDA update stages nothing, so there the buffer alone counts); ShardedMuon rs_ag's reduce buffers (W chunks
    + the own chunk per bucket). reduce_bcast Muon converts tensor by tensor, transiently: 0 here."""
    out = {}
    for name, u in units.groupby("group", sort=False):
        red, par = u["reduce_dtype"].iloc[0], u["param_dtype"].iloc[0]
        if red == par or (name == "muon" and u["kind"].iloc[0] == "reduce_bcast"):
            out[name] = 0
        elif name == "muon":
            out[name] = int((u["wire_numel"] + u["wire_numel"] // world).sum()) * _BYTES[red]
        else:
            staging = 4 * int((u["wire_numel"] // world).max())
            out[name] = (int(u["wire_numel"].sum()) * _BYTES[red] + (red != "fp32") * staging
                         - (par != "fp32") * staging)
    return out


# ------------------------------------------------------------------ 3. the model: links and times

@dataclass(frozen=True)
class Link:
    """A fabric, as the model sees it: per-GPU one-way peak, the fraction large collectives reach,
    and a fixed cost per collective call. Stated parameters, not measurements."""

    name: str
    peak_gb_s: float
    efficiency: float
    latency_us: float
    source: str

    @property
    def bus_gb_s(self) -> float:
        return self.peak_gb_s * self.efficiency


NVLINK_H200 = Link("NVLink 4 (HGX H200, within a node)", 450.0, 0.8, 15.0,
                   "NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (both directions) = 450 GB/s each way; "
                   "efficiency 0.8 and 15 us per call are assumptions in the range nccl-tests report, "
                   "not measured here")
IB_NDR_8X400 = Link("InfiniBand NDR, 8 x 400 Gb/s per node (one NIC per GPU)", 50.0, 0.8, 30.0,
                    "400 Gb/s = 50 GB/s per NIC and GPU (ConnectX-7 NDR, one per GPU on HGX H200 nodes); "
                    "efficiency 0.8 and 30 us per call are assumptions, not measured here")


@dataclass(frozen=True)
class Topology:
    name: str
    world: int
    nodes: int


TOPOLOGIES = (Topology("1x2", 2, 1), Topology("1x4", 4, 1), Topology("1x8", 8, 1), Topology("2x8", 16, 2))


def link_for(topology: Topology, intra: Link = NVLINK_H200, inter: Link = IB_NDR_8X400) -> Link:
    """The link that bounds a flat ring over `topology`: NVLink in one node, the NIC across nodes."""
    return intra if topology.nodes == 1 else inter


def collective_ms(nbytes: float, world: int, link: Link, kind: str, calls: int = 1) -> float:
    """One unit's phase: rs_ag alpha + (W-1)/W n / bw; reduce_bcast calls x alpha + n / bw."""
    if world == 1:
        return 0.0
    per_ms = link.bus_gb_s * 1e6           # bytes per ms
    share = (world - 1) / world if kind == "rs_ag" else 1.0
    return calls * link.latency_us / 1e3 + share * nbytes / per_ms


def unit_times(units: pd.DataFrame, world: int, link: Link, timeline: Timeline | None = None) -> pd.DataFrame:
    """units + reduce_ms, publish_ms and (with a timeline) ready_ms: when the unit's last gradient is
    ready (a parameter the timeline lacks counts as ready at the end of the backward)."""
    out = units.copy()
    out["reduce_ms"] = [collective_ms(r.reduce_bytes, world, link, r.kind, r.calls) for r in units.itertuples()]
    out["publish_ms"] = [collective_ms(r.publish_bytes, world, link, r.kind, r.calls) for r in units.itertuples()]
    if timeline is not None:
        ready = dict(zip(timeline.backward["param"], timeline.backward["grad_ready_ms"]))
        out["ready_ms"] = [max(ready.get(n, timeline.bwd_ms) for n in r.params) for r in units.itertuples()]
    return out


def reduce_schedule(units: pd.DataFrame) -> pd.DataFrame:
    """overlap_backward's schedule: units + issue_ms (each group issues its units in its fixed order,
    each once complete) and done_ms (one stream runs them in issue order), in issue order."""
    parts = [g.assign(issue_ms=g["ready_ms"].cummax())
             for _, g in units.sort_values(["group_pos", "reduce_pos"]).groupby("group_pos")]
    out = pd.concat(parts).sort_values(["issue_ms", "group_pos", "reduce_pos"])
    done, t = [], 0.0
    for issue, dur in zip(out["issue_ms"], out["reduce_ms"]):
        t = max(t, issue) + dur
        done.append(t)
    return out.assign(done_ms=done)


def exposed_reduce_ms(units: pd.DataFrame, backward_ms: float, overlap: bool) -> float:
    """The gradient reduction's time past the end of the backward (all of it without overlap)."""
    if not overlap or units.empty:
        return float(units["reduce_ms"].sum())
    return max(0.0, float(reduce_schedule(units)["done_ms"].max()) - backward_ms)


def publish_schedule(units: pd.DataFrame) -> pd.DataFrame:
    """overlap_refresh's publishes, all issued at the forward's start (groups in step order, each in
    its publish order) and run one at a time: units + done_ms, in that order."""
    fifo = units.sort_values(["group_pos", "publish_pos"])
    return fifo.assign(done_ms=fifo["publish_ms"].cumsum())


def exposed_refresh_ms(units: pd.DataFrame, needed_ms: list[float], overlap: bool) -> float:
    """The forward's delay waiting for updated parameters (all of the publish time without overlap).
    overlap: publish_schedule, and stage s's pre-hook waits for each group's publishes up to the last
    one holding a parameter of a stage <= s."""
    if not overlap or units.empty:
        return float(units["publish_ms"].sum())
    fifo = publish_schedule(units)
    end = dict(zip(zip(fifo["group_pos"], fifo["publish_pos"]), fifo["done_ms"]))
    n_stages = len(needed_ms)
    required = [0.0] * n_stages
    for g, u in units.groupby("group_pos"):
        order = list(range(len(u)))   # a group's units indexed by publish_pos
        by_pos = sorted(u.itertuples(), key=lambda r: r.publish_pos)
        waits = stage_waits([list(r.stages) for r in by_pos], order, n_stages)
        for s, n in enumerate(waits):
            if n:
                required[s] = max(required[s], end[(g, by_pos[n - 1].publish_pos)])
    start = 0.0
    for s in range(n_stages):
        start = max(start + (needed_ms[s] - needed_ms[s - 1] if s else 0.0), required[s])
    return max(0.0, start - needed_ms[-1])   # the last stage's delay: nothing waits after it


# ------------------------------------------------------------------ 3. the model: predictions

OVERLAPS = {"off": (False, False), "backward": (True, False), "refresh": (False, True), "both": (True, True)}


def _variant_cfg(timeline: Timeline, collective: str, reduce_dtype: str, **extra) -> TrainConfig:
    cfg = preset(timeline.preset)
    cfg.optimizer, cfg.B, cfg.T = timeline.optimizer, timeline.B, timeline.T
    cfg.collective = cfg.muon_collective = collective
    cfg.reduce_dtype = reduce_dtype
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def muon_step_share(model: torch.nn.Module, world: int, ns_steps: int = 5) -> float:
    """The largest owner's share of the Newton-Schulz cost under ShardedMuon's LPT partition."""
    params = muon_param_groups(model)[0]["params"]
    costs = [ns_cost(p.shape, ns_steps) for p in params]
    loads = [0.0] * world
    for c, r in zip(costs, lpt_partition(costs, world)):
        loads[r] += c
    return max(loads) / sum(costs)


def timeline_units(timeline: Timeline, model: torch.nn.Module, topology: Topology, collective: str = "rs_ag",
                   reduce_dtype: str = "param", intra: Link = NVLINK_H200, inter: Link = IB_NDR_8X400,
                   **cfg_overrides) -> pd.DataFrame:
    """The units of the timeline's optimizer set at `topology` (one layout and reduce dtype; the
    preset's bucket sizes unless overridden) with their times and ready_ms (unit_times)."""
    cfg = _variant_cfg(timeline, collective, reduce_dtype, **cfg_overrides)
    return unit_times(comm_units(model, cfg, topology.world), topology.world, link_for(topology, intra, inter),
                      timeline)


def predict(timeline: Timeline, model: torch.nn.Module, topology: Topology, overlap: str = "both",
            collective: str = "rs_ag", reduce_dtype: str = "param", global_batch: int | None = None,
            intra: Link = NVLINK_H200, inter: Link = IB_NDR_8X400, **cfg_overrides) -> dict:
    """The model's step at `topology` for one variant, from one preset's W = 1 timeline (module
    docstring, section 3). global_batch: tokens per step (default the preset's). cfg_overrides:
    bucket_mb, muon_buckets."""
    W = topology.world
    link = link_for(topology, intra, inter)
    units = timeline_units(timeline, model, topology, collective, reduce_dtype, intra, inter, **cfg_overrides)
    ob, orf = OVERLAPS[overlap]
    red = exposed_reduce_ms(units, timeline.bwd_ms, ob)
    pub = exposed_refresh_ms(units, list(timeline.forward["needed_ms"]), orf)
    # the norm all-reduce of every group and Muon's stats gather: latency only, never hidden
    small = (units["group"].nunique() + (timeline.optimizer == "muon")) * link.latency_us / 1e3 if W > 1 else 0.0
    tokens = global_batch or preset(timeline.preset).global_batch
    accum = max(1.0, tokens / (timeline.B * timeline.T * W))
    share = muon_step_share(model, W) if timeline.optimizer == "muon" else 1.0 / W
    compute = accum * (timeline.fwd_ms + timeline.bwd_ms) + timeline.opt_step_ms * share
    sent = (W - 1) / W * float((units["reduce_bytes"] + units["publish_bytes"]).sum())
    return {"preset": timeline.preset, "optimizer": timeline.optimizer, "topology": topology.name, "world_size": W,
            "nodes": topology.nodes, "overlap": overlap, "collective": collective, "reduce_dtype": reduce_dtype,
            **cfg_overrides, "link": link.name, "sent_mib_per_rank": sent / MIB,
            "collective_calls": int(2 * units["calls"].sum()), "reduce_ms": float(units["reduce_ms"].sum()),
            "publish_ms": float(units["publish_ms"].sum()), "exposed_reduce_ms": red, "exposed_refresh_ms": pub,
            "exposed_ms": red + pub + small, "compute_ms": compute, "accum": accum,
            "step_ms": compute + red + pub + small}


def predictions(timelines: list[Timeline], topologies=TOPOLOGIES, overlaps=tuple(OVERLAPS),
                collectives=("rs_ag", "reduce_bcast"), reduce_dtypes=("param", "fp32", "bf16"),
                models: dict[str, torch.nn.Module] | None = None, **kw) -> pd.DataFrame:
    """predict() over every timeline x topology x overlap x layout x reduce dtype. models: preset ->
    the model whose parameters the timeline measured (default timeline_model)."""
    rows = []
    for t in timelines:
        model = models[t.preset] if models and t.preset in models else timeline_model(t)
        for topo, ov, col, dt in itertools.product(topologies, overlaps, collectives, reduce_dtypes):
            rows.append(predict(t, model, topo, ov, col, dt, **kw))
    return pd.DataFrame(rows)


def best_variants(pred: pd.DataFrame) -> pd.DataFrame:
    """The fastest variant per preset, optimizer and topology, and how much it saves over the serial path."""
    keys = ["preset", "optimizer", "topology"]
    best = pred.loc[pred.groupby(keys, sort=False)["step_ms"].idxmin()]
    serial = pred[(pred["overlap"] == "off") & (pred["collective"] == "rs_ag") & (pred["reduce_dtype"] == "param")]
    out = best.merge(serial[keys + ["step_ms", "exposed_ms"]], on=keys, suffixes=("", "_serial"))
    return out[keys + ["overlap", "collective", "reduce_dtype", "exposed_ms", "step_ms", "exposed_ms_serial",
                       "step_ms_serial"]].reset_index(drop=True)


def bucket_sweep(timeline: Timeline, model: torch.nn.Module, topology: Topology, sizes=None, **kw) -> pd.DataFrame:
    """Exposed time (both overlaps, rs_ag) against the bucket size: bucket_mb for AdamW, muon_buckets
    (a bucket count) for Muon."""
    if timeline.optimizer == "muon":
        key, sizes = "muon_buckets", sizes or (1, 2, 3, 4, 6, 8, 12, 16, 24, 36, 48)
    else:
        key, sizes = "bucket_mb", sizes or (1, 2, 5, 10, 25, 50, 100, 200, 400, 800, 1600)
    return pd.DataFrame([predict(timeline, model, topology, "both", **{key: s}, **kw) for s in sizes])


def best_bucket_size(sweep: pd.DataFrame, tolerance: float = 0.01) -> pd.Series:
    """The sweep row with the LARGEST bucket size whose exposed time is within `tolerance` of the
    minimum: the same exposure with the fewest collectives (each a sync point whose rank-skew wait
    the model leaves out)."""
    key = "muon_buckets" if "muon_buckets" in sweep and sweep["muon_buckets"].notna().all() else "bucket_mb"
    near = sweep[sweep["exposed_ms"] <= sweep["exposed_ms"].min() * (1 + tolerance)]
    # the fewest collectives: the largest bucket_mb, or the smallest muon_buckets count
    return near.loc[near[key].idxmin() if key == "muon_buckets" else near[key].idxmax()]


def layout_table(model: torch.nn.Module, preset_name: str, optimizer: str, topologies=TOPOLOGIES,
                 collectives=("rs_ag", "reduce_bcast"), reduce_dtypes=("param", "fp32", "bf16"),
                 intra: Link = NVLINK_H200, inter: Link = IB_NDR_8X400, **cfg_overrides) -> pd.DataFrame:
    """No timeline needed: per topology, layout, reduce dtype and group, the units, collective calls,
    reduce / publish MiB and MiB sent per rank per step, the padding, the largest unit, the extra
    reduce-buffer MiB, and serial_comm_ms: what a step pays with no overlap (the most the overlaps
    can hide)."""
    rows = []
    for topo, col, dt in itertools.product(topologies, collectives, reduce_dtypes):
        W, link = topo.world, link_for(topo, intra, inter)
        cfg = preset(preset_name)
        cfg.optimizer, cfg.collective, cfg.muon_collective, cfg.reduce_dtype = optimizer, col, col, dt
        for k, v in cfg_overrides.items():
            setattr(cfg, k, v)
        units = unit_times(comm_units(model, cfg, W), W, link)
        extra = reduce_buffer_bytes(units, W)
        for name, u in units.groupby("group", sort=False):
            moved = u["reduce_bytes"] + u["publish_bytes"]
            rows.append({"preset": preset_name, "optimizer": optimizer, "topology": topo.name, "world_size": W,
                         "collective": col, "reduce_dtype": dt, "group": name, "units": len(u),
                         "calls_per_step": int(2 * u["calls"].sum()), "params": int(u["numel"].sum()),
                         "padding": int((u["wire_numel"] - u["numel"]).sum()),
                         "reduce_mib": u["reduce_bytes"].sum() / MIB, "publish_mib": u["publish_bytes"].sum() / MIB,
                         "sent_mib_per_rank": (W - 1) / W * moved.sum() / MIB,
                         "largest_unit_mib": u["reduce_bytes"].max() / MIB, "extra_buffer_mib": extra[name] / MIB,
                         "serial_comm_ms": float((u["reduce_ms"] + u["publish_ms"]).sum())})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ 4. measured multi-GPU timings

MEASURED_KEYS = ["preset", "optimizer", "world_size", "nodes", "collective", "muon_collective", "reduce_dtype",
                 "overlap_backward", "overlap_refresh", "bucket_mb", "muon_buckets", "B", "T", "global_batch"]


def load_measured(results: str | Path) -> pd.DataFrame:
    """Measured W > 1 step times under `results` (module docstring): results/overlap/multi_gpu_*.csv
    and bench/zero.csv's blunb rows, as MEASURED_KEYS + step_ms, device, source. Empty when none exist."""
    results = Path(results)
    parts = []
    for path in sorted((results / "overlap").glob("multi_gpu_*.csv")):
        parts.append(pd.read_csv(path).assign(source=str(path.relative_to(results))))
    zero = results / "bench" / "zero.csv"
    if zero.is_file():
        z = pd.read_csv(zero)
        z = z[z["variant"].str.startswith("blunb") & (z["world_size"] > 1)]
        parts.append(pd.DataFrame({
            "preset": z["preset"], "optimizer": "adamw", "world_size": z["world_size"], "nodes": 1,
            "collective": z["collective"], "muon_collective": "rs_ag", "reduce_dtype": "param",
            "overlap_backward": z["overlap_backward"], "overlap_refresh": z["overlap_refresh"],
            "bucket_mb": z["bucket_mb"], "muon_buckets": 6, "B": z["B"], "T": z["T"],
            "global_batch": z["B"] * z["T"] * z["world_size"], "step_ms": z["step_ms"], "device": z["device"],
            "source": "bench/zero.csv"}))
    if not parts:
        return pd.DataFrame(columns=MEASURED_KEYS + ["step_ms", "device", "source"])
    return pd.concat(parts, ignore_index=True)


def predict_measured(measured: pd.DataFrame, timelines: list[Timeline], **kw) -> pd.DataFrame:
    """measured + the model's step_ms and exposed_ms for every row whose preset and optimizer have a
    timeline (scaled to the row's B, T; the row's world size, nodes, layouts, reduce dtype, overlaps,
    bucket sizes and global batch)."""
    by_key = {(t.preset, t.optimizer): t for t in timelines}
    label = {v: k for k, v in OVERLAPS.items()}
    out = []
    for r in measured.itertuples(index=False):
        t = by_key.get((r.preset, r.optimizer))
        if t is None:
            continue
        topo = Topology(f"{int(r.nodes)}x{int(r.world_size) // int(r.nodes)}", int(r.world_size), int(r.nodes))
        p = predict(t.scaled(int(r.B), int(r.T)), timeline_model(t), topo,
                    label[(bool(r.overlap_backward), bool(r.overlap_refresh))], r.collective, r.reduce_dtype,
                    global_batch=int(r.global_batch), bucket_mb=float(r.bucket_mb), muon_buckets=int(r.muon_buckets),
                    muon_collective=r.muon_collective, **kw)
        out.append({**r._asdict(), "predicted_step_ms": p["step_ms"], "predicted_exposed_ms": p["exposed_ms"]})
    return pd.DataFrame(out)


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def bucket_csv(units: pd.DataFrame) -> pd.DataFrame:
    """comm_units rows for a CSV: the parameter tuple becomes its count and first / last names."""
    out = units.drop(columns=["params", "stages"]).copy()
    out["first_param"] = [p[0] for p in units["params"]]
    out["last_param"] = [p[-1] for p in units["params"]]
    out["first_stage"] = [s[0] for s in units["stages"]]
    return out

