"""The Muon vs AdamW study's claims (notebooks/13_muon_vs_adamw.ipynb), declared before its GPU runs.

Each claim says what blunb computes and the test that decides it (blunb.claims.evaluate); the
notebook computes one blunb.claims.Evidence per claim id. A criterion changed after the runs is a
visible diff of this file. The reference is the seed trainer's text (/work/shared/seeds/
000_*.txt, bluscript.cpp: cited by struct / function and the comment the words are in).

Ratios (tokens to the target, step times) are tested on the log scale (blunb.stats.ratio_ci); a
band claim passes only when the whole CI lies inside its band, so a wide CI is inconclusive, never
a pass. Each interval is computed at its claim's `confidence` (95% two-sided; 90% for a one-sided
band, whose finite edge is then the 95% one-sided bound). min_seeds follows GPU_SCALE: a claim on
the tuned arms needs their 6 seed pairs, one on the controlled arms their 3.

Issue 30's Newton-Schulz options (target 5: "fewer Newton-Schulz iterations with better coefficients (Polar
Express) or a preconditioned start (AOL), as options measured in the Muon study; the default changes only if
the study shows no loss at the declared margin") are arms of this study, not claims of the reference:
NS_OPTIONS below.
"""

from blunb.claims import Claim
from blunb.stats import pairs_for_tost

# The reference's run-to-run noise floor of final losses (bluscript.cpp, the BLU_GLOBAL_CLIP comment:
# "inside the 0.019 run-to-run noise floor"): the margin for "no worse" / "worse" on final val loss.
NOISE_MARGIN_NATS = 0.019

# Issue 30's option: the tuned Muon arm (its swept lr, every other setting its own) with Polar Express's
# per-iteration coefficients (muon_ns_schedule=polar_express: Amsel et al., arXiv 2505.16932, Algorithm 1)
# and one Newton-Schulz iteration fewer than the tuned arm's (NS_BASELINE: the config's defaults, the
# reference's ModelConfig muon_ns_steps = 5 with torch.optim.Muon's one fixed quintic). It runs at the tuned
# arms' seeds, seed k sharing data_seed k with the tuned Muon arm's seed k. What the arm risks: in exact
# arithmetic, from singular values s / ||G||_F in [1e-3, 1], polar_express leaves [0.42, 1.56] after 4 steps
# ([0.84, 1.12] after 5), the fixed quintic [0.47, 1.20] after 5 (from [1e-2, 1]: [0.44, 1.56] and [0.68,
# 1.13]): 4 steps are NOT a tighter band than the fixed 5, only a cheaper one; whether the looser
# orthogonalization costs loss is what muon.ns_polar_express4_equivalent measures. muon.ns_no_rejects and
# muon.ns_ratio_near_1 read every Muon run, this arm's included (its looser band shows in nsratio: 1.12-1.18
# at the notebook's CPU defaults, against 0.94-0.98 for the fixed quintic's runs; the band is 0.5-2).
#
# The second option (declared 2026-12-05, before any GPU run of this study): the tuned Muon arm with the fixed
# quintic at 4 steps from AOL's preconditioned start (muon_ns_precondition=aol: Prach & Lampert 2022's
# almost-orthogonal rescaling, the start of Turbo-Muon, Boissin et al., arXiv 2512.04632, whose point is to
# drop one iteration). Measured in bf16 on the CPU (tests/test_ns_schedules.py, inputs whose rows differ in
# scale): fixed + aol at 4 steps leaves [0.679, 1.139], fixed at 5 [0.677, 1.204], fixed at 4 alone a smallest
# singular value of 0.303: unlike polar_express at 4, the saved iteration keeps the 5-step band there. Whether
# it costs loss is what muon.ns_aol4_equivalent measures, at the same margin, seeds and pairing.
NS_BASELINE = {"muon_ns_schedule": "fixed", "muon_ns_steps": 5}
NS_OPTIONS = {"polar_express4": {"muon_ns_schedule": "polar_express", "muon_ns_steps": 4},
              "aol4": {"muon_ns_schedule": "fixed", "muon_ns_steps": 4, "muon_ns_precondition": "aol"}}
