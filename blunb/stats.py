"""The statistics a study's claims rest on, on scipy.stats (no hand-written quantiles).

One module, so every notebook computes its intervals and tests the same way, on library quantiles:
across seeds (t intervals, Welch, paired differences, the paired TOST and its power, log-scale ratios, a
seeded bootstrap) and over steps (curve bands, first crossings, matched-step differences). NaNs (a
failed run's final loss) are dropped throughout, and n counts what is left; a spread from fewer than two
values is unknown, never zero: the interval is NaN.

Details (each function and what it returns): docs/architecture.md, section "blunb/stats.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import stats as sps

from blunb.study import LONG_COLUMNS

_NAN = float("nan")


class MeanCI(NamedTuple):
    """The mean of n values with a two-sided t-based confidence interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int


class Interval(NamedTuple):
    """An estimate with its two-sided confidence interval [lo, hi] at `confidence`, from n values or pairs."""

    estimate: float
    lo: float
    hi: float
    n: int
    confidence: float


class Tost(NamedTuple):
    """A paired TOST of mean(a - b) against +-margin: lo/hi is the (1 - 2*alpha) t interval,
    p_value the larger of the two one-sided p values, equivalent = p_value < alpha (the same as the
    interval lying inside (-margin, +margin))."""

    estimate: float
    lo: float
    hi: float
    p_value: float
    margin: float
    alpha: float
    n: int
    equivalent: bool


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _finite(values) -> np.ndarray:
    x = np.asarray(list(values), dtype=np.float64)
    return x[~np.isnan(x)]


def _t_half_width(sd: float, n: int, confidence: float, df: float | None = None) -> float:
    return float(sps.t.ppf((1 + confidence) / 2, n - 1 if df is None else df)) * sd / math.sqrt(n)


def mean_ci(values, confidence: float = 0.95) -> MeanCI:
    """Mean and t-based CI across seeds. NaNs (failed runs) are dropped and n counts the rest;
    with one value the interval is NaN (a spread from one seed is unknown, not zero)."""
    _check_confidence(confidence)
    raw = list(values)
    if not raw:
        raise ValueError("mean_ci of no values")
    xs = _finite(raw)
    n = len(xs)
    if n == 0:
        return MeanCI(_NAN, _NAN, _NAN, 0)
    mean = float(xs.mean())
    if n == 1:
        return MeanCI(mean, _NAN, _NAN, 1)
    half = _t_half_width(float(xs.std(ddof=1)), n, confidence)
    return MeanCI(mean, mean - half, mean + half, n)


def diff_ci(a, b, confidence: float = 0.95) -> MeanCI:
    """mean(a) - mean(b) of two independent samples with Welch's t interval (unequal variances,
    the Welch-Satterthwaite df as scipy.stats.ttest_ind(equal_var=False) takes it). NaNs are
    dropped; n is the smaller sample's size; fewer than two values on a side gives a NaN interval."""
    _check_confidence(confidence)
    xs, ys = _finite(a), _finite(b)
    if not len(xs) or not len(ys):
        return MeanCI(_NAN, _NAN, _NAN, 0)
    n = min(len(xs), len(ys))
    diff = float(xs.mean() - ys.mean())
    if len(xs) < 2 or len(ys) < 2:
        return MeanCI(diff, _NAN, _NAN, n)
    va, vb = xs.var(ddof=1) / len(xs), ys.var(ddof=1) / len(ys)
    if va + vb == 0:
        return MeanCI(diff, diff, diff, n)
    df = (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(ys) - 1))
    half = float(sps.t.ppf((1 + confidence) / 2, df)) * math.sqrt(va + vb)
    return MeanCI(diff, diff - half, diff + half, n)


def _pairs(a, b) -> np.ndarray:
    """a - b pair by pair; a pair with a NaN on either side is dropped."""
    xs, ys = np.asarray(list(a), dtype=np.float64), np.asarray(list(b), dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"paired samples need one value per pair on each side, got {xs.shape} and {ys.shape}")
    d = xs - ys
    return d[~np.isnan(d)]


def _one_sample_interval(d: np.ndarray, confidence: float) -> Interval:
    n = len(d)
    if n == 0:
        return Interval(_NAN, _NAN, _NAN, 0, confidence)
    est = float(d.mean())
    if n == 1:
        return Interval(est, _NAN, _NAN, 1, confidence)
    half = _t_half_width(float(d.std(ddof=1)), n, confidence)
    return Interval(est, est - half, est + half, n, confidence)


def paired_diff_ci(a, b, confidence: float = 0.95) -> Interval:
    """The mean of a - b over pairs (a[i] with b[i]: the same seed and data in two arms) with its
    t interval on n - 1 df (scipy.stats.ttest_rel's)."""
    _check_confidence(confidence)
    return _one_sample_interval(_pairs(a, b), confidence)


