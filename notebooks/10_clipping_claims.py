"""The clipping study's claims, declared before its GPU runs (notebooks/10_clipping.ipynb evaluates them).

Every claim comes from the reference trainer's text (/work/shared/seeds/000_*.txt, bluscript.cpp):
its global-clipping comment in main() ("CORRECTION (measured, 2 x 2000-step runs — see
docs/ZERO1_CLIPPING_AUDIT.md)" and the "WHICH norm the coefficient is derived from" paragraph
below it). Its audit ran Muon (the body's matrices in ShardedMuon, which skips the clip), so the
magnitudes are Muon's; under AdamW only the direction is claimed. A criterion changed after the
runs is a visible diff of this file.

Tolerances, stated once:
- magnitudes measured at the reference's scale (3.9B, 2M-token steps) are tested within a factor
  of FACTOR = 2 either way (norm ratios, the coefficient's drift, the Adam replay's distortion);
- the A/B equivalence margin AB_MARGIN_NATS = 0.02 nats of final val loss: the reference's own
  run-to-run noise floor (0.019 nats, rounded up), about 1% of the 124m's final loss at this
  horizon (2.0-2.2 nats). The per-step across-seed spread is not a margin: at 32k-token batches it
  is batch noise (0.23 nats here, 12x the reference's);
- min_seeds: the A/B TOSTs need the seeds GPU_SCALE gives the A/B arms (6); a band read across
  seeds needs 3 (t(0.975, 1) = 12.7 makes two seeds' interval meaningless); an exact number needs 1.
"""

import math

from blunb.claims import Claim
from blunb.stats import pairs_for_tost

FACTOR = 2.0
AB_MARGIN_NATS = 0.02
AB_SEEDS = 6
BAND_SEEDS = 3
# The spread of the A/B pairs' final-val-loss differences in the committed 124m runs of 2026-12-01 (results/
# clipping/summary.csv at commit 87bd736: 240 steps, 3 pairs, two of them reading the same data), and the pairs
# a TOST at AB_MARGIN_NATS needs for 80% power at alpha 0.05 if the GPU_SCALE runs spread as much (adamw 36,
# muon 3): the first AB_SEEDS pairs re-estimate it (the A/B table's pairs_for_power): more seeds where it says so.
PILOT_PAIRED_SD = {"adamw": 0.040, "muon": 0.0063}
PAIRS_FOR_POWER = {opt: pairs_for_tost(sd, AB_MARGIN_NATS) for opt, sd in PILOT_PAIRED_SD.items()}

# The reference's numbers (bluscript.cpp, main(): the global-clipping comment).
SEED_WINDOW_RATIOS = (4.4, 2.4, 16.2, 17.2)   # G0 (body) / G1 (fp32) over steps 0-199, 800-999, 1400-1599, 1800-1999
SEED_COEF = (0.52, 0.18)                      # the strict coefficient, start -> end of the stable phase
SEED_BODY = (2.0, 4.5)                        # the body's norm over the same span
SEED_REST_SHARE = (0.07, 0.11)                # the AdamW group's share of ||g||^2
SEED_UNCLIPPED = 0.94                         # of the model, under Muon
SEED_REPLAY_RMS = 0.05                        # Adam-replayed distortion of the coefficient series

_AUDIT = "bluscript.cpp main(), global-clipping comment: CORRECTION (docs/ZERO1_CLIPPING_AUDIT.md, 2 x 2000 steps)"
_WHICH = "bluscript.cpp main(), global-clipping comment: 'WHICH norm the coefficient is derived from'"
_coef_ratio = SEED_COEF[1] / SEED_COEF[0]
_body_ratio = SEED_BODY[1] / SEED_BODY[0]
_share_pad = (SEED_REST_SHARE[1] - SEED_REST_SHARE[0]) / 2

