"""blunb.stats against known values: Student t tables, scipy.stats called directly, textbook examples."""

import math
import statistics

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from blunb.stats import (
    Interval,
    bootstrap_ci,
    curve_band,
    diff_ci,
    first_crossing,
    matched_step_difference,
    mean_ci,
    paired_diff_ci,
    paired_tost,
    pairs_for_tost,
    ratio_ci,
    tost_power,
)

# Two-sided Student t critical values (standard tables): (confidence, df) -> t.
T_TABLE = {(0.95, 1): 12.706204736, (0.95, 2): 4.302652730, (0.95, 3): 3.182446305, (0.95, 4): 2.776445105,
           (0.95, 9): 2.262157163, (0.95, 30): 2.042272456, (0.99, 5): 4.032142984, (0.90, 7): 1.894578605}

# Student's own data (Biometrika 1908, Cushny & Peebles): extra hours of sleep under two drugs, the
# same 10 patients. The textbook paired t test: mean difference 1.58, t = 4.06 on 9 df, 95% CI
# [0.700, 2.460] (R's `t.test(extra ~ group, data = sleep, paired = TRUE)`).
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


@pytest.mark.parametrize("confidence, df", sorted(T_TABLE))
def test_mean_ci_is_t_based(confidence, df):
    n = df + 1
    values = [10.0 + i for i in range(n)]
    mean, sd = 10.0 + df / 2, math.sqrt(n * (n + 1) / 12)  # 0..df: sample sd of consecutive integers
    ci = mean_ci(values, confidence)
    assert ci.n == n and ci.mean == pytest.approx(mean)
    assert (ci.high - ci.mean) / (sd / math.sqrt(n)) == pytest.approx(T_TABLE[(confidence, df)], rel=1e-9)
    assert ci.mean - ci.low == pytest.approx(ci.high - ci.mean)


def test_mean_ci_edge_cases():
    ci = mean_ci([2.5])
    assert ci.mean == 2.5 and ci.n == 1 and math.isnan(ci.low) and math.isnan(ci.high)  # one seed: unknown, not 0
    ci = mean_ci(pd.Series([1.0, float("nan"), 3.0]))  # a failed run's NaN is dropped and not counted
    assert ci.n == 2 and ci.mean == 2.0 and ci.high == pytest.approx(2.0 + 12.706204736)
    ci = mean_ci([float("nan")])
    assert ci.n == 0 and math.isnan(ci.mean)
    assert mean_ci([4.0, 4.0, 4.0]) == (4.0, 4.0, 4.0, 3)
    with pytest.raises(ValueError, match="no values"):
        mean_ci([])
    with pytest.raises(ValueError, match="confidence"):
        mean_ci([1.0, 2.0], confidence=95)


