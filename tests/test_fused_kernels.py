"""Fused Triton kernels vs reference.py under the Triton interpreter (CPU, CI).

Fresh random inputs each run, forward and backward (torch.autograd.grad against the
reference's autograd), odd shapes: rows not a multiple of the block, head_dim 64 and
128, GQA ratios 1/3/8, V not a multiple of the block, ignored and all-ignored rows.
Only fp32 and fp16: the interpreter computes bf16 arithmetic wrongly (bf16 runs on
the GPU, tests/test_fused_kernels_gpu.py). The kernels upcast right after each load,
so fp16 here only exercises the loads/stores.

Tolerances: fp32 kernels and reference do the same fp32 math in a different reduction
order, ~1e-6 relative apart, so 1e-5 abs/rel (1e-4 for the gamma/weight gradients,
sums over all rows). fp16 outputs are rounded once from fp32: one fp16 ulp is 2^-10
~ 1e-3 relative, so 2e-3 abs/rel (1e-2 for gradients summed over rows).
Interpreter runs are slow per program instance: shapes are kept small.
"""

import pytest
import torch

from blunb import kernels
from blunb.kernels import reference as ref

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
TOL_SUM = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def _grads(out, inputs, douts):
    return torch.autograd.grad(out, inputs, douts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 200), (2, 5, 64)])
