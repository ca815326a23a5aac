"""torchrun worker for tests/test_skip.py: a non-finite gradient on ONE rank skips the whole step.

For each optimizer set the trainer builds (adamw with one or two dtype groups, muon, ddp_adamw;
with and without global clip and overlap), step 2 of a tiny model is poisoned on the last rank
with the trainer's own fault injection (a NaN gradient at the embedding output, before any
reduction). Checks: every parameter and every optimizer state tensor is bit-identical before and
after that step on every rank; the next step is a normal one (not skipped, parameters move);
replicas stay identical. nan_policy=group (the reference trainer's rule) is checked too: there
only the poisoned group keeps still.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from blunb.config import apply_overrides, preset
from blunb.faults import poison_next_forward
from blunb.model import BLU
from blunb.optim.build import DDPAdamW, build_optimizers
from blunb.optim.interface import StepRecord
from blunb.optim.zero_adamw import ShardedAdamW

POISON_STEP, STEPS, ACCUM = 2, 4, 2

CASES = [
    ("adamw-1group", ["optimizer=adamw", "linear_dtype=fp32"]),
    ("adamw-2groups", ["optimizer=adamw", "linear_dtype=bf16"]),
    ("adamw-2groups-globalclip", ["optimizer=adamw", "linear_dtype=bf16", "global_clip=true"]),
    ("adamw-2groups-overlap", ["optimizer=adamw", "linear_dtype=bf16", "overlap_backward=true",
                               "overlap_refresh=true"]),
    ("muon", ["optimizer=muon", "linear_dtype=fp32"]),
    ("muon-globalclip", ["optimizer=muon", "linear_dtype=fp32", "global_clip=true"]),
    ("ddp_adamw", ["optimizer=ddp_adamw", "linear_dtype=fp32"]),
]


def tiny_config(overrides, world):
    cfg = apply_overrides(preset("tiny"), ["d_model=64", "n_layers=2", "q_heads=2", "kv_heads=1", "head_dim=32",
                                           "ffn_hidden=96", "T=32", "B=2", f"global_batch={2 * 32 * world * ACCUM}",
                                           "kernels=torch", *overrides])
    cfg.rescale_schedule(10)
    cfg.validate(world)
    return cfg


def batch(step, rank, micro, vocab):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    t = torch.randint(0, vocab, (2, 33), generator=g)
    return t[:, :-1], t[:, 1:]


def state_tensors(opt) -> list[torch.Tensor]:
    """Every optimizer state tensor: fp32 masters, moments, momenta, step counts."""
    if isinstance(opt, DDPAdamW):
        found = [t for st in opt.opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    else:
        found = []
        for _, o, _ in opt.groups:
            if isinstance(o, ShardedAdamW):
                found += [o._master, o._exp_avg, o._exp_avg_sq, o._steps]
            else:
                found += [t for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return [t.detach().clone() for t in found]


def replicas_identical(model, world) -> bool:
    """Every rank holds exactly the same parameters (all of them gathered: fine at this size)."""
    if world == 1:
        return True
    mine = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, mine) for g in gathered)


def run_case(name, overrides, rank, world, nan_policy="step"):
    cfg = tiny_config([*overrides, f"nan_policy={nan_policy}"], world)
    model = BLU(cfg.model, seed=cfg.seed)
    opt = build_optimizers(model, cfg, torch.device("cpu"), world)
    for step in range(STEPS):
        opt.drain()
        params_before = [p.detach().clone() for p in model.parameters()]
        state_before = state_tensors(opt)
        opt.set_lr(step)
        for micro in range(ACCUM):
            if micro == 0 and step == POISON_STEP and rank == world - 1:
                poison_next_forward(model)
            x, y = batch(step, rank, micro, cfg.model.vocab_size)
            with opt.micro_step(last=micro == ACCUM - 1):
                _, loss = opt.forward_model(x, y)
                (loss / ACCUM).backward()
        stats = opt.step()
        rec = StepRecord.from_values(stats, stats.values().tolist())
        opt.drain()
        moved = [not torch.equal(a, p.detach()) for a, p in zip(params_before, model.parameters())]
        if step != POISON_STEP:
            assert not rec.skipped, f"{name}: step {step} skipped"
            assert all(moved), f"{name}: step {step} left {moved.count(False)} tensors still"
            continue
        assert rec.skipped, f"{name}: the poisoned step was not reported as skipped"
        if nan_policy == "step":
            assert not any(moved), f"{name}: {sum(moved)} of {len(moved)} parameters changed on a skipped step"
            state_after = state_tensors(opt)
            assert len(state_after) == len(state_before) and all(
                torch.equal(a, b) for a, b in zip(state_before, state_after)), f"{name}: optimizer state changed"
        else:   # the reference trainer's rule: the healthy group (the Muon body) still steps
            assert rec.skipped_groups and 0 < sum(moved) < len(moved), (name, rec, sum(moved))
    assert replicas_identical(model, world), f"{name}: replicas differ"


def run_all(rank: int = 0, world: int = 1) -> None:
    torch.set_num_threads(1)
    for name, overrides in CASES:
        run_case(name, overrides, rank, world)
        if rank == 0:
            print(f"OK W={world} {name}", flush=True)
    run_case("muon-group-policy", ["optimizer=muon", "linear_dtype=fp32"], rank, world, nan_policy="group")
    if rank == 0:
        print(f"OK W={world} muon-group-policy", flush=True)


def main():
    dist.init_process_group("gloo")
    run_all(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
