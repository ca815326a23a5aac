"""The gradient-clipping audit: what each clip rule does, measured from run folders' metrics.

The reference trainer clips each optimizer group on its own norm (per-group, the default) or with one
coefficient for all groups (global_clip). The seed's audit of global clipping made five claims; this
module holds the measurements that test them (notebooks/10_clipping_claims.py declares the tests, the
clipping study notebooks/10_clipping.ipynb evaluates them), computed from the metrics the trainer
already writes (norm_<group>, clip_<group>), so the audit needs no instrument inside the trainer.

Details (the five claims, the group names): docs/architecture.md, section "blunb/studies/clip_audit.py".
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from blunb.config import ModelConfig

# The reference audit's step windows, as fractions of a 2000-step run (steps 0-199, 800-999,
# 1400-1599, 1800-1999), so runs of any length bin the same way.
SEED_WINDOWS = ((0.0, 0.1), (0.4, 0.5), (0.7, 0.8), (0.9, 1.0))
SEED_BODY_RATIOS = (4.4, 2.4, 16.2, 17.2)
REST_GROUP = "adamw_fp32"


def body_group(metrics: pd.DataFrame) -> str:
    """The group holding the transformer body's matrices in this run's metrics."""
    for group in ("muon", "adamw_bf16"):
        if f"norm_{group}" in metrics.columns:
            return group
    raise ValueError("no body group in these metrics (norm_muon / norm_adamw_bf16): with AdamW, the "
                     "Linears must be bf16 (model.linear_dtype=bf16) for the body to be a group of its own")


def wsd_phase(steps, config: dict) -> np.ndarray:
    """'warmup' | 'stable' | 'decay' for each step, from a run's config.json."""
    steps = np.asarray(steps)
    warmup, stable = config["warmup_steps"], config["stable_steps"]
    return np.where(steps < warmup, "warmup", np.where(steps < warmup + stable, "stable", "decay"))


def seed_window_labels(max_steps: int) -> list[tuple[str, int, int]]:
    """(label, first, last+1) of the reference audit's four windows scaled to max_steps."""
    out = []
    for lo, hi in SEED_WINDOWS:
        a, b = round(lo * max_steps), round(hi * max_steps)
        out.append((f"{a}-{b - 1}", a, b))
    return out


def body_rest_ratio(metrics: pd.DataFrame, config: dict) -> pd.DataFrame:
    """The body / rest gradient-norm ratio, mean over each WSD phase and each of the reference
    audit's windows: columns bin, kind (phase | window), steps, ratio."""
    body = body_group(metrics)
    ratio = metrics[f"norm_{body}"] / metrics[f"norm_{REST_GROUP}"]
    rows = []
    phases = wsd_phase(metrics["step"], config)
    for phase in ("warmup", "stable", "decay"):
        sel = ratio[phases == phase]
        rows.append({"bin": phase, "kind": "phase", "steps": len(sel), "ratio": float(sel.mean())})
    for label, a, b in seed_window_labels(config["max_steps"]):
        sel = ratio[(metrics["step"] >= a) & (metrics["step"] < b)]
        rows.append({"bin": label, "kind": "window", "steps": len(sel), "ratio": float(sel.mean())})
    return pd.DataFrame(rows)


def stable_phase_drift(metrics: pd.DataFrame, config: dict, edge: float = 0.1) -> dict:
    """How the global clip coefficient and the body's norm move across the stable phase: means
    over its first and last `edge` fraction (coef_start, coef_end, body_start, body_end). No
    correlation of the two: while the clip is active the strict coefficient is grad_clip / ||g||
    by construction, so a correlation with the body's norm could not fail; the drift's size can."""
    warmup, stable = config["warmup_steps"], config["stable_steps"]
    width = max(1, round(edge * stable))
    head = metrics[(metrics["step"] >= warmup) & (metrics["step"] < warmup + width)]
    tail = metrics[(metrics["step"] >= warmup + stable - width) & (metrics["step"] < warmup + stable)]
    body = f"norm_{body_group(metrics)}"
    return {"coef_start": float(head["global_clip_coef"].mean()), "coef_end": float(tail["global_clip_coef"].mean()),
            "body_start": float(head[body].mean()), "body_end": float(tail[body].mean())}


def window_ratio_log_error(metrics: pd.DataFrame, config: dict) -> float:
    """How far this run's body / rest ratio in the reference's four windows lies from the
    reference's (SEED_BODY_RATIOS): the largest |ln(ours / reference)| over the windows, so
    ln 2 means the worst window is off by a factor of 2 either way."""
    ours = body_rest_ratio(metrics, config).query("kind == 'window'")["ratio"].to_numpy()
    return float(np.max(np.abs(np.log(ours / np.asarray(SEED_BODY_RATIOS)))))


