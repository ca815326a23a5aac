"""Fused Triton kernels on a CUDA GPU, in bf16 (and fp32 for cross-entropy).

Accuracy: every output and gradient is compared with a float64 evaluation of
reference.py by ||out - ref64|| / ||ref64||. The bar is the same-dtype torch op
(reference.py run on the bf16 inputs, whose only error is rounding to bf16 once):
the fused kernel's error must be <= 2x that, plus 1e-4 of slack for the cases where
the torch error is ~0 (fp32 outputs such as the loss, where only the summation order
differs). Poisoning: the CUDA caching allocator is filled with NaN before each call,
so the kernels' outputs (allocated with torch.empty) start as NaN; with finite
inputs, any NaN left in a result is an element the kernel never wrote.
"""

import pytest
import torch

from blunb import kernels
from blunb.kernels import reference as ref

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _poison_allocator():
    """Fill cached blocks of both allocator pools with NaN and free them again."""
    big = torch.full((1 << 29,), float("nan"), device=DEV)  # 2 GiB, split for large tensors
    small = [torch.full((1 << 16,), float("nan"), device=DEV) for _ in range(64)]  # small pool (<1 MiB)
    del big, small


def _rel(a, b64):
    return ((a.double() - b64).norm() / b64.norm().clamp(min=1e-30)).item()


def _check(name, fused, torch_same_dtype, ref64):
    assert torch.isfinite(fused).all(), f"{name}: NaN/inf: an element was not written"
    e_fused, e_torch = _rel(fused, ref64), _rel(torch_same_dtype, ref64)
    assert e_fused <= 2 * e_torch + 1e-4, f"{name}: error {e_fused:.3e} vs torch {e_torch:.3e}"


def _run(fn, inputs, douts):
    """Outputs and input gradients of fn(*inputs) for the given output gradients."""
    inputs = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [x for x in inputs if x.requires_grad]
    grads = torch.autograd.grad(outs, diff, douts)
    return [o.detach() for o in outs], list(grads)


def _compare(name, fused_fn, ref_fn, inputs, douts):
    _poison_allocator()
    f_out, f_grads = _run(fused_fn, inputs, douts)
    t_out, t_grads = _run(ref_fn, inputs, douts)
    in64 = [x.double() if x.is_floating_point() else x for x in inputs]
    d64 = None if douts is None else [d.double() for d in douts]
    r_out, r_grads = _run(ref_fn, in64, d64)
    for i, (f, t, r) in enumerate(zip(f_out + f_grads, t_out + t_grads, r_out + r_grads, strict=True)):
        assert f.dtype == t.dtype and f.shape == t.shape, f"{name}[{i}]: {f.dtype}{tuple(f.shape)}"
        _check(f"{name}[{i}]", f, t, r)


@pytest.mark.parametrize("shape, wdtype", [
    ((4099, 4096), torch.float32),
    ((3, 333, 3000), torch.bfloat16),
    ((5, 8192), torch.float32),  # fewer rows than one program's chunk
])
def test_rms_norm_bf16(shape, wdtype):
    x = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    w = (1 + 0.2 * torch.randn(shape[-1], device=DEV)).to(wdtype)
    dy = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    _compare("rms_norm", lambda a, b: kernels.rms_norm(a, b, 1e-6, backend="triton"),
             lambda a, b: ref.rms_norm(a, b, 1e-6), [x, w], [dy])


