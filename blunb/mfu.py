"""Model FLOPs Utilization, counted exactly as the seed counts it.

Per token, every weight matmul costs 2 x its parameter count; the attention core
(QK^T and PV, no parameters) costs 4*T*hd*Hq dense (PaLM / Megatron convention) or
half of that causal (the headline: a causal kernel skips the masked half); lm_head
2*d*V; the embedding gather 0. fwd+bwd = 3 x fwd. MFU = model FLOPs per step /
(step time * world size * peak). The peak is dense bf16 (no sparsity doubling).
With no known peak (CPU, an unknown GPU) MFU is NaN - "n/a" - never invented;
BLUNB_PEAK_TFLOPS overrides the table.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from blunb.config import ConfigError, ModelConfig

# Dense bf16 tensor-core TFLOP/s per GPU, matched by substring of the device name, in order.
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1800.0),
    ("H200", 989.4),  # SXM; NVL/PCIe parts are slower: set BLUNB_PEAK_TFLOPS
    ("H100", 989.4),  # SXM; PCIe ~756
    ("H800", 989.4),
    ("L40S", 362.1),
    ("A100", 312.0),
    ("A800", 312.0),
)


def peak_tflops_from_env(environ=None) -> float | None:
    """BLUNB_PEAK_TFLOPS as a positive finite float, None when unset or empty. A bad value is a
    ConfigError here, before training: -5 used to produce negative MFU, 'abc' a crash mid-setup."""
    raw = (os.environ if environ is None else environ).get("BLUNB_PEAK_TFLOPS")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"BLUNB_PEAK_TFLOPS must be a positive number of dense bf16 TFLOP/s per GPU, got {raw!r}")
    return value


def lookup_peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


@dataclass
class MFUMeter:
    fwd_per_token_causal: float
    fwd_per_token_dense: float
    flops_per_token_causal: float
    flops_per_token_dense: float
    peak_flops_per_gpu: float  # NaN when unknown
    device_name: str
    peak_source: str           # "table", "BLUNB_PEAK_TFLOPS", "argument" or "unknown"
    world_size: int = 1
    warmup_steps: int = 5
    ss_tokens: float = 0.0
    ss_secs: float = 0.0
    ss_steps: int = 0
    seen: int = 0
    best_mfu: float = 0.0

    @classmethod
    def build(cls, cfg: ModelConfig, seq_len: int, world_size: int = 1, peak_tflops: float | None = None,
              device_name: str | None = None, warmup_steps: int = 5) -> "MFUMeter":
        d, L, hd = cfg.d_model, cfg.n_layers, cfg.head_dim
        Hq, Hkv, F, V, T = cfg.q_heads, cfg.kv_heads, cfg.ffn_hidden, cfg.vocab_size, seq_len
        qkv = 2.0 * d * (Hq * hd) + 2.0 * 2.0 * d * (Hkv * hd)
        proj = 2.0 * (Hq * hd) * d
        ffn = 2.0 * d * (2.0 * F) + 2.0 * F * d
        # QK^T and PV: per token and query head, [1,hd]x[hd,T] and [1,T]x[T,hd]. GQA does
        # not shrink this: KV heads are broadcast over all Hq query heads.
        attn_dense = 4.0 * T * hd * Hq
        head = 2.0 * d * V
        fwd_causal = L * (qkv + proj + ffn + 0.5 * attn_dense) + head
        fwd_dense = L * (qkv + proj + ffn + attn_dense) + head
        if device_name is None:
            device_name = _current_device_name()
        source = "argument"
        if peak_tflops is None:
            env = peak_tflops_from_env()
            if env is not None:
                peak_tflops, source = env, "BLUNB_PEAK_TFLOPS"
            else:
                peak_tflops = lookup_peak_tflops(device_name)
                source = "table" if peak_tflops is not None else "unknown"
        peak = peak_tflops * 1e12 if peak_tflops else math.nan
        return cls(fwd_causal, fwd_dense, 3.0 * fwd_causal, 3.0 * fwd_dense, peak, device_name, source,
                   world_size=world_size, warmup_steps=warmup_steps)

    def cluster_peak(self) -> float:
        return self.peak_flops_per_gpu * self.world_size

    def mfu(self, dt: float, tokens: int) -> float:
        """Headline (causal) MFU of one step; `tokens` is the global count for the step."""
        return self.flops_per_token_causal * tokens / (dt * self.cluster_peak()) if dt > 0 else 0.0

    def mfu_palm(self, dt: float, tokens: int) -> float:
        return self.flops_per_token_dense * tokens / (dt * self.cluster_peak()) if dt > 0 else 0.0

    def tflops_per_gpu(self, dt: float, tokens: int) -> float:
        return self.flops_per_token_causal * tokens / (dt * self.world_size * 1e12) if dt > 0 else 0.0

    def observe(self, dt: float, tokens: int) -> None:
        """Fold one step into the steady-state aggregate, dropping the first `warmup_steps` calls
        (pipeline fill, allocator and autotune warm-up). Counts calls, not step indices, so a
        resumed run excludes its own warm-up too."""
        self.seen += 1
        if self.seen <= self.warmup_steps or dt <= 0:
            return
        self.ss_tokens += tokens
        self.ss_secs += dt
        self.ss_steps += 1
        step_mfu = self.mfu(dt, tokens)
        if step_mfu > self.best_mfu:  # NaN (unknown peak) never compares greater
            self.best_mfu = step_mfu

    def steady_mfu(self) -> float:
        """Total model FLOPs / total time over the steady steps: an aggregate, not a mean of ratios."""
        return self.flops_per_token_causal * self.ss_tokens / (self.ss_secs * self.cluster_peak()) \
            if self.ss_secs > 0 else 0.0

    def steady_tok_per_sec(self) -> float:
        return self.ss_tokens / self.ss_secs if self.ss_secs > 0 else 0.0

    def banner(self, num_params: int, tokens_per_step: int) -> str:
        G = 1e9
        peak = self.peak_flops_per_gpu / 1e12
        note = {"unknown": "  [!] device not in the peak table: MFU is n/a (set BLUNB_PEAK_TFLOPS)",
                "BLUNB_PEAK_TFLOPS": "  (from BLUNB_PEAK_TFLOPS)", "argument": "  (given)", "table": ""}
        step_flops = self.flops_per_token_causal * tokens_per_step
        ideal_ms = step_flops / self.cluster_peak() * 1e3
        lines = [
            "==================== MFU accounting ====================",
            f" device            : {self.device_name} x {self.world_size}",
            f" peak BF16 (dense) : {_fmt(peak, '.1f')} TFLOP/s per GPU{note[self.peak_source]}",
            f" fwd FLOPs/token   : {self.fwd_per_token_causal / G:.3f} GFLOP (causal)",
            f" fwd+bwd /token    : {self.flops_per_token_causal / G:.3f} GFLOP (causal, x3) <-- headline",
            f" fwd+bwd /token    : {self.flops_per_token_dense / G:.3f} GFLOP (PaLM convention)",
            f" 6*N cross-check   : {6.0 * num_params / G:.3f} GFLOP (weight matmuls incl. embedding params; "
            f"no attention core)",
            f" model FLOPs/step  : {step_flops / 1e15:.4f} PFLOP over {tokens_per_step} tokens",
            f" 100% MFU would be : {_fmt(ideal_ms, '.2f')} ms/step",
            " note              : no activation checkpointing, so HFU == MFU",
            "========================================================",
        ]
        return "\n".join(lines)

    def summary(self) -> str:
        if not self.ss_steps:  # zeros here would read as a measurement
            return "\n".join([
                "==================== MFU summary ====================",
                f" too few steps for a steady figure: {self.seen} step(s) timed, the first {self.warmup_steps} "
                f"are warm-up",
                "=====================================================",
            ])
        ss = self.steady_mfu()
        best = self.best_mfu * 100 if self.ss_steps and self.peak_flops_per_gpu > 0 else math.nan
        tflops = self.flops_per_token_causal * self.ss_tokens / max(self.ss_secs, 1e-12) / self.world_size / 1e12
        lines = [
            "==================== MFU summary ====================",
            f" steady-state MFU  : {_fmt(ss * 100, '.2f')}% ({self.ss_steps} steps, "
            f"first {self.warmup_steps} excluded)",
            f" best-step MFU     : {_fmt(best, '.2f')}%",
            f" model TFLOP/s/gpu : {tflops:.2f} of {_fmt(self.peak_flops_per_gpu / 1e12, '.1f')} peak",
            f" steady tok/s      : {self.steady_tok_per_sec():.0f}",
            f" total model FLOPs : {self.flops_per_token_causal * self.ss_tokens / 1e18:.6f} EFLOP over "
            f"{self.ss_secs / 60:.3f} min",
            "=====================================================",
        ]
        return "\n".join(lines)


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or math.isnan(x) else format(x, spec)


def _current_device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"
