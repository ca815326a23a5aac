"""The precision study's claims, declared before its GPU runs (notebooks/11_precision.ipynb evaluates them).

The source is the reference trainer's text (/work/shared/seeds/000_*.txt, bluscript.cpp): the
"activation / parameter precision" block of ModelConfig (the three stage flags, the two things
deliberately not flags: fp32 optimizer masters and the fp32 QK-norm + RoPE island, and the
bf16-logits loss-scalar note), the forward's output-projection comment (the [B,T,vocab] logits'
cost) and main()'s BLU_ALL_BF16 wiring and its "[precision] bf16 logits ON" warning. A criterion
changed after the runs is a visible diff of this file.

The fp8 arms are not the reference's: it has no fp8. Their claims ask issue 30's question, what the body's
GEMMs in float8 (model.fp8, torchao float8 training, tensorwise or rowwise scales) cost in loss against
fp32_layout, the layout they change nothing else of; declared here before any fp8 run.

Tolerances, stated once:
- equivalence margin MARGIN_NATS = 0.02 nats of final val loss: the reference's run-to-run noise
  floor (0.019 nats, the clipping audit's), rounded up; under 1% of the 124m's final loss here;
- min_seeds: the paired loss claims need the 4 seeds GPU_SCALE gives every arm, the fp8 TOSTs the 6 it gives
  fp32_layout and the fp8 arms (no fp8 pilot exists: more pairs against an unknown spread); exact numbers
  (a byte count, a grid spacing, an element count) need 1;
- memory: the reference's "~3 GiB" read as the formula B*T*V*4 bytes within +-25%.
Arms pair by seed: seed k of every arm uses data_seed k and init seed k (fp32_layout's seeds 4 and 5 pair with
the fp8 arms' only).
"""

import math

from blunb.claims import Claim
from blunb.stats import pairs_for_tost, tost_power


def _largest_sd(pairs: int, margin: float, power: float = 0.8) -> float:
    """The largest paired sd at which `pairs` pairs give a TOST at `margin` `power` (true difference 0): bisection."""
    lo, hi = 1e-6, margin
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tost_power(pairs, mid, margin) >= power else (lo, mid)
    return lo


MARGIN_NATS = 0.02
LOSS_SEEDS = 4
FP8_SEEDS = 6                     # fp32_layout and the fp8 arms
FP8_ARMS = ("fp8_tensorwise", "fp8_rowwise")   # fp32_layout's settings + model.fp8=tensorwise|rowwise
MEMORY_TOLERANCE = 0.25
SEED_LR, SEED_WD = 6e-4, 0.1      # ModelConfig: max_lr, weight_decay
SEED_LOSS_ULP = 0.0625            # bf16's spacing in [8, 16): the reference's loss near 10.8
# bf16_logits - fp32_layout in the committed 124m runs (results/precision/summary.csv at commit 87bd736: 2 pairs,
# a spread that rough): the pairs a TOST at MARGIN_NATS needs for 80% power at alpha 0.05 if it holds (2).
PILOT_PAIRED_SD = 0.0026
PAIRS_FOR_POWER = pairs_for_tost(PILOT_PAIRED_SD, MARGIN_NATS)
# No fp8 pilot exists. At bf16_logits' pilot spread the fp8 TOSTs would need PAIRS_FOR_POWER pairs too; what
# FP8_SEEDS pairs buy instead is room for a larger, unknown spread: the largest paired sd (true difference 0)
# at which they still reach 80% power at alpha 0.05, and the power at the pilot's spread if fp8 costs half the margin.
FP8_SD_FOR_POWER = round(_largest_sd(FP8_SEEDS, MARGIN_NATS), 4)
FP8_POWER_HALF_MARGIN = tost_power(FP8_SEEDS, PILOT_PAIRED_SD, MARGIN_NATS, true_diff=MARGIN_NATS / 2)

_BLOCK = "bluscript.cpp ModelConfig, 'activation / parameter precision' block"
_MAIN = "bluscript.cpp main(): the BLU_ALL_BF16 wiring"
_LOGITS = "bluscript.cpp forward, output-projection comment; main()'s '[precision] bf16 logits ON' warning"
_FP8 = ("none: issue 30's question, what FP8 body GEMMs cost in loss (the reference has no fp8); blunb/fp8.py, "
        "torchao float8 training")
_descriptive = ("no claim of the reference; reported because the data shows it (a paired interval of final val "
                "loss against fp32_layout)")

