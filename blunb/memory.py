"""A run's memory, estimated before any work, against what the device has free.

On the CPU the ranks of one host share its memory, and an oversized run does not fail: it swaps or is
killed by the OS after minutes (1b with its GPU defaults reached 21 GB of a 24 GB machine without
finishing a step). So the trainer refuses a CPU run whose estimate exceeds the free memory, naming the
estimate and the overrides that fit; on CUDA an oversized run fails fast with the allocator's own
error, so there the estimate is only logged, with a warning when it is close.

The estimate is deliberately simple (and errs high on the CPU, where the attention scores are
materialized): parameters, gradients and optimizer state by dtype and sharding, plus the activations
one micro-batch keeps for backward, counted per token and layer.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from blunb.config import ConfigError, TrainConfig, auto_switch

GIB = 1 << 30
WARN_FRACTION = 0.8        # a CUDA estimate above this share of the free memory gets a warning line
# torch, triton, pandas, the interpreter and the data maps, per rank: a tiny run at B=1 T=64 (nothing else of
# size) peaks at 0.48 GiB on a 2-core AMD EPYC with CPU torch 2.13, and CI's 6-step tiny run at 0.62 GiB, of
# which the estimate's other parts are 0.07; it errs high, as the rest of the estimate does
PROCESS_OVERHEAD = 0.6 * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    logits: float

    @property
    def per_rank(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.buffers + self.activations + self.logits
                + PROCESS_OVERHEAD)

    def describe(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer),
                 ("buffers", self.buffers), ("activations", self.activations), ("logits", self.logits)]
        return f"{self.per_rank / GIB:.1f} GiB per rank (" + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts) + ")"


def estimate(cfg: TrainConfig, world_size: int, device_type: str) -> MemoryEstimate:
    m, P = cfg.model, cfg.model.num_params()
    on_cuda = device_type == "cuda"
    linear_bf16 = m.linear_dtype == "bf16" or (m.linear_dtype == "auto" and on_cuda)
    weight_bytes = 2 if linear_bf16 else 4          # the Linears dominate P; embedding / norms ride along
    # model.fp8 changes no term: torchao's dynamic-scaling Linears keep their weights in linear_dtype and save the
    # input and weight in that dtype for backward; the float8 copies live only for their GEMM.
    if cfg.optimizer in ("ddp_adamw",):
        optimizer = 8.0 * P + (4.0 * P if linear_bf16 else 0.0)   # moments (+ fp32 params beside bf16 copies)
    elif cfg.optimizer == "adamw_bf16_nomaster":
        optimizer = 2.0 * weight_bytes * P
    else:  # ZeRO-1: moments and any fp32 master only for this rank's shard
        optimizer = (8.0 + (4.0 if linear_bf16 else 0.0)) * P / world_size
    act_bytes = 2 if (on_cuda and linear_bf16) else 4
    tokens = cfg.B * cfg.T
    d, hd, F = m.d_model, m.head_dim, m.ffn_hidden
    per_token_layer = 4 * d + 4 * m.q_heads * hd + 4 * m.kv_heads * hd + 4 * F   # saved tensors, counted on the CPU
    activations = m.n_layers * tokens * per_token_layer * act_bytes
    if not on_cuda:  # the CPU's attention keeps its [T, T] scores and probabilities per head for backward
        activations += m.n_layers * cfg.B * m.q_heads * cfg.T * cfg.T * 4 * 2
    chunked = auto_switch(m.chunked_ce, device_type)
    logits = 0.0 if chunked else 3.0 * tokens * m.vocab_size * 4   # fp32 logits, softmax, gradient
    # The flattened gradient and the reduce's copy of it (measured on the CPU: ~8 B per parameter above the
    # weights, gradients and moments at 124m).
    buffers = 2.0 * weight_bytes * P
    return MemoryEstimate(weights=float(weight_bytes * P), gradients=float(weight_bytes * P), optimizer=optimizer,
                          buffers=buffers, activations=float(activations), logits=logits)


def free_bytes(device) -> float | None:
    """What the device has free now: MemAvailable on a Linux host, the CUDA allocator's free memory on a
    GPU; None where it cannot be read."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fitting_overrides(cfg: TrainConfig, world_size: int, local_ranks: int, free: float) -> str:
    """The largest micro-batch (B, then T halved) that fits, keeping the global batch where it divides."""
    for T in _halvings(cfg.T, 64):
        for B in _halvings(cfg.B, 1):
            trial = _with(cfg, B=B, T=T)
            need = estimate(trial, world_size, "cpu").per_rank * local_ranks
            if need <= free:
                sets = [f"B={B}"] + ([f"T={T}"] if T != cfg.T else [])
                if cfg.global_batch % (B * T * world_size):
                    sets.append(f"global_batch={B * T * world_size}")
                if cfg.val_tokens and cfg.val_tokens % T:
                    sets.append(f"val_tokens={max(T, cfg.val_tokens // T * T)}")
                return " ".join(f"--set {s}" for s in sets) + f" (estimated {need / GIB:.1f} GiB)"
    static = estimate(_with(cfg, B=1, T=64), world_size, "cpu").per_rank * local_ranks
    return (f"none: the weights, gradients and optimizer state alone need {static / GIB:.1f} GiB on this host at "
            f"{local_ranks} rank(s); run fewer ranks here, a smaller preset or a GPU")


def _halvings(start: int, floor: int):
    value = start
    while value >= floor:
        yield value
        value //= 2


def _with(cfg: TrainConfig, **changes) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)


def check(cfg: TrainConfig, world_size: int, device, local_ranks: int | None = None) -> str:
    """Refuse (ConfigError) a CPU run whose estimate exceeds the host's free memory; return the line the
    run log records (the estimate, and on CUDA a warning when it is close to the free memory)."""
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    est = estimate(cfg, world_size, device.type)
    free = free_bytes(device)
    host_total = est.per_rank * local_ranks if device.type == "cpu" else est.per_rank
    line = f"memory estimate: {est.describe()}"
    if device.type == "cpu":
        line += f"; {local_ranks} rank(s) on this host: {host_total / GIB:.1f} GiB"
    if free is None or math.isnan(free):
        return line + "; free memory unknown"
    line += f"; free {free / GIB:.1f} GiB"
    if device.type == "cpu" and host_total > free:
        raise ConfigError(f"this run needs about {host_total / GIB:.1f} GiB on this host ({est.describe()}, "
                          f"x {local_ranks} rank(s)) but {free / GIB:.1f} GiB is free; what fits: "
                          f"{_fitting_overrides(cfg, world_size, local_ranks, free)}")
    if device.type == "cuda" and host_total > WARN_FRACTION * free:
        line += " [!] close to the free memory: an out-of-memory error is likely (model.chunked_ce=true, a smaller B)"
    return line