NS_OPTION_SEEDS = 6
# No pilot spread exists for this pair. Assumed: the spread of paired final-val-loss differences between two
# Muon arms at this study's scale (124m, 2000 steps 200/1400/400, 32,768 tokens per step, the BPE-16384
# site-packages corpus, same seed and data per pair), measured in results/clipping-gpu (muon-global_strict -
# muon-per_group, seeds 0-4 at commit 1bd4fe2: sd 0.00066 nats). Those arms differ only in the aux AdamW
# group's clip coefficient, less than two NS schedules may; so the pessimistic case is also stated: no
# pairing benefit at all, the differences spreading as two unpaired Muon seeds do (sqrt(2) x 0.0028 nats, the
# same runs' seed-to-seed sd of muon-per_group's final loss). Both need fewer pairs than NS_OPTION_SEEDS. The
# same assumption serves both options.
NS_PAIRED_SD = {"paired (clipping-gpu Muon A/B)": 0.0007, "unpaired (sqrt(2) x Muon seed sd)": 0.0039}
NS_PAIRS_FOR_POWER = {what: pairs_for_tost(sd, NOISE_MARGIN_NATS) for what, sd in NS_PAIRED_SD.items()}

# The scale issue 31 runs (one H200; the notebook's `-p` parameters that realize it are under
# "parameters"). The lr sweep is one seed per lr at the full schedule (its best run is seed 0 of the
# tuned arm); the tuned arms run 6 seeds, seed k of every arm sharing data_seed k; AdamW's tuned arm
# also runs on a schedule twice as long, so that tokens-to-target is read inside AdamW's own budget
# (a target Muon reaches late in its run may lie beyond AdamW's 1x budget); the step-cost runs (AdamW, Muon,
# Muon with each NS option) use the preset's own 524,288-token batch, one run at a time on the GPU, timing
# opt_step_ms, in COST_ROUNDS rounds (each arm once a round, the order reversed every other round). Runs: the
# sweep 10 (5 lrs each, seed 0), the tuned arms' other seeds 5 + 6 (Muon's with the pilot), AdamW's 2x schedule 6,
# the controlled and original arms 3 + 3, the two NS option arms 6 + 6: 45 grid runs, and 4 x 4 step-cost runs
# (61 in all).
#
# Rounds, not one run per arm (changed 2026-12-08, before any GPU run of this study): two consecutive one-at-a-time
# 150-step runs on one H100 differed by 36% in median step time where their settings explain none of it
# (results/precision-gpu's timing pass: fp32_layout 38.5 ms, bf16_embed 28.3 ms; alone on another lease both
# settings ran at ~29 ms). One run per arm puts that between-run spread into the ratio and no interval over
# one run's steps shows it; an interval over rounds does. 4 rounds of 12 steps cost about what 4 runs of 20 did
# not: ~16 runs x ~45 s.
COST_ROUNDS = 4
GPU_SCALE = {
    "preset": "124m",
    "max_steps": 2000, "warmup_steps": 200, "stable_steps": 1400, "decay_steps": 400,
    "tokens_per_step": 32768,
    "corpus": "site-packages, bpe:16384 (blunb-data prepare --source site-packages --tokenizer bpe:16384)",
    "seeds_per_tuned_arm": 6,
    "pilot_seed": 100,
    "sweep_seeds_per_lr": 1,
    "controlled_arm_seeds": 3,
    "adamw_schedule_factor": 2,
    # 2 x 2000 steps x 32,768 tokens = 131M, 1.3 passes over the ~101M-token corpus: tokens-to-target is read
    # within the first pass only (a crossing on repeated data would flatter AdamW), later as not reached.
    "to_target_within": "one epoch of the corpus (env.json's corpus train_tokens); a crossing after it is not "
                        "reached, and that seed's ratio a lower bound (budget / Muon's tokens)",
    "ns_options": {tag: {"arm": f"muon {tag}: the tuned Muon arm's settings and lr with NS_OPTIONS[{tag!r}]",
                         "overrides": overrides, "baseline": NS_BASELINE, "seeds": NS_OPTION_SEEDS,
                         "pairing": "seed k shares seed and data_seed k with the tuned Muon arm's seed k"}
                   for tag, overrides in NS_OPTIONS.items()},
    "step_cost": {"global_batch": 524288, "steps": 12, "rounds": COST_ROUNDS, "one_at_a_time": True,
                  "order": "every arm once a round; the arms' order reversed every other round",
                  "timed": "opt_step_ms and dt_ms",
                  "arms": ["adamw", "muon", *(f"muon with {tag}" for tag in NS_OPTIONS)]},
    "runs": {"grid": 45, "step_cost": 4 * COST_ROUNDS, "total": 45 + 4 * COST_ROUNDS},
    "power": {f"muon.ns_<option>_equivalent pairs for 80% power, {what} sd {NS_PAIRED_SD[what]}": n
              for what, n in NS_PAIRS_FOR_POWER.items()},
    "parameters": {
        "preset": "124m", "steps": 2000, "seeds": [0, 1, 2, 3, 4, 5], "pilot_seed": 100,
        "adamw_lrs": [7.5e-5, 1.5e-4, 3e-4, 6e-4, 1.2e-3], "muon_lrs": [4e-4, 8e-4, 1.6e-3, 3.2e-3, 6.4e-3],
        "controlled_seeds": 3, "adamw_schedule_factor": 2, "ns_option": True, "real_batch_steps": 12,
        "cost_rounds": COST_ROUNDS,
        # 2, not 4 (changed 2026-12-07, before any GPU run of this study): a borrowed machine's lease gives
        # ~900-1,600 s of training, and a run still in flight when it ends is lost (its checkpoints are too large
        # to bring home). Four at a time on an H100 took ~530 s a 2000-step run (clipping-gpu), so the AdamW arm's
        # 4000-step runs would need ~1,060 s; two at a time halves both (the total throughput, expected about the
        # same, is not measured).
        "runs_per_gpu": 2, "study": "muon_vs_adamw-gpu",
        "common": ["global_batch=32768", "warmup_steps=200", "stable_steps=1400", "val_freq=50",
                   "val_tokens=163840", "data=<site-packages bpe:16384 corpus>", "model.vocab_size=16384"],
    },
}

