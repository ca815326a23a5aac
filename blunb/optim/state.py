"""The sharded optimizer state, as torch.distributed.checkpoint (DCP) saves and loads it.

ShardedAdamW and ShardedMuon build their state_dict() from these helpers: every flat tensor a
ShardedTensor holding only this rank's piece at its offset, so DCP writes each element once and
re-cuts it on load for any world size. blunb.checkpoint saves and loads any optimizer that is
`ShardedStateful` this way, and any other (a plain torch optimizer) through torch's own helpers.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist


@runtime_checkable
class ShardedStateful(Protocol):
    """An optimizer whose state_dict is per parameter, keyed by name, world-size independent."""

    def state_dict(self, param_names=None) -> dict: ...

    def load_state_dict(self, state_dict: dict, param_names=None) -> None: ...

    def resync_masters_from_params(self) -> None: ...



@contextlib.contextmanager
def quiet_dcp():
    # DCP's own planner touches ShardedTensor through deprecated paths on every call, and warns at
    # every single-process save; neither says anything a user of blunb can act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def state_keys(params: list, param_names=None) -> list[str]:
    """The state-dict key of each parameter: param_names[p] (e.g. the model's FQN), else "p<index>"."""
    if param_names is None:
        return [f"p{i}" for i in range(len(params))]
    missing = [i for i, p in enumerate(params) if p not in param_names]
    if missing:
        raise ValueError(f"param_names has no name for parameter(s) {missing} (shape "
                         f"{tuple(params[missing[0]].shape)}, ...)")
    return [param_names[p] for p in params]


def sharded_tensor(local: torch.Tensor | None, shape, pieces, *, device, dtype=torch.float32, process_group=None):
    """A ShardedTensor of global `shape` made of `pieces`, [(group rank, offsets, sizes)] of EVERY
    rank in the same order on every rank (at most one per rank); `local` is this rank's piece, None
    where it holds none. Built without communication: every rank derives the same layout itself."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    def global_rank(q):  # placements name global ranks
        return q if process_group is None else dist.get_global_rank(process_group, q)

    me = dist.get_rank()
    metas = [ShardMetadata(list(off), list(size), f"rank:{global_rank(q)}/{device}") for q, off, size in pieces]
    mine = [m for m in metas if m.placement.rank() == me]
    if len(mine) != (local is not None):
        raise AssertionError(f"rank {me}: {len(mine)} piece(s) in the layout but local={local is not None}")
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    with quiet_dcp():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, mine[0])] if mine else [], ShardedTensorMetadata(metas, torch.Size(shape), props),
            process_group=process_group)


def local_piece(t, offsets, sizes, shape, what: str) -> torch.Tensor:
    """This rank's piece (at `offsets`, of `sizes`) of a loaded tensor of global `shape`: the
    matching local shard of a ShardedTensor (what a DCP load into state_dict() gives), or the
    slice of a full tensor (any tensor with the right number of elements)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(t, ShardedTensor):
        with quiet_dcp():
            if tuple(t.size()) != tuple(shape):
                raise ValueError(f"{what}: saved shape {tuple(t.size())}, expected {tuple(shape)}")
            for s in t.local_shards():
                if tuple(s.metadata.shard_offsets) == tuple(offsets) and tuple(s.metadata.shard_sizes) == tuple(sizes):
                    return s.tensor
        raise ValueError(f"{what}: the loaded ShardedTensor holds no local piece at {tuple(offsets)} of {tuple(sizes)}")
    t = torch.as_tensor(t)
    if t.numel() != int(np.prod(shape)):
        raise ValueError(f"{what}: {t.numel()} elements, expected {int(np.prod(shape))} (shape {tuple(shape)})")
    return t.reshape(shape)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def check_state_kind(state_dict: dict, kind: str) -> None:
    """Refuse another optimizer class's state (a dict without "kind" is taken to be ours)."""
    got = state_dict.get("kind", kind)
    if got != kind:
        raise ValueError(f"{kind}.load_state_dict got the state of a {got}: optimizer state does not carry "
                         "over between kinds of optimizer")