def paired_tost(a, b, margin: float, alpha: float = 0.05) -> Tost:
    """Two one-sided paired t tests of mean(a - b): H0 mean <= -margin against > -margin, and H0
    mean >= +margin against < +margin (scipy.stats.ttest_1samp). Equivalent when both reject at
    alpha. With no spread the tests are exact (p = 0 inside the margins, 1 outside); with fewer
    than two pairs nothing is known (p NaN, not equivalent)."""
    if not margin > 0 or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number > 0, got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    d = _pairs(a, b)
    ci = _one_sample_interval(d, 1 - 2 * alpha)
    if ci.n < 2:
        return Tost(ci.estimate, ci.lo, ci.hi, _NAN, margin, alpha, ci.n, False)
    if d.std(ddof=1) == 0:
        p = 0.0 if -margin < ci.estimate < margin else 1.0
    else:
        p_low = sps.ttest_1samp(d, -margin, alternative="greater").pvalue
        p_high = sps.ttest_1samp(d, margin, alternative="less").pvalue
        p = float(max(p_low, p_high))
    return Tost(ci.estimate, ci.lo, ci.hi, p, margin, alpha, ci.n, bool(p < alpha))


def tost_power(n: int, sd: float, margin: float, alpha: float = 0.05, true_diff: float = 0.0) -> float:
    """The chance that paired_tost over n pairs declares equivalence when the pairs' differences are
    normal with mean true_diff and standard deviation sd: the two one-sided tests' powers from the
    noncentral t (scipy.stats.nct), combined as P1 + P2 - 1, a lower bound (exact as both approach 1),
    so a plan built on it errs towards more seeds."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an integer >= 2 (pairs), got {n!r}")
    if not sd > 0 or not math.isfinite(sd):
        raise ValueError(f"sd must be a finite number > 0, got {sd}")
    if not margin > abs(true_diff) or not math.isfinite(margin):
        raise ValueError(f"margin must be finite and larger than |true_diff| ({abs(true_diff)}), got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    df, se = n - 1, sd / math.sqrt(n)
    t_crit = sps.t.ppf(1 - alpha, df)
    rejects_low = sps.nct.sf(t_crit, df, (true_diff + margin) / se)    # H0: mean <= -margin
    rejects_high = sps.nct.sf(t_crit, df, (margin - true_diff) / se)   # H0: mean >= +margin
    return float(max(0.0, rejects_low + rejects_high - 1.0))


def pairs_for_tost(sd: float, margin: float, alpha: float = 0.05, power: float = 0.8, true_diff: float = 0.0,
                   most: int = 10_000) -> int:
    """The fewest pairs (>= 2) whose tost_power reaches `power`; ValueError beyond `most`."""
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power}")
    n = 2
    while tost_power(n, sd, margin, alpha, true_diff) < power:
        n += 1
        if n > most:
            raise ValueError(f"more than {most} pairs for power {power} at sd {sd} and margin {margin}")
    return n


def ratio_ci(a, b, confidence: float = 0.95, paired: bool = True) -> Interval:
    """a / b on the log scale: exp of the mean of log a - log b (the geometric-mean ratio) and exp
    of its t interval: paired (pair i is a[i] / b[i]) or, with paired=False, Welch's interval of
    two independent samples. Every value must be positive (NaNs are dropped as elsewhere)."""
    _check_confidence(confidence)
    xs, ys = (np.asarray(list(v), dtype=np.float64) for v in (a, b))
    if (xs <= 0).any() or (ys <= 0).any():
        raise ValueError("ratio_ci needs positive values (a ratio is read on the log scale)")
    if paired:
        ci = paired_diff_ci(np.log(xs), np.log(ys), confidence)
        return Interval(math.exp(ci.estimate), math.exp(ci.lo), math.exp(ci.hi), ci.n, confidence)
    ci = diff_ci(np.log(xs), np.log(ys), confidence)
    return Interval(math.exp(ci.mean), math.exp(ci.low), math.exp(ci.high), ci.n, confidence)


def bootstrap_ci(values, statistic=np.median, confidence: float = 0.95, n_resamples: int = 9999, seed: int = 0,
                 method: str = "percentile") -> Interval:
    """statistic(values) with scipy.stats.bootstrap's interval (method "percentile" or "BCa"),
    resampled from a seeded generator so the same call gives the same interval. The values are
    resampled as independent draws: pass one value per run, not a run's correlated steps."""
    _check_confidence(confidence)
    if method not in ("percentile", "BCa"):
        raise ValueError(f"method must be 'percentile' or 'BCa', got {method!r}")
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return Interval(_NAN, _NAN, _NAN, 0, confidence)
    est = float(statistic(xs))
    if n == 1:
        return Interval(est, _NAN, _NAN, 1, confidence)
    if (xs == xs[0]).all():  # every resample is the sample: no spread (BCa would divide by zero)
        return Interval(est, est, est, n, confidence)
    res = sps.bootstrap((xs,), statistic, n_resamples=n_resamples, confidence_level=confidence, method=method,
                        random_state=np.random.default_rng(seed))
    return Interval(est, float(res.confidence_interval.low), float(res.confidence_interval.high), n, confidence)


