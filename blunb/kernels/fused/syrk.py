"""Symmetric rank-k product in Triton: out = alpha * X @ X^T (+ beta * C, C symmetric).

For Newton-Schulz, which uses it twice per iteration (the Gram A = X X^T, and c*A@A + b*A, a SYRK too as
A is symmetric): only the lower triangle of output tiles is computed (the ~2x a symmetric product allows)
and mirrored, so the result is exactly symmetric. Whether it beats cuBLAS depends on the shape, so each
shape is autotuned once on the GPU against cuBLAS, after a numerical cross-check, and the verdict is
cached across processes; under torch's deterministic mode nothing is timed and the auto choice is cuBLAS.

Details (the autotune, the verdict cache, forcing a backend): docs/architecture.md, section
"blunb/kernels/fused/syrk.py".
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

from blunb.kernels.fused._common import deterministic, interpreting

CACHE_VERSION = 1
# (BLOCK_M, BLOCK_K, num_warps, num_stages). Tiles are square: the mirror store needs
# row and column tiles to coincide.
GPU_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (128, 32, 4, 5),
               (64, 64, 4, 4), (64, 32, 4, 5)]
CPU_CONFIG = (32, 32, 4, 1)  # one config under the interpreter; small programs are faster there
FIXED_CONFIG = GPU_CONFIGS[0]  # a forced Triton SYRK under deterministic mode (never timed)
# describe()'s words for the choice under torch's deterministic mode
DETERMINISTIC_CHOICE = "torch (cuBLAS, not timed)"
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@triton.jit
def _acc_step(acc, a_ptrs, b_ptrs, rm, rn, rk, k0, M, K, sxk, IEEE: tl.constexpr):
    kmask = rk + k0 < K
    a = tl.load(a_ptrs + k0 * sxk, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
    b = tl.load(b_ptrs + k0 * sxk, mask=kmask[:, None] & (rn[None, :] < M), other=0.0)
    if IEEE:  # fp32 inputs: full precision, not tf32
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _syrk_kernel(x_ptr, c_ptr, out_ptr, M, K,
                 sxb, sxm, sxk, scb, scm, scn, sob, som, son,
                 alpha, beta,
                 HAS_C: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # Linear index -> lower-triangle tile (ti >= tj); the float sqrt is fixed up by one
    # in either direction so rounding can never pick a wrong row.
    ti = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where(ti * (ti + 1) // 2 > pid, ti - 1, ti)
    ti = tl.where((ti + 1) * (ti + 2) // 2 <= pid, ti + 1, ti)
    tj = pid - ti * (ti + 1) // 2

    rm = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tj * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    xb = x_ptr + batch * sxb
    a_ptrs = xb + rm[:, None] * sxm + rk[None, :] * sxk   # X[rm, k]   [BM, BK]
    b_ptrs = xb + rn[None, :] * sxm + rk[:, None] * sxk   # X[rn, k]^T [BK, BM]
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    if INTERPRET:  # the interpreter (numpy 2.x) cannot range() over a runtime bound
        k0 = 0
        while k0 < K:
            acc = _acc_step(acc, a_ptrs, b_ptrs, rm, rn, rk, k0, M, K, sxk, IEEE)
            k0 += BLOCK_K
    else:  # a for loop, so the compiler software-pipelines the loads
        for k0 in range(0, K, BLOCK_K):
            acc = _acc_step(acc, a_ptrs, b_ptrs, rm, rn, rk, k0, M, K, sxk, IEEE)

    out = acc * alpha
    mask = (rm[:, None] < M) & (rn[None, :] < M)
    if HAS_C:
        c = tl.load(c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn, mask=mask, other=0.0)
        out += beta * c.to(tl.float32)
    o = out.to(out_ptr.dtype.element_ty)
    ob = out_ptr + batch * sob
    tl.store(ob + rm[:, None] * som + rn[None, :] * son, o, mask=mask)
    # Mirror: out[rn, rm] = o^T (diagonal tiles were written whole above).
    mask_t = (rn[:, None] < M) & (rm[None, :] < M) & (ti != tj)
    tl.store(ob + rn[:, None] * som + rm[None, :] * son, tl.trans(o), mask=mask_t)


def _launch(x3: torch.Tensor, out3: torch.Tensor, c3: torch.Tensor | None,
            alpha: float, beta: float, config) -> None:
    bm, bk, warps, stages = config
    B, M, K = x3.shape
    tiles = triton.cdiv(M, bm)
    cc = c3 if c3 is not None else out3  # never read when HAS_C is False
    _syrk_kernel[(tiles * (tiles + 1) // 2, B)](
        x3, cc, out3, M, K,
        x3.stride(0), x3.stride(1), x3.stride(2), cc.stride(0), cc.stride(1), cc.stride(2),
        out3.stride(0), out3.stride(1), out3.stride(2), float(alpha), float(beta),
        HAS_C=c3 is not None, IEEE=x3.dtype == torch.float32, INTERPRET=interpreting(),
        BLOCK_M=bm, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def _as3(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def cublas(x: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, c: torch.Tensor | None = None):
    """The same op through cuBLAS (the baseline the kernel is tuned against)."""
    if c is None:
        out = x @ x.mT
        return out if alpha == 1.0 else out.mul_(alpha)
    if x.dim() == 2:
        return torch.addmm(c, x, x.mT, beta=beta, alpha=alpha)
    return torch.baddbmm(c, x, x.mT, beta=beta, alpha=alpha)


def triton_syrk(x: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, c: torch.Tensor | None = None,
                config=None) -> torch.Tensor:
    """alpha * x @ x.mT (+ beta * c) with the Triton kernel, for [m, k] or [b, m, k]."""
    if x.dim() not in (2, 3):
        raise ValueError(f"syrk expects [m, k] or [b, m, k], got {tuple(x.shape)}")
    if c is not None and c.shape != x.shape[:-1] + (x.shape[-2],):
        raise ValueError(f"syrk: c must be {tuple(x.shape[:-1]) + (x.shape[-2],)}, got {tuple(c.shape)}")
    if config is None:
        if interpreting() or not x.is_cuda:
            config = CPU_CONFIG
        else:
            config = FIXED_CONFIG if deterministic() else _best_config(x, c is not None)
    out = torch.empty(x.shape[:-1] + (x.shape[-2],), dtype=x.dtype, device=x.device)
    _launch(_as3(x), _as3(out), None if c is None else _as3(c), alpha, beta, config)
    return out


def syrk(x: torch.Tensor) -> torch.Tensor:
    """x @ x.mT for [m, n] or [b, m, n] (the op behind `kernels.syrk(x, backend="triton")`)."""
    return triton_syrk(x)


def prefer(x: torch.Tensor) -> bool:
    """Whether the Triton kernel beat cuBLAS for x's shape (autotuned on first sight)."""
    return use_triton(x, has_c=False)


