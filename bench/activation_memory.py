"""Where the activation memory goes: bytes one decoder block (and the head) keeps for backward, blunb
against the plain baseline (bench/plain_llama.py), each op's backend switched in turn.

    PYTHONPATH=. python3 bench/activation_memory.py --preset 1b --out results/bench/activation_memory_1b.csv

A training step's peak is reached early in the backward, with every block's saved tensors alive, so
saved bytes per block x n_layers is most of the activation side of peak memory. For each variant one
block (or a whole one-block model, for the embedding + head + loss) runs forward and backward a few times
(compile, autotune), then once measured: `saved_mib` is what the forward left allocated beyond its
input and output, `peak_mib` the highest allocation during forward + backward, both above what was
allocated before (weights and their gradients excluded). Blocks see a fp32 residual stream
[B, T, d] as in the trainer; blunb's Linears are bf16 (the trainer's CUDA default), the baseline's fp32
under bf16 autocast. Needs CUDA.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

from bench.plain_llama import PlainBlock, PlainLlama, rope_tables
from blunb import kernels
from blunb.config import preset
from blunb.model import BLU, Block
from blunb.runs import environment

log = logging.getLogger("activation_memory")

MIB = 2**20
# (part, variant, model, compiled, kernels setting, chunked lm_head + loss), the most telling first:
# a head row needs the block row of its variant (without "-chunked") measured before it
VARIANTS = [
    ("block", "plain-compile", "plain", True, "auto", False),
    ("block", "blunb-compile", "blunb", True, "auto", False),
    ("block", "blunb-compile-qk-torch", "blunb", True, "qk_norm_rope=torch", False),
    ("block", "blunb-compile-swiglu-torch", "blunb", True, "swiglu=torch", False),
    ("block", "blunb-compile-rmsnorm-torch", "blunb", True, "rms_norm=torch", False),
    ("head", "plain-compile", "plain", True, "auto", False),
    ("head", "blunb-compile", "blunb", True, "auto", False),
    ("head", "blunb-compile-chunked", "blunb", True, "auto", True),
    ("block", "blunb-compile-all-torch", "blunb", True, "torch", False),
    ("block", "blunb-compile-attention-torch", "blunb", True, "flash_attention=torch", False),
    ("block", "plain-eager", "plain", False, "auto", False),
    ("block", "blunb-eager", "blunb", False, "auto", False),
]


def _measure(fn, inputs: list[torch.Tensor], params: list[nn.Parameter], warmup: int = 3) -> dict:
    """fn(*inputs) -> a tensor; its forward's saved bytes and the fwd+bwd peak above the start."""
    def run(measured: bool) -> dict:
        for t in inputs:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        out = fn(*inputs)
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - m0 - out.numel() * out.element_size()
        out.backward(torch.ones_like(out) if out.dim() else None)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - m0
        return {"saved_mib": saved / MIB, "peak_mib": peak / MIB} if measured else {}

    for _ in range(warmup):
        run(False)
    for p in params:  # gradients exist from here on (accumulated in place): not part of what is measured
        if p.grad is not None:
            p.grad.zero_()
    return run(True)


def _block(kind: str, cfg, device) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":
        blk = PlainBlock(cfg.model).to(device)
    else:
        blk = Block(cfg.model, torch.bfloat16, torch.float32).to(device)
    with torch.no_grad():
        for p in blk.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return blk


def _block_row(kind: str, compiled: bool, cfg, B: int, T: int, device) -> dict:
    blk = _block(kind, cfg, device)
    c = cfg.model
    if kind == "plain":
        cos, sin = rope_tables(T, c.head_dim, c.rope_theta, device)
    else:
        cos, sin = kernels.rope_cache(T, c.head_dim, c.rope_theta, device=device)
    fwd = torch.compile(blk) if compiled else blk

    def fn(x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=kind == "plain"):
            return fwd(x, cos, sin)

    x = torch.randn(B, T, c.d_model, device=device, requires_grad=True)
    return _measure(fn, [x], list(blk.parameters()))


def _head_row(kind: str, compiled: bool, chunked: bool, cfg, B: int, T: int, device) -> dict:
    """A one-block model (embedding, block, norm, lm_head, loss) minus the block's own measurement."""
    mcfg = cfg.model
    mcfg.n_layers, mcfg.chunked_ce = 1, chunked
    torch.manual_seed(0)
    model = PlainLlama(mcfg, device) if kind == "plain" else BLU(mcfg, device=device)
    fwd = torch.compile(model) if compiled else model
    gen = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, mcfg.vocab_size, (B, T + 1), device=device, generator=gen)

    def fn():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=kind == "plain"):
            out = fwd(idx[:, :-1], idx[:, 1:])
        return out if kind == "plain" else out[1]

    return _measure(fn, [], list(model.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("activation_memory.py measures CUDA allocations: it needs a GPU")
    device = torch.device("cuda")
    cfg = preset(args.preset)
    B, T = cfg.B, cfg.T
    facts = {k: v for k, v in environment(1, "cuda").items() if k in ("device", "torch", "triton", "cuda", "git_sha")}
    rows = []
    for part, name, kind, compiled, spec, chunked in VARIANTS:
        os.environ["BLUNB_KERNELS"] = spec  # read by blunb.kernels at every call
        torch._dynamo.reset()
        try:
            if part == "block":
                r = _block_row(kind, compiled, preset(args.preset), B, T, device)
            else:
                r = _head_row(kind, compiled, chunked, preset(args.preset), B, T, device)
                one_block = next(x for x in rows if x["part"] == "block" and x["variant"] == name.replace(
                    "-chunked", "") and x["status"] == "ok")
                r = {k: v - one_block[k] for k, v in r.items()}
            status = "ok"
        except Exception as exc:  # one variant's failure must not lose the others' rows
            log.exception(f"{part} {name} failed")
            r, status = {}, f"error: {type(exc).__name__}: {exc}"[:300]
        row = {"preset": args.preset, "part": part, "variant": name, "kernels": spec, "compiled": compiled,
               "chunked_ce": chunked, "B": B, "T": T, **r, "status": status, **facts}
        log.info(row)
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out, index=False)
    table = pd.DataFrame(rows).set_index(["part", "variant"])
    log.info(f"MiB kept for backward (a block's x {cfg.model.n_layers} layers):\n"
             + table.reindex(columns=["saved_mib", "peak_mib", "status"]).to_string())


if __name__ == "__main__":
    main()
