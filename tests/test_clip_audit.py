"""blunb.clip_audit on hand-made metrics, and the Adam replay against cases with known answers."""

import numpy as np
import pandas as pd
import pytest

from blunb.clip_audit import (
    adam_replay_distortion,
    body_group,
    body_rest_ratio,
    coverage,
    per_group_coef,
    seed_window_labels,
    stable_phase_drift,
    wsd_phase,
)

CONFIG = {"warmup_steps": 2, "stable_steps": 5, "max_steps": 10}


def metrics(body="muon"):
    steps = np.arange(10)
    return pd.DataFrame({"step": steps, f"norm_{body}": 2.0 + steps, "norm_adamw_fp32": np.ones(10),
                         "grad_norm": np.sqrt((2.0 + steps) ** 2 + 1), "clip_covered_frac": np.full(10, 0.06),
                         "global_clip_coef": 1.0 / (2.0 + steps)})


def test_wsd_phase_and_the_seed_windows_scale_with_the_run():
    assert list(wsd_phase(range(10), CONFIG)) == ["warmup"] * 2 + ["stable"] * 5 + ["decay"] * 3
    assert seed_window_labels(2000) == [("0-199", 0, 200), ("800-999", 800, 1000), ("1400-1599", 1400, 1600),
                                        ("1800-1999", 1800, 2000)]


def test_body_rest_ratio_bins_by_phase_and_window():
    table = body_rest_ratio(metrics(), CONFIG).set_index("bin")
    assert table.loc["warmup", "ratio"] == pytest.approx(2.5)          # steps 0, 1: 2, 3
    assert table.loc["stable", "ratio"] == pytest.approx(6.0)          # steps 2..6: 4..8
    assert table.loc["decay", "ratio"] == pytest.approx(10.0)          # steps 7..9: 9..11
    assert table.loc["0-0", "ratio"] == pytest.approx(2.0) and table.loc["9-9", "ratio"] == pytest.approx(11.0)
    assert list(table["kind"]) == ["phase"] * 3 + ["window"] * 4


def test_body_group_prefers_muon_and_names_the_fix_for_fp32_adamw():
    assert body_group(metrics("muon")) == "muon" and body_group(metrics("adamw_bf16")) == "adamw_bf16"
    with pytest.raises(ValueError, match="linear_dtype=bf16"):
        body_group(metrics().drop(columns="norm_muon"))


def test_stable_phase_drift_and_coverage():
    drift = stable_phase_drift(metrics(), {**CONFIG, "stable_steps": 5}, edge=0.2)  # one step at each end
    assert drift == pytest.approx({"coef_start": 1 / 4, "coef_end": 1 / 8, "body_start": 4.0, "body_end": 8.0,
                                   "log_corr": -1.0})  # coef = 1 / body norm exactly
    cov = coverage(metrics())
    assert cov["unclipped_frac"] == pytest.approx(0.94)
    assert cov["rest_sq_share_max"] == pytest.approx(1 / 5) and cov["rest_sq_share_min"] == pytest.approx(1 / 122)


def test_per_group_coef_is_torchs_rule():
    assert list(per_group_coef(pd.Series([0.5, 2.0]), 1.0)) == pytest.approx([1.0, 1 / (2.0 + 1e-6)])


def test_adam_replay_is_blind_to_a_constant_factor_and_sees_variation():
    rng = np.random.default_rng(1)
    ref = rng.uniform(0.2, 1.0, 200)
    same = adam_replay_distortion(0.3 * ref, ref, eps=0.0)
    assert same["update_rms_distortion"] < 1e-9           # Adam's invariance, exactly (eps = 0)
    assert same["naive_step_ratio"] == pytest.approx(0.3)  # what an SGD reading would predict
    wobble = ref * np.where(np.arange(200) % 2, 1.0, 0.5)
    varied = adam_replay_distortion(wobble, ref)
    assert 0.05 < varied["update_rms_distortion"] < varied["naive_rms_distortion"]
    with pytest.raises(ValueError, match="one length"):
        adam_replay_distortion(ref[:3], ref)
    with pytest.raises(ValueError, match="finite and positive"):
        adam_replay_distortion(np.zeros(200), ref)
