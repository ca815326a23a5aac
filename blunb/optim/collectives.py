"""The collectives the ZeRO-1 optimizers issue, in one place for both torch stacks.

torch 2.13 renamed the flat-tensor collectives (reduce_scatter_single, all_gather_single) and
warns on every call of the old names; 2.11, the GPU stack, only has reduce_scatter_tensor and
all_gather_into_tensor.

Why this module also imports torch.distributed.nn: that module binds `group.WORLD` as a default
argument of its functions when it is first imported, and torch.optim.Optimizer imports it (through
torch._dynamo) on construction. Imported after init_process_group, those defaults keep the default
process group alive past destroy_process_group: gloo's worker threads then outlive the interpreter
and abort the process (`terminate called without an active exception`) when one of them releases a
finished collective during interpreter shutdown. Importing it with blunb.optim, before any process
group exists, binds None and lets destroy_process_group really join those threads.
"""

from __future__ import annotations

import torch.distributed as dist

if dist.is_available():
    import torch.distributed.nn  # noqa: F401  (see the module docstring)

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
