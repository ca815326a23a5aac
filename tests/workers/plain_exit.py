"""A plain user script: import blunb, start gloo, step both ZeRO optimizers, destroy the process
group, exit. No teardown beyond destroy_process_group: the optimizers must leave nothing that
keeps the group (and its worker threads, which abort the process at interpreter exit) alive."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from blunb.optim import ShardedAdamW, ShardedMuon
from tests.distributed import gloo_threads


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 11))
    adamw = ShardedAdamW(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-3, bucket_mb=1e-4,
                         overlap_backward=True, overlap_refresh=True, stages=model)
    muon = ShardedMuon([{"params": list(model[1].parameters()), "use_muon": True}], lr=0.02, verbose=False)
    for _ in range(3):
        adamw.arm_grad_sync()
        model(torch.randint(0, 11, (4, 5))).logsumexp(-1).mean().backward()
        adamw.step()
        muon.step()
        adamw.zero_grad()
        muon.zero_grad()
    adamw.drain_refresh()
    assert gloo_threads() > 0, "the check below needs to see gloo's threads"
    dist.destroy_process_group()
    left = gloo_threads()
    assert left == 0, f"{left} gloo threads outlived destroy_process_group"
    print(f"OK rank {int(os.environ['RANK'])}: clean exit", flush=True)


if __name__ == "__main__":
    main()
