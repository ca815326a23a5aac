"""Time forward+backward of the fused kernels against torch eager, torch.compile and Liger.

Run on a CUDA GPU:  PYTHONPATH=. python3 bench/kernels.py [--out results/bench/kernels.csv]
At a preset's real shapes and dtypes (RMSNorm on the fp32 residual stream, QK-norm + RoPE on the
projections' strided views, SwiGLU at its ffn width, fp32 logits at its vocab):
                    PYTHONPATH=. python3 bench/kernels.py --preset 1b --out results/bench/kernels_1b.csv

Every impl of an op gets the same fresh random inputs and one output gradient, and is
timed as forward + torch.autograd.grad (no .grad accumulation) with
triton.testing.do_bench (median, after warm-up; autotuning and compilation happen
in an untimed first call): `ms` is forward+backward, `fwd_ms` the forward alone (with
autograd recording) and `bwd_ms` the backward alone (repeated on one retained graph).
Effective bandwidth (of `ms`) uses the minimum byte counts of the issue: RMSNorm 5
passes over x, SwiGLU 8*F elements per row, cross-entropy 2 passes over the logits,
QK-norm+RoPE 4 passes over q+k, the chunked linear cross-entropy x, weight and their gradients once
(its logits are made and used chunk by chunk), the AdamW shard update 28 bytes per element (bf16 gradient
and weights, fp32 master and moments, each read or written once). RMSNorm also runs torch's built-in fused
F.rms_norm as a baseline; the linear cross-entropy its own plain-torch chunks; the AdamW update (an
in-place optimizer step, no autograd: `ms` only) ShardedAdamW's torch path. The device's copy bandwidth
(read + write of a 2 GiB device-to-device copy) is measured in the same run.
The CSV is rewritten after every op, so a cut-short run keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from blunb import kernels
from blunb.kernels import reference as ref
from blunb.kernels.fused import adamw as fused_adamw
from blunb.kernels.fused.cross_entropy import cross_entropy as tri_ce
from blunb.kernels.fused.qk_norm_rope import qk_norm_rope as tri_qk
from blunb.kernels.fused.rms_norm import rms_norm as tri_rms
from blunb.kernels.fused.swiglu import swiglu as tri_swiglu

COLUMNS = ["op", "shape", "dtype", "impl", "ms", "fwd_ms", "bwd_ms", "eff_GBps", "frac_of_copy_bw",
           "speedup_vs_best_baseline", "device", "torch", "triton"]
DEV = "cuda"



def _liger():
    """Liger-Kernel's ops module, or None where its wheel was not carried. Imported in main(),
    not at module level: torch.compile's spawned workers re-import this script."""
    try:
        import liger_kernel.ops as liger
    except Exception as err:
        print(f"Liger-Kernel not importable ({type(err).__name__}: {err}); skipping it", file=sys.stderr)
        return None
    return liger


def _time(fn) -> float:
    fn()  # autotune / compile outside the timing
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth_gbps() -> float:
    src = torch.randn(1 << 29, device=DEV)  # 2 GiB
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


