"""blunb.studies.clip_audit on hand-made metrics, and the Adam replay against cases with known answers."""

import numpy as np
import pandas as pd
import pytest

from blunb.config import preset
from blunb.model import BLU
from blunb.optim.muon import muon_param_groups
from blunb.studies.clip_audit import (
    SEED_BODY_RATIOS,
    adam_replay_distortion,
    body_group,
    body_rest_ratio,
    coverage,
    muon_unclipped_fraction,
    per_group_coef,
    rest_sq_share_by_phase,
    seed_window_labels,
    stable_phase_drift,
    window_ratio_log_error,
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
    assert drift == pytest.approx({"coef_start": 1 / 4, "coef_end": 1 / 8, "body_start": 4.0, "body_end": 8.0})
    cov = coverage(metrics())
    assert cov["unclipped_frac"] == pytest.approx(0.94)
    assert cov["rest_sq_share_max"] == pytest.approx(1 / 5) and cov["rest_sq_share_min"] == pytest.approx(1 / 122)


def test_rest_share_by_phase_reads_the_phase_it_names():
    share = rest_sq_share_by_phase(metrics(), CONFIG)  # rest^2 / (body^2 + 1) with body 2 + step
    at = lambda body: 1 / (body ** 2 + 1)
    assert share["stable"] == pytest.approx(at(6.0))                        # steps 2..6: body 4..8
    assert share["after_warmup"] == pytest.approx((at(7.0) + at(8.0)) / 2)  # steps 2..9: body 4..11
    assert share["run"] == pytest.approx((at(6.0) + at(7.0)) / 2)           # steps 0..9: body 2..11


def test_window_ratio_log_error_is_the_worst_window_off_the_reference():
    steps = np.arange(20)
    body = np.full(20, 100.0)  # outside the windows: never read
    for (_, a, b), ratio in zip(seed_window_labels(20), SEED_BODY_RATIOS):  # steps 0-1, 8-9, 14-15, 18-19
        body[a:b] = ratio
    m = pd.DataFrame({"step": steps, "norm_muon": body, "norm_adamw_fp32": np.ones(20)})
    config = {"warmup_steps": 2, "stable_steps": 10, "max_steps": 20}
    assert window_ratio_log_error(m, config) == pytest.approx(0.0, abs=1e-12)
    m.loc[m["step"].isin([14, 15]), "norm_muon"] /= 4.0            # the third window 4x low
    assert window_ratio_log_error(m, config) == pytest.approx(np.log(4.0))


@pytest.mark.parametrize("tying", [True, False])
def test_muon_unclipped_fraction_is_the_partition_of_a_real_model(tying):
    cfg = preset("tiny").model
    cfg.weight_tying = tying
    muon, rest = (sum(p.numel() for p in g["params"]) for g in muon_param_groups(BLU(cfg)))
    assert muon_unclipped_fraction(cfg) == pytest.approx(muon / (muon + rest), rel=1e-12)
    assert 0.9 < muon_unclipped_fraction(preset("seed-4b").model) < 0.95  # the reference's shape: ~94% said


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