def use_triton(x: torch.Tensor, has_c: bool) -> bool:
    if not x.is_cuda or interpreting() or x.dim() not in (2, 3):
        return False
    from blunb.kernels import forced_backend  # here: blunb.kernels imports this module

    forced = forced_backend("syrk")
    if forced is not None:
        return forced == "triton"
    if deterministic():
        return False
    if torch.cuda.is_current_stream_capturing():  # cannot time now: only a known verdict counts
        v = _cache.get(_key(x, has_c))
        return bool(v) and v["backend"] == "triton"
    return verdict(x, has_c)["backend"] == "triton"


# ----------------------------------------------------------------------------- autotune

def _cache_path() -> Path:
    root = os.environ.get("BLUNB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "blunb")
    return Path(root) / f"syrk_autotune_v{CACHE_VERSION}.json"


class _Cache:
    """Verdicts on disk; one JSON object per shape key, rewritten atomically on each addition. The entries are read
    once per file: a process that points BLUNB_CACHE_DIR elsewhere reads (and writes) the new file, never carrying
    the old one's verdicts into it."""

    def __init__(self):
        self._entries: dict | None = None
        self._path: Path | None = None   # the file self._entries came from
        self._lock = threading.Lock()

    def _load(self) -> dict:
        path = _cache_path()
        if self._entries is None or path != self._path:
            try:
                data = json.loads(path.read_text())
                self._entries = data["entries"] if data.get("version") == CACHE_VERSION else {}
            except (OSError, ValueError, KeyError):
                self._entries = {}
            self._path = path
        return self._entries

    def get(self, key: str):
        return self._load().get(key)

    def put(self, key: str, value: dict) -> None:
        with self._lock:
            entries = self._load()
            entries[key] = value
            path = _cache_path()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except OSError as err:  # a read-only home must not stop training; the verdict stays in memory
                warnings.warn(f"syrk: could not persist autotune cache to {path}: {err}", stacklevel=2)


_cache = _Cache()


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _key(x: torch.Tensor, has_c: bool) -> str:
    b = x.shape[0] if x.dim() == 3 else 0
    m, k = x.shape[-2:]
    contiguous = x.stride(-1) == 1
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (f"{_device_name(index)}|torch{torch.__version__}|triton{triton.__version__}"
            f"|{str(x.dtype).removeprefix('torch.')}|b{b}|m{m}|k{k}|c{int(has_c)}|rowmajor{int(contiguous)}")


def gpu_time_ms(fn, iters: int = 20) -> float:
    """Mean kernel-execution time of fn() in ms, host launch cost excluded: a sleep kernel
    keeps the GPU busy while the host enqueues every iteration, so the timed window holds
    only back-to-back execution."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hasattr(torch.cuda, "_sleep"):  # private API: without it, the timing includes launch gaps
        torch.cuda._sleep(20_000_000)  # ~10 ms at H200 clocks, covers the enqueue
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _probe(x: torch.Tensor) -> torch.Tensor:
    """A seeded random input of x's shape AND layout (the key's rowmajor): a column-major x
    (the transposed view Newton-Schulz passes for a tall matrix) loads differently, so it
    is timed as such."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    shape = x.shape if x.stride(-1) == 1 else x.shape[:-2] + (x.shape[-1], x.shape[-2])
    xs = torch.randn(shape, generator=gen, device=x.device, dtype=torch.float32).to(x.dtype)
    xs = xs / math.sqrt(x.shape[-1])
    return xs if x.stride(-1) == 1 else xs.mT


