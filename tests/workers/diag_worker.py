"""torchrun worker for tests/test_diag.py: Diagnostics across ranks, with the trainer's optimizer sets.

A 6-layer tiny BLU (probes L0 L1 L2 L3 L5), 2 micro-batches per rank, 4 steps, for
  zero-overlap  ZeRO-1 AdamW with overlap_backward (gradients reduced in place from hooks during
                the last backward) and overlap_refresh (parameters published asynchronously);
  ddp_adamw     torch DDP + AdamW (gradients averaged in place at the end of backward).
Checks, on every rank: the report is the same on every rank; each rank's micro losses, shards and
offsets arrive intact; step 0's probe gradient norms are each rank's PRE-reduce local norms (a
plain model's own backward on the same batches); an outlier injected on the last rank at step 1 is
named with its rank, shard and offset; replicas agree except at step 2, where the last rank's
copy of one weight is one ulp off: ZeRO's next publish heals it, DDP keeps the divergence.
Rank 0 also checks diag.csv. argv[1]: a folder for the run folders; argv[2] "cuda": the same on
one GPU per rank under NCCL (by hand on a GPU host; the test suite runs gloo on CPU).
"""

from __future__ import annotations

import csv
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from blunb.config import apply_overrides, preset
from blunb.diag import Diagnostics
from blunb.model import BLU
from blunb.optim.build import build_optimizers

STEPS, ACCUM, OUTLIER_STEP, PERTURB_STEP = 4, 2, 1, 2
CASES = [
    # ~1 KB buckets: each tensor's in-place reduce is launched from its own gradient hook.
    ("zero-overlap", ["optimizer=adamw", "overlap_backward=true", "overlap_refresh=true", "bucket_mb=0.001"],
     [1, 1, 0, 1]),
    ("ddp_adamw", ["optimizer=ddp_adamw"], [1, 1, 0, 0]),
]


def tiny_config(overrides, world):
    cfg = apply_overrides(preset("tiny"), ["d_model=64", "n_layers=6", "q_heads=2", "kv_heads=1", "head_dim=32",
                                           "ffn_hidden=96", "T=32", "B=2", f"global_batch={2 * 32 * world * ACCUM}",
                                           "kernels=torch", "linear_dtype=fp32", *overrides])
    cfg.rescale_schedule(10)
    cfg.validate(world)
    return cfg


def batch(step, rank, micro, vocab, device):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    t = torch.randint(0, vocab, (2, 33), generator=g).to(device)
    return t[:, :-1], t[:, 1:]


def where(step, rank, micro):
    """(shard, offset) of each of a micro-batch's two rows."""
    return [(f"train_r{rank}_{step % 2}.bin", 10_000 * step + 100 * rank + 7 * micro),
            (f"train_m{micro}.bin", 3 * step + rank)]


def detail(rows):
    return " ".join("%s:%d" % row for row in rows)


def local_grad_norms(cfg, rank, layers, device):
    """||grad(wQ)|| of a plain model's own step-0 backward: the pre-reduce local norm."""
    ref = BLU(cfg.model, device=device, seed=cfg.seed)
    for micro in range(ACCUM):
        _, loss = ref(*batch(0, rank, micro, cfg.model.vocab_size, device))
        (loss / ACCUM).backward()
    return torch.stack([torch.linalg.vector_norm(ref.blocks[k].attn.wq.weight.grad) for k in layers]).double()


