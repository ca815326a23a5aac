"""BLU: the seed's Llama-style decoder, in one readable file.

token embedding -> N x [RMSNorm -> wQ/wK/wV -> QK-norm + RoPE -> GQA causal attention -> wO -> +x ;
                        RMSNorm -> gate_up -> SwiGLU -> down -> +x] -> RMSNorm -> lm_head -> cross-entropy
(chunked_ce runs the last two together in token chunks: kernels/chunked_ce.py)

Precision follows the seed: Linear weights bf16 on CUDA (fp32 on CPU), the residual
stream, norms, embedding and logits fp32 unless one of the bf16_* flags moves that stage
to bf16 (the `all_bf16` override sets all three); `fp8` runs the body's GEMMs in float8
through torchao (blunb/fp8.py); the QK-norm + RoPE island always computes in fp32 (its
gammas are fp32). Every non-matmul op goes through `blunb.kernels`, so the fused Triton
kernels slot in there.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from blunb import fp8, kernels
from blunb.config import BF16_STAGES, ModelConfig, auto_switch
from blunb.kernels import linear_cross_entropy


def _cpu_multiplies_bf16() -> bool:
    """Whether oneDNN multiplies bf16 in hardware here: the CPU has AVX512-BF16 or AMX (torch's CPU probes)
    and ONEDNN_MAX_CPU_ISA, when set, does not cap oneDNN below them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if not any(isa in cap for isa in ("ALL", "BF16", "FP16", "AMX", "AVX10")):
        return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


# Without bf16 instructions oneDNN's bf16 GEMM is several times slower than fp32 (a tiny bf16 run took 3.5x
# as long on AVX2): there the bf16 Linears multiply their bf16 values in fp32 instead (see _gemm).
NATIVE_CPU_BF16 = _cpu_multiplies_bf16()


def _gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight). For bf16 operands on a CPU without bf16 instructions: an fp32 GEMM of the bf16
    values (exact conversions, exact products) rounded back to bf16, i.e. the fp32 accumulation a bf16 GEMM
    does on the GPU's tensor cores and in oneDNN, in another summation order."""
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not NATIVE_CPU_BF16:
        return F.linear(x.float(), weight.float()).to(torch.bfloat16)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear without bias whose GEMM goes through _gemm. model.fp8 swaps the body's for torchao's Float8Linear
    (blunb/fp8.py), which keeps the weight Parameter."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x):
        return _gemm(x, self.weight)


def _linear_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.linear_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if cfg.linear_dtype == "bf16" else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = Linear(d, cfg.q_heads * hd, dtype=linear_dtype)
        self.wk = Linear(d, cfg.kv_heads * hd, dtype=linear_dtype)
        self.wv = Linear(d, cfg.kv_heads * hd, dtype=linear_dtype)
        self.wo = Linear(cfg.q_heads * hd, d, dtype=linear_dtype)
        # QK-norm scales stay fp32 under every precision flag: the island computes in fp32.
        self.q_gamma = nn.Parameter(torch.ones(hd, dtype=torch.float32))
        self.k_gamma = nn.Parameter(torch.ones(hd, dtype=torch.float32))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        c = self.cfg
        x = x.to(self.wq.weight.dtype)
        # [B,T,H*hd] -> [B,H,T,hd] as strided views: no transpose copies before the kernels.
        q = self.wq(x).view(B, T, c.q_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = kernels.qk_norm_rope(q, k, self.q_gamma, self.k_gamma, cos, sin, c.qk_eps, c.rope_interleaved)
        y = kernels.flash_attention(q, k, v, causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, c.q_heads * c.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_dtype: torch.dtype):
        super().__init__()
        self.gate_up = Linear(cfg.d_model, 2 * cfg.ffn_hidden, dtype=linear_dtype)  # [gate|up]
        self.down = Linear(cfg.ffn_hidden, cfg.d_model, dtype=linear_dtype)

    def forward(self, x):
        return self.down(kernels.swiglu(self.gate_up(x.to(self.gate_up.weight.dtype))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_dtype: torch.dtype, resid_dtype: torch.dtype):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, resid_dtype)
        self.attn = Attention(cfg, linear_dtype)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, resid_dtype)
        self.ffn = SwiGLU(cfg, linear_dtype)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin).to(x.dtype)
        return x + self.ffn(self.ffn_norm(x)).to(x.dtype)


