"""What a run says about itself: the start-of-run facts and lines, and the per-step console line.

The facts are env.json's "training" record and the start lines are printed from them; the step line is
the reference trainer's, plus blunb's group norms and skip notes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from blunb import fp8, kernels
from blunb.optim.layout import refresh_stages

if TYPE_CHECKING:
    import torch

    from blunb.config import TrainConfig
    from blunb.model import BLU
    from blunb.optim.interface import StepRecord
    from blunb.train import _Run


def run_facts(cfg: TrainConfig, model: BLU, opt, device: torch.device) -> dict:
    """The start-of-run record (env.json "training"): precision layout, optimizer set, stage map."""
    described = opt.describe()
    facts = {"precision": {**model.precision_layout(), "optimizer_masters": described["precision"]["masters"]},
             "optimizer": described,
             "kernels": kernels.describe(device),
             "dt": "host wall-clock between step starts; no per-step device sync"}
    if model.fp8_linears:
        facts["fp8"] = fp8.describe(model, cfg.model.fp8)
    if cfg.overlap_refresh:   # validate() allows it only where a ZeRO-1 set reads it
        names = {id(m): name or "<model>" for name, m in model.named_modules()}
        stages = refresh_stages(model)
        covered = {id(p) for _, ps in stages for p in ps}
        facts["refresh_stages"] = [{"stage": i, "module": names.get(id(m), type(m).__name__), "params": len(ps),
                                    "numel": sum(p.numel() for p in ps)} for i, (m, ps) in enumerate(stages)]
        facts["refresh_uncovered"] = [n for n, p in model.named_parameters() if id(p) not in covered]
    return facts


def start_lines(run: _Run, facts: dict, data_dir: Path, meta: dict) -> list[str]:
    """What the seed prints at the start of a run, from the same facts env.json records."""
    cfg, o = run.cfg, facts["optimizer"]
    prec = facts["precision"]
    lines = [f"blunb {cfg.preset}: {run.model.num_params():,} params | world {run.world_size} x {run.device} | "
             f"B {cfg.B} T {cfg.T} accum {run.accum} -> {run.tokens_per_step:,} tokens/step",
             "precision: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in prec.items())]
    if "fp8" in facts:
        lines += fp8.start_lines(facts["fp8"], compiled=bool(cfg.compile))
    head = f"optimizer: {o['label']} over {o['world_size']} rank(s)"
    if "zero" in o:
        z = o["zero"]
        head += (f" | collective {z['collective']}" + (f", muon {z['muon_collective']} ({z['muon_buckets']} buckets)"
                                                       if z["muon_collective"] else "")
                 + f" | reduce_dtype {z['reduce_dtype']} | overlap_backward {z['overlap_backward']} | "
                 f"overlap_refresh {z['overlap_refresh']} | bucket {z['bucket_mb']:g} MiB | state "
                 f"{o['state_bytes_this_rank'] / 2**20:.1f} MiB on this rank")
    lines.append(head)
    lines += [f"  G{i} {g['name']}: {g['params']:,} params, lr {g['lr_max']:g} -> {g['lr_min']:g}"
              for i, g in enumerate(o["groups"])]
    c = o["clip"]
    pct = 100.0 * c["covered_params"] / max(c["total_params"], 1)
    lines.append(f"  grad clip {c['max_norm']:g} ({c['mode']}) covers {c['covered_params']:,} / "
                 f"{c['total_params']:,} params ({pct:.2f}%)")
    if c["max_norm"] > 0 and pct < 25.0:
        lines.append(f"  WARNING: the clip leaves {100 - pct:.2f}% of parameters (the orthogonalized matrices) "
                     "unclipped")
    lines.append(f"  weight decay on {o['decayed_params']:,} params (>= 2-D), none on {o['non_decayed_params']:,}")
    if "muon" in o:
        m = o["muon"]
        start = "" if m["ns_precondition"] == "none" else f"+{m['ns_precondition']}"  # e.g. "NS4 fixed+aol"
        lines.append(f"  muon: {m['matrices']} matrices, lr {m['lr_max']:g} -> {m['lr_min']:g}, momentum "
                     f"{m['momentum']}, nesterov {m['nesterov']}, NS{m['ns_steps']} {m['ns_schedule']}{start}, "
                     f"adjust_lr {m['adjust_lr']}, wd {m['weight_decay']:g}, collective buckets "
                     f"{m['comm_buffer_bytes'] / 2**20:.1f} MiB")
    if "refresh_stages" in facts:
        st = facts["refresh_stages"]
        lines.append(f"  refresh stages: {len(st)} (" + ", ".join(f"{s['module']} {s['numel']:,}" for s in st[:3])
                     + (", ..." if len(st) > 3 else "") + ")")
        if facts["refresh_uncovered"]:
            lines.append(f"  WARNING: no refresh stage covers {', '.join(facts['refresh_uncovered'])}: installed "
                         "with stage 0, not overlapped")
    lines.append("kernels: " + " ".join(f"{op}={b}" for op, b in facts["kernels"].items()))
    if facts.get("auto_settings"):
        lines.append(auto_settings_line(facts["auto_settings"], run.device.type))
    if "cuda_graph" in facts:
        g = facts["cuda_graph"]
        lines.append(f"cuda_graph: {'on' if g['on'] else 'off'} ({g['why']})")
    lines += determinism_lines(facts["determinism"])
    lines.append(f"data: {data_dir} ({meta.get('tokenizer')}, {meta.get('train_tokens', '?')} train tokens); "
                 f"validation: {run.val_set.n_seq * cfg.T:,} tokens split over {run.world_size} rank(s)")
    d = facts["data"]
    if d["order"] == "windows":
        order = (f"{d['windows']:,} windows of {d['window_tokens']} tokens (stride {d['stride']}) over {d['shards']} "
                 f"shard(s), permuted afresh each epoch (one epoch: {d['windows'] * cfg.T / run.tokens_per_step:,.1f} "
                 "steps)")
    else:
        order = f"legacy, whole shards permuted ({', '.join(d['shards'])}), each read strided"
    lines.append(f"data order: {d['order']}, data_seed {d['data_seed']}: {order}; init_seed {d['init_seed']}")
    lines.append(f"non-finite gradient norm: nan_policy={cfg.nan_policy} "
                 + ("(the whole step is skipped on every rank)" if cfg.nan_policy == "step"
                    else "(only the group whose norm is non-finite skips, as the reference trainer)"))
    lines.append(f"dt: {facts['dt']} (step N's line is printed during step N+1)")
    if run.faults.active:
        lines.append(f"FAULT INJECTION (testing aid): fault_nan_grad={cfg.fault_nan_grad!r} "
                     f"fault_stall={cfg.fault_stall!r}")
    lines.append(run.meter.banner(run.model.num_params(), run.tokens_per_step))
    return lines


def auto_settings_line(decided: dict[str, bool], device_type: str) -> str:
    """The start line naming what the "auto" settings became on this device, and why (config.AUTO_SWITCHES)."""
    picked = " ".join(f"{name}={str(on).lower()}" for name, on in decided.items())
    why = ("the fastest setting measured on CUDA (results/bench/)" if device_type == "cuda"
           else "the eager path: compiling is not timed on the CPU")
    return f"auto settings on {device_type}: {picked} ({why}; set them to override)"


def determinism_lines(d: dict) -> list[str]:
    """The start line(s) saying which deterministic=true settings the run set (from env.json's record)."""
    if not d["deterministic"]:
        return ["determinism: off (deterministic=false): Triton configs and some backend choices are timed; two "
                "runs can differ from step 0"]
    algorithms = d["torch_deterministic_algorithms"]
    parts = ["torch.use_deterministic_algorithms(True) (an op without a deterministic implementation raises)"
             if algorithms else "torch's deterministic algorithms OFF",
             f"CUBLAS_WORKSPACE_CONFIG={d['cublas_workspace_config']}",
             "cuDNN deterministic, benchmark off" if d["cudnn_deterministic"] and not d["cudnn_benchmark"]
             else "cuDNN NOT deterministic",
             *(["SDPA's deterministic backends (no cuDNN attention)", "uninitialized memory filled"
                if d["fill_uninitialized_memory"] else "uninitialized memory not filled"] if algorithms else []),
             f"Triton configs {d['triton_configs']}", f"backend choice {d['backend_choice']}"]
    if "inductor_deterministic" in d:
        parts.append("Inductor deterministic" if d["inductor_deterministic"] else "Inductor NOT deterministic")
    left_out = d.get("left_out")  # absent from env.json before the bisection's setting
    head = (f"deterministic=true except {', '.join(left_out)} (BLUNB_DETERMINISM_EXCEPT: a bisection run, not "
            "reproducible by design)" if left_out else "deterministic=true")
    return [f"determinism: {head}: " + ", ".join(parts), *(f"  WARNING: {n}" for n in d["notes"])]


def step_line(step, train_loss, last_val, row, rec: StepRecord, lrs, skipped_total, nan_policy) -> str:
    """The reference trainer's step line, plus blunb's group norms and skip notes."""
    val_txt = f"{last_val:.6f}" if last_val is not None else "n/a"
    mfu_txt = "n/a" if math.isnan(row["mfu"]) else f"{row['mfu'] * 100:.2f}%"
    line = (f"step {step:6d} | train {train_loss:.6f} | val {val_txt} | tok/s {row['tok_per_sec']:.2f} | "
            f"norm {rec.grad_norm:.4f} | dt {row['dt_ms']:.2f} ms | mfu {mfu_txt} | "
            f"TF/gpu {row['tflops_per_gpu']:.1f} | lr {lrs['lr']:.4e}")
    if len(rec.group_norms) > 1:
        line += "".join(f" | {k} {v:.4f}" for k, v in rec.group_norms.items())
    s = rec.scalars
    if "global_clip_coef" in s:
        line += f" | globalclip {s['global_clip_coef']:.4f}"
    if "ns_rejected" in s:
        line += f" | nsrej {s['ns_rejected']}/{s['ns_rejected_total']} | nsratio {s['ns_ratio']:.3f}"
    if rec.skipped:
        bad = [k for k, v in rec.group_norms.items() if not math.isfinite(v)]
        where = f" in {', '.join(bad)}" if bad else ""
        if nan_policy == "group" and len(rec.skipped_groups) < len(rec.group_norms):
            line += f" | SKIPPED {', '.join(rec.skipped_groups)} only (non-finite norm; nan_policy=group"
        else:
            line += f" | SKIPPED (non-finite gradient norm{where}; every group skipped"
        line += f"; {skipped_total} so far)"
    return line