class _Case:
    """fn(*inputs) with the gradients of its outputs w.r.t. the float inputs, timed three ways."""

    def __init__(self, fn, inputs, douts):
        self.fn, self.inputs, self.douts = fn, inputs, douts
        self.diff = [x for x in inputs if x.requires_grad]

    def times(self) -> tuple[float, float, float]:
        """(fwd+bwd, fwd, bwd) ms; a split that cannot be timed (e.g. no retained graph) is NaN."""
        both = _time(lambda: torch.autograd.grad(self.fn(*self.inputs), self.diff, self.douts))
        try:
            fwd = _time(lambda: self.fn(*self.inputs))
            outs = self.fn(*self.inputs)
            bwd = _time(lambda: torch.autograd.grad(outs, self.diff, self.douts, retain_graph=True))
        except Exception as err:
            print(f"fwd/bwd split not timed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
            fwd = bwd = float("nan")
        return both, fwd, bwd


class _Step:
    """An in-place step without autograd (the optimizer's): timed whole, no fwd/bwd split."""

    def __init__(self, fn):
        self.fn = fn

    def times(self) -> tuple[float, float, float]:
        return _time(self.fn), float("nan"), float("nan")


def _compiled(fn):
    # donated buffers (a memory saving) forbid the retained graph that times backward alone
    from torch._functorch import config as functorch_config

    functorch_config.donated_buffer = False
    return torch.compile(fn, dynamic=False)


# The shapes of the default run (no --preset): each case reads what it needs from this dict.
DEFAULT_SHAPES = dict(M=16384, d=4096, resid_dtype=torch.bfloat16, B=8, Hq=16, Hkv=8, T=2048, hd=128, ffn=8192,
                      V=50304)


def preset_shapes(name: str) -> dict:
    """The shapes and dtypes `name`'s model runs these ops at on a GPU (one micro-batch of B x T)."""
    from blunb.config import preset

    cfg = preset(name)
    c = cfg.model
    return dict(M=cfg.B * cfg.T, d=c.d_model, resid_dtype=torch.bfloat16 if c.bf16_resid else torch.float32,
                B=cfg.B, Hq=c.q_heads, Hkv=c.kv_heads, T=cfg.T, hd=c.head_dim, ffn=c.ffn_hidden, V=c.vocab_size)


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def case_rms_norm(liger, shapes):
    M, N, eps, dtype = shapes["M"], shapes["d"], 1e-6, shapes["resid_dtype"]
    x = torch.randn(M, N, device=DEV, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N, device=DEV)).to(dtype).requires_grad_()
    dy = torch.randn_like(x)
    impls = {
        "blunb_triton": lambda x, w: tri_rms(x, w, eps),
        "torch_eager": lambda x, w: ref.rms_norm(x, w, eps),
        "torch_compile": _compiled(lambda x, w: ref.rms_norm(x, w, eps)),
        "torch_F_rms_norm": lambda x, w: F.rms_norm(x, (N,), w, eps),  # torch's own fused CUDA kernel
    }
    if liger is not None:
        impls["liger"] = lambda x, w: liger.LigerRMSNormFunction.apply(x, w, eps)
    return "rms_norm", f"{M}x{N}", DTYPE_NAMES[dtype], 5 * x.numel() * x.element_size(), \
        {k: _Case(f, [x, w], [dy]) for k, f in impls.items()}


def case_qk_norm_rope(liger, shapes):  # Liger has no fused QK-norm + RoPE
    B, Hq, Hk, T, hd, eps = shapes["B"], shapes["Hq"], shapes["Hkv"], shapes["T"], shapes["hd"], 1e-6
    # the model's layout: projection outputs [B,T,H*hd] viewed as [B,H,T,hd]
    q = torch.randn(B, T, Hq * hd, device=DEV, dtype=torch.bfloat16).view(B, T, Hq, hd).transpose(1, 2)
    k = torch.randn(B, T, Hk * hd, device=DEV, dtype=torch.bfloat16).view(B, T, Hk, hd).transpose(1, 2)
    q.requires_grad_(), k.requires_grad_()
    qg = (1 + 0.1 * torch.randn(hd, device=DEV)).requires_grad_()
    kg = (1 + 0.1 * torch.randn(hd, device=DEV)).requires_grad_()
    cos, sin = ref.rope_cache(T, hd, 10000.0, device=DEV)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    impls = {
        "blunb_triton": lambda q, k, a, b: tri_qk(q, k, a, b, cos, sin, eps, False),
        "torch_eager": lambda q, k, a, b: ref.qk_norm_rope(q, k, a, b, cos, sin, eps, False),
        "torch_compile": _compiled(lambda q, k, a, b: ref.qk_norm_rope(q, k, a, b, cos, sin, eps, False)),
    }
    nbytes = 4 * (q.numel() + k.numel()) * 2
    shape = f"B{B} Hq{Hq} Hkv{Hk} T{T} hd{hd}"
    return "qk_norm_rope", shape, "bf16", nbytes, {k_: _Case(f, [q, k, qg, kg], [dq, dk]) for k_, f in impls.items()}


