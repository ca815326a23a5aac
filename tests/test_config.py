import subprocess
import sys

import pytest

from blunb.config import ConfigError, TrainConfig, apply_overrides, preset


def test_presets_validate_and_match_the_seed():
    for name in ("tiny", "124m", "1b", "seed-4b"):
        preset(name).validate(world_size=1)
    s = preset("seed-4b")
    m = s.model
    assert (m.d_model, m.n_layers, m.q_heads, m.kv_heads, m.head_dim, m.ffn_hidden) == (3072, 36, 24, 8, 128, 8192)
    assert (m.context_length, m.vocab_size, m.weight_tying, m.rope_theta) == (4096, 50304, False, 500000)
    assert (s.global_batch, s.max_lr, s.min_lr, s.muon_lr, s.muon_min_lr) == (2097152, 6e-4, 6e-5, 8e-4, 8e-5)
    assert (s.warmup_steps, s.stable_steps, s.max_steps, s.grad_clip, s.weight_decay) == (200, 1400, 2000, 1.0, 0.1)
    one_b = preset("1b").model
    assert (one_b.d_model, one_b.n_layers, one_b.q_heads, one_b.kv_heads, one_b.head_dim, one_b.ffn_hidden,
            one_b.context_length) == (2048, 16, 16, 8, 128, 5632, 2048)
    assert 3.9e9 < m.num_params() < 3.95e9  # the seed's 3.93B


def test_preset_returns_a_fresh_copy():
    a = preset("tiny")
    a.model.d_model = 1
    assert preset("tiny").model.d_model == 128


def test_unknown_preset_is_named():
    with pytest.raises(ConfigError, match="'huge'.*tiny"):
        preset("huge")


@pytest.mark.parametrize("override, message", [
    ("nope=1", "unknown setting 'nope'"),
    ("model.nope=1", "unknown model setting 'nope'"),
    ("B", "not of the form key=value"),
    ("B=two", "expected an integer"),
    ("weight_tying=maybe", "expected a boolean"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(preset("tiny"), [override])


def test_overrides_reach_both_dataclasses():
    cfg = apply_overrides(preset("tiny"), ["B=4", "model.n_layers=2", "kv_heads=4", "max_lr=1e-3",
                                           "weight_tying=false"])
    assert (cfg.B, cfg.model.n_layers, cfg.model.kv_heads, cfg.max_lr, cfg.model.weight_tying) == \
        (4, 2, 4, 1e-3, False)


@pytest.mark.parametrize("overrides, world, message", [
    (["q_heads=4", "kv_heads=3"], 1, "divisible by model.kv_heads"),
    (["head_dim=33"], 1, "head_dim must be even"),
    (["global_batch=5000"], 1, "global_batch .* divisible by B\\*T\\*world_size"),
    ([], 3, "divisible by B\\*T\\*world_size = 8\\*128\\*3"),
    (["warmup_steps=50", "stable_steps=50"], 1, "no decay tail"),
    (["T=256"], 1, "exceeds model.context_length"),
    (["optimizer=sgd"], 1, "optimizer must be"),
])
def test_validation_errors(overrides, world, message):
    cfg = apply_overrides(preset("tiny"), overrides)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world_size=world)


def test_rescale_schedule_is_the_seeds_max_steps_rule():
    cfg = preset("seed-4b")
    cfg.rescale_schedule(50)
    assert (cfg.max_steps, cfg.warmup_steps, cfg.stable_steps) == (50, 5, 25)
    cfg.validate(world_size=8)


def test_roundtrip_through_dict():
    cfg = preset("1b")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_cli_reports_config_errors_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "blunb.train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"),
                           "--set", "kv_heads=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "kv_heads" in proc.stderr
    assert not (tmp_path / "r").exists()
