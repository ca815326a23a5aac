"""kernels.linear_cross_entropy's chunking: lm_head GEMM + cross-entropy in token chunks, never whole logits.

Why: the unchunked path keeps the [N, V] logits for backward and then makes a gradient of the same size
(at 1b, 16384 tokens x V 50304: 2 x 3.3 GB in fp32). Walking the tokens in chunks, with each chunk's
gradient made in the same pass, keeps only grad_x [N, d] and grad_weight [V, d]. Both backends of the op
run these chunks (the Triton one fuses each chunk's softmax, loss and gradient:
fused/linear_cross_entropy.py); this module needs no triton, so the plain chunks run where triton has
no wheel. The forward is a torch.library custom op, so Inductor cannot re-materialize the logits it
exists to avoid.

Details (a chunk's math, why both backends give the plain path's values): docs/architecture.md, section
"blunb/kernels/chunked_ce.py".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# 4096 tokens x V 50304: on CUDA one bf16 buffer (0.4 GB: the GEMM's output, overwritten by its
# gradient); the plain path adds the chunk's fp32 copy (0.8 GB); against 6.6 GB for 1b's whole fp32
# logits and gradient. The GEMMs stay large (4096 x d x V).
CHUNK_TOKENS = 4096


# The forward returns grad_x and grad_weight as non-differentiable outputs only so autograd can save
# them; linear_cross_entropy() drops them. Backward scales them out of place, so nothing is mutated.
@torch.library.custom_op("blunb::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                             logit_dtype: torch.dtype, chunk_tokens: int, has_grad: bool,
                             fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, d loss / d x, d loss / d weight), the two gradients empty tensors unless has_grad;
    fused: each chunk's softmax and gradient by the Triton cross-entropy kernel."""
    N = x.shape[0]
    targets = targets.long()
    valid = targets != ignore_index
    n_valid = valid.sum().clamp(min=1)
    loss_sum = x.new_zeros((), dtype=torch.float32)
    if fused:  # imported here: that module needs triton, which the plain chunks must not
        from blunb.kernels.fused.linear_cross_entropy import chunk_loss_
    if has_grad:
        row_scale = valid / n_valid  # fp32; 0 on ignored rows: they get no gradient
        grad_x = torch.empty((N, x.shape[1]), dtype=x.dtype, device=x.device)
        # fp32 accumulator: in bf16 every chunk's add would round the running sum, an error growing with
        # the chunk count; in fp32 each chunk's GEMM result is rounded once, as the unchunked GEMM's is.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for s in range(0, N, chunk_tokens):
        e = min(s + chunk_tokens, N)
        x_c = x[s:e]
        if fused:
            chunk_loss, z = chunk_loss_(F.linear(x_c, weight), targets[s:e], n_valid, ignore_index, logit_dtype,
                                        has_grad)
            loss_sum += chunk_loss
            if has_grad:
                _backward_gemms(z, x_c, weight, grad_x[s:e], grad_w)
            continue
        t = torch.where(valid[s:e], targets[s:e], 0)
        z = F.linear(x_c, weight).to(logit_dtype).float()
        # Everything below works in place on z, the chunk's one fp32 [chunk, V] buffer.
        z -= z.amax(-1, keepdim=True)  # shifted by the row max: exp cannot overflow
        z_t = z.gather(1, t[:, None]).squeeze(1)
        sum_exp = z.exp_().sum(-1)
        loss_sum += torch.where(valid[s:e], sum_exp.log() - z_t, 0.0).sum()  # lse - target logit
        if not has_grad:
            continue
        scale = row_scale[s:e]
        z *= (scale / sum_exp)[:, None]  # softmax / n_valid
        z[torch.arange(e - s, device=z.device), t] -= scale  # - onehot / n_valid
        # stored through logit_dtype as the unchunked path's gradient is
        _backward_gemms(z.to(logit_dtype), x_c, weight, grad_x[s:e], grad_w)
    if not has_grad:
        return loss_sum / n_valid, x.new_empty(0), weight.new_empty(0)
    return loss_sum / n_valid, grad_x, grad_w.to(weight.dtype)


def _backward_gemms(grad_logits: torch.Tensor, x_c: torch.Tensor, weight: torch.Tensor, grad_x_c: torch.Tensor,
                    grad_w: torch.Tensor) -> None:
    """grad_x_c = g @ weight, grad_w += g^T @ x_c, with g the chunk's logit gradient in weight's dtype."""
    g = grad_logits.to(weight.dtype)
    torch.mm(g, weight, out=grad_x_c)
    if grad_w.dtype == g.dtype:  # fp32 weights: accumulate inside the GEMM, no [V, d] temporary
        grad_w.addmm_(g.mT, x_c)
    else:
        grad_w += g.mT @ x_c


@linear_cross_entropy_fwd.register_fake
def _(x, weight, targets, ignore_index, logit_dtype, chunk_tokens, has_grad, fused):
    loss = x.new_empty((), dtype=torch.float32)
    if not has_grad:
        return loss, x.new_empty(0), weight.new_empty(0)
    return loss, x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    _, grad_x, grad_w = output
    ctx.save_for_backward(grad_x, grad_w)
    ctx.mark_non_differentiable(grad_x, grad_w)
    ctx.set_materialize_grads(False)  # the saved gradients get none: no zeros of their size are made


def _backward(ctx, grad_loss, _grad_x, _grad_w):
    grad_x, grad_w = ctx.saved_tensors
    return grad_x * grad_loss, grad_w * grad_loss, None, None, None, None, None, None


linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         logit_dtype: torch.dtype = torch.float32, chunk_tokens: int | None = None,
                         fused: bool = False) -> torch.Tensor:
    """kernels.linear_cross_entropy's chunks (its arguments, chunk_tokens=None: CHUNK_TOKENS, read at call
    time); fused: each chunk's loss and gradient by the Triton cross-entropy kernel."""
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or targets.shape != x.shape[:1]:
        raise ValueError(f"linear_cross_entropy expects x [N, d], weight [V, d], targets [N], got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype (the GEMM's), got {x.dtype} and {weight.dtype}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    # decided here: inside the op grad mode is off, and validation skips the gradient work
    has_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return linear_cross_entropy_fwd(x, weight, targets, ignore_index, logit_dtype, chunk_tokens, has_grad, fused)[0]