def case_swiglu(liger, shapes):
    M, F = shapes["M"], shapes["ffn"]
    gu = torch.randn(M, 2 * F, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, F, device=DEV, dtype=torch.bfloat16)
    impls = {"blunb_triton": tri_swiglu, "torch_eager": ref.swiglu, "torch_compile": _compiled(ref.swiglu)}
    if liger is not None:  # Liger's kernel for the same fused [gate | up] layout
        impls["liger"] = lambda gu: liger.LigerFusedGateUpSiLUMulFunction.apply(gu)
    return "swiglu", f"{M}x(2x{F})", "bf16", 8 * F * M * 2, {k: _Case(f, [gu], [dy]) for k, f in impls.items()}


def case_cross_entropy(liger, shapes, dtype):
    N, V = shapes["M"], shapes["V"]
    logits = (2 * torch.randn(N, V, device=DEV)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device=DEV)
    impls = {
        "blunb_triton": tri_ce,
        "torch_eager": ref.cross_entropy,
        "torch_compile": _compiled(ref.cross_entropy),
    }
    if liger is not None:  # Liger writes its gradient into the logits in place
        impls["liger"] = lambda lg, t: liger.LigerCrossEntropyFunction.apply(lg, t, None, -100)[0]
    name = DTYPE_NAMES[dtype]
    nbytes = 2 * logits.numel() * logits.element_size()
    runs = {k: _Case(f, [logits, targets], None) for k, f in impls.items()}
    return "cross_entropy", f"{N}x{V}", name, nbytes, runs


def case_linear_cross_entropy(liger, shapes):
    N, d, V = shapes["M"], shapes["d"], shapes["V"]
    x = torch.randn(N, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(V, d, device=DEV)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (N,), device=DEV)
    impls = {  # fp32 logits (the default logit_dtype), bf16 GEMMs
        "blunb_triton": lambda x, w, t: kernels.linear_cross_entropy(x, w, t, backend="triton"),
        "blunb_torch_chunks": lambda x, w, t: kernels.linear_cross_entropy(x, w, t, backend="torch"),
        "torch_eager": ref.linear_cross_entropy,
        "torch_compile": _compiled(ref.linear_cross_entropy),
    }
    nbytes = 2 * (x.numel() + w.numel()) * x.element_size()
    return "linear_cross_entropy", f"{N}x{d}x{V}", "bf16", nbytes, \
        {k: _Case(f, [x, w, targets], None) for k, f in impls.items()}


