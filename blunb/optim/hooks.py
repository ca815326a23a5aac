"""Hooks that hold their optimizer weakly, shared by ShardedAdamW and ShardedMuon."""

from __future__ import annotations

import weakref


def weak_hook(opt, method: str, *bound):
    """A hook calling opt.<method>(*bound, *hook_args) that does not keep opt alive: a strong
    reference from the model's tensors and modules back to the optimizer would be a cycle."""
    ref = weakref.ref(opt)

    def hook(*args):
        target = ref()
        if target is not None:
            return getattr(target, method)(*bound, *args)
    return hook


def remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
