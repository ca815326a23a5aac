"""Runs blunb.train.train() in-process and watches its destroy_process_group(): by then no torch
DDP wrapper may be alive (its reducer holds the process group) and right after it no gloo thread
may be left (a surviving one aborts or deadlocks the process at interpreter exit)."""

import gc
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from blunb.config import apply_overrides, preset
from blunb.train import train
from tests.distributed import gloo_threads


def main():
    optimizer, out = sys.argv[1], Path(sys.argv[2])
    cfg = apply_overrides(preset("tiny"), [f"optimizer={optimizer}", "linear_dtype=fp32"])
    cfg.rescale_schedule(3)
    seen = []
    real_destroy = dist.destroy_process_group

    def watched_destroy(*args, **kwargs):
        seen.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
        real_destroy(*args, **kwargs)
        seen.append(gloo_threads())

    dist.destroy_process_group = watched_destroy
    train(cfg, out / optimizer)
    assert seen == [0, 0], f"at destroy_process_group: {seen[0]} DDP wrappers alive, then {seen[1]} gloo threads"
    print(f"OK rank {os.environ['RANK']}: {optimizer} left no gloo thread", flush=True)


if __name__ == "__main__":
    main()