def case_adamw(liger, shapes):
    """One layer's weights as one rank's shard of a bf16 group (world size 1: shard = flat buffers)."""
    d, ffn = shapes["d"], shapes["ffn"]
    sizes = [d, 4 * d * d, d, 2 * d * ffn, d * ffn]  # norm, q/k/v/o, norm, gate_up, down
    segments, at = [], 0
    for i, n in enumerate(sizes):
        segments.append((at, at, n, i, n != d))
        at += n
    master = torch.randn(at, device=DEV)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    grad = torch.randn(at, device=DEV).bfloat16()
    param, grad32 = master.bfloat16(), torch.empty_like(master)
    steps = torch.ones(len(sizes), device=DEV)
    grad_scale, found_inf = torch.ones((), device=DEV), torch.zeros((), device=DEV)
    table = kernels.adamw_block_table(segments, DEV)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    views = [[t[s0:s0 + n] for s0, _, n, _, _ in segments] for t in (master, grad32, exp_avg, exp_avg_sq)]
    step_views = list(steps.unbind())

    masked = fused_adamw.block_table(segments, DEV, whole_blocks=False)

    def update(backend, blocks=table):
        kernels.adamw_update_(master, exp_avg, exp_avg_sq, grad, param, steps, blocks, **hyper,
                              grad_scale=grad_scale, found_inf=found_inf, backend=backend)

    def torch_path():  # ShardedAdamW with kernels=adamw=torch: stage the gradient, update per decay class, copy
        grad32.copy_(grad)
        for decays in (True, False):
            run = [i for i, seg in enumerate(segments) if seg[4] == decays]
            torch._fused_adamw_(*([v[i] for i in run] for v in views), [], [step_views[i] for i in run],
                                lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"],
                                weight_decay=hyper["weight_decay"] if decays else 0.0, eps=hyper["eps"],
                                amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        param.copy_(master)

    # blunb_triton_masked: every block masked, at run-time offsets (the kernel before its whole blocks)
    impls = {"blunb_triton": lambda: update("triton"), "blunb_triton_masked": lambda: update("triton", masked),
             "torch_fused_adamw": torch_path,
             "torch_eager": lambda: update("torch")}
    return "adamw", f"{at} ({len(sizes)} params)", "bf16", 28 * at, {k: _Step(f) for k, f in impls.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/kernels.csv")
    ap.add_argument("--ops", default="copy,rms_norm,qk_norm_rope,swiglu,ce_bf16,ce_fp32,lce,adamw")
    ap.add_argument("--preset", help="time at this preset's shapes and dtypes (default: the fixed shapes above)")
    args = ap.parse_args()
    shapes = preset_shapes(args.preset) if args.preset else DEFAULT_SHAPES
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    ops = args.ops.split(",")
    device = torch.cuda.get_device_name()
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__)
    rows = []

    def write():
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)

    copy_bw = copy_bandwidth_gbps()
    rows.append(dict(op="copy", shape="2GiB", dtype="fp32", impl="torch_copy", ms="", fwd_ms="", bwd_ms="",
                     eff_GBps=f"{copy_bw:.0f}", frac_of_copy_bw="1.000", speedup_vs_best_baseline="", **meta))
    print(f"device {device}: copy bandwidth {copy_bw:.0f} GB/s")
    write()
    cases = {"rms_norm": case_rms_norm, "qk_norm_rope": case_qk_norm_rope, "swiglu": case_swiglu,
             "ce_bf16": lambda lg, sh: case_cross_entropy(lg, sh, torch.bfloat16),
             "ce_fp32": lambda lg, sh: case_cross_entropy(lg, sh, torch.float32),
             "lce": case_linear_cross_entropy, "adamw": case_adamw}
    liger = _liger()
    for key in ops:
        if key == "copy":
            continue
        op, shape, dtype, nbytes, impls = cases[key](liger, shapes)
        times = {}
        for impl, case in impls.items():
            try:
                times[impl] = case.times()
            except Exception as err:  # one failing baseline must not cost the others
                print(f"{op} {dtype} {impl}: FAILED {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
        del impls
        torch.cuda.empty_cache()
        base = [t[0] for impl, t in times.items() if impl != "blunb_triton"]
        best = min(base) if base else float("nan")
        for impl, (ms, fwd_ms, bwd_ms) in times.items():
            gbps = nbytes / ms / 1e6
            rows.append(dict(op=op, shape=shape, dtype=dtype, impl=impl, ms=f"{ms:.4f}", fwd_ms=f"{fwd_ms:.4f}",
                             bwd_ms=f"{bwd_ms:.4f}", eff_GBps=f"{gbps:.0f}",
                             frac_of_copy_bw=f"{gbps / copy_bw:.3f}", speedup_vs_best_baseline=f"{best / ms:.3f}",
                             **meta))
        write()

    print(f"\n{'op':20s} {'dtype':5s} {'impl':18s} {'ms':>8s} {'fwd_ms':>8s} {'bwd_ms':>8s} {'GB/s':>6s} "
          f"{'/copy':>6s} {'vs best':>7s}")
    for r in rows[1:]:
        print(f"{r['op']:20s} {r['dtype']:5s} {r['impl']:18s} {r['ms']:>8s} {r['fwd_ms']:>8s} {r['bwd_ms']:>8s} "
              f"{r['eff_GBps']:>6s} {r['frac_of_copy_bw']:>6s} {r['speedup_vs_best_baseline']:>7s}")
    print(f"(copy {copy_bw:.0f} GB/s; 'vs best' = best baseline's ms / this ms; written to {args.out})")


if __name__ == "__main__":
    main()
