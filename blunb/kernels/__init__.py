"""Kernel ops used by the model, each dispatching to plain torch or a fused Triton kernel.

One public function per op, so the model calls one name whatever runs underneath: backend=None picks the
fused kernel where one exists and is the better choice, else the torch reference (reference.py, the
spec); `BLUNB_KERNELS` forces either, for every op or per op, for A/B runs. Code outside this package
asks `backend_for(op, *args)` which backend a call would take; the dispatcher's own names (leading
underscore) are not for it. On a machine without CUDA, Triton kernels run under the interpreter
(TRITON_INTERPRET=1, set here before Triton is imported), so the CPU tests run the real kernels.

Details (the auto choice, deterministic mode, the torch.library custom ops): docs/architecture.md,
section "blunb/kernels/__init__.py".
"""

from __future__ import annotations

import importlib
import os

import torch

from blunb.determinism import fixed_kernel_configs
from blunb.kernels import chunked_ce, reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = (None, "torch", "triton")
# linear_cross_entropy is the model's lm_head + loss with model.chunked_ce; syrk serves Muon's
# Newton-Schulz and adamw ShardedAdamW's shard update (blunb/optim): no model ops
OPS = ("rms_norm", "qk_norm_rope", "flash_attention", "swiglu", "cross_entropy", "linear_cross_entropy", "syrk",
       "adamw")


def _import_fused(op: str):
    try:
        return importlib.import_module(f"blunb.kernels.fused.{op}")
    except ModuleNotFoundError as err:
        if err.name not in (f"blunb.kernels.fused.{op}", "triton"):
            raise
        return None


# Imported now, not on first use: torch.compile cannot trace an import (each op's first call
# under compile would break the graph), and the custom ops must be registered before tracing.
_fused_modules = {op: _import_fused(op) for op in OPS}


def _fused(op: str):
    """The fused module of `op`, or None when it has no Triton kernel (or triton is missing)."""
    return _fused_modules[op]


def parse_backends(spec: str) -> dict[str, str | None]:
    """A kernels setting ("auto", "torch", "triton", or "op=backend,..." with backend auto|torch|triton)
    -> each op's forced backend, None for auto."""
    spec = spec.strip()
    if spec in ("", "auto", "torch", "triton"):
        return dict.fromkeys(OPS, None if spec in ("", "auto") else spec)
    out = dict.fromkeys(OPS)
    for item in spec.split(","):
        op, sep, backend = item.strip().partition("=")
        if not sep or op not in OPS or backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be auto, torch, triton or op=backend,... with op one of {', '.join(OPS)} "
                             f"and backend auto, torch or triton; got {spec!r}")
        out[op] = None if backend == "auto" else backend
    return out


def forced_backend(op: str) -> str | None:
    """The backend BLUNB_KERNELS forces for `op` (torch or triton), None for auto."""
    return parse_backends(os.environ.get("BLUNB_KERNELS", "auto"))[op]


def _auto_module(op: str, on_cuda: bool):
    """The fused module the auto backend may pick for `op` (CUDA only, and not a module with AUTO = False),
    else None: what _resolve and describe both go by."""
    mod = _fused(op) if on_cuda else None
    return mod if getattr(mod, "AUTO", True) else None


def _resolve(op: str, backend: str | None, x: torch.Tensor, args) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    backend = backend or forced_backend(op)
    if backend is None:
        mod = _auto_module(op, x.is_cuda)
        prefer = getattr(mod, "prefer", None)
        return "triton" if mod is not None and (prefer is None or prefer(*args)) else "torch"
    if backend == "triton" and _fused(op) is None:
        raise NotImplementedError(f"kernels.{op}: no Triton implementation yet; use backend='torch'")
    return backend


def has_auto_kernel(op: str) -> bool:
    """Whether the auto backend may pick a Triton kernel for `op` on CUDA (one is installed and not AUTO = False)."""
    return _auto_module(op, True) is not None


def backend_for(op: str, *args, backend: str | None = None) -> str:
    """"torch" or "triton": the backend kernels.<op>(*args, backend=backend) runs (args: the op's own, the
    first a tensor), for callers that pick their own path by it (ShardedAdamW's shard update)."""
    return _resolve(op, backend, args[0], args)


def _call(op: str, backend: str | None, *args):
    impl = reference if _resolve(op, backend, args[0], args) == "torch" else _fused(op)
    return getattr(impl, op)(*args)