def verdict(x: torch.Tensor, has_c: bool) -> dict:
    """{"backend": "triton"|"cublas", "config", "triton_ms", "cublas_ms"} for x's shape and layout."""
    key = _key(x, has_c)
    v = _cache.get(key)
    if v is not None:
        return v
    xs = _probe(x)
    cs = cublas(xs) if has_c else None  # symmetric, as the epilogue requires
    alpha, beta = (2.0315, -4.775) if has_c else (1.0, 0.0)
    ref = cublas(xs, alpha, beta, cs)
    tol = TOLERANCE.get(x.dtype, 2e-2)
    best, best_ms = None, math.inf
    for cfg in GPU_CONFIGS:
        try:
            err = _rel_err(triton_syrk(xs, alpha, beta, cs, config=cfg), ref)
        except Exception as exc:  # e.g. out of shared memory for this tile on this GPU
            print(f"[syrk] config {cfg} failed to run for {key}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        if not err <= tol:
            print(f"[syrk] *** REJECTED config {cfg} for {key}: rel. error {err:.2e} vs cuBLAS "
                  f"exceeds {tol:.0e} ***", file=sys.stderr)
            continue
        ms = gpu_time_ms(lambda cfg=cfg: triton_syrk(xs, alpha, beta, cs, config=cfg))
        if ms < best_ms:
            best, best_ms = cfg, ms
    cublas_ms = gpu_time_ms(lambda: cublas(xs, alpha, beta, cs))
    v = {"backend": "triton" if best is not None and best_ms < cublas_ms else "cublas",
         "config": list(best) if best is not None else None,
         "triton_ms": best_ms if best is not None else None, "cublas_ms": cublas_ms}
    _cache.put(key, v)
    return v


def _best_config(x: torch.Tensor, has_c: bool):
    v = verdict(x, has_c)
    if v["config"] is None:
        raise RuntimeError(f"syrk: no Triton config passed the cuBLAS cross-check for {_key(x, has_c)}")
    return tuple(v["config"])