def test_rms_norm(shape, dtype):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.3 * torch.randn(shape[-1])).requires_grad_()  # fp32 weight, like the model's params
    y = kernels.rms_norm(x, w, 1e-6, backend="triton")
    y_ref = ref.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    dy = torch.randn_like(y)
    dx, dw = _grads(y, (x, w), dy)
    dx_ref, dw_ref = _grads(y_ref, (x, w), dy)
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    torch.testing.assert_close(dw, dw_ref, **TOL_SUM[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu(dtype):
    gu = torch.randn(3, 7, 2 * 200, dtype=dtype, requires_grad=True)  # F=200: not a multiple of the block
    y = kernels.swiglu(gu, backend="triton")
    y_ref = ref.swiglu(gu)
    assert y.shape == (3, 7, 200) and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    dy = torch.randn_like(y)
    torch.testing.assert_close(_grads(y, gu, dy)[0], _grads(y_ref, gu, dy)[0], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_ignored", [0, 4, "all"])
def test_cross_entropy(dtype, n_ignored):
    N, V = 11, 300  # V not a multiple of the interpreter's 128-wide block
    logits = (3 * torch.randn(N, V)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,))
    targets[: N if n_ignored == "all" else n_ignored] = -100
    loss = kernels.cross_entropy(logits, targets, backend="triton")
    loss_ref = ref.cross_entropy(logits, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, loss_ref, **TOL[torch.float32])  # the loss is fp32 math for both
    scale = 1.7  # a grad_output != 1 takes the in-place rescale path
    g = _grads(scale * loss, logits, None)[0]
    g_ref = _grads(scale * loss_ref, logits, None)[0]
    torch.testing.assert_close(g, g_ref, **TOL[dtype])
    if n_ignored == "all":
        assert loss.item() == 0.0 and not g.any()


def test_cross_entropy_ignore_index_and_no_grad():
    logits = torch.randn(6, 130)
    targets = torch.tensor([1, 5, 7, 129, 0, 3])
    with torch.no_grad():
        loss = kernels.cross_entropy(logits, targets, ignore_index=5, backend="triton")
    torch.testing.assert_close(loss, ref.cross_entropy(logits, targets, ignore_index=5), **TOL[torch.float32])


def _qk_tensor(B, H, T, hd, dtype, layout):
    if layout == "bthd":  # the model's projection output viewed as [B,H,T,hd]: strided, not copied
        return torch.randn(B, T, H * hd, dtype=dtype).view(B, T, H, hd).transpose(1, 2).requires_grad_()
    if layout == "sliced":  # a slice of a fused projection: not dense (the wrapper copies it)
        x = torch.randn(B, T, (H + 1) * hd, dtype=dtype)[..., :H * hd]
        return x.view(B, T, H, hd).transpose(1, 2).requires_grad_()
    return torch.randn(B, H, T, hd, dtype=dtype, requires_grad=True)  # "bhtd": contiguous


def _qk_inputs(B, Hq, Hk, T, hd, dtype, layout):
    q_layout, k_layout = ("bthd", "bhtd") if layout == "mixed" else (layout, layout)
    return _qk_tensor(B, Hq, T, hd, dtype, q_layout), _qk_tensor(B, Hk, T, hd, dtype, k_layout)


@pytest.mark.parametrize(
    "hd, Hq, Hk, interleaved, layout, dtype",
    [
        (64, 2, 2, False, "bthd", torch.float32),  # GQA 1
        (128, 3, 1, True, "bhtd", torch.float32),  # GQA 3
        (64, 8, 1, True, "bthd", torch.float32),  # GQA 8
        (128, 8, 1, False, "bthd", torch.float32),
        (64, 6, 2, False, "bhtd", torch.float16),
        (128, 2, 2, True, "bthd", torch.float32),  # GQA 1, GPT-J, the model's layout
        (64, 3, 1, False, "bhtd", torch.float32),  # GQA 3, NeoX, contiguous
        (128, 8, 1, True, "bhtd", torch.float16),  # GQA 8, GPT-J, contiguous
        (64, 6, 2, True, "mixed", torch.float32),  # q [B,T,H,hd] memory, k contiguous [B,H,T,hd]
        (80, 4, 2, False, "sliced", torch.float32),  # non-dense inputs; hd/2 not a power of two
        (80, 2, 1, True, "bthd", torch.float32),
    ],
)
def test_qk_norm_rope(hd, Hq, Hk, interleaved, layout, dtype):
    B, T = 2, 7
    q, k = _qk_inputs(B, Hq, Hk, T, hd, dtype, layout)
    qg = (1 + 0.3 * torch.randn(hd)).requires_grad_()
    kg = (1 + 0.3 * torch.randn(hd)).requires_grad_()
    cos, sin = ref.rope_cache(T + 5, hd, 10000.0)  # a longer cache: only its first T rows are used
    args = (qg, kg, cos, sin, 1e-6, interleaved)
    qo, ko = kernels.qk_norm_rope(q, k, *args, backend="triton")
    qo_ref, ko_ref = ref.qk_norm_rope(q, k, *args)
    assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    if layout != "sliced":  # dense inputs go through in their own memory layout
        assert qo.stride() == q.stride() and ko.stride() == k.stride()
    torch.testing.assert_close(qo, qo_ref, **TOL[dtype])
    torch.testing.assert_close(ko, ko_ref, **TOL[dtype])
    dqo, dko = torch.randn_like(qo), torch.randn_like(ko)
    got = _grads((qo, ko), (q, k, qg, kg), (dqo, dko))
    want = _grads((qo_ref, ko_ref), (q, k, qg, kg), (dqo, dko))
    for name, a, b in zip(("dq", "dk", "dq_gamma", "dk_gamma"), got, want, strict=True):
        tol = TOL_SUM[dtype] if "gamma" in name else TOL[dtype]
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_norm_rope_many_chunks(interleaved):
    """Many row tiles: backward programs walk several tiles, the last run ends mid-tile, and
    some k programs get no rows at all (q and k get the same number of backward programs)."""
    B, Hq, Hk, T, hd = 2, 8, 1, 13, 64
    q, k = _qk_inputs(B, Hq, Hk, T, hd, torch.float32, "bthd")
    qg = (1 + 0.3 * torch.randn(hd)).requires_grad_()
    kg = (1 + 0.3 * torch.randn(hd)).requires_grad_()
    cos, sin = ref.rope_cache(T, hd, 10000.0)
    args = (qg, kg, cos, sin, 1e-6, interleaved)
    out = kernels.qk_norm_rope(q, k, *args, backend="triton")
    out_ref = ref.qk_norm_rope(q, k, *args)
    for a, b in zip(out, out_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    douts = [torch.randn_like(o) for o in out]
    got = _grads(out, (q, k, qg, kg), douts)
    want = _grads(out_ref, (q, k, qg, kg), douts)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, **(TOL_SUM if i >= 2 else TOL)[torch.float32])


def test_qk_norm_rope_strided_grad_output():
    """Grad outputs with a layout unlike the inputs' (e.g. from attention backward) are read via strides."""
    B, Hq, Hk, T, hd = 1, 4, 2, 5, 64
    q, k = _qk_inputs(B, Hq, Hk, T, hd, torch.float32, "bthd")
    qg, kg = torch.randn(hd, requires_grad=True), torch.randn(hd, requires_grad=True)
    cos, sin = ref.rope_cache(T, hd, 500.0)
    qo, ko = kernels.qk_norm_rope(q, k, qg, kg, cos, sin, 1e-5, backend="triton")
    dqo = torch.randn(B, Hq, T, hd)  # contiguous, while qo is [B,T,H,hd] in memory
    dko = torch.randn(B, T, Hk, hd).transpose(1, 2)
    qo_ref, ko_ref = ref.qk_norm_rope(q, k, qg, kg, cos, sin, 1e-5)
    got = _grads((qo, ko), (q, k, qg, kg), (dqo, dko))
    want = _grads((qo_ref, ko_ref), (q, k, qg, kg), (dqo, dko))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL_SUM[torch.float32])


# ---------------------------------------------------------------- adamw (ZeRO-1 shard update)

# (shard offset, flat offset, length, decays) per parameter, with padding between segments in both buffers, the
# flat range starting off zero. Against the interpreter's 128-element blocks and the 8-element alignment: 300 from
# aligned offsets is two whole blocks and a tail of 44; 1 element; 129 and 127 at offsets that are not congruent
# modulo 8 (masked blocks only); 261 from congruent offsets 7 short of alignment: a head of 7, one whole block,
# a tail of 126. Decay on and off.
ADAMW_SEGMENTS = ((0, 8, 300, True), (303, 311, 1, False), (307, 320, 129, True), (439, 453, 127, False),
                  (569, 585, 261, True))
ADAMW_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _adamw_inputs(grad_dtype, param_dtype, found_inf=0.0):
    """A rank's shard as ADAMW_SEGMENTS lays it out; per-parameter step counts from 1 (the largest bias
    correction) up."""
    segments = [(s0, f0, n, i, decays) for i, (s0, f0, n, decays) in enumerate(ADAMW_SEGMENTS)]
    shard_at, flat_at = (max(s[k] + s[2] for s in segments) + 3 for k in (0, 1))
    master = torch.randn(shard_at)
    state = dict(master=master, exp_avg=0.1 * torch.randn(shard_at), exp_avg_sq=0.01 * torch.rand(shard_at),
                 grad=torch.randn(flat_at).to(grad_dtype), param=torch.randn(flat_at).to(param_dtype),
                 steps=torch.tensor([1.0, 2.0, 10.0, 1000.0, 3.0]))
    scalars = dict(grad_scale=torch.tensor(2.0), found_inf=torch.tensor(found_inf))
    return segments, state, scalars


def _adamw_step(backend, segments, state, scalars):
    out = {k: v.clone() for k, v in state.items()}
    kernels.adamw_update_(out["master"], out["exp_avg"], out["exp_avg_sq"], out["grad"], out["param"],
                          out["steps"], kernels.adamw_block_table(segments, "cpu"), **ADAMW_HYPER, **scalars,
                          backend=backend)
    return out


@pytest.mark.parametrize("grad_dtype, param_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                     (torch.float16, torch.float32)])
def test_adamw_update(grad_dtype, param_dtype):
    segments, state, scalars = _adamw_inputs(grad_dtype, param_dtype)
    got, want = _adamw_step("triton", segments, state, scalars), _adamw_step("torch", segments, state, scalars)
    # The moments are the same fp32 formula per element (measured: equal; a few ulps allowed). The master:
    # the kernel forms the bias corrections as exp(t log b), the reference as b ** t, ulps of b^t apart,
    # which 1 - b^t magnifies at t = 1 (by 1 / (1 - b2) = 20) and the square root halves: the step agrees
    # to ~1e-6 of its size (allowed: 1e-5). Each side also rounds its three fp32 operations on the old
    # value: 4 ulps (2^-21) of |p_old|, not of the new value, which cancellation can bring near zero.
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0, msg=name)
    p_old = state["master"]
    bound = 2**-21 * p_old.abs() + 1e-5 * (want["master"] - p_old).abs()
    assert ((got["master"] - want["master"]).abs() <= bound).all()
    touched = torch.zeros_like(state["master"], dtype=torch.bool)
    flat_touched = torch.zeros_like(state["param"], dtype=torch.bool)
    for s0, f0, n, _, _ in segments:
        touched[s0:s0 + n], flat_touched[f0:f0 + n] = True, True
    for out in (got, want):
        # the weights are the master rounded to their dtype; padding is never written
        assert torch.equal(out["param"][flat_touched], out["master"][touched].to(param_dtype))
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(out[name][~touched], state[name][~touched]), name
            assert not torch.equal(out[name][touched], state[name][touched]), name
        assert torch.equal(out["param"][~flat_touched], state["param"][~flat_touched])


def test_adamw_block_table_puts_aligned_whole_blocks_first():
    """Every element of every segment in exactly one block; the whole blocks (the unmasked launch) first, each
    BLOCK long from offsets that are multiples of ADAMW_ALIGN in both buffers, as many as ADAMW_SEGMENTS allows
    (two in the first segment, one in the last); every block inside its segment, with its parameter's facts."""
    from blunb.kernels.fused import adamw
    from blunb.kernels.reference import ADAMW_ALIGN

    segments, _, _ = _adamw_inputs(torch.float32, torch.float32)
    table = kernels.adamw_block_table(segments, "cpu")
    rows = list(zip(*(table[k].tolist() for k in ("shard", "flat", "len", "param", "decays")), strict=True))
    assert table["whole"] == 3
    for shard, flat, n, _, _ in rows[:3]:
        assert n == adamw.BLOCK and shard % ADAMW_ALIGN == 0 and flat % ADAMW_ALIGN == 0
    assert all(0 < n <= adamw.BLOCK for _, _, n, _, _ in rows)
    for s0, f0, n, i, decays in segments:
        mine = sorted((shard - s0, flat - f0, m) for shard, flat, m, p, d in rows if p == i and d == decays)
        assert all(a == b for a, b, _ in mine)          # the same place in both buffers
        covered = [k for a, _, m in mine for k in range(a, a + m)]
        assert covered == list(range(n))               # once each, nothing outside the segment


@pytest.mark.parametrize("shift_buffer", [0, 1], ids=["shard", "flat"])
def test_adamw_block_table_refuses_overlapping_segments(shift_buffer):
    """Two segments sharing elements in either buffer would have their blocks race on those elements (the GPU
    writes whichever block lands last): refused before any table is built. Adjacent segments are fine."""
    from blunb.kernels.fused import adamw

    segments, _, _ = _adamw_inputs(torch.float32, torch.float32)
    adjacent = list(segments)
    _, _, n, i, dec = adjacent[1]
    prev = adjacent[0]
    adjacent[1] = (prev[0] + prev[2], prev[1] + prev[2], n, i, dec)   # starts where the first segment ends
    adamw.block_table(adjacent, "cpu")
    overlapping = list(adjacent)
    moved = list(overlapping[1])
    moved[shift_buffer] -= 1                                            # one element into the first segment
    overlapping[1] = tuple(moved)
    with pytest.raises(ValueError, match="overlap in the " + ("shard", "flat")[shift_buffer]):
        adamw.block_table(overlapping, "cpu")
    with pytest.raises(ValueError, match="negative"):
        adamw.block_table([(0, -1, 4, 0, True)], "cpu")


def test_adamw_whole_blocks_update_as_masked_blocks_do():
    """The unmasked launch of the whole blocks and the masked one over the same elements: the same bits (the same
    formula per element; only the loads and stores differ)."""
    from blunb.kernels.fused import adamw

    segments, state, scalars = _adamw_inputs(torch.float16, torch.float16)
    outs = []
    for whole_blocks in (True, False):
        table = adamw.block_table(segments, "cpu", whole_blocks=whole_blocks)
        assert table["whole"] == (3 if whole_blocks else 0)
        out = {k: v.clone() for k, v in state.items()}
        kernels.adamw_update_(out["master"], out["exp_avg"], out["exp_avg_sq"], out["grad"], out["param"],
                              out["steps"], table, **ADAMW_HYPER, **scalars, backend="triton")
        outs.append(out)
    for name in state:
        assert torch.equal(outs[0][name], outs[1][name]), name


def test_adamw_update_skips_the_step_on_found_inf():
    segments, state, scalars = _adamw_inputs(torch.float32, torch.float16, found_inf=1.0)
    for backend in ("triton", "torch"):
        out = _adamw_step(backend, segments, state, scalars)
        for name, t in state.items():
            assert torch.equal(out[name], t), (backend, name)