def test_diff_ci_is_welchs_interval():
    # equal sizes and variances: Welch's df is 2n - 2 and the interval is the pooled t interval
    a, b = [1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0]
    ci = diff_ci(a, b)
    half = 2.4469118511 * math.sqrt(2 * statistics.variance(a) / 4)   # t(0.975, df=6)
    assert ci.mean == pytest.approx(1.0) and ci.n == 4
    assert (ci.low, ci.high) == pytest.approx((1.0 - half, 1.0 + half), rel=1e-6)
    # one noisy side: the df falls toward that side's n - 1, so the interval is wider than a pooled-df one
    noisy_a, quiet_b = [0.0, 10.0, -10.0, 5.0], [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    se = math.sqrt(statistics.variance(noisy_a) / 4 + statistics.variance(quiet_b) / 6)
    noisy = diff_ci(noisy_a, quiet_b)
    assert noisy.high - noisy.mean > 2.2621571628 * se   # t(0.975, df=9 = 4 + 6 - 1)
    # ... and it is scipy's Welch interval exactly (fractional df)
    expected = sps.ttest_ind(noisy_a, quiet_b, equal_var=False).confidence_interval(0.95)
    assert (noisy.low, noisy.high) == pytest.approx((expected.low, expected.high), rel=1e-12)
    one = diff_ci([1.0], [2.0, 3.0])
    assert one.mean == pytest.approx(-1.5) and math.isnan(one.low)
    assert diff_ci([2.0, 2.0], [1.0, 1.0]) == (1.0, 1.0, 1.0, 2)


def test_paired_diff_ci_on_students_sleep_data():
    ci = paired_diff_ci(SLEEP_2, SLEEP_1)
    assert isinstance(ci, Interval) and ci.n == 10 and ci.confidence == 0.95
    assert ci.estimate == pytest.approx(1.58)
    assert (ci.lo, ci.hi) == pytest.approx((0.700, 2.460), abs=5e-4)  # the textbook's three decimals
    expected = sps.ttest_rel(SLEEP_2, SLEEP_1).confidence_interval(0.90)
    ci90 = paired_diff_ci(SLEEP_2, SLEEP_1, confidence=0.90)
    assert (ci90.lo, ci90.hi) == pytest.approx((expected.low, expected.high), rel=1e-12)
    # pairing is what makes it sharp: the unpaired Welch interval of the same numbers includes 0
    welch = diff_ci(SLEEP_2, SLEEP_1)
    assert welch.low < 0 < ci.lo


def test_paired_diff_ci_drops_a_pair_with_a_nan_and_rejects_unequal_lengths():
    ci = paired_diff_ci([1.0, 2.0, float("nan"), 4.0], [0.0, 1.5, 1.0, 3.0])
    assert ci.n == 3 and ci.estimate == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    one = paired_diff_ci([1.0], [0.5])
    assert one.n == 1 and one.estimate == 0.5 and math.isnan(one.lo) and math.isnan(one.hi)
    with pytest.raises(ValueError, match="one value per pair"):
        paired_diff_ci([1.0, 2.0], [1.0])


def test_paired_tost_matches_two_one_sided_scipy_tests():
    rng = np.random.default_rng(3)
    b = rng.normal(2.0, 0.1, 8)
    a = b + rng.normal(0.003, 0.01, 8)
    d = a - b
    t = paired_tost(a, b, margin=0.02, alpha=0.05)
    p_low = sps.ttest_1samp(d, -0.02, alternative="greater").pvalue
    p_high = sps.ttest_1samp(d, 0.02, alternative="less").pvalue
    assert t.p_value == pytest.approx(max(p_low, p_high), rel=1e-12)
    ci90 = sps.ttest_1samp(d, 0.0).confidence_interval(0.90)
    assert (t.lo, t.hi) == pytest.approx((ci90.low, ci90.high), rel=1e-12)
    assert t.estimate == pytest.approx(d.mean()) and t.n == 8 and t.margin == 0.02 and t.alpha == 0.05
    # p < alpha exactly when the 90% interval lies inside the margins
    assert t.equivalent == (t.p_value < 0.05) == (-0.02 < t.lo and t.hi < 0.02)
    assert t.equivalent


def test_paired_tost_outcomes_on_hand_made_differences():
    base = np.zeros(6)
    tight = np.array([0.001, -0.002, 0.0015, 0.0, -0.001, 0.0005])
    assert paired_tost(tight, base, margin=0.02).equivalent                      # well inside: equivalent
    far = tight + 0.1
    t = paired_tost(far, base, margin=0.02)
    assert not t.equivalent and t.lo > 0.02 and t.p_value > 0.99               # clearly different
    wide = np.array([0.05, -0.04, 0.03, -0.06, 0.02, 0.0])
    t = paired_tost(wide, base, margin=0.02)
    assert not t.equivalent and t.lo < -0.02 < 0.02 < t.hi                       # too noisy to say
    flat = paired_tost([1.01, 1.01], [1.0, 1.0], margin=0.02)                    # no spread: exact
    assert flat.equivalent and flat.p_value == 0.0 and flat.lo == flat.hi == pytest.approx(0.01)
    assert paired_tost([1.03, 1.03], [1.0, 1.0], margin=0.02).p_value == 1.0
    one = paired_tost([1.0], [1.0], margin=0.02)
    assert one.n == 1 and math.isnan(one.p_value) and not one.equivalent
    with pytest.raises(ValueError, match="margin"):
        paired_tost(tight, base, margin=0.0)
    with pytest.raises(ValueError, match="alpha"):
        paired_tost(tight, base, margin=0.02, alpha=0.5)


def test_ratio_ci_is_the_log_scale_interval():
    a, b = [2.0, 4.2, 3.9, 8.4], [1.0, 2.0, 2.0, 4.0]
    r = ratio_ci(a, b)
    logs = np.log(a) - np.log(b)
    ci = sps.ttest_1samp(logs, 0.0).confidence_interval(0.95)
    assert r.estimate == pytest.approx(math.exp(logs.mean()))   # the geometric mean of the ratios
    assert (r.lo, r.hi) == pytest.approx((math.exp(ci.low), math.exp(ci.high)), rel=1e-12)
    assert r.lo < r.estimate < r.hi and r.n == 4
    assert ratio_ci([3.0, 3.0], [1.5, 1.5]) == (2.0, 2.0, 2.0, 2, 0.95)          # no spread: exact
    u = ratio_ci(a, [1.0, 2.0, 2.0], paired=False)
    w = sps.ttest_ind(np.log(a), np.log([1.0, 2.0, 2.0]), equal_var=False).confidence_interval(0.95)
    assert (u.lo, u.hi) == pytest.approx((math.exp(w.low), math.exp(w.high)), rel=1e-12)
    # the interval of a ratio is symmetric on the log scale, not on the ratio's own
    assert math.log(r.hi / r.estimate) == pytest.approx(math.log(r.estimate / r.lo))
    with pytest.raises(ValueError, match="positive"):
        ratio_ci([1.0, -1.0], [1.0, 1.0])


def test_bootstrap_ci_is_scipys_seeded_and_reproducible():
    values = [2.1, 2.3, 1.9, 2.6, 2.2, 2.0, 2.4, 5.0]
    b = bootstrap_ci(values)
    expected = sps.bootstrap((np.array(values),), np.median, n_resamples=9999, confidence_level=0.95,
                             method="percentile", random_state=np.random.default_rng(0)).confidence_interval
    assert b.estimate == pytest.approx(np.median(values)) and b.n == 8
    assert (b.lo, b.hi) == (pytest.approx(expected.low), pytest.approx(expected.high))
    assert bootstrap_ci(values) == b                                       # seeded: the same call, the same interval
    bca = bootstrap_ci(values, method="BCa", seed=1)
    assert bca.lo <= bca.estimate <= bca.hi
    # a textbook check: for a large normal sample the bootstrap interval of the mean is the t interval
    big = np.random.default_rng(5).normal(10.0, 2.0, 400)
    boot, t = bootstrap_ci(big, np.mean, n_resamples=4000), mean_ci(big)
    assert boot.lo == pytest.approx(t.low, abs=0.05) and boot.hi == pytest.approx(t.high, abs=0.05)
    assert bootstrap_ci([3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0, 3, 0.95)
    assert math.isnan(bootstrap_ci([3.0]).lo)
    with pytest.raises(ValueError, match="method"):
        bootstrap_ci(values, method="basic")


def _long(arm, seed, values, metric="val_loss"):
    return [{"arm": arm, "seed": seed, "step": s, "metric": metric, "value": v} for s, v in values.items()]


def test_curve_band_is_mean_ci_per_arm_and_step():
    rows = _long("a", 0, {0: 5.0, 10: 4.0}) + _long("a", 1, {0: 5.2, 10: 4.4}) + _long("b", 0, {0: 6.0})
    band = curve_band(pd.DataFrame(rows))
    a10 = band[(band["arm"] == "a") & (band["step"] == 10)].iloc[0]
    assert (a10["mean"], a10["n"]) == (pytest.approx(4.2), 2)
    assert a10["high"] - a10["mean"] == pytest.approx(12.706204736 * statistics.stdev([4.0, 4.4]) / math.sqrt(2))
    assert math.isnan(band[band["arm"] == "b"].iloc[0]["low"])
    with pytest.raises(ValueError, match="no values of metric 'train_loss'"):
        curve_band(pd.DataFrame(rows), "train_loss")


def test_first_crossing_interpolates_and_says_never():
    m = pd.DataFrame({"tokens": [0, 10, 20, 30, 40], "val_loss": [5.0, None, 3.0, None, 1.0]})
    assert first_crossing(m, 2.0) == pytest.approx(30.0)   # between (20, 3.0) and (40, 1.0)
    assert first_crossing(m, 5.0) == 0.0 and first_crossing(m, 3.0) == 20.0
    assert math.isnan(first_crossing(m, 0.5))


def test_matched_step_difference_on_hand_made_numbers():
    rows = (_long("a", 0, {0: 5.0, 10: 4.0, 20: 3.0}) + _long("a", 1, {0: 5.2, 10: 4.4, 20: 3.1})
            + _long("b", 0, {0: 5.0, 10: 4.6, 30: 2.0}) + _long("b", 1, {0: 5.4, 10: 4.8})
            + _long("a", 0, {0: 9.0}, metric="train_loss"))
    d = matched_step_difference(pd.DataFrame(rows), "a", "b")
    p = d.per_step
    assert list(p["step"]) == [0, 10]  # 20 only in a, 30 only in b
    assert p["mean_a"].tolist() == pytest.approx([5.1, 4.2]) and p["mean_b"].tolist() == pytest.approx([5.2, 4.7])
    assert p["diff"].tolist() == pytest.approx([-0.1, -0.5])
    sd = lambda x, y: abs(x - y) / math.sqrt(2)  # sample sd of two values
    assert p["sd_a"].tolist() == pytest.approx([sd(5.0, 5.2), sd(4.0, 4.4)])
    assert p["sd_b"].tolist() == pytest.approx([sd(5.0, 5.4), sd(4.6, 4.8)])
    assert p["n_a"].tolist() == [2, 2] and p["n_b"].tolist() == [2, 2]
    pooled = lambda sa, sb: math.sqrt((sa ** 2 + sb ** 2) / 2)
    noise = [pooled(sd(5.0, 5.2), sd(5.0, 5.4)), pooled(sd(4.0, 4.4), sd(4.6, 4.8))]
    assert p["noise"].tolist() == pytest.approx(noise)
    assert d.mean_diff == pytest.approx(-0.3) and d.noise_floor == pytest.approx(sum(noise) / 2)
    assert d.exceeds_noise == (0.3 > sum(noise) / 2)
    assert matched_step_difference(pd.DataFrame(rows), "b", "a").mean_diff == pytest.approx(0.3)


def test_matched_step_difference_one_seed_has_no_noise_floor_and_bad_input_is_named():
    one = pd.DataFrame(_long("a", 0, {0: 5.0, 5: 4.0}) + _long("b", 0, {0: 5.0, 5: 3.0}))
    d = matched_step_difference(one, "a", "b")
    assert d.mean_diff == pytest.approx(0.5) and math.isnan(d.noise_floor) and not d.exceeds_noise
    with pytest.raises(ValueError, match=r"unknown arm 'c'; the table has \['a', 'b'\]"):
        matched_step_difference(one, "a", "c")
    with pytest.raises(ValueError, match="no values of metric 'train_loss'"):
        matched_step_difference(one, "a", "b", metric="train_loss")
    with pytest.raises(ValueError, match="missing"):
        matched_step_difference(one.drop(columns="seed"), "a", "b")
    with pytest.raises(ValueError, match="more than one"):
        matched_step_difference(pd.concat([one, one]), "a", "b")
    apart = pd.DataFrame(_long("a", 0, {0: 5.0}) + _long("b", 0, {1: 5.0}))
    with pytest.raises(ValueError, match="no step with 'val_loss' in common"):
        matched_step_difference(apart, "a", "b")


@pytest.mark.parametrize("n, sd, margin, true_diff", [(8, 1.0, 1.2, 0.0), (5, 0.5, 1.0, 0.2), (20, 1.0, 0.6, 0.0)])
def test_tost_power_is_a_lower_bound_of_the_simulated_rate_and_close_to_it(n, sd, margin, true_diff):
    """Against paired_tost itself on simulated experiments: the bound never exceeds the simulated rate by
    more than its sampling error, and is within 0.06 of it (P1 + P2 - 1 is tight when the power is high)."""
    rng = np.random.default_rng(0)
    trials = 4000
    hits = sum(paired_tost(rng.normal(true_diff, sd, n), np.zeros(n), margin).equivalent for _ in range(trials))
    rate = hits / trials
    bound = tost_power(n, sd, margin, true_diff=true_diff)
    assert bound <= rate + 3 * math.sqrt(rate * (1 - rate) / trials) + 1e-9, (bound, rate)
    assert rate - bound < 0.06, (bound, rate)


def test_pairs_for_tost_is_the_fewest_reaching_the_power():
    n = pairs_for_tost(0.04, 0.02)
    assert tost_power(n, 0.04, 0.02) >= 0.8 > tost_power(n - 1, 0.04, 0.02)
    assert pairs_for_tost(0.001, 0.02) == 2  # a spread far inside the margin: the fewest a t test takes
    assert pairs_for_tost(0.04, 0.02, power=0.9) > n
    with pytest.raises(ValueError, match="more than 50 pairs"):
        pairs_for_tost(1.0, 0.02, most=50)
    with pytest.raises(ValueError, match="margin must be finite and larger than"):
        tost_power(6, 0.04, 0.02, true_diff=0.03)
    with pytest.raises(ValueError, match="n must be an integer >= 2"):
        tost_power(1, 0.04, 0.02)
