"""The speed baseline: a plain PyTorch Llama-style model of a blunb preset's shape, trained the
way a user would write it without blunb, eager or under torch.compile.

    PYTHONPATH=. python3 bench/plain_llama.py --preset 1b --compile --steps 15 --json /tmp/plain.json

Same shape as BLU (GQA, QK-norm with per-head-dim scales, NeoX RoPE, SwiGLU, untied or tied
lm_head), written with stock ops: F.rms_norm, F.scaled_dot_product_attention (enable_gqa),
fp32 parameters under bf16 autocast, fp32 cross-entropy, torch.optim.AdamW(fused=True) with
global-norm clipping, one optimizer step per micro-batch of random tokens (throughput does not
depend on the data). Prints and writes one JSON row: ms/step, tok/s, MFU (causal and PaLM, by
blunb's MFU meter, so both sides share one FLOP count) and peak allocated memory.

`--cuda-graph` (with --compile: plain_compile_graph): the whole step in one CUDA graph, as torch's docs show
whole-network capture: the compiled forward and backward, the clip, torch's fused AdamW with capturable=True
and the gradients zeroed in place, captured after the warm-up steps (run on a side stream) and replayed; the
random tokens are drawn into a static buffer before each replay.

`--fp8 tensorwise|rowwise`: the body's Linears converted as torchao's float8 training README shows,
convert_to_float8_training with the recipe's Float8LinearConfig (the one model.fp8 uses) and a filter
that keeps lm_head out, before torch.compile; the fp32 parameters under autocast stay as they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from blunb.config import FP8_RECIPES, ModelConfig, preset
from blunb.mfu import MFUMeter
from blunb.profiling import write_profile

log = logging.getLogger("plain_llama")


def rope_tables(T: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class PlainBlock(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        d, hd = c.d_model, c.head_dim
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.wq = nn.Linear(d, c.q_heads * hd, bias=False)
        self.wk = nn.Linear(d, c.kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, c.kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.q_heads * hd, d, bias=False)
        self.q_gamma = nn.Parameter(torch.ones(hd))
        self.k_gamma = nn.Parameter(torch.ones(hd))
        self.gate_up = nn.Linear(d, 2 * c.ffn_hidden, bias=False)
        self.down = nn.Linear(c.ffn_hidden, d, bias=False)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        h = F.rms_norm(x, (c.d_model,), self.attn_norm, c.rms_eps)
        q = self.wq(h).view(B, T, c.q_heads, c.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q = apply_rope(F.rms_norm(q.float(), (c.head_dim,), self.q_gamma, c.qk_eps), cos, sin).to(v.dtype)
        k = apply_rope(F.rms_norm(k.float(), (c.head_dim,), self.k_gamma, c.qk_eps), cos, sin).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.q_heads != c.kv_heads)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, c.q_heads * c.head_dim))
        gate, up = self.gate_up(F.rms_norm(x, (c.d_model,), self.ffn_norm, c.rms_eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, c: ModelConfig, device):
        super().__init__()
        self.c = c
        with torch.device(device):
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.blocks = nn.ModuleList(PlainBlock(c) for _ in range(c.n_layers))
            self.norm_f = nn.Parameter(torch.ones(c.d_model))
            self.lm_head = None if c.weight_tying else nn.Linear(c.d_model, c.vocab_size, bias=False)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
        cos, sin = rope_tables(c.context_length, c.head_dim, c.rope_theta, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x, self.cos[:T], self.sin[:T])
        x = F.rms_norm(x, (self.c.d_model,), self.norm_f, self.c.rms_eps)
        logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def convert_to_fp8(model: PlainLlama, recipe: str) -> int:
    """The body's Linears (every nn.Linear but lm_head) as torchao Float8Linears; returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = []

    def body(module: nn.Module, fqn: str) -> bool:   # asked of every nn.Linear
        if fqn == "lm_head":
            return False
        names.append(fqn)
        return True

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=body)
    return len(names)


def variant_name(compile_model: bool, fp8: str, cuda_graph: bool = False) -> str:
    return (("plain_compile" if compile_model else "plain_eager") + ("_graph" if cuda_graph else "")
            + ("" if fp8 == "off" else f"-fp8-{fp8}"))