def curve_band(metrics_long: pd.DataFrame, metric: str = "val_loss", confidence: float = 0.95) -> pd.DataFrame:
    """Per arm and step, the mean of `metric` across seeds and its t-based CI (mean_ci): columns
    arm, step, mean, low, high, n. What a loss-curve plot with a CI band draws."""
    rows = metrics_long[(metrics_long["metric"] == metric) & metrics_long["value"].notna()]
    if rows.empty:
        raise ValueError(f"no values of metric {metric!r}; the table has {sorted(metrics_long['metric'].unique())}")
    out = [{"arm": arm, "step": step, **mean_ci(group["value"], confidence)._asdict()}
           for (arm, step), group in rows.groupby(["arm", "step"], sort=True)]
    return pd.DataFrame(out, columns=["arm", "step", "mean", "low", "high", "n"])


def first_crossing(metrics: pd.DataFrame, target: float, metric: str = "val_loss", x: str = "tokens") -> float:
    """The value of column `x` where `metric` first falls to `target` or below, interpolated
    linearly between the last point above and the first at or below (tokens to a target loss,
    say); NaN when it never does. Rows without the metric (steps between validations) are skipped."""
    rows = metrics[[x, metric]].dropna()
    hit = (rows[metric] <= target).to_numpy()
    if not hit.any():
        return float("nan")
    i = int(hit.argmax())
    if i == 0:
        return float(rows[x].iloc[0])
    (x0, y0), (x1, y1) = rows.iloc[i - 1].to_numpy(), rows.iloc[i].to_numpy()
    return float(x0 + (x1 - x0) * (y0 - target) / (y0 - y1))


@dataclass
class MatchedDifference:
    """arm_a minus arm_b on `metric`, step by step over the steps both arms have.

    per_step: step, mean_a, mean_b, diff (mean_a - mean_b), sd_a, sd_b (across seeds), n_a, n_b
    (seeds with a value), noise (sqrt((sd_a^2 + sd_b^2) / 2), the seed-to-seed spread).
    mean_diff: the mean of diff; noise_floor: the mean of noise over the steps where it is known
    (NaN with one seed per arm).
    exceeds_noise: |mean_diff| > noise_floor, i.e. the arms differ by more than seeds do: a
    description, not an equivalence test (paired_tost with a stated margin is that).
    """

    arm_a: str
    arm_b: str
    metric: str
    per_step: pd.DataFrame
    mean_diff: float
    noise_floor: float

    @property
    def exceeds_noise(self) -> bool:
        return bool(abs(self.mean_diff) > self.noise_floor)  # False when the floor is NaN: unknown


def matched_step_difference(metrics_long: pd.DataFrame, arm_a: str, arm_b: str,
                            metric: str = "val_loss") -> MatchedDifference:
    """Compare two arms of metrics_long (arm, seed, step, metric, value) at the steps both have."""
    missing = set(LONG_COLUMNS) - set(metrics_long.columns)
    if missing:
        raise ValueError(f"metrics_long needs columns {LONG_COLUMNS}; missing {sorted(missing)}")
    arms = sorted(metrics_long["arm"].unique())
    for arm in (arm_a, arm_b):
        if arm not in arms:
            raise ValueError(f"unknown arm {arm!r}; the table has {arms}")
    rows = metrics_long[(metrics_long["metric"] == metric) & metrics_long["value"].notna()]
    if rows.empty:
        raise ValueError(f"no values of metric {metric!r}; the table has {sorted(metrics_long['metric'].unique())}")
    if rows.duplicated(["arm", "seed", "step"]).any():
        raise ValueError(f"metrics_long has more than one {metric!r} value for some (arm, seed, step)")

    def per_arm(arm: str) -> pd.DataFrame:
        return rows[rows["arm"] == arm].groupby("step")["value"].agg(["mean", "std", "count"])

    both = per_arm(arm_a).merge(per_arm(arm_b), left_index=True, right_index=True, suffixes=("_a", "_b"))
    if both.empty:
        raise ValueError(f"arms {arm_a!r} and {arm_b!r} have no step with {metric!r} in common")
    per_step = pd.DataFrame({"step": both.index, "mean_a": both["mean_a"].values, "mean_b": both["mean_b"].values,
                             "diff": (both["mean_a"] - both["mean_b"]).values, "sd_a": both["std_a"].values,
                             "sd_b": both["std_b"].values, "n_a": both["count_a"].values,
                             "n_b": both["count_b"].values})
    per_step["noise"] = ((per_step["sd_a"] ** 2 + per_step["sd_b"] ** 2) / 2) ** 0.5
    return MatchedDifference(arm_a, arm_b, metric, per_step, float(per_step["diff"].mean()),
                             float(per_step["noise"].mean()))
