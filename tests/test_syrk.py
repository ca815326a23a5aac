"""Triton SYRK under the interpreter (fp32, odd sizes) vs the torch reference; the cache."""

from __future__ import annotations

import json

import pytest
import torch

from blunb import kernels
from blunb.kernels import reference
from blunb.kernels.fused import syrk as fused


@pytest.mark.parametrize("shape", [(33, 70), (70, 33), (3, 50, 17), (1, 5, 3)])
def test_syrk_matches_reference(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    out = kernels.syrk(x, backend="triton")
    torch.testing.assert_close(out, reference.syrk(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(70, 33), (3, 50, 17)])
def test_syrk_takes_a_transposed_view(shape):
    """Newton-Schulz passes a tall X as X.mT (column-major, no copy) for the Gram X^T X; the
    autotune probe has that layout too, so the verdict is for the layout that runs."""
    torch.manual_seed(0)
    x = torch.randn(*shape).mT
    assert x.stride(-1) != 1
    torch.testing.assert_close(fused.triton_syrk(x), reference.syrk(x), rtol=1e-5, atol=1e-5)
    probe = fused._probe(x)
    assert probe.shape == x.shape and probe.stride() == x.stride()
    assert fused._probe(x.contiguous()).is_contiguous()


def test_syrk_epilogue_and_mirror():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 23)  # 40 rows: two 32-row tiles, so one mirrored off-diagonal tile
    c = x @ x.mT                # symmetric, as the epilogue requires
    out = fused.triton_syrk(x, 2.0315, -4.775, c)
    torch.testing.assert_close(out, 2.0315 * (x @ x.mT) - 4.775 * c, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, 32:, :32], out[:, :32, 32:].mT)  # the mirrored tile is an exact copy


def test_dispatch_on_cpu_uses_torch():
    x = torch.randn(4, 6)
    assert torch.equal(kernels.syrk(x), x @ x.mT)  # backend=None on CPU: the torch reference
    assert not fused.prefer(x)


def test_verdict_cache_follows_the_cache_dir(tmp_path, monkeypatch):
    """A process that moves BLUNB_CACHE_DIR reads the new folder's verdicts, and writes there only its own."""
    entry = {"backend": "cublas", "config": None, "triton_ms": None, "cublas_ms": 1.0}
    first, second = tmp_path / "a", tmp_path / "b"
    cache = fused._Cache()
    monkeypatch.setenv("BLUNB_CACHE_DIR", str(first))
    cache.put("dev|b0|m8|k8", entry)
    monkeypatch.setenv("BLUNB_CACHE_DIR", str(second))
    assert cache.get("dev|b0|m8|k8") is None
    cache.put("dev|b0|m16|k16", entry)
    name = f"syrk_autotune_v{fused.CACHE_VERSION}.json"
    assert set(json.loads((second / name).read_text())["entries"]) == {"dev|b0|m16|k16"}
    monkeypatch.setenv("BLUNB_CACHE_DIR", str(first))
    assert cache.get("dev|b0|m8|k8") == entry and cache.get("dev|b0|m16|k16") is None


def test_verdict_cache_is_versioned_and_persisted(tmp_path, monkeypatch):
    monkeypatch.setenv("BLUNB_CACHE_DIR", str(tmp_path))
    cache = fused._Cache()
    cache.put("dev|b0|m8|k8", {"backend": "cublas", "config": None, "triton_ms": None, "cublas_ms": 1.0})
    path = tmp_path / f"syrk_autotune_v{fused.CACHE_VERSION}.json"
    data = json.loads(path.read_text())
    assert data["version"] == fused.CACHE_VERSION and data["entries"]["dev|b0|m8|k8"]["backend"] == "cublas"
    assert fused._Cache().get("dev|b0|m8|k8")["cublas_ms"] == 1.0
    path.write_text(json.dumps({"version": fused.CACHE_VERSION - 1, "entries": {"dev|b0|m8|k8": {}}}))
    assert fused._Cache().get("dev|b0|m8|k8") is None  # an older generation is never reused


@pytest.mark.parametrize("schedule", ["fixed", "polar_express"])
@pytest.mark.parametrize("shape", [(2, 37, 70), (2, 70, 37), (1, 45, 45)])
def test_newton_schulz_on_the_syrk_equals_the_plain_path(schedule, shape, monkeypatch):
    """Both of an iteration's symmetric products on the Triton SYRK (the Gram, and c A A + b A with that
    step's own b, c) against the cuBLAS-style bmm path, per coefficient schedule, tall / wide / square.
    fp32 through NS's own chain (the engine stages bf16, whose arithmetic the interpreter gets wrong; the
    GPU tests take bf16): the two differ only in summation order, ~1e-7 relative per product, amplified
    by each step's polynomial (slope up to ~8 in polar_express's first), so 1e-5 on O(1) entries
    (measured: <= 1.3e-6). A triple applied at the wrong step or a lost b or c is off by O(0.1)."""
    from blunb.optim.newton_schulz import NewtonSchulz
    calls = []
    real = fused.triton_syrk

    def counted(*args, **kwargs):
        calls.append(len(args))
        return real(*args, **kwargs)
    monkeypatch.setattr(fused, "triton_syrk", counted)
    torch.manual_seed(0)
    ns = NewtonSchulz(5, schedule, graphs=False)
    X = torch.randn(*shape)
    torch.testing.assert_close(ns._ns(X, (True, True)), ns._ns(X, (False, False)), rtol=0, atol=1e-5)
    assert calls == [1, 4] * 5   # each step: the Gram, then the product with that step's (c, b) epilogue
