"""The ZeRO-1 layouts, planned from parameter shapes, dtypes and order alone.

Pure functions (no tensors are allocated, nothing is communicated): ShardedAdamW and ShardedMuon
build their buffers and hooks from these plans, and blunb.studies.overlap's communication model derives
its collective units from the same calls, so the model cannot drift from the optimizers.

  backward_buckets   ShardedAdamW's reduce buckets (whole tensors in backward order, capped)
  bucket_chunk       each rank's share of one of them (padded: ranks' ranges start on the fused update's vectors)
  ns_cost, lpt_partition   ShardedMuon's owner per tensor (LPT over the Newton-Schulz cost)
  muon_buckets       ShardedMuon rs_ag's buckets (each rank's owned run k, padded to the largest)
  refresh_stages, stage_index, publish_order, stage_waits   overlap_refresh's plan: which forward
                     pre-hook installs which parameters, the publish order, and how many publishes
                     each stage waits for
  COLLECTIVES, REDUCE_DTYPES   the allowed values of `collective` and `reduce_dtype`
"""

from __future__ import annotations

import torch
from torch import nn

from blunb.kernels.reference import ADAMW_ALIGN

COLLECTIVES = ("rs_ag", "reduce_bcast")
REDUCE_DTYPES = {"param": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def backward_buckets(numels: list[int], cap: int) -> list[list[int]]:
    """Parameter indices grouped into reduce buckets: whole tensors in backward order (gradients
    arrive last-first), a new bucket once the next tensor would take it past `cap` elements."""
    buckets, cur, cur_n = [], [], 0
    for i in reversed(range(len(numels))):
        if cur and cur_n + numels[i] > cap:
            buckets.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += numels[i]
    buckets.append(cur)
    return buckets


def bucket_chunk(numel: int, world: int) -> int:
    """Each rank's share of a ShardedAdamW bucket of `numel` elements (the bucket is padded to `world` of them):
    a multiple of ADAMW_ALIGN, so that every rank's range, and every parameter's offset in it wherever the
    parameters before it are multiples too, starts where the fused shard update's 16-byte vectors can."""
    return -(-numel // (world * ADAMW_ALIGN)) * ADAMW_ALIGN


def ns_cost(shape, steps: int) -> float:
    """FLOPs of NS on one matrix (wide orientation r <= c): Gram, A A, B X per step."""
    r, c = sorted(shape[:2])
    return steps * (4.0 * r * r * c + 2.0 * r ** 3)


def lpt_partition(costs: list[float], world: int) -> list[int]:
    """Owner rank per item: longest processing time first onto the least-loaded rank.
    Ties break on index and rank, so every rank computes the same answer."""
    loads = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return owners


def muon_buckets(numels: list[int], dtypes: list, owners: list[int], world: int,
                 target: int) -> list[tuple[object, list[list[int]], int]]:
    """ShardedMuon's rs_ag buckets: per dtype (in str order), each rank's owned tensors (in
    parameter order) cut into `target` consecutive runs of ~equal numel; bucket k is every rank's
    k-th run, each padded to the largest, so shard boundaries fall on tensor boundaries.
    Returns [(dtype, per rank the tensor indices of its run, chunk = the padded per-rank numel)],
    empty buckets left out."""
    out = []
    for dtype in sorted(set(dtypes), key=str):
        runs = []
        for r in range(world):
            owned = [i for i in range(len(numels)) if dtypes[i] == dtype and owners[i] == r]
            total = sum(numels[i] for i in owned)
            cuts, acc, k = [[] for _ in range(target)], 0, 0
            for i in owned:
                cuts[min(k, target - 1)].append(i)
                acc += numels[i]
                while k < target - 1 and acc >= total * (k + 1) / target:
                    k += 1
            runs.append(cuts)
        for k in range(target):
            chunk = max(sum(numels[i] for i in runs[r][k]) for r in range(world))
            if chunk:
                out.append((dtype, [runs[r][k] for r in range(world)], chunk))
    return out


def refresh_stages(model: nn.Module) -> list[tuple[nn.Module, list]]:
    """Refresh stages in consumption order for an embedding -> layers -> head model.

    Stage 0 (installed by a pre-hook on the model itself, before anything runs) holds every
    parameter registered before the first non-empty nn.ModuleList (the embedding); then one
    stage per layer; parameters registered after the layers (final norm, untied head) ride
    with the last layer, whose pre-hook fires before they are read. Tied weights stay in
    the stage of their first registration. No ModuleList: a single stage 0.
    """
    layers = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)), None)
    if layers is None:
        return [(model, list(model.parameters()))]
    in_layers = {id(p) for p in layers.parameters()}
    before, after, seen_layers = [], [], False
    for p in model.parameters():
        if id(p) in in_layers:
            seen_layers = True
        else:
            (after if seen_layers else before).append(p)
    stages = [(model, before)] + [(layer, list(layer.parameters())) for layer in layers]
    stages[-1][1].extend(after)
    return stages


def as_stages(stages) -> list[tuple[nn.Module, list]]:
    """The optimizers' `stages` argument: the model itself (split by refresh_stages) or a list of
    (module, params) in forward order."""
    return refresh_stages(stages) if isinstance(stages, nn.Module) else list(stages)


def stage_index(stages) -> dict[int, int]:
    """id(param) -> its stage: the first that names it (a tied weight appears in one)."""
    stage_of: dict[int, int] = {}
    for s, (_, params) in enumerate(stages):
        for p in params:
            stage_of.setdefault(id(p), s)
    return stage_of


def publish_order(unit_stages: list[list[int]], keys: list) -> list[int]:
    """overlap_refresh's publish order of the collective units: by the first stage that reads the
    unit (unit_stages[u]: the stages of its parameters), then by keys[u] (the layout's own order)."""
    return sorted(range(len(unit_stages)), key=lambda u: (min(unit_stages[u]), keys[u]))


def stage_waits(unit_stages: list[list[int]], order: list[int], n_stages: int) -> list[int]:
    """Per stage, how many publishes of `order` its forward pre-hook waits for: up to the last unit
    holding a parameter of that stage, and never fewer than the stage before it."""
    pos = {u: k for k, u in enumerate(order)}
    need = [0] * n_stages
    for u, stages in enumerate(unit_stages):
        for s in stages:
            need[s] = max(need[s], pos[u] + 1)
    for s in range(1, n_stages):
        need[s] = max(need[s], need[s - 1])
    return need