@pytest.mark.parametrize("shape", [(2, 1023, 2 * 2816), (5, 2 * 8192), (7, 2 * 1000)])
def test_swiglu_bf16(shape):
    gu = torch.randn(shape, device=DEV, dtype=torch.bfloat16) * 3
    dy = torch.randn(*shape[:-1], shape[-1] // 2, device=DEV, dtype=torch.bfloat16)
    _compare("swiglu", lambda a: kernels.swiglu(a, backend="triton"), ref.swiglu, [gu], [dy])


@pytest.mark.parametrize("N, V, dtype, ignored", [
    (1027, 50304, torch.bfloat16, 0.1),
    (513, 32001, torch.float32, 0.3),
    (64, 50304, torch.bfloat16, 1.0),
])
def test_cross_entropy(N, V, dtype, ignored):
    logits = (4 * torch.randn(N, V, device=DEV)).to(dtype)
    targets = torch.randint(0, V, (N,), device=DEV)
    targets[torch.rand(N, device=DEV) < ignored] = -100
    scale = torch.tensor(0.37, device=DEV)  # grad_output != 1 exercises the in-place rescale
    _compare("cross_entropy", lambda a, t: kernels.cross_entropy(a, t, backend="triton") * scale,
             lambda a, t: ref.cross_entropy(a, t) * scale, [logits, targets], None)
    if ignored == 1.0:
        assert kernels.cross_entropy(logits, targets, backend="triton").item() == 0.0
    with torch.no_grad():  # eval path: no gradient pass
        loss = kernels.cross_entropy(logits, targets, backend="triton")
        torch.testing.assert_close(loss, ref.cross_entropy(logits.double(), targets).float(), atol=1e-4, rtol=1e-4)


def _qk_tensor(B, H, T, hd, layout, dtype=torch.bfloat16):
    """A [B,H,T,hd] tensor in one of the layouts qk_norm_rope meets."""
    if layout == "bthd":  # the model's projections: [B,T,H,hd] memory viewed as [B,H,T,hd]
        return torch.randn(B, T, H * hd, device=DEV).to(dtype).view(B, T, H, hd).transpose(1, 2)
    if layout == "sliced":  # a slice of a fused projection: not dense, copied by the kernel's wrapper
        return torch.randn(B, T, (H + 1) * hd, device=DEV).to(dtype)[..., :H * hd].view(B, T, H, hd).transpose(1, 2)
    return torch.randn(B, H, T, hd, device=DEV).to(dtype)  # "bhtd": contiguous [B,H,T,hd]


@pytest.mark.parametrize("B, Hq, Hk, T, hd, interleaved, layout, dlayout", [
    # dlayout "cross": dq' contiguous [B,H,T,hd] and dk' [B,T,H,hd], whatever the inputs' layout;
    # "same": the grad outputs in their inputs' layout (what attention's backward produces)
    (2, 16, 8, 257, 128, False, "bthd", "cross"),
    (1, 12, 4, 130, 64, True, "bhtd", "cross"),  # GQA 3
    (2, 8, 1, 64, 128, True, "bthd", "cross"),  # GQA 8
    (1, 4, 4, 33, 64, False, "bhtd", "cross"),  # GQA 1
    (4, 16, 8, 1024, 128, False, "bthd", "same"),  # the benchmark's layout, many backward programs
    (2, 6, 2, 1001, 128, True, "bthd", "same"),  # GQA 3, odd T
    (1, 8, 8, 77, 128, True, "bhtd", "same"),  # GQA 1
    (2, 16, 2, 255, 64, True, "bthd", "same"),  # GQA 8, hd 64
    (3, 4, 1, 513, 128, False, "mixed", "same"),  # q [B,T,H,hd] memory, k contiguous [B,H,T,hd]
    (1, 3, 1, 300, 80, False, "sliced", "cross"),  # non-dense inputs, hd not a power of two
])
def test_qk_norm_rope_bf16(B, Hq, Hk, T, hd, interleaved, layout, dlayout):
    q_layout, k_layout = ("bthd", "bhtd") if layout == "mixed" else (layout, layout)
    q, k = _qk_tensor(B, Hq, T, hd, q_layout), _qk_tensor(B, Hk, T, hd, k_layout)
    qg = 1 + 0.2 * torch.randn(hd, device=DEV)
    kg = 1 + 0.2 * torch.randn(hd, device=DEV)
    cos, sin = ref.rope_cache(T + 100, hd, 10000.0, device=DEV)
    if dlayout == "cross":
        dqo = _qk_tensor(B, Hq, T, hd, "bhtd")
        dko = _qk_tensor(B, Hk, T, hd, "bthd")
    else:
        dqo = torch.randn(q.shape, device=DEV).to(torch.bfloat16) if q.is_contiguous() else \
            _qk_tensor(B, Hq, T, hd, "bthd")
        dko = torch.randn(k.shape, device=DEV).to(torch.bfloat16) if k.is_contiguous() else \
            _qk_tensor(B, Hk, T, hd, "bthd")

    def fused(q, k, qg, kg):
        return kernels.qk_norm_rope(q, k, qg, kg, cos, sin, 1e-6, interleaved, backend="triton")

    def torch_ref(q, k, qg, kg):
        return ref.qk_norm_rope(q, k, qg, kg, cos.to(qg.dtype), sin.to(qg.dtype), 1e-6, interleaved)

    _compare("qk_norm_rope", fused, torch_ref, [q, k, qg, kg], [dqo, dko])
    qo, ko = fused(q, k, qg, kg)
    if layout != "sliced":  # dense inputs go through in their own layout, without a copy
        assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16], ids=["fp32_logits", "bf16_logits"])