def graphed(step, new_batch, warmup: int):
    """`step` (queues one training step on static inputs) captured as a CUDA graph after `warmup` runs on a side
    stream (torch's rule); returns the replaying step (new_batch(), then the replay, returning step's output) and
    the capture's peak allocation in bytes: the step's activations live in the graph's pool, which a replay reuses
    without allocating, so only the capture shows what the step needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            new_batch()
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.graph(graph):
        out = step()
    capture_peak = torch.cuda.max_memory_allocated()

    def replay():
        new_batch()
        graph.replay()
        return out
    return replay, capture_peak


def time_plain(preset_name: str, compile_model: bool, steps: int, warmup: int, B: int | None = None,
               T: int | None = None, lr: float = 6e-4, profile_steps: int = 0, profile_to: Path | None = None,
               fp8: str = "off", cuda_graph: bool = False) -> dict:
    cfg = preset(preset_name)
    B, T = B or cfg.B, T or cfg.T
    device = torch.device("cuda")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = PlainLlama(cfg.model, device)
    fp8_linears = convert_to_fp8(model, fp8) if fp8 != "off" else 0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
                            capturable=cuda_graph)
    fwd = torch.compile(model) if compile_model else model
    gen = torch.Generator(device=device).manual_seed(0)
    idx = torch.empty((B, T + 1), dtype=torch.long, device=device)

    def new_batch():
        torch.randint(0, cfg.model.vocab_size, (B, T + 1), device=device, generator=gen, out=idx)

    def train_step():
        # a captured autocast region must not keep its cast cache across replays (torch's CUDA-graph notes)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not cuda_graph):
            loss = fwd(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=not cuda_graph)   # a graph zeroes its static gradients in place
        return loss

    def step():
        new_batch()
        return train_step()

    t0 = time.perf_counter()
    capture_peak = 0
    if cuda_graph:   # the warm-up steps run on the capture's side stream, then the capture
        step, capture_peak = graphed(train_step, new_batch, warmup)
    else:
        for _ in range(warmup):   # the first steps compile and autotune
            step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = max(torch.cuda.max_memory_allocated(), capture_peak) / 2**30   # with a graph: its pool included
    if profile_steps:  # after the timed steps, so the profiler's overhead is in none of them
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                step()
            torch.cuda.synchronize()
        write_profile(prof, profile_steps, profile_to.parent, prefix=profile_to.stem)
    meter = MFUMeter.build(cfg.model, seq_len=T, world_size=1, device_name=torch.cuda.get_device_name(device))
    tokens = B * T
    return {"variant": variant_name(compile_model, fp8, cuda_graph), "preset": preset_name, "fp8": fp8,
            "fp8_linears": fp8_linears, "cuda_graph": cuda_graph,
            "B": B, "T": T, "ms_per_step": dt * 1e3, "tok_per_s": tokens / dt, "mfu_causal": meter.mfu(dt, tokens),
            "mfu_palm": meter.mfu_palm(dt, tokens), "peak_mem_gib": peak,
            "warmup_s": warm_s, "timed_steps": steps, "final_loss": float(loss.detach()), "num_params":
            sum(p.numel() for p in model.parameters())}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--fp8", default="off", choices=["off", *FP8_RECIPES],
                    help="convert the body's Linears with torchao's float8 training recipe (needs torchao)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the whole step (forward, backward, clip, fused AdamW capturable=True, zero_grad) as "
                         "one CUDA graph and replay it")
    ap.add_argument("--json", required=True)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="then profile this many steps: <json stem>-profile.csv / -profile_kernels.csv beside it")
    args = ap.parse_args()
    row = time_plain(args.preset, args.compile, args.steps, args.warmup, profile_steps=args.profile_steps,
                     profile_to=Path(args.json).with_name(Path(args.json).stem + "-profile"), fp8=args.fp8,
                     cuda_graph=args.cuda_graph)
    log.info(json.dumps(row))
    Path(args.json).write_text(json.dumps(row))


if __name__ == "__main__":
    main()
