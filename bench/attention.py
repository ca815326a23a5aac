"""Causal GQA attention on the GPU: Triton kernel vs SDPA, forward and forward+backward.

    PYTHONPATH=. python3 bench/attention.py --out results/bench/attention.csv

TFLOP/s use the causal count: forward 2*2*B*Hq*T^2*hd/2, forward+backward 3.5x that
(the backward counts 2.5x the forward). Inputs are bf16 [B,T,H,hd] projection views seen as
[B,H,T,hd], as the model passes them. `sdpa` is F.scaled_dot_product_attention's default
dispatch with enable_gqa (what the model falls back to, and the ratio's baseline);
`sdpa_flash` / `sdpa_cudnn` pin one backend where it accepts the call.
"""

import argparse
import csv
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from blunb.kernels.fused import flash_attention as fa

CONFIGS = [  # name, B, Hq, Hkv, T, hd
    ("B8-Hq16-Hkv16-T2048-hd128", 8, 16, 16, 2048, 128),
    ("B4-Hq24-Hkv8-T4096-hd128", 4, 24, 8, 4096, 128),
    ("B8-Hq16-Hkv4-T2048-hd64", 8, 16, 4, 2048, 64),
]


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def pinned(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return sdpa(q, k, v, causal)

    return run


IMPLS = {"triton": fa.flash_attention, "sdpa": sdpa, "sdpa_flash": pinned(SDPBackend.FLASH_ATTENTION),
         "sdpa_cudnn": pinned(SDPBackend.CUDNN_ATTENTION)}


def inputs(B, Hq, Hkv, T, hd):
    def make(H):
        return torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()

    return make(Hq), make(Hkv), make(Hkv)


def time_ms(fn, q, k, v, backward):
    go = torch.randn_like(q)

    def step():
        out = fn(q, k, v, True)
        if backward:
            torch.autograd.grad(out, (q, k, v), go)

    with torch.enable_grad() if backward else torch.no_grad():
        return do_bench(step, warmup=25, rep=100, return_mode="median")


FIELDS = ["config", "B", "Hq", "Hkv", "T", "hd", "pass", "impl", "ms", "tflops", "ratio_vs_sdpa", "device", "torch",
          "triton"]


def bench_config(name, B, Hq, Hkv, T, hd, device):
    q, k, v = inputs(B, Hq, Hkv, T, hd)
    fwd_flops = 2 * 2 * B * Hq * T * T * hd / 2
    for pas, backward, flops in (("fwd", False, fwd_flops), ("fwd+bwd", True, 3.5 * fwd_flops)):
        times = {}
        for impl, fn in IMPLS.items():
            try:
                times[impl] = time_ms(fn, q, k, v, backward)
            except RuntimeError as err:  # a pinned backend that rejects this shape
                print(f"{name} {pas} {impl}: unavailable ({str(err).splitlines()[0][:120]})", flush=True)
        for impl, ms in times.items():
            tflops = flops / (ms * 1e-3) / 1e12
            ratio = times["sdpa"] / ms
            print(f"{name:28s} {pas:8s} {impl:11s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s  x{ratio:.3f} vs sdpa",
                  flush=True)
            yield dict(config=name, B=B, Hq=Hq, Hkv=Hkv, T=T, hd=hd, **{"pass": pas}, impl=impl, ms=f"{ms:.4f}",
                       tflops=f"{tflops:.1f}", ratio_vs_sdpa=f"{ratio:.3f}", device=device,
                       torch=torch.__version__, triton=triton.__version__)
    for kern in (fa._fwd_kernel, fa._bwd_kernel):  # the autotuner's last timings, for the record
        ranked = sorted((getattr(kern, "configs_timings", None) or {}).items(), key=lambda kv: kv[1])
        print(f"  {kern.base_fn.__name__}: " + "; ".join(f"{c} -> {t}" for c, t in ranked), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench/attention.csv")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:  # rows written as measured: a cut-short run keeps them
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for cfg in CONFIGS:
            for row in bench_config(*cfg, device):
                w.writerow(row)
                f.flush()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