CLAIMS = [
    Claim("prec.bf16_unit_roundoff",
          source="bf16's relative grid is 2^-8 = 3.9e-3",
          figure=_BLOCK + ": 'Optimizer masters and moments'",
          statistic="torch.finfo(bfloat16).eps / 2 (the unit roundoff)",
          test="exact", band=(2 ** -8, 2 ** -8)),
    Claim("prec.one_stage_per_flag",
          source="each flag moves exactly ONE stage to bf16; BLU_ALL_BF16 turns on all three",
          figure=_BLOCK + "; " + _MAIN,
          statistic="arms whose recorded precision layout (env.json) moves other stages than their flag names "
                    "(bf16_resid: residual stream, bf16_logits: logits, bf16_embed: embedding, all_bf16: the three, "
                    "fp32_layout and no_fp32_master: none)",
          test="exact", band=(0, 0)),
    Claim("prec.qk_island_fp32",
          source="QK-norm + RoPE is not a flag: q_gamma / k_gamma stay fp32 under every flag",
          figure=_BLOCK + ": 'QK-norm + RoPE'",
          statistic="arms whose recorded qk_norm_rope precision is not fp32",
          test="exact", band=(0, 0)),
    Claim("prec.qk_island_silent_garbage",
          source="handing the fused QK-norm + RoPE kernel a bf16 tensor would read garbage SILENTLY (data() "
                 "is a bare reinterpret_cast)",
          figure=_BLOCK + ": 'QK-norm + RoPE'",
          statistic="none",
          test="n/a",
          na_reason="a property of the reference's kernel: blunb's QK-norm + RoPE takes q/k of any dtype and "
                    "computes in fp32 (the torch path casts, the Triton kernel is compiled per dtype), so there is "
                    "no untyped read to provoke"),
    Claim("prec.all_bf16_fp32_group",
          source="under all three flags the q/k gammas alone still need an fp32 AdamW group",
          figure=_BLOCK + ": 'QK-norm + RoPE'; " + _MAIN,
          statistic="all_bf16's fp32 AdamW group's elements minus 2 x head_dim x n_layers (its q/k gammas), "
                    "and the run's group count minus 2 (one bf16, one fp32 group)",
          test="exact", band=(0, 0)),
    Claim("prec.no_master_decay_rounds_away",
          source="a bf16 master would round the entire weight-decay term (1 - lr*wd = 1 - 6e-5) away at any "
                 "weight magnitude",
          figure=_BLOCK + ": 'Optimizer masters and moments'",
          statistic="the fraction of bf16 weights one decay step at lr*wd = 6e-5 changes without a master: the "
                    "largest over a sample of the model's initial Linear weights and magnitudes 1e-8..1e4 "
                    "(precision.decay_moved_fraction), and 1 - ||w|| / ||w_0|| after the reference's whole "
                    "2000-step schedule without a master (precision.decay_only)",
          test="exact", band=(0.0, 0.0)),
    Claim("prec.master_keeps_decay",
          source="masters and moments stay fp32 under every flag, which is what keeps the update path safe",
          figure=_BLOCK + ": 'Optimizer masters and moments'",
          statistic="|shrink with an fp32 master - exact shrink prod(1 - lr*wd)| after the reference's 2000-step "
                    "WSD schedule (precision.decay_only; exact: 0.902)",
          test="exact", band=(0.0, 1e-3)),
    Claim("prec.no_master_loss_worse",
          source="without fp32 masters the decay is lost (the reference never shipped it: no loss measured)",
          figure=_BLOCK + ": 'Optimizer masters and moments'",
          statistic="paired difference of final val loss (end of the decay phase), no_fp32_master - fp32_layout, "
                    "seed k against seed k; one-sided: worse means the interval lies above 0",
          test="diff_ci", band=(0.0, math.inf), min_seeds=LOSS_SEEDS),
    Claim("prec.loss_scalar_grid",
          source="with bf16 logits the reported loss is bf16: near 10.8 it quantizes to 0.0625 steps",
          figure=_BLOCK + ": 'Logits' ('What is NOT fixed')",
          statistic="the smallest spacing of the distinct loss values the reference's reduction gives over a "
                    "sweep of bf16 logits (V = 50304) whose loss walks down from ln V (precision.loss_dtype_sweep)",
          test="exact", band=(SEED_LOSS_ULP, SEED_LOSS_ULP)),
    Claim("prec.blunb_loss_fp32",
          source="the reference's loss scalar follows the logits' dtype (a documented bug); blunb's is fp32",
          figure=_BLOCK + ": 'Logits' ('Decoupling the loss dtype ... needs a LossT template parameter')",
          statistic="the fraction of loss values on the bf16 grid: the larger of blunb's fp32 readings over the "
                    "sweep and the bf16_logits runs' logged train losses (an fp32 value lies on it by chance "
                    "about 2^-16 of the time)",
          test="exact", band=(0.0, 0.01)),
    Claim("prec.bf16_logits_equivalent",
          source="bf16 logits cost the metric, not the run: gradients are unaffected",
          figure=_BLOCK + ": 'Logits' ('GRADIENTS ARE UNAFFECTED')",
          statistic=f"paired TOST of final val loss, bf16_logits - fp32_layout, seed k against seed k; margin "
                    f"{MARGIN_NATS:g} nats",
          test="tost", margin=MARGIN_NATS, min_seeds=LOSS_SEEDS),
    Claim("prec.bf16_logits_memory",
          source="fp32 logits cost a [B,T,vocab] fp32 tensor (3.30 GB at B*T=16384, vocab=50304); bf16 logits "
                 "free ~3 GiB (activation + gradient)",
          figure=_LOGITS,
          statistic="per seed: (peak CUDA memory of fp32_layout - of bf16_logits) / the formula's saving B*T*V*4 "
                    "bytes (precision.logits_memory); t interval over seeds (a deterministic allocation: no spread)",
          test="band", band=(1 - MEMORY_TOLERANCE, 1 + MEMORY_TOLERANCE)),
    Claim("prec.bf16_resid_loss",
          source="(no claim) bf16 residual stream and norms",
          figure="none: what this study's data shows",
          statistic="paired difference of final val loss, bf16_resid - fp32_layout, seed k against seed k",
          test="diff_ci", na_reason=_descriptive),
    Claim("prec.bf16_embed_loss",
          source="(no claim) bf16 embedding",
          figure="none: what this study's data shows",
          statistic="paired difference of final val loss, bf16_embed - fp32_layout, seed k against seed k",
          test="diff_ci", na_reason=_descriptive),
    Claim("prec.all_bf16_loss",
          source="(no claim) all three stages in bf16",
          figure="none: what this study's data shows",
          statistic="paired difference of final val loss, all_bf16 - fp32_layout, seed k against seed k",
          test="diff_ci", na_reason=_descriptive),
    Claim("prec.fp8_body_gemms_only",
          source="(no claim of the reference) model.fp8 moves the body's Linear GEMMs to float8 and nothing else",
          figure=_FP8,
          statistic="fp8 arms whose recorded precision layout (env.json) differs from fp32_layout's anywhere but "
                    "body_gemms, or whose body_gemms does not name the arm's recipe ('fp8 tensorwise' / 'fp8 rowwise')",
          test="exact", band=(0, 0)),
    *(Claim(f"prec.{arm}_equivalent",
            source=f"(no claim of the reference) fp8 body Linears, torchao float8 training, "
                   f"{arm.removeprefix('fp8_')} scales: inside the noise of final val loss",
            figure=_FP8,
            statistic=f"paired TOST of final val loss, {arm} - fp32_layout, seed k against seed k; margin "
                      f"{MARGIN_NATS:g} nats",
            test="tost", margin=MARGIN_NATS, min_seeds=FP8_SEEDS) for arm in FP8_ARMS),
]

