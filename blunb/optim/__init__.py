"""Optimizers and schedules: ZeRO-1 ShardedAdamW, ShardedMuon, the WSD schedule."""

from blunb.optim import collectives  # noqa: F401  (first, before any process group: see its docstring)
from blunb.optim.clip import ClipStats
from blunb.optim.schedule import wsd_lr

__all__ = ["ClipStats", "ShardedAdamW", "ShardedMuon", "wsd_lr"]


def __getattr__(name):
    # Imported on first use so `import blunb.optim` stays light for the schedule alone.
    if name == "ShardedAdamW":
        from blunb.optim.zero_adamw import ShardedAdamW
        return ShardedAdamW
    if name == "ShardedMuon":
        from blunb.optim.muon import ShardedMuon
        return ShardedMuon
    raise AttributeError(f"module 'blunb.optim' has no attribute {name!r}")
