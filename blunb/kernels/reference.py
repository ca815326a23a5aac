"""Plain-torch reference of every kernel op: the executable spec.

Each fused kernel in `blunb/kernels/fused/` is tested against the function of the
same name here, which is also the op's torch backend (linear_cross_entropy's excepted:
its torch backend chunks too). All math runs in fp32; results are cast back to the input
dtype, which is what the fused kernels do too (fp32 statistics, low-precision storage).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_cache(T: int, head_dim: int, theta: float, device=None):
    """(cos, sin), each [T, head_dim // 2] fp32, for positions 0..T-1."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(T, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32.

    torch's native fused op computes exactly that; on fp32 inputs (the model's residual
    stream) the casts are no-ops, and on an H200 it beats our Triton kernel (see prefer()
    in fused/rms_norm.py), so the reference doubles as the fast path.
    """
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of fp32 x [..., T, hd] by (cos, sin) [T, hd/2]."""
    if interleaved:  # GPT-J: pairs (x[2i], x[2i+1])
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2  # NeoX: halves (x[i], x[i + hd/2])
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qk_norm_rope(q, k, q_gamma, k_gamma, cos, sin, eps: float, interleaved: bool = False):
    """q [B,Hq,T,hd], k [B,Hkv,T,hd] (any strides): RMSNorm over hd with gamma, then RoPE.

    The island runs in fp32 whatever the input dtype; outputs keep q/k's dtype.
    """
    T = q.shape[-2]
    cos, sin = cos[:T].float(), sin[:T].float()

    def one(x, gamma):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
        return apply_rope(xf, cos, sin, interleaved).to(x.dtype)

    return one(q, q_gamma), one(k, k_gamma)


def flash_attention(q, k, v, causal: bool = True):
    """Grouped-query attention: q [B,Hq,T,hd], k/v [B,Hkv,T,hd], scale hd**-0.5.

    Query head h reads kv head h // (Hq // Hkv).
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def attention_math(q, k, v, causal: bool = True):
    """The same attention as explicit fp32 math: the spec the fused kernel is held to."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        T, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vf).to(q.dtype)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2F] laid out [gate | up] -> silu(gate) * up, [..., F]."""
    gate, up = gu.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gu.dtype)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """fp32 mean loss over non-ignored targets (0.0, not NaN, when every target is ignored)."""
    total = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum().clamp(min=1)
    return total / count


def syrk(x: torch.Tensor) -> torch.Tensor:
    """x @ x.mT for [m, n] or [b, m, n]."""
    return x @ x.mT


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         logit_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """cross_entropy of (x [N, d] @ weight [V, d]^T).to(logit_dtype): the GEMM in weight's dtype, its logits
    rounded to logit_dtype, the loss in fp32. The spec only: it makes the [N, V] logits that
    kernels.linear_cross_entropy's backends (both chunked, kernels/chunked_ce.py) never hold whole."""
    return cross_entropy(F.linear(x, weight).to(logit_dtype), targets, ignore_index)


# The fused shard update's vector width in elements (16 bytes of bf16; fp32's 4 divide it): its block table starts
# whole blocks on multiples of this in both buffers where a segment allows, and ShardedAdamW rounds each bucket's
# chunk up to a multiple of it so that every segment does.
ADAMW_ALIGN = 8


def adamw_update_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                  param: torch.Tensor, steps: torch.Tensor, table: dict[str, torch.Tensor], *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: torch.Tensor,
                  found_inf: torch.Tensor) -> None:
    """One AdamW step (torch._fused_adamw_'s ADAMW math, in fp32) in place over the blocks of `table`.

    Each block (table["shard"], ["flat"], ["len"], ["param"], ["decays"]: one entry per block) is a run of
    `len` elements of one parameter, at `shard` in the fp32 1-D master / exp_avg / exp_avg_sq and at `flat`
    in the 1-D grad (any float dtype) and param (its dtype gets master's rounding). With
    g = grad / grad_scale, t = steps[param] (already advanced) and wd = weight_decay where the block decays:
    p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps); param = p. Nothing is written when
    found_inf is nonzero (grad_scale, found_inf: 0-dim fp32 tensors). lr: a float or a 0-dim device tensor."""
    lr = lr.float() if isinstance(lr, torch.Tensor) else lr
    lens = table["len"].long()
    shard = torch.repeat_interleave(table["shard"], lens)
    flat = torch.repeat_interleave(table["flat"], lens)
    within = torch.arange(shard.numel(), device=shard.device) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    shard, flat = shard + within, flat + within
    step = steps[torch.repeat_interleave(table["param"].long(), lens)]
    wd = weight_decay * torch.repeat_interleave(table["decays"], lens).float()
    g = grad[flat].float() / grad_scale
    p, m, v = master[shard], exp_avg[shard], exp_avg_sq[shard]
    p = p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = (1.0 - beta2 ** step).sqrt()
    p = p - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps)
    skip = found_inf != 0
    master[shard] = torch.where(skip, master[shard], p)
    exp_avg[shard] = torch.where(skip, exp_avg[shard], m)
    exp_avg_sq[shard] = torch.where(skip, exp_avg_sq[shard], v)
    param[flat] = torch.where(skip, param[flat], p.to(param.dtype))