# What issue 31 runs on one lent GPU (an H200 or H100). Every arm shares the schedule (the pairs need it); 2000 steps is
# long enough that decay alone would shrink the weights measurably: prod(1 - lr*wd) over the
# reference's WSD schedule is 0.902 (9.8% smaller; 1.3% within the last 400 steps), which the fp32
# master follows and the no-master arm's bf16 weights never see.
# Only step time needs a GPU to itself: seed 0 of every arm trains alone (the notebook's first Study call),
# the other runs two per GPU, where a pair trains at nearly twice one run's throughput. No claim reads time;
# peak memory is each process's own allocation. GPU time is an estimate from the 6 arms x 4 seeds plan's: ~44 GPU
# minutes for its 24 runs alone, ~28 with 6 alone + 9 pairs, i.e. ~1.8 min a run alone and ~1.9 a pair; with the
# fp8 arms 5 x 4 + 3 x 6 = 38 runs, 8 alone + 15 pairs: ~43 GPU minutes (~70 all alone), if an fp8 run takes as
# long as a bf16 one (not measured yet: bench/speed.py --fp8 has not run on a GPU).
SEEDS = {"fp32_layout": FP8_SEEDS, "bf16_resid": LOSS_SEEDS, "bf16_logits": LOSS_SEEDS, "bf16_embed": LOSS_SEEDS,
         "all_bf16": LOSS_SEEDS, "no_fp32_master": LOSS_SEEDS, **{arm: FP8_SEEDS for arm in FP8_ARMS}}