def test_linear_cross_entropy_bf16(logit_dtype):
    """The chunked lm_head + loss (kernels.linear_cross_entropy's Triton backend) against its unchunked
    reference: N = 2 chunks + 17 (the last one partial), V and d no multiples of a block."""
    N, d, V, chunk = 2 * 1024 + 17, 520, 32001, 1024
    x = torch.randn(N, d, device=DEV).bfloat16()
    w = (0.05 * torch.randn(V, d, device=DEV)).bfloat16()
    targets = torch.randint(0, V, (N,), device=DEV)
    targets[::97] = -100
    _compare("linear_cross_entropy",
             lambda a, b, t: kernels.linear_cross_entropy(a, b, t, logit_dtype=logit_dtype, chunk_tokens=chunk,
                                                          backend="triton"),
             lambda a, b, t: ref.linear_cross_entropy(a, b, t, logit_dtype=logit_dtype), [x, w, targets], None)


def test_adamw_update_bf16():
    """The fused ZeRO-1 shard update with bf16 gradient and weights against reference.adamw_update_, at the
    GPU's 4096-element blocks: segments ending one element into a block, one short of it, a single element;
    aligned (three whole blocks: the unmasked launch), six short of alignment (a head, one whole block, a tail),
    and at offsets not congruent modulo 8 (masked blocks only). The same bars as under the interpreter
    (tests/test_fused_kernels.py, where they are derived); the bf16 weights are exactly each side's master
    rounded."""
    specs = ((3 * 4096 + 1, 0), (1, 0), (4095, 5), (4096 + 7, 0))   # (length, flat offset's shift off congruence)
    segments, shard_at, flat_at = [], 0, 16
    for i, (n, shift) in enumerate(specs):
        segments.append((shard_at, flat_at + shift, n, i, n > 1))
        # both buffers advance alike (the next segment congruent again), past the shifted one's end
        shard_at, flat_at = shard_at + n + 11, flat_at + n + 11
    flat_at += 8
    state = dict(master=torch.randn(shard_at, device=DEV), exp_avg=0.1 * torch.randn(shard_at, device=DEV),
                 exp_avg_sq=0.01 * torch.rand(shard_at, device=DEV),
                 grad=torch.randn(flat_at, device=DEV).bfloat16(), param=torch.zeros(flat_at, device=DEV).bfloat16(),
                 steps=torch.tensor([1.0, 2.0, 10.0, 1000.0], device=DEV))
    table = kernels.adamw_block_table(segments, DEV)
    assert table["whole"] == 4
    outs = {}
    for backend in ("triton", "torch"):
        out = {k: v.clone() for k, v in state.items()}
        kernels.adamw_update_(out["master"], out["exp_avg"], out["exp_avg_sq"], out["grad"], out["param"],
                              out["steps"], table, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              grad_scale=torch.tensor(2.0, device=DEV), found_inf=torch.tensor(0.0, device=DEV),
                              backend=backend)
        for s0, f0, n, _, _ in segments:
            assert torch.equal(out["param"][f0:f0 + n], out["master"][s0:s0 + n].bfloat16())
        outs[backend] = out
    got, want = outs["triton"], outs["torch"]
    # On the GPU the kernel's b * m + (1 - b) * g compiles to one fused multiply-add (one rounding where
    # torch rounds the product and the sum): the moments then differ by ulps of the two terms, not of
    # their sum, which cancellation brings near zero in m. 4 ulps (2^-21) of |term 1| + |term 2|.
    g = torch.cat([state["grad"][f0:f0 + n].float() for _, f0, n, _, _ in segments]) / 2.0
    touched = torch.cat([torch.arange(s0, s0 + n, device=DEV) for s0, _, n, _, _ in segments])
    padding = torch.ones_like(state["master"], dtype=torch.bool)
    padding[touched] = False
    for name, beta, term in (("exp_avg", 0.9, g), ("exp_avg_sq", 0.95, g * g)):
        terms = beta * state[name][touched].abs() + (1 - beta) * term.abs()
        gap = (got[name][touched] - want[name][touched]).abs()
        assert (gap <= 2**-21 * terms).all(), f"{name}: worst gap {(gap / terms).max().item():.3g} of the terms"
        assert torch.equal(got[name][padding], state[name][padding]), f"{name}: padding written"
    p_old = state["master"]
    bound = 2**-21 * p_old.abs() + 1e-5 * (want["master"] - p_old).abs()
    assert ((got["master"] - want["master"]).abs() <= bound).all()
