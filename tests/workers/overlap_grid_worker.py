"""torchrun worker for tests/test_overlap_grid.py: the overlap x collective x reduce_dtype grid.

For both ZeRO optimizer sets ("adamw" and "muon", built by build_optimizers on the tiny preset,
fp32 on CPU, grad clip on) and every collective and reduce dtype (fp32, bf16), each
overlap_backward x overlap_refresh variant trains 5 steps of 2 micro-batches through the
optimizer set's API exactly as blunb/train.py does. Asserted: every variant's parameters and
micro-batch losses are bit-identical to the serial path (both overlaps off) of the same
collective and reduce dtype (the losses prove each refresh stage landed before it was read),
every run's replicas are bit-identical, the overlaps really were in flight (a switch that is
ignored would pass the identity trivially), and bf16 reduction changes the result.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from blunb.config import preset
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.optim.muon import ShardedMuon
from tests.distributed import gloo_threads

STEPS, ACCUM, B, T = 5, 2, 2, 32
BUCKET_MB = 0.25          # several ShardedAdamW buckets on the tiny model
DEVICE = torch.device("cpu")


def batch(step: int, micro: int, rank: int, W: int, vocab: int):
    """The same token block on every rank, each rank reading its own rows."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    rows = torch.randint(vocab, (W * B, T + 1), generator=g)[rank * B:(rank + 1) * B]
    return rows[:, :-1], rows[:, 1:]


def in_flight(o, what: str) -> bool:
    """Whether an overlap is under way right now (peeks at the optimizers' bookkeeping)."""
    if what == "backward":
        return (o._next_unit if isinstance(o, ShardedMuon) else o._next_bucket) > 0
    return bool(o._pending_publish)


def run(optimizer, collective, reduce_dtype, overlap_backward, overlap_refresh, rank, W):
    cfg = preset("tiny")
    cfg.optimizer, cfg.device, cfg.B, cfg.T, cfg.bucket_mb = optimizer, "cpu", B, T, BUCKET_MB
    cfg.reduce_dtype, cfg.overlap_backward, cfg.overlap_refresh = reduce_dtype, overlap_backward, overlap_refresh
    if optimizer == "muon":
        cfg.muon_collective = collective
    else:
        cfg.collective = collective
    assert cfg.grad_clip > 0
    model = BLU(cfg.model, device=DEVICE, seed=cfg.seed)
    opt = build_optimizers(model, cfg, DEVICE, W)
    groups = [o for _, o, _ in opt.groups]
    if optimizer == "muon":
        assert isinstance(groups[-1], ShardedMuon) and groups[-1].collective == collective
        assert (groups[-1].overlap_backward, groups[-1].overlap_refresh) == (overlap_backward, overlap_refresh)
        if overlap_refresh:
            stage_map = groups[-1].refresh_stage_map()
            rows = stage_map["stages"]
            assert len(rows) == 1 + cfg.model.n_layers and not stage_map["uncovered"]
            assert sum(r["params"] for r in rows) == len(groups[-1]._muon_params)   # each installed once
            assert sum(r["collectives"] for r in rows) == len(groups[-1]._units)
    losses = []
    for step in range(STEPS):
        opt.set_lr(step)
        for micro in range(ACCUM):
            x, y = batch(step, micro, rank, W, cfg.model.vocab_size)
            with opt.micro_step(last=micro == ACCUM - 1):
                loss = opt.forward_model(x, y)[1]
                (loss / ACCUM).backward()
            losses.append(loss.detach().clone())
        if overlap_backward:
            assert all(in_flight(o, "backward") for o in groups), "overlap_backward issued nothing from the hooks"
        opt.step()
        if overlap_refresh:
            assert all(in_flight(o, "refresh") for o in groups), "overlap_refresh left nothing in flight"
    opt.drain()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(params) for _ in range(W)]
    dist.all_gather(every, params)
    assert all(torch.equal(e, params) for e in every), "replicas diverged"
    return params, torch.stack(losses)


def main():
    dist.init_process_group("gloo")
    W, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    for optimizer, collective in itertools.product(("adamw", "muon"), ("rs_ag", "reduce_bcast")):
        serial = {}
        for reduce_dtype in ("fp32", "bf16"):
            base = serial[reduce_dtype] = run(optimizer, collective, reduce_dtype, False, False, rank, W)
            for ob, orf in ((True, False), (False, True), (True, True)):
                params, losses = run(optimizer, collective, reduce_dtype, ob, orf, rank, W)
                what = f"{optimizer} {collective} {reduce_dtype} overlap_backward={ob} overlap_refresh={orf}"
                assert torch.equal(losses, base[1]), f"{what}: losses differ from the serial path"
                assert torch.equal(params, base[0]), f"{what}: parameters differ from the serial path"
            if rank == 0:
                print(f"OK W={W} {optimizer} {collective} {reduce_dtype}", flush=True)
        assert not torch.equal(serial["bf16"][0], serial["fp32"][0]), \
            f"{optimizer} {collective}: reduce_dtype=bf16 changed nothing"
    dist.destroy_process_group()
    assert gloo_threads() == 0, "gloo threads outlived destroy_process_group"
    print(f"OK rank {rank}: clean exit", flush=True)


if __name__ == "__main__":
    main()
