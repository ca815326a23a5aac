"""bench/kernels.py's AdamW case on the CPU (its timings are GPU-only and not tested here): each of its
implementations runs on the case's buffers, so a GPU call does not fail on them."""

from bench import kernels as kernels_bench


def test_every_adamw_implementation_of_the_bench_runs(monkeypatch):
    monkeypatch.setattr(kernels_bench, "DEV", "cpu")
    op, _, dtype, nbytes, impls = kernels_bench.case_adamw(None, {"d": 16, "ffn": 40})
    n = 16 + 4 * 16 * 16 + 16 + 2 * 16 * 40 + 16 * 40    # one layer: norm, q/k/v/o, norm, gate_up, down
    assert (op, dtype, nbytes) == ("adamw", "bf16", 28 * n)
    assert set(impls) == {"blunb_triton", "blunb_triton_masked", "torch_fused_adamw", "torch_eager"}
    for step in impls.values():
        step.fn()