CLAIMS = [
    Claim("clip.body_gt_rest.adamw",
          source="the body's gradient norm is always the larger one (G0/G1 > 1 in every window)",
          figure=_AUDIT + " (measured under Muon; the direction is stated for the partition in general)",
          statistic="per seed of adamw-per_group: the smallest of the four windows' mean body/rest norm "
                    "ratio (the reference's windows scaled to the run); t interval over seeds",
          test="band", band=(1.0, math.inf), min_seeds=BAND_SEEDS),
    Claim("clip.body_gt_rest.muon",
          source="the body's gradient norm is always the larger one (G0/G1 > 1 in every window)",
          figure=_AUDIT,
          statistic="per seed of muon-per_group: the smallest of the four windows' mean body/rest norm ratio; "
                    "t interval over seeds",
          test="band", band=(1.0, math.inf), min_seeds=BAND_SEEDS),
    Claim("clip.body_rest_ratio_magnitude.muon",
          source="G0/G1 = 4.4, 2.4, 16.2, 17.2 over steps 0-199, 800-999, 1400-1599, 1800-1999",
          figure=_AUDIT,
          statistic="per seed of muon-per_group: the largest |ln(ours / reference)| over the four windows "
                    f"(clip_audit.window_ratio_log_error); t interval over seeds; within a factor {FACTOR:g}",
          test="band", band=(0.0, math.log(FACTOR)), min_seeds=BAND_SEEDS),
    Claim("clip.strict_body_growth.muon",
          source="the body's norm grew from 2.0 to 4.5 across the stable phase",
          figure=_WHICH,
          statistic="per seed of muon-global_strict: mean body norm over the last / first 10% of the stable "
                    f"phase; geometric mean with its log-scale t interval over seeds (ratio_ci); "
                    f"reference {_body_ratio:.3g}x within a factor {FACTOR:g}",
          test="ratio_ci", band=(_body_ratio / FACTOR, _body_ratio * FACTOR), min_seeds=BAND_SEEDS),
    Claim("clip.strict_coef_drift.muon",
          source="the strict coefficient tracked the body: it drifted 0.52 -> 0.18 across the stable phase",
          figure=_WHICH,
          statistic="per seed of muon-global_strict: mean global clip coefficient over the last / first 10% of "
                    f"the stable phase; ratio_ci over seeds; reference {_coef_ratio:.3g}x within a factor "
                    f"{FACTOR:g} (a correlation with the body's norm is -1 by construction: no test)",
          test="ratio_ci", band=(_coef_ratio / FACTOR, _coef_ratio * FACTOR), min_seeds=BAND_SEEDS),
    Claim("clip.rest_sq_share.muon",
          source="the AdamW group is only 7-11% of the total ||g||^2, so the coefficient tracked the body",
          figure=_WHICH,
          statistic="per seed of muon-per_group: the median over the stable phase of ||g_adamw||^2 / ||g||^2 "
                    "(the phase the drift is read in); t interval over seeds; the reference's 7-11% widened by "
                    "half its width on each side",
          test="band", band=(SEED_REST_SHARE[0] - _share_pad, SEED_REST_SHARE[1] + _share_pad),
          min_seeds=BAND_SEEDS),
    Claim("clip.muon_unclipped",
          source="per-group vs global is a distinction without a difference on 94% of the model (Muon's body "
                 "is never clipped)",
          figure=_AUDIT,
          statistic="the fraction of parameters in Muon's group at the reference's shape (preset seed-4b), from "
                    "blunb's partition (clip_audit.muon_unclipped_fraction); ~94% read as +-3 points",
          test="exact", band=(SEED_UNCLIPPED - 0.03, SEED_UNCLIPPED + 0.03)),
    Claim("clip.muon_covered_is_per_group",
          source="the default global coefficient is derived from the norm of the COVERED subset (under Muon "
                 "the AdamW group alone), so the clip is a real clip of the thing it scales",
          figure=_WHICH,
          statistic="muon-global, every step: the largest |applied global coefficient - the AdamW group's own "
                    "per-group coefficient|; fp32 rounding allowed",
          test="exact", band=(0.0, 1e-6)),
    Claim("clip.adam_replay.adamw",
          source="Adam is invariant to a constant gradient factor: the real coefficient series distorts the "
                 "update by ~5% RMS, not the 2.6x a step-size reading predicts",
          figure=_AUDIT,
          statistic="per seed of adamw-global: its coefficient series against the group's own per-group one "
                    "replayed through Adam (clip_audit.adam_replay_distortion); t interval over seeds; "
                    f"~5% within a factor {FACTOR:g}",
          test="band", band=(SEED_REPLAY_RMS / FACTOR, SEED_REPLAY_RMS * FACTOR), min_seeds=BAND_SEEDS),
    Claim("clip.adam_replay.muon",
          source="Adam is invariant to a constant gradient factor: the real coefficient series distorts the "
                 "update by ~5% RMS, not the 2.6x a step-size reading predicts",
          figure=_AUDIT,
          statistic="per seed of muon-global_strict (the full-norm rule the 2.6x was said of): the AdamW group's "
                    "coefficient series against its own per-group one, replayed through Adam; t interval over "
                    f"seeds; ~5% within a factor {FACTOR:g}",
          test="band", band=(SEED_REPLAY_RMS / FACTOR, SEED_REPLAY_RMS * FACTOR), min_seeds=BAND_SEEDS),
    Claim("clip.ab_equivalent.adamw",
          source="per-group vs global: 0.005 mean loss difference, inside the 0.019 run-to-run noise floor",
          figure=_AUDIT,
          statistic="paired TOST of final val loss, adamw-per_group - adamw-global, seed k against seed k "
                    f"(the same data_seed); margin {AB_MARGIN_NATS:g} nats",
          test="tost", margin=AB_MARGIN_NATS, min_seeds=AB_SEEDS),
    Claim("clip.ab_equivalent.muon",
          source="per-group vs global: 0.005 mean loss difference, inside the 0.019 run-to-run noise floor",
          figure=_AUDIT,
          statistic="paired TOST of final val loss, muon-per_group - muon-global_strict (the rule the audit "
                    f"replaced), seed k against seed k; margin {AB_MARGIN_NATS:g} nats",
          test="tost", margin=AB_MARGIN_NATS, min_seeds=AB_SEEDS),
    Claim("clip.no_head_of_line_blocking",
          source="phase 1 does every norm all-reduce before any group issues its staged parameter transfers, "
                 "removing the head-of-line blocking step_order works around",
          figure="bluscript.cpp main(), global-clipping comment: 'This also removes the head-of-line blocking'",
          statistic="none",
          test="n/a",
          na_reason="a communication-timing claim: the study's runs are one GPU each (no all-reduce, no staged "
                    "transfers); the overlap study (notebooks/12_overlap.ipynb) times communication"),
]