def coverage(metrics: pd.DataFrame) -> dict:
    """What a clip can reach: the fraction of parameters it scales (clip_covered_frac) and the
    AdamW (rest) group's share of the total ||g||^2, its range over the WSD phases' means."""
    share = metrics[f"norm_{REST_GROUP}"] ** 2 / metrics["grad_norm"] ** 2
    return {"covered_frac": float(metrics["clip_covered_frac"].mean()),
            "unclipped_frac": float(1 - metrics["clip_covered_frac"].mean()),
            "rest_sq_share_min": float(share.min()), "rest_sq_share_median": float(share.median()),
            "rest_sq_share_max": float(share.max())}


def rest_sq_share_by_phase(metrics: pd.DataFrame, config: dict) -> dict:
    """The median over steps of the rest (AdamW) group's share of ||g||^2, over the whole run, after
    warmup and over the stable phase (where the strict coefficient's drift is read)."""
    share = metrics[f"norm_{REST_GROUP}"] ** 2 / metrics["grad_norm"] ** 2
    phase = wsd_phase(metrics["step"], config)
    return {"run": float(share.median()), "after_warmup": float(share[phase != "warmup"].median()),
            "stable": float(share[phase == "stable"].median())}


def muon_unclipped_fraction(model_cfg: ModelConfig) -> float:
    """The fraction of parameters in Muon's group (so no clip scales them) for a model shape, from
    its dimensions: the seed's split (blunb.optim.muon.muon_param_groups) gives AdamW the embedding,
    an untied lm_head and every 1-D scale, and Muon the rest. No model is built, so the reference's
    3.9B shape costs nothing (tests hold this to muon_param_groups on a real model)."""
    c = model_cfg
    total = c.num_params()
    embedding_and_head = c.vocab_size * c.d_model * (1 if c.weight_tying else 2)
    scales = c.n_layers * (2 * c.d_model + 2 * c.head_dim) + c.d_model  # RMSNorm scales, q/k gammas, final norm
    return (total - embedding_and_head - scales) / total


def per_group_coef(norms: pd.Series, grad_clip: float) -> pd.Series:
    """The coefficient a group would get clipping on its own norm (torch's clip_grad_norm_ rule)."""
    return (grad_clip / (norms + 1e-6)).clip(upper=1.0)


def adam_replay_distortion(coef: np.ndarray, reference: np.ndarray, grad_scale: np.ndarray | None = None,
                           betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, n: int = 4096,
                           seed: int = 0) -> dict:
    """Replay two clip-coefficient series through Adam on the same synthetic gradients and measure
    how far apart the updates land.

    The gradients are i.i.d. standard normal per element (n elements per step), scaled by
    grad_scale per step (e.g. the group's logged norm; ones when None), then by each series'
    coefficient. Returns:
      update_rms_distortion: sqrt(mean_t ||u_t(coef) - u_t(ref)||^2 / mean_t ||u_t(ref)||^2),
        the relative difference of the Adam updates (zero for a constant coef / reference ratio,
        up to eps: Adam's invariance to a constant gradient factor);
      naive_step_ratio: mean_t coef_t / ref_t, the step-size change one would predict if the update
        were proportional to the gradient (SGD);
      naive_rms_distortion: sqrt(mean_t (coef_t / ref_t - 1)^2), the same as an RMS distortion.
    A model, labelled as one: real gradients are correlated across steps and elements.
    """
    coef, reference = np.asarray(coef, np.float64), np.asarray(reference, np.float64)
    if coef.shape != reference.shape or coef.ndim != 1 or len(coef) == 0:
        raise ValueError(f"coef and reference must be 1-D series of one length, got {coef.shape} and {reference.shape}")
    if not (np.isfinite(coef).all() and np.isfinite(reference).all() and (coef > 0).all() and (reference > 0).all()):
        raise ValueError("coefficient series must be finite and positive")
    scale = np.ones_like(coef) if grad_scale is None else np.asarray(grad_scale, np.float64)
    if scale.shape != coef.shape:
        raise ValueError(f"grad_scale must match the coefficient series' length {len(coef)}, got {scale.shape}")
    b1, b2 = betas
    rng = np.random.default_rng(seed)
    m = {"a": np.zeros(n), "b": np.zeros(n)}
    v = {"a": np.zeros(n), "b": np.zeros(n)}
    diff_sq = ref_sq = 0.0
    for t in range(len(coef)):
        g = rng.standard_normal(n) * scale[t] / np.sqrt(n)
        updates = {}
        for key, c in (("a", coef[t]), ("b", reference[t])):
            m[key] = b1 * m[key] + (1 - b1) * c * g
            v[key] = b2 * v[key] + (1 - b2) * (c * g) ** 2
            m_hat, v_hat = m[key] / (1 - b1 ** (t + 1)), v[key] / (1 - b2 ** (t + 1))
            updates[key] = m_hat / (np.sqrt(v_hat) + eps)
        diff_sq += float(np.sum((updates["a"] - updates["b"]) ** 2))
        ref_sq += float(np.sum(updates["b"] ** 2))
    ratio = coef / reference
    return {"update_rms_distortion": float(np.sqrt(diff_sq / ref_sq)), "naive_step_ratio": float(ratio.mean()),
            "naive_rms_distortion": float(np.sqrt(np.mean((ratio - 1) ** 2)))}