def run_case(name, overrides, expect_match, rank, world, run_dir, device):
    cfg = tiny_config(overrides, world)
    model = BLU(cfg.model, device=device, seed=cfg.seed)
    diag = Diagnostics(model, rank, world, run_dir)      # before the optimizers: its hook runs first
    opt = build_optimizers(model, cfg, device, world)
    assert diag.probe_layers == [0, 1, 2, 3, 5], diag.probe_layers
    last = world - 1
    for step in range(STEPS):
        if step == PERTURB_STEP and rank == last:
            opt.drain()      # install the staged refresh first, or it would overwrite the perturbation
            with torch.no_grad():
                w = model.blocks[-1].attn.wq.weight.view(-1)
                w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
        opt.set_lr(step)
        mine = []
        for micro in range(ACCUM):
            x, y = batch(step, rank, micro, cfg.model.vocab_size, device)
            with opt.micro_step(last=micro == ACCUM - 1):
                _, loss = opt.forward_model(x, y)
                (loss / ACCUM).backward()
            if (step, rank, micro) == (OUTLIER_STEP, last, 1):
                loss = loss + 3.0
            mine.append(float(loss.detach().float()))
            diag.record_micro(loss, where(step, rank, micro))
        opt.step()
        lines = diag.end_step(step)
        rep = diag.last

        everyone = [None] * world
        dist.all_gather_object(everyone, lines)
        assert all(other == lines for other in everyone), f"{name}: ranks disagree on the report at step {step}"
        assert rep.losses[rank].tolist() == mine, (name, step, rep.losses[rank], mine)
        assert [[(s, int(o)) for s, o in zip(names, offsets)] for names, offsets in
                zip(rep.shards[rank], rep.offsets[rank])] == [where(step, rank, m) for m in range(ACCUM)]
        if step == 0:
            expected = local_grad_norms(cfg, rank, diag.probe_layers, device).cpu()
            torch.testing.assert_close(torch.from_numpy(rep.grad_norms[rank].copy()), expected, rtol=1e-6, atol=0)
            assert len({tuple(row) for row in rep.grad_norms.tolist()}) == world, "the norms look reduced"
        outlier_line = [ln for ln in lines if "OUTLIER" in ln]
        if step == OUTLIER_STEP:
            assert rep.outliers == [(last, 1)], rep.outliers
            assert outlier_line == [f"  [micro] OUTLIER rank {last} m=1 loss {rep.losses[last, 1]:.4f} "
                                    f"(median {rep.median:.4f}) from {detail(where(step, last, 1))} (shard:token "
                                    "offset per row)"], outlier_line
        else:
            assert not outlier_line, outlier_line
        bad = [ln for ln in lines if "[replica] ERROR" in ln]
        if expect_match[step]:
            assert rep.mismatched_ranks == [] and not bad, (name, step, lines)
        else:
            assert rep.mismatched_ranks == [last], (name, step, rep.mismatched_ranks)
            assert len(bad) == 1 and f"ERROR step {step}:" in bad[0] and f"rank(s) {last} differs" in bad[0], bad
    diag.close()
    opt.drain()

    if rank == 0:
        with open(Path(run_dir) / "diag.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        P = len(diag.probe_layers)
        for step in range(STEPS):
            at = [r for r in rows if int(r["step"]) == step]
            n_out = int(step == OUTLIER_STEP)
            assert len(at) == world * ACCUM + 1 + n_out + P * (world + 2) + 1, (name, step, len(at))
            match = [r for r in at if r["item"] == "replica_checksum_match"]
            assert [int(r["value"]) for r in match] == [expect_match[step]], (name, step, match)
            losses = [r for r in at if r["item"] == "micro_loss"]
            assert sorted((int(r["rank"]), int(r["micro"]), r["detail"]) for r in losses) == \
                sorted((q, m, detail(where(step, q, m))) for q in range(world) for m in range(ACCUM))
            outl = [r for r in at if r["item"] == "micro_outlier"]
            assert [(int(r["rank"]), int(r["micro"]), r["detail"]) for r in outl] == \
                ([(last, 1, detail(where(step, last, 1)))] if n_out else [])
            norms = [r for r in at if r["item"].startswith("probe_grad_norm.")]
            assert sorted({int(r["rank"]) for r in norms}) == list(range(world)) and len(norms) == P * world
        print(f"OK W={world} {name}", flush=True)


def main():
    if sys.argv[2:] == ["cuda"]:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for name, overrides, expect_match in CASES:
        run_dir = Path(sys.argv[1]) / name
        if rank == 0:
            run_dir.mkdir(parents=True)
        dist.barrier()
        run_case(name, overrides, expect_match, rank, world, run_dir, device)
    if rank == 0:
        print(f"diag worker OK at W={world}", flush=True)
    gc.collect()   # frees the DDP wrapper (reference cycles) so the group's gloo threads can join
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