_ALONE_MIN, _PAIR_MIN = 44 / 24, (28 - 6 * 44 / 24) / 9
_PAIRS = (sum(SEEDS.values()) - len(SEEDS)) // 2
GPU_SCALE = {
    "preset": "124m",
    # Changed 2026-12-07, after every arm's seed 0 had trained alone on two H100 leases that timed the same 124m
    # step differently (results/precision-gpu/README.md): the time figures come from the timing pass, each arm
    # alone for timing_steps steps one right after another, on one machine. No claim reads time.
    # Worded 2026-12-07: the lent machines have been H100s (80GB HBM3) for H200 requests; no claim reads which.
    "device": "one NVIDIA H200 or H100, as lent: seed 0 of each arm alone, the other seeds two per GPU (peak memory "
              "is each run's own max_memory_allocated, the same shared or alone); the time figures from the timing "
              "pass "
              "(timing_steps, each arm alone, one right after another on one card: env.json's device_uuid)",
    "runs_per_gpu": 2,
    "max_steps": 2000, "warmup_steps": 200, "stable_steps": 1400, "decay_steps": 400,
    "tokens_per_step": 16384,   # one B16 x T1024 micro-batch: the logits formula's B*T = 16384
    "corpus": "site-packages code, bpe:16384 (blunb-data prepare --source site-packages --tokenizer bpe:16384)",
    "arms": list(SEEDS),
    "seeds": SEEDS,
    "runs": sum(SEEDS.values()),
    "gpu_minutes": f"~{len(SEEDS) * _ALONE_MIN + _PAIRS * _PAIR_MIN:.0f}, an estimate ({len(SEEDS)} runs alone + "
                   f"{_PAIRS} pairs at the bf16 plan's ~{_ALONE_MIN:.1f} min a run alone, ~{_PAIR_MIN:.1f} a pair; fp8 "
                   "runs assumed as long as bf16 ones, not measured)",
    "fp8": "model.fp8 needs compute capability >= 8.9 and torchao 0.18.0 (the fp8 extra) on the GPU machine; "
           "compile on (the CUDA default), under which torchao's casts fuse",
    "pairing": "seed k of every arm uses data_seed k; fp32_layout's seeds 4 and 5 pair with the fp8 arms only",
    "power": f"bf16_logits TOST: {PAIRS_FOR_POWER} pairs for 80% power at the pilot's spread ({LOSS_SEEDS} run)",
    "power_fp8": f"fp8 TOSTs: no fp8 pilot exists; at bf16_logits' pilot spread ({PILOT_PAIRED_SD:g}) "
                 f"{pairs_for_tost(PILOT_PAIRED_SD, MARGIN_NATS)} pairs give 80% power; {FP8_SEEDS} run, which reach "
                 f"80% up to a paired sd of {FP8_SD_FOR_POWER:g} nats (true difference 0), and "
                 f"{FP8_POWER_HALF_MARGIN:.3f} at the pilot's spread if fp8 costs half the margin",
    "no_master_decay": "2000 steps: exact decay alone shrinks ||w|| to 0.902 (-9.8%), the last 400 steps -1.3%",
    # The notebook's `-p` parameters that realize this scale (results/precision-gpu; validation as the clipping
    # study's at this horizon: every 250 steps over 1,048,576 tokens, so the final val loss the TOSTs read
    # carries little sampling noise of its own).
    "parameters": {
        "preset": "124m", "steps": 2000, "seeds": list(range(LOSS_SEEDS)), "fp8_seeds": list(range(FP8_SEEDS)),
        "fp8_arms": "auto", "runs_per_gpu": 2, "timing_steps": 150, "study": "precision-gpu",
        "common": ["global_batch=16384", "warmup_steps=200", "stable_steps=1400", "val_freq=250",
                   "val_tokens=1048576", "data=<site-packages bpe:16384 corpus>", "model.vocab_size=16384"],
    },
}
