"""torchrun worker for tests/test_checkpoint.py: train the tiny preset, checkpoint, resume (gloo, CPU).

    checkpoint_worker.py save   RUN_ROOT DATA_DIR          (W = 2) per optimizer kind: 2 steps,
        checkpoint, 1 step, checkpoint (step 3), 5 more steps; rank 0 records what the resume must
        reproduce in RUN_ROOT/<kind>/expected.pt (the state gathered HERE, for the test only)
    checkpoint_worker.py resume RUN_ROOT DATA_DIR [key=value ...]   (any W, also without torchrun)
        per kind: a model built from another seed, find_resume + load, then the state, weights,
        RNG and the next 5 steps' losses checked against expected.pt (bit-exact at the saved world
        size and layout, losses to 1e-5 otherwise); the overrides change the ZeRO layout
    checkpoint_worker.py kill   RUN_ROOT DATA_DIR          (W = 2) checkpoint at step 3, then a
        save at step 6 that waits before its commit (BLUNB_TEST_CKPT_DELAY_S) for the test's SIGKILL

The helpers are imported by the in-process tests too (W = 1, no torch.distributed).
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from blunb import checkpoint as ckpt
from blunb.config import apply_overrides, preset
from blunb.data import build_train_loader, write_shard
from blunb.model import BLU
from blunb.optim.build import build_optimizers

KINDS = ("adamw", "muon")
CKPT_STEP, MORE = 3, 5
LAST_VAL = 5.4321
RTOL = 1e-5


def make_cfg(kind: str, overrides=()):
    """The tiny model on a small batch that divides at W = 1, 2, 3 (accum 6, 3, 2), several buckets."""
    cfg = preset("tiny")
    cfg.B, cfg.T, cfg.global_batch = 2, 32, 384
    cfg.optimizer, cfg.bucket_mb, cfg.muon_buckets = kind, 0.05, 3
    return apply_overrides(cfg, list(overrides))


def write_data(folder: Path) -> None:
    """Two train shards of random byte tokens (1,248 windows of T = 32)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        write_shard(folder / f"train_{i:03d}.bin", rng.integers(0, 257, 20000))


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def make_run(cfg, data_dir: Path, seed: int):
    rank, world = rank_world()
    model = BLU(cfg.model, seed=seed)
    opt = build_optimizers(model, cfg, torch.device("cpu"), world)
    # The trainer's loader (data_order windows): its state must carry the stream across the resume at any W.
    loader = build_train_loader(sorted(Path(data_dir).glob("train_*.bin")), cfg.B, cfg.T, rank, world,
                                order=cfg.data_order, data_seed=cfg.resolved_data_seed())
    return model, opt, loader


def train_steps(cfg, model, opt, loader, first: int, n: int) -> list[float]:
    """Steps first .. first+n-1 as blunb.train runs them; the rank-averaged loss of each."""
    _, world = rank_world()
    accum = cfg.grad_accum_steps(world)
    losses = []
    for step in range(first, first + n):
        opt.set_lr(step)
        total = torch.zeros(())
        for micro in range(accum):
            x, y = loader.next_batch()
            with opt.micro_step(last=micro == accum - 1):
                _, loss = opt.forward_model(x, y)
                (loss / accum).backward()
            total += loss.detach().float() / accum
        opt.step()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    return losses


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every optimizer tensor reassembled whole ("<fqn>.<field>"): a test-only gather."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    names = {p: name for name, p in model.named_parameters()}
    out = {}
    for _, o, _ in opt.groups:
        for key, entry in o.state_dict(param_names=names)["state"].items():
            for field, t in entry.items():
                if isinstance(t, ShardedTensor):
                    mine = [(s.metadata.shard_offsets, s.tensor.clone()) for s in t.local_shards()]
                    pieces = [None] * dist.get_world_size()
                    dist.all_gather_object(pieces, mine)
                    with warnings.catch_warnings():   # ShardedTensor.size() warns of its deprecation
                        warnings.simplefilter("ignore", FutureWarning)
                        whole = torch.full(tuple(t.size()), float("nan"))
                    for offsets, piece in (x for rank_pieces in pieces for x in rank_pieces):
                        whole[tuple(slice(a, a + n) for a, n in zip(offsets, piece.shape))] = piece
                    t = whole
                out[f"{key}.{field}"] = t.detach().clone().reshape(-1)
    return out


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rng_draws() -> tuple[float, float, float]:
    return float(torch.rand(())), float(np.random.rand()), random.random()


def gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_save(root: Path, data: Path) -> None:
    rank, _ = rank_world()
    for kind in KINDS:
        cfg = make_cfg(kind)
        model, opt, loader = make_run(cfg, data, cfg.seed)
        run_dir = root / kind
        train_steps(cfg, model, opt, loader, 0, 2)
        assert ckpt.save(run_dir, 2, model, opt, {"train": loader}, {"last_val_loss": None})
        train_steps(cfg, model, opt, loader, 2, 1)
        torch.manual_seed(100 + rank)
        np.random.seed(200 + rank)
        random.seed(300 + rank)
        assert ckpt.save(run_dir, CKPT_STEP, model, opt, {"train": loader}, {"last_val_loss": LAST_VAL})
        expected = {"state": full_state(model, opt), "weights_ckpt": weights(model), "rng": gather(rng_draws())}
        expected["losses"] = train_steps(cfg, model, opt, loader, CKPT_STEP, MORE)
        expected["weights_final"] = weights(model)
        if rank == 0:
            torch.save(expected, run_dir / "expected.pt")
            print(f"OK save {kind}", flush=True)


def run_resume(root: Path, data: Path, overrides: list[str]) -> None:
    rank, world = rank_world()
    for kind in KINDS:
        cfg = make_cfg(kind, overrides)
        run_dir = root / kind
        expected = torch.load(run_dir / "expected.pt")
        model, opt, loader = make_run(cfg, data, cfg.seed + 1)   # other weights: the load must replace them
        path = ckpt.find_resume(run_dir)
        assert path is not None and path.name == f"step_{CKPT_STEP}", path
        meta = ckpt.load(path, model, opt, {"train": loader})
        assert meta["step"] == CKPT_STEP and meta["extra"]["last_val_loss"] == LAST_VAL and meta["world_size"] == 2
        saved_rng = expected["rng"]
        if rank < len(saved_rng):
            assert rng_draws() == saved_rng[rank], f"rank {rank}: RNG state not restored"
        state = full_state(model, opt)
        assert state.keys() == expected["state"].keys(), sorted(state.keys() ^ expected["state"].keys())[:5]
        for key, want in expected["state"].items():
            assert torch.equal(state[key], want), f"{kind} W={world}: optimizer state {key} differs after the load"
        for key, want in expected["weights_ckpt"].items():
            assert torch.equal(model.state_dict()[key], want), f"{kind} W={world}: weight {key} differs"
        losses = train_steps(cfg, model, opt, loader, CKPT_STEP, MORE)
        if world == 2 and not overrides:
            assert losses == expected["losses"], (losses, expected["losses"])
            for key, want in expected["weights_final"].items():
                assert torch.equal(model.state_dict()[key], want), f"{kind}: weight {key} differs after {MORE} steps"
        else:
            for got, want in zip(losses, expected["losses"]):
                assert abs(got - want) <= RTOL * abs(want), f"{kind} W={world}: loss {got} vs {want}"
        if rank == 0:
            print(f"OK resume {kind} W={world}", flush=True)


def run_kill(root: Path, data: Path) -> None:
    rank, _ = rank_world()
    cfg = make_cfg("adamw")
    model, opt, loader = make_run(cfg, data, cfg.seed)
    train_steps(cfg, model, opt, loader, 0, CKPT_STEP)
    assert ckpt.save(root, CKPT_STEP, model, opt, {"train": loader})
    train_steps(cfg, model, opt, loader, CKPT_STEP, 3)
    (root / f"rank{rank}.pid").write_text(str(os.getpid()))
    os.environ[ckpt.DELAY_ENV] = "300"
    ckpt.save(root, CKPT_STEP + 3, model, opt, {"train": loader})
    raise AssertionError("the save at step 6 should have been killed during its delay")


def main() -> None:
    phase, root, data, *overrides = sys.argv[1:]
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    {"save": lambda: run_save(Path(root), Path(data)),
     "resume": lambda: run_resume(Path(root), Path(data), overrides),
     "kill": lambda: run_kill(Path(root), Path(data))}[phase]()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