class BLU(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, seed: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        device = torch.device(device) if device is not None else torch.device("cpu")
        linear_dtype = self.linear_dtype = _linear_dtype(cfg, device)
        self.chunked_ce = auto_switch(cfg.chunked_ce, device.type)
        self.resid_dtype = torch.bfloat16 if cfg.bf16_resid else torch.float32
        self.logit_dtype = torch.bfloat16 if cfg.bf16_logits else torch.float32
        embed_dtype = torch.bfloat16 if cfg.bf16_embed else torch.float32
        with torch.device(device):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=embed_dtype)
            self.blocks = nn.ModuleList(Block(cfg, linear_dtype, self.resid_dtype) for _ in range(cfg.n_layers))
            self.norm_f = RMSNorm(cfg.d_model, cfg.rms_eps, self.resid_dtype)
            self.lm_head = None if cfg.weight_tying else Linear(cfg.d_model, cfg.vocab_size,
                                                               dtype=linear_dtype)
            cos, sin = kernels.rope_cache(cfg.context_length, cfg.head_dim, cfg.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)
        # after the init: the swap keeps each weight Parameter, so the fp8 model starts from the same weights
        self.fp8_linears = fp8.convert_body(self, cfg.fp8) if cfg.fp8 != "off" else []

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02); wO and down scaled by (2 n_layers)^-0.5; norm/QK scales 1.

        Drawn in a fixed order from one generator on the parameters' device, so every
        rank that builds the model with the same seed holds bit-identical weights.
        """
        gen = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        resid_std = 0.02 * (2 * self.cfg.n_layers) ** -0.5

        def normal_(p, std):
            draw = torch.empty(p.shape, dtype=torch.float32, device=p.device).normal_(0.0, std, generator=gen)
            p.copy_(draw)

        normal_(self.wte.weight, 0.02)
        for blk in self.blocks:
            for lin in (blk.attn.wq, blk.attn.wk, blk.attn.wv, blk.ffn.gate_up):
                normal_(lin.weight, 0.02)
            normal_(blk.attn.wo.weight, resid_std)
            normal_(blk.ffn.down.weight, resid_std)
            for scale in (blk.attn_norm.weight, blk.ffn_norm.weight, blk.attn.q_gamma, blk.attn.k_gamma):
                scale.fill_(1.0)
        self.norm_f.weight.fill_(1.0)
        if self.lm_head is not None:
            normal_(self.lm_head.weight, 0.02)

    def precision_layout(self) -> dict[str, str]:
        """Which stage computes or stores in which dtype (recorded at the start of every run), and
        which of the per-stage flags are on ("all three (all_bf16)" when the whole set is)."""
        label = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        stages = [name.removeprefix("bf16_") for name in BF16_STAGES if getattr(self.cfg, name)]
        body = label[self.linear_dtype]
        if self.fp8_linears:
            body = f"fp8 {self.cfg.fp8} (torchao {fp8.torchao_version()}; weights {body})"
        return {"linear_weights": label[self.linear_dtype], "output_projection": label[self.linear_dtype],
                "residual_stream_and_norms": label[self.resid_dtype], "embedding": label[self.wte.weight.dtype],
                "logits": label[self.logit_dtype] + (" (chunked, never materialized)" if self.chunked_ce else ""),
                "body_gemms": body,
                "qk_norm_rope": "fp32 (always)", "loss": "fp32",
                "bf16_stages": "all three (all_bf16)" if len(stages) == len(BF16_STAGES) else
                ", ".join(stages) or "none"}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.cfg.context_length:
            raise ValueError(f"sequence length {T} exceeds context_length {self.cfg.context_length}")
        x = self.wte(idx).to(self.resid_dtype)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        x = self.norm_f(x).to(self.linear_dtype)
        # the output GEMM runs in the Linears' dtype, tied (a cast of the embedding) or not, as the seed's
        weight = self.wte.weight.to(self.linear_dtype) if self.lm_head is None else self.lm_head.weight
        if targets is not None and self.chunked_ce:
            return None, linear_cross_entropy(x.reshape(B * T, -1), weight, targets.reshape(B * T),
                                              logit_dtype=self.logit_dtype)
        logits = _gemm(x, weight).to(self.logit_dtype)
        if targets is None:
            return logits
        loss = kernels.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss
