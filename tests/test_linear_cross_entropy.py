"""kernels.linear_cross_entropy (both backends: kernels/chunked_ce.py, fused/linear_cross_entropy.py) against
the unchunked path it replaces, and BLU with chunked_ce on.

The reference (reference.linear_cross_entropy) is what BLU.forward runs without chunked_ce: F.linear in
weight's dtype, .to(logit_dtype), then the loss of kernels.cross_entropy's torch reference, gradients by
autograd through all three. Shapes are odd on purpose: N=37 is no multiple of the chunk, V=97 and d=24 no
multiple of anything.
"""

import importlib.util

import pytest
import torch
import torch._dynamo

from blunb.config import apply_overrides, preset
from blunb.kernels import chunked_ce, linear_cross_entropy, reference
from blunb.model import BLU

N, V, D = 37, 97, 24


def inputs(dtype, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[[0, 9, n - 1]] = -100  # ignored rows: first, inside a chunk, last
    return x, w, targets


def loss_and_grads(fn, x, w, targets, **kw):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(x, w, targets, **kw)
    loss.backward()
    return loss.detach(), x.grad, w.grad


unchunked = reference.linear_cross_entropy


def assert_matches_unchunked(x, w, targets, logit_dtype, chunk_tokens, backend="torch"):
    loss, gx, gw = loss_and_grads(linear_cross_entropy, x, w, targets, logit_dtype=logit_dtype,
                                  chunk_tokens=chunk_tokens, backend=backend)
    ref_loss, ref_gx, ref_gw = loss_and_grads(unchunked, x, w, targets, logit_dtype=logit_dtype)
    assert loss.dtype == torch.float32 and (gx.dtype, gw.dtype) == (x.dtype, w.dtype)
    # The loss is fp32 math on the same logits either way (per-row GEMMs do not depend on the chunking),
    # summed in another order: fp32 rounding.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    if w.dtype == torch.float32:
        # fp32 GEMMs and softmax: the chunked sums over tokens (grad_w) reorder fp32 additions only.
        # Under bf16 logits both round d logits to bf16 alike; an element whose fp32 value sits on a
        # rounding boundary may round one bf16 ulp apart, hence the looser floor (measured: 2e-7).
        floor = 1e-5 if logit_dtype == torch.float32 else 1e-4
        for g, ref in ((gx, ref_gx), (gw, ref_gw)):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=floor * ref.abs().max().item())
    else:
        # bf16 GEMMs: grad_x rows are the same GEMM rows, rounded once to bf16 either way (half an ulp,
        # 2^-8 relative). grad_w sums ceil(N / chunk) partial GEMMs, each rounded to bf16 before the fp32
        # sum, against one rounding of the whole: at most one half-ulp (2^-8 of the largest entry) per
        # partial plus the final one.
        torch.testing.assert_close(gx, ref_gx, rtol=2**-8, atol=2**-8 * ref_gx.abs().max().item())
        partials = -(-x.shape[0] // chunk_tokens)
        torch.testing.assert_close(gw.float(), ref_gw.float(), rtol=0,
                                   atol=(partials + 1) * 2**-8 * ref_gw.abs().max().item())


@pytest.mark.parametrize("chunk_tokens", [8, 37, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16], ids=["fp32_logits", "bf16_logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32_weight", "bf16_weight"])
def test_loss_and_grads_match_the_unchunked_path(dtype, logit_dtype, chunk_tokens):
    assert_matches_unchunked(*inputs(dtype), logit_dtype, chunk_tokens)


@pytest.mark.parametrize("chunk_tokens", [8, 64], ids=lambda c: f"chunk{c}")
def test_the_fused_chunks_match_the_unchunked_path(chunk_tokens):
    """The Triton cross-entropy kernel in place over each chunk's logits (the CUDA path), here under the
    Triton interpreter, so fp32 only (its bf16 arithmetic is not the GPU's; tests/test_speed_gpu.py
    checks bf16 on CUDA): the same bar as the plain chunks, a custom ignore_index and eval included."""
    pytest.importorskip("triton")
    x, w, targets = inputs(torch.float32)
    assert_matches_unchunked(x, w, targets, torch.float32, chunk_tokens, backend="triton")
    targets[targets == -100] = 5
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, targets, ignore_index=5, chunk_tokens=chunk_tokens, backend="triton")
    torch.testing.assert_close(loss, unchunked(x, w, targets, ignore_index=5), rtol=1e-5, atol=0)