# Tokens-to-target's target val loss, fixed here before the runs: the val loss of ONE pilot run
# (Muon at the tuned lr, seed `pilot_seed`, which is none of the compared seeds) where it has done
# `at_fraction` of its steps (linear between validations). It reads neither arm's final losses, and
# lies late in Muon's own run (in the decay: the curve is steep there, so each seed's crossing is
# sharp), where the published claim is made: "AdamW needs 1.35x the tokens to reach Muon's loss".
TARGET_RULE = {"pilot_arm": "muon tuned", "pilot_seed": GPU_SCALE["pilot_seed"], "at_fraction": 0.9}

CLAIMS = [
    Claim(id="muon.both_tuned",
          source="each optimizer tuned by its own lr sweep (train_muon.py ships the post-sweep muon_lr)",
          figure="bluscript.cpp ModelConfig, Muon block: '8e-4 here is ... the post-sweep value train_muon.py ships'",
          statistic="optimizers whose best sweep lr (final val loss, sweep seed) is at an edge of its sweep",
          test="exact", band=(0, 0)),
    Claim(id="muon.fewer_tokens",
          source="Muon needs fewer tokens to a target loss",
          figure="published Muon results as the notebook's introduction quotes them (not in the seed)",
          statistic="AdamW / Muon tokens to TARGET_RULE's val loss, paired by seed, geometric-mean ratio; "
                    "AdamW read from its 2x-schedule arm when it runs",
          test="ratio_ci", band=(1.0, float("inf")), min_seeds=6),
    Claim(id="muon.tokens_ratio_published",
          source="about 1.35x fewer tokens to a target loss",
          figure="published Muon results as the notebook's introduction quotes them (not in the seed)",
          statistic="the same ratio as muon.fewer_tokens; band: 1.35 +- 0.15 ('about 1.35x')",
          test="ratio_ci", band=(1.2, 1.5), min_seeds=6),
    Claim(id="muon.faster_time_grid",
          source="Muon reaches the target in less training time",
          figure="the notebook's own claim (the seed gives no time-to-target)",
          statistic="AdamW / Muon training seconds to the target, from the grid runs",
          test="n/a",
          na_reason="the grid's runs share the device (GPU_SCALE: runs_per_gpu at a time; on the CPU, parallel "
                    "processes on shared cores), so their step times hold the others' contention; issue 31: "
                    "a time claim uses step times from one-at-a-time runs only"),
    Claim(id="muon.faster_real_batch",
          source="Muon is faster to the target at the real batch",
          figure="the notebook's own claim (the seed gives no time-to-target)",
          statistic="(was) the 32k-batch token ratio x AdamW / Muon step time at the 524k batch",
          test="n/a",
          na_reason="a token ratio measured at 32,768 tokens per step times step times at 524,288 is not a "
                    "measurement: the token ratio at the real batch needs runs to the target at that batch, "
                    "which this study does not make; muon.step_time_ratio is what was measured"),
    Claim(id="muon.step_time_ratio",
          source="Muon's step costs little more than AdamW's at the real batch",
          figure="blunb's own: the seed times no Muon vs AdamW step (bluscript.cpp's 'cheaper than sharded "
                 "AdamW' is about state memory)",
          statistic="Muon / AdamW whole-step time (each run's mean dt_ms over steps >= 2) at the preset's "
                    "524,288-token batch, one-at-a-time runs in rounds (each arm once a round, the order reversed "
                    "every other round); geometric-mean ratio of round r's Muon over round r's AdamW, paired t CI "
                    "of the log ratios; n: rounds",
          test="ratio_ci", band=(float("-inf"), 1.10), min_seeds=COST_ROUNDS),
    Claim(id="muon.opt_step_extra",
          source="Muon's optimizer step is a small part of the step at the real batch",
          figure="blunb's own (the seed times the Newton-Schulz path only as a whole step)",
          statistic="per round, (mean Muon - mean AdamW opt_step_ms) / AdamW's mean dt_ms, the runs and steps of "
                    "muon.step_time_ratio; its mean over rounds with the t CI; runs without opt_step_ms have no "
                    "estimate (inconclusive)",
          test="diff_ci", band=(float("-inf"), 0.10), min_seeds=COST_ROUNDS),
    Claim(id="muon.larger_lr",
          source="Muon typically tolerates 2-4x more LR once it is working",
          figure="bluscript.cpp ModelConfig, Muon block, the muon_lr comment",
          statistic="best muon_lr / best AdamW max_lr of the sweeps; interval: the ratio's bounds from each "
                    "best lr's neighbouring sweep points (a unimodal curve has its optimum between them; "
                    "unbounded at a sweep edge)",
          test="band", band=(2.0, 4.0)),
    Claim(id="muon.one_lr_scale",
          source="adjust_lr=match_rms_adamw puts muon_lr on the same scale as max_lr",
          figure="bluscript.cpp ModelConfig, Muon block: 'puts muon_lr on the SAME SCALE as max_lr' (and "
                 "main(): under 'original' the scales differ by 4.5x-21.2x)",
          statistic="the ratio of muon.larger_lr; band: within the factor 4 the seed itself calls the same "
                    "scale (its shipped muon_lr, 'Muon tolerates 2-4x'), short of original mode's 4.5x",
          test="band", band=(0.25, 4.0)),
    Claim(id="muon.controlled_same_lr",
          source="at muon_lr = max_lr the arms differ only in update direction: Muon no worse than AdamW",
          figure="bluscript.cpp ModelConfig, Muon block: 'Setting them equal ... the controlled experiment'",
          statistic="final val loss, Muon at muon_lr = AdamW's tuned max_lr minus tuned AdamW, paired by seed; "
                    "non-inferiority: the CI below NOISE_MARGIN_NATS",
          test="diff_ci", band=(float("-inf"), NOISE_MARGIN_NATS), min_seeds=3),
    Claim(id="muon.original_other_scale",
          source="original adjust_lr is on another lr scale: it needs its own sweep",
          figure="bluscript.cpp main(), BLU_MUON_ADJUST_LR: 'NO single lr that converts ... means re-sweeping'",
          statistic="final val loss, original mode minus match_rms_adamw, both at the tuned muon_lr, paired by "
                    "seed: worse by more than NOISE_MARGIN_NATS",
          test="diff_ci", band=(NOISE_MARGIN_NATS, float("inf")), min_seeds=3),
    *(claim for tag, (what, figure) in {
        "polar_express4": ("polar_express, 4 steps", "the per-iteration coefficients are Amsel et al. 2025 (arXiv "
                                                     "2505.16932, Algorithm 1)"),
        "aol4": ("the fixed quintic at 4 steps from AOL's start", "the start is Prach & Lampert 2022's AOL rescaling "
                                                                  "as Turbo-Muon uses it (arXiv 2512.04632)"),
    }.items() for claim in (
        Claim(id=f"muon.ns_{tag}_equivalent",
              source="issue 30, target 5: fewer Newton-Schulz iterations (better coefficients or a preconditioned "
                     "start), an option this study measures; the default changes only if it shows no loss at the "
                     "declared margin",
              figure="not the reference's: bluscript.cpp ModelConfig, Muon block, runs muon_ns_steps = 5 of one fixed "
                     f"quintic; {figure}",
              statistic=f"final val loss, the {tag} arm ({what}) minus the tuned Muon arm (fixed, 5 steps), same lr, "
                        "paired by seed; TOST at the reference's noise floor (90% t interval inside "
                        "+-NOISE_MARGIN_NATS)",
              test="tost", margin=NOISE_MARGIN_NATS, min_seeds=NS_OPTION_SEEDS),
        Claim(id=f"muon.ns_{tag}_step_cost",
              source="fewer Newton-Schulz iterations cost less (issue 30's reason for the option)",
              figure="not the reference's (issue 30); the Newton-Schulz alone is timed by bench/muon.py --schedules "
                     "--preconditions",
              statistic=f"Muon's optimizer step with NS_OPTIONS[{tag!r}] / with NS_BASELINE (opt_step_ms, steps >= 2) "
                        "at the preset's 524,288-token batch, each run's mean over steps >= 2, in the rounds of "
                        "muon.step_time_ratio (the muon runs there and this option's); geometric-mean ratio, paired "
                        "t CI of the log ratios over rounds; runs without opt_step_ms have no estimate",
              test="ratio_ci", na_reason="no source states a figure: 4/5 would be the Newton-Schulz's own ratio (the "
                                         "same GEMMs per iteration), but opt_step_ms also holds the momentum, the "
                                         "update, the aux AdamW and the graph replay's host cost, so the whole step's "
                                         "ratio should lie between 4/5 and 1; reported, not tested"))),
    Claim(id="muon.ns_no_rejects",
          source="Newton-Schulz healthy: no rejected updates",
          figure="bluscript.cpp training loop, the nsrej / nsratio step-line comment",
          statistic="rejected Newton-Schulz updates, summed over every Muon run",
          test="exact", band=(0, 0)),
    Claim(id="muon.ns_ratio_near_1",
          source="nsratio healthy ~1.0",
          figure="bluscript.cpp training loop, the nsrej / nsratio step-line comment",
          statistic="the nsratio farthest from 1 (in log) over every step of every Muon run",
          test="exact", band=(0.5, 2.0)),
]