# What issue 31 runs on the H200: the reference's schedule shape, so the four windows are its own.
GPU_SCALE = {
    "preset": "124m",
    "device": "one NVIDIA H200, several runs at a time (no time claim here)",
    "max_steps": 2000, "warmup_steps": 200, "stable_steps": 1400, "decay_steps": 400,
    "tokens_per_step": 32768,
    "corpus": "site-packages code, bpe:16384 (blunb-data prepare --source site-packages --tokenizer bpe:16384)",
    "seeds": {"adamw-per_group": AB_SEEDS, "adamw-global": AB_SEEDS, "muon-per_group": AB_SEEDS,
              "muon-global_strict": AB_SEEDS, "adamw-none": 1, "muon-none": 1, "muon-global": 1},
    "pairing": "seed k of every arm uses data_seed k (the A/B pairs share their data)",
    "power": {f"{opt} A/B pairs for 80% power at the pilot's spread": n for opt, n in PAIRS_FOR_POWER.items()},
    # The notebook's `-p` parameters that realize this scale (results/clipping-gpu/README.md has the command).
    "parameters": {
        "preset": "124m", "steps": 2000, "seeds": list(range(AB_SEEDS)), "optimizers": ["muon", "adamw"],
        "runs_per_gpu": 2, "study": "clipping-gpu",
        "common": ["model.linear_dtype=bf16", "data=<site-packages bpe:16384 corpus>", "model.vocab_size=16384",
                   "global_batch=32768", "val_freq=250", "val_tokens=1048576", "warmup_steps=200",
                   "stable_steps=1400"],
    },
}