def test_the_incoming_grad_scales_both_gradients():
    x, w, targets = inputs(torch.float32)
    (3.0 * linear_cross_entropy(x, w, targets, chunk_tokens=8)).backward()
    ref_loss, ref_gx, ref_gw = loss_and_grads(unchunked, x, w, targets)
    torch.testing.assert_close(x.grad, 3.0 * ref_gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, 3.0 * ref_gw, rtol=1e-5, atol=1e-7)


def test_every_target_ignored_gives_zero_loss_and_zero_grads_like_kernels_cross_entropy():
    x, w, targets = inputs(torch.float32)
    targets = torch.full_like(targets, -100)
    loss, gx, gw = loss_and_grads(linear_cross_entropy, x, w, targets, chunk_tokens=8)
    ref_loss, _, _ = loss_and_grads(unchunked, x, w, targets)
    assert loss.item() == ref_loss.item() == 0.0  # not torch's NaN: the mean over no tokens is defined as 0
    assert not gx.any() and not gw.any()


def test_a_custom_ignore_index():
    x, w, targets = inputs(torch.float32)
    targets[targets == -100] = 5
    loss = linear_cross_entropy(x, w, targets, ignore_index=5, chunk_tokens=8)
    torch.testing.assert_close(loss, unchunked(x, w, targets, ignore_index=5), rtol=1e-5, atol=0)


def test_gradient_work_only_when_some_input_needs_it(monkeypatch):
    x, w, targets = inputs(torch.float32)
    seen = []
    real = chunked_ce.linear_cross_entropy_fwd

    def spy(*args):
        seen.append(args[-2])  # has_grad
        return real(*args)

    monkeypatch.setattr(chunked_ce, "linear_cross_entropy_fwd", spy)
    with torch.no_grad():  # validation
        loss = linear_cross_entropy(x, w, targets, chunk_tokens=8)
    linear_cross_entropy(x.detach(), w.detach(), targets, chunk_tokens=8)
    linear_cross_entropy(x.detach(), w, targets, chunk_tokens=8)
    assert seen == [False, False, True] and not loss.requires_grad
    torch.testing.assert_close(loss, unchunked(x, w, targets), rtol=1e-5, atol=0)
    _, grad_x, grad_w = real(x.detach(), w.detach(), targets, -100, torch.float32, 8, False, False)
    assert grad_x.numel() == grad_w.numel() == 0  # nothing [N, d] or [V, d] is made for eval


def test_the_backend_follows_the_ops_own_kernels_entry(monkeypatch):
    """BLUNB_KERNELS' linear_cross_entropy entry picks the chunks' backend (not cross_entropy's): triton runs
    the fused chunk step (here under the interpreter, fp32), torch the plain one."""
    pytest.importorskip("triton")
    x, w, targets = inputs(torch.float32)
    seen = []
    real = chunked_ce.linear_cross_entropy_fwd
    monkeypatch.setattr(chunked_ce, "linear_cross_entropy_fwd", lambda *args: seen.append(args[-1]) or real(*args))
    for spec in ("linear_cross_entropy=triton", "cross_entropy=triton", "linear_cross_entropy=torch"):
        monkeypatch.setenv("BLUNB_KERNELS", spec)
        torch.testing.assert_close(linear_cross_entropy(x, w, targets, chunk_tokens=16), unchunked(x, w, targets),
                                   rtol=1e-5, atol=0)
    assert seen == [True, False, False]


def test_bad_shapes_and_dtypes_are_errors():
    x, w, targets = inputs(torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        linear_cross_entropy(x, w.bfloat16(), targets)
    with pytest.raises(ValueError, match="expects x"):
        linear_cross_entropy(x, w[:, :-1], targets)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(x, w, targets, chunk_tokens=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_custom_op_passes_opcheck(dtype):
    """Schema, fake implementation (shapes, dtypes, strides), autograd registration and AOT dispatch.
    The gradients are saved outputs scaled out of place, so unlike cross_entropy_fwd every check runs."""
    x, w, targets = inputs(dtype)
    op = torch.ops.blunb.linear_cross_entropy_fwd
    torch.library.opcheck(op, (x, w, targets, -100, torch.float32, 8, True, False))
    torch.library.opcheck(op, (x.detach(), w.detach(), targets, -100, torch.bfloat16, 64, False, False))
    if dtype == torch.float32 and importlib.util.find_spec("triton") is not None:   # the interpreter: fp32
        torch.library.opcheck(op, (x, w, targets, -100, torch.float32, 8, True, True))


# ---------------------------------------------------------------- BLU with chunked_ce

def tiny_pair(*overrides, n_layers=2):
    cfg = apply_overrides(preset("tiny"), [f"n_layers={n_layers}", *overrides]).model
    return BLU(cfg, seed=3), BLU(apply_overrides(preset("tiny"), [f"n_layers={n_layers}", "chunked_ce=true",
                                                                  *overrides]).model, seed=3)


def batch(B=2, T=24, V=320):
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    targets[0, :5] = -100
    return idx, targets


@pytest.mark.parametrize("overrides", [[], ["weight_tying=false"], ["bf16_logits=true"]],
                         ids=["tied", "untied", "bf16_logits"])
def test_blu_with_chunked_ce_matches_the_plain_model(overrides, monkeypatch):
    """tiny (tied by default; fp32 Linears on the CPU), 48 tokens in 3 chunks of 16: same loss, same
    gradient for every parameter, the tied embedding's included (its grad sums the lookup's and the
    output GEMM's). fp32 throughout, so the bar is fp32 reordering; bf16_logits rounds d logits to bf16
    in both paths, and a value on a rounding boundary may land one bf16 ulp apart, hence its floor
    (measured: 1e-5 of the largest entry)."""
    monkeypatch.setattr(chunked_ce, "CHUNK_TOKENS", 16)
    plain, chunked = tiny_pair(*overrides)
    idx, targets = batch()
    logits, loss_p = plain(idx, targets)
    none, loss_c = chunked(idx, targets)
    assert none is None and logits is not None
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-5, atol=0)
    loss_p.backward()
    loss_c.backward()
    floor = 1e-4 if "bf16_logits=true" in overrides else 1e-5
    grads_c = dict(chunked.named_parameters())
    for name, p in plain.named_parameters():
        g = p.grad
        torch.testing.assert_close(grads_c[name].grad, g, rtol=1e-5, atol=floor * g.abs().max().item(), msg=name)
    torch.testing.assert_close(chunked(idx), plain(idx), rtol=0, atol=0)  # without targets: the logits


def test_compiled_blu_with_chunked_ce_is_one_graph_and_matches_eager(monkeypatch):
    """Dynamo sees the op as one node (no graph break), and AOT autograd's joint graph through its fake
    implementation and registered backward gives eager's loss and gradients (aot_eager: Inductor's C++
    build is what takes minutes on the CPU, and it adds nothing to this op, which stays opaque)."""
    monkeypatch.setenv("BLUNB_KERNELS", "torch")  # the other ops' Triton interpreter is not what is tested here
    torch._dynamo.reset()
    try:
        _, eager = tiny_pair(n_layers=1)
        _, compiled = tiny_pair(n_layers=1)
        idx, targets = batch()
        explained = torch._dynamo.explain(compiled)(idx, targets)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        called = {str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"}
        assert "blunb.linear_cross_entropy_fwd.default" in called
        torch._dynamo.reset()
        compiled.compile(backend="aot_eager", fullgraph=True)
        _, loss_e = eager(idx, targets)
        _, loss_c = compiled(idx, targets)
        loss_e.backward()
        loss_c.backward()
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
        grads_c = dict(compiled.named_parameters())
        for name, p in eager.named_parameters():
            torch.testing.assert_close(grads_c[name].grad, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(),
                                       msg=name)
    finally:
        torch._dynamo.reset()