def rope_cache(T: int, head_dim: int, theta: float, device=None):
    return reference.rope_cache(T, head_dim, theta, device)


def rms_norm(x, weight, eps: float, backend: str | None = None):
    return _call("rms_norm", backend, x, weight, eps)


def qk_norm_rope(q, k, q_gamma, k_gamma, cos, sin, eps: float, interleaved: bool = False,
                 backend: str | None = None):
    return _call("qk_norm_rope", backend, q, k, q_gamma, k_gamma, cos, sin, eps, interleaved)


def flash_attention(q, k, v, causal: bool = True, backend: str | None = None):
    return _call("flash_attention", backend, q, k, v, causal)


def swiglu(gu, backend: str | None = None):
    return _call("swiglu", backend, gu)


def cross_entropy(logits, targets, ignore_index: int = -100, backend: str | None = None):
    return _call("cross_entropy", backend, logits, targets, ignore_index)


def linear_cross_entropy(x, weight, targets, ignore_index: int = -100, logit_dtype: torch.dtype = torch.float32,
                         chunk_tokens: int | None = None, backend: str | None = None):
    """fp32 mean cross-entropy of (x [N, d] @ weight [V, d]^T).to(logit_dtype) against targets [N]
    (reference.linear_cross_entropy) without the [N, V] logits: both backends walk the tokens in chunks of
    chunk_tokens (None: chunked_ce.CHUNK_TOKENS), the torch one in plain torch (chunked_ce.py)."""
    if _resolve("linear_cross_entropy", backend, x, ()) == "triton":
        return _fused("linear_cross_entropy").linear_cross_entropy(x, weight, targets, ignore_index, logit_dtype,
                                                                   chunk_tokens)
    return chunked_ce.linear_cross_entropy(x, weight, targets, ignore_index, logit_dtype, chunk_tokens)


def syrk(x, backend: str | None = None):
    return _call("syrk", backend, x)


def adamw_block_table(segments: list[tuple[int, int, int, int, bool]], device) -> dict:
    """adamw_update_'s block table for segments (shard offset, flat offset, length, parameter index, decays),
    split into the fused kernel's blocks (each inside one segment; the torch backend reads any such table): a
    tensor per column and "whole", the count of the whole blocks that come first (fused/adamw.py)."""
    if _fused("adamw") is None:
        raise NotImplementedError("kernels.adamw_block_table: no Triton AdamW kernel here (triton is missing)")
    return _fused("adamw").block_table(segments, device)


def adamw_update_(master, exp_avg, exp_avg_sq, grad, param, steps, table, *, lr, beta1: float,
                  beta2: float, eps: float, weight_decay: float, grad_scale, found_inf, backend: str | None = None):
    """One AdamW step in place over a ZeRO-1 shard (reference.adamw_update_ says what, fused/adamw.py how):
    the fp32 master and moments from the flat gradient, the flat weights from the master. The op is "adamw"
    (BLUNB_KERNELS' key) and, in place, named like its modules' function."""
    impl = reference if _resolve("adamw", backend, master, ()) == "torch" else _fused("adamw")
    impl.adamw_update_(master, exp_avg, exp_avg_sq, grad, param, steps, table, lr=lr, beta1=beta1, beta2=beta2,
                       eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, found_inf=found_inf)


def describe(device) -> dict[str, str]:
    """The backend each op will use on `device` (for the run log), decided as a call decides it: torch,
    triton, or triton-or-torch where the fused module's `prefer` decides per shape; with fixed configs
    (deterministic=true) a Triton kernel is "triton (fixed config)" and a per-shape choice says what
    it is then (the module's DETERMINISTIC_CHOICE)."""
    backends = parse_backends(os.environ.get("BLUNB_KERNELS", "auto"))
    fixed = fixed_kernel_configs()
    out = {}
    for op in OPS:
        forced = backends[op]
        mod = _auto_module(op, torch.device(device).type == "cuda")
        if forced:
            out[op] = forced if (forced == "torch" or _fused(op) is not None) else "triton (no kernel here: it raises)"
        elif mod is None:
            out[op] = "torch"
        elif hasattr(mod, "prefer"):
            out[op] = mod.DETERMINISTIC_CHOICE if fixed else "triton-or-torch (per shape)"
        else:
            out[op] = "triton"
        if fixed and out[op] == "triton":
            out[op] = "triton (fixed config)"
    return out
