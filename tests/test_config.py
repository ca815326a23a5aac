import json
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from blunb.config import ConfigError, ModelConfig, TrainConfig, apply_overrides, preset, settings_help


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


@pytest.mark.parametrize("override, suggestion", [
    ("max_lrr=1", "did you mean max_lr"),
    ("model.d_modle=64", "did you mean d_model"),
    ("n_layer=2", "did you mean n_layers"),
])
def test_a_mistyped_key_names_the_nearest_keys_not_every_key(override, suggestion):
    with pytest.raises(ConfigError, match=suggestion) as err:
        apply_overrides(preset("tiny"), [override])
    assert len(str(err.value)) < 200


def test_a_key_like_no_other_points_to_the_settings_list():
    with pytest.raises(ConfigError, match="--help-settings"):
        apply_overrides(preset("tiny"), ["zzzqqq=1"])


def test_settings_help_lists_every_key_that_apply_overrides_accepts():
    listed = [line.split(" = ")[0] for line in settings_help(preset("124m")).splitlines()]
    assert {"max_lr", "model.d_model", "all_bf16"} <= set(listed)
    for key in listed:
        try:
            apply_overrides(preset("124m"), [f"{key}=1"])
        except ConfigError as err:  # a bad value is fine here, an unknown key is not
            assert "unknown" not in str(err), key


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


def _float_fields():
    cfg = preset("tiny")
    train = [f.name for f in fields(TrainConfig) if isinstance(getattr(cfg, f.name), float)]
    model = [f"model.{f.name}" for f in fields(ModelConfig) if isinstance(getattr(cfg.model, f.name), float)]
    return train + model


def test_every_float_setting_is_covered():
    # the generic check must reach fields added later too: these are just the ones known today
    assert {"max_lr", "grad_clip", "bucket_mb", "collective_timeout_s", "model.rope_theta", "model.rms_eps"} <= \
        set(_float_fields())


@pytest.mark.parametrize("name", _float_fields())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_rejected_by_name(name, value):
    cfg = apply_overrides(preset("tiny"), [f"{name}={value}"])
    with pytest.raises(ConfigError, match=f"{re.escape(name)} must be a finite number"):
        cfg.validate(world_size=1)


@pytest.mark.parametrize("overrides, message", [
    (["weight_decay=-0.1"], "weight_decay must be >= 0"),
    (["muon_weight_decay=-0.1"], "muon_weight_decay must be >= 0"),
    (["grad_clip=-1"], "grad_clip must be >= 0"),
    (["muon_lr=0"], "muon_lr > 0"),
    (["muon_min_lr=-1e-5"], "0 <= muon_min_lr"),
    (["muon_lr=1e-3", "muon_min_lr=2e-3"], "muon_min_lr <= muon_lr"),
    (["min_lr=1e-2"], "min_lr <= max_lr"),
    (["muon_buckets=0"], "muon_buckets must be >= 1"),
    (["muon_collective=allreduce"], "muon_collective must be one of"),
    (["muon_ns_schedule=polar"], r"muon_ns_schedule must be one of \('fixed', 'polar_express'\), got 'polar'"),
    (["muon_ns_steps=0"], "muon_ns_steps must be >= 1"),
    (["muon_ns_precondition=AOL"], r"muon_ns_precondition must be one of \('none', 'aol'\), got 'AOL'"),
    (["nan_policy=ignore"], "nan_policy must be one of"),
    (["collective_timeout_s=0"], "collective_timeout_s must be positive"),
    (["val_tokens=-1"], "val_tokens must be >= 0"),
    (["kernels=fast"], "kernels must be auto, torch, triton or op=backend"),
    (["kernels=swiglu=cuda"], "kernels must be auto, torch, triton or op=backend"),
    (["kernels=softmax=torch"], "kernels must be auto, torch, triton or op=backend"),
    (["kernels=swiglu"], "kernels must be auto, torch, triton or op=backend"),
])
def test_more_validation_errors(overrides, message):
    cfg = apply_overrides(preset("tiny"), overrides)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world_size=1)


def test_zero_grad_clip_stays_off_and_new_settings_validate():
    cfg = apply_overrides(preset("tiny"), ["grad_clip=0", "weight_decay=0", "muon_weight_decay=0", "nan_policy=group",
                                           "collective_timeout_s=60", "val_tokens=1000"])
    cfg.validate(world_size=1)
    assert (cfg.nan_policy, cfg.collective_timeout_s, cfg.val_tokens) == ("group", 60.0, 1000)


@pytest.mark.parametrize("switch", ["collective=reduce_bcast", "reduce_dtype=fp32", "overlap_backward=true",
                                    "overlap_refresh=true", "bucket_mb=25", "global_clip=true",
                                    "global_clip_strict=true"])
def test_ddp_adamw_rejects_each_zero_only_switch(switch):
    cfg = apply_overrides(preset("tiny"), ["optimizer=ddp_adamw", switch])
    with pytest.raises(ConfigError, match=f"optimizer=ddp_adamw would ignore .*{switch.split('=')[0]}="):
        cfg.validate(world_size=1)


def test_ddp_adamw_lists_every_ignored_switch_and_accepts_defaults():
    cfg = apply_overrides(preset("tiny"), ["optimizer=ddp_adamw", "bucket_mb=50", "collective=rs_ag"])
    cfg.validate(world_size=2)  # set explicitly, but to the defaults: nothing is ignored
    cfg = apply_overrides(cfg, ["global_clip=true", "reduce_dtype=bf16"])
    with pytest.raises(ConfigError) as info:
        cfg.validate(world_size=2)
    assert "reduce_dtype='bf16'" in str(info.value) and "global_clip=True" in str(info.value)
    assert "collective" not in str(info.value)


def test_fault_specs_parse_and_validate_against_world_size():
    cfg = apply_overrides(preset("tiny"), ["fault_nan_grad=3:1,5:0", "fault_stall= 7:1 "])
    cfg.validate(world_size=2)
    assert cfg.fault_nan_grad_at() == {(3, 1), (5, 0)} and cfg.fault_stall_at() == {(7, 1)}
    assert preset("tiny").fault_nan_grad_at() == set() == preset("tiny").fault_stall_at()
    with pytest.raises(ConfigError, match="fault_nan_grad: rank 1 .* world_size 1"):
        cfg.validate(world_size=1)


@pytest.mark.parametrize("name", ["fault_nan_grad", "fault_stall"])
@pytest.mark.parametrize("spec, message", [
    ("3", "STEP:RANK"), ("a:1", "STEP:RANK"), ("3:1:2", "STEP:RANK"), ("3:1,", "STEP:RANK"), ("1.5:0", "STEP:RANK"),
    ("-1:0", ">= 0"), ("3:-1", ">= 0"), ("3:4", "world_size 4"),
])
def test_bad_fault_specs_are_named(name, spec, message):
    cfg = apply_overrides(preset("tiny"), [f"{name}={spec}"])
    with pytest.raises(ConfigError, match=f"{name}.*{message}"):
        cfg.validate(world_size=4)


def test_resolved_val_tokens():
    cfg = preset("tiny")  # val_tokens 8192, T 128
    assert cfg.resolved_val_tokens() == 8192
    cfg.validate(world_size=4)  # independent of world size: nothing in it reads W
    assert cfg.resolved_val_tokens() == 8192
    cfg.val_tokens = 0  # derived: val_loss_steps 4 x B 8 x T 128
    assert cfg.resolved_val_tokens() == 4 * 8 * 128
    for given, expected in [(1000, 896), (4096, 4096), (10, 128)]:
        cfg.val_tokens = given
        assert cfg.resolved_val_tokens() == expected


def test_old_config_json_without_the_new_keys_loads():
    old = json.loads(preset("tiny").to_json())
    for key in ("nan_policy", "fault_nan_grad", "fault_stall", "collective_timeout_s", "val_tokens"):
        del old[key]
    cfg = TrainConfig.from_dict(old)
    assert (cfg.nan_policy, cfg.fault_nan_grad, cfg.collective_timeout_s, cfg.val_tokens) == \
        ("step", "", 600.0, 1310720)
    cfg.validate(world_size=2)


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan", "inf"])
def test_bad_peak_tflops_env_is_a_config_error_when_the_meter_is_built(monkeypatch, value):
    from blunb.mfu import MFUMeter

    monkeypatch.setenv("BLUNB_PEAK_TFLOPS", value)
    with pytest.raises(ConfigError, match="BLUNB_PEAK_TFLOPS"):
        MFUMeter.build(preset("tiny").model, seq_len=128, device_name="cpu")


def test_compile_and_the_chunked_loss_default_to_auto_which_the_device_decides():
    """Both on on CUDA (the fastest measured setting), off on the CPU; an explicit value stays as given,
    and resolve_auto (the trainer's, before anything reads them) says what it decided."""
    assert ModelConfig().chunked_ce == "auto" and preset("124m").compile == "auto"
    cfg = apply_overrides(preset("tiny"), ["chunked_ce=true", "compile=auto"])
    assert cfg.model.chunked_ce is True and cfg.compile == "auto"
    assert cfg.resolve_auto("cuda") == {"compile": True} and cfg.compile is True and cfg.model.chunked_ce is True
    cpu = preset("tiny")
    assert cpu.resolve_auto("cpu") == {"compile": False, "model.chunked_ce": False}
    assert json.loads(cpu.to_json())["compile"] is False and cpu.resolve_auto("cpu") == {}
    cuda = preset("tiny")
    assert cuda.resolve_auto("cuda") == {"compile": True, "model.chunked_ce": True}
    with pytest.raises(ConfigError, match=r"override 'model.chunked_ce=maybe': expected true, false or auto"):
        apply_overrides(preset("tiny"), ["model.chunked_ce=maybe"])
    cfg.model.chunked_ce = "yes"
    with pytest.raises(ConfigError, match="model.chunked_ce must be true, false or auto"):
        cfg.validate()


def test_a_config_json_from_before_compile_and_the_chunked_loss_reads_as_run_without_them():
    old = json.loads(preset("tiny").to_json())
    del old["compile"], old["model"]["chunked_ce"]
    cfg = TrainConfig.from_dict(old)
    assert cfg.compile is False and cfg.model.chunked_ce is False


@pytest.mark.parametrize("field, default, other, steps, bad, valid", [
    ("muon_ns_schedule", "fixed", "polar_express", 8, "polar-express", "'fixed', 'polar_express'"),
    ("muon_ns_precondition", "none", "aol", 4, "turbo", "'none', 'aol'"),
])
def test_a_newton_schulz_option_defaults_to_what_runs_ran_and_reads_so_from_an_older_config_json(
        field, default, other, steps, bad, valid, tmp_path):
    """muon_ns_schedule (fixed) and muon_ns_precondition (none, the Frobenius-normalized start): the default
    computes what runs computed before the field, an old config.json reads as it (config.PREDATED: what those
    runs ran, whatever the default becomes), the other value round-trips, and an unknown name stops the
    trainer before any work, the run folder not created."""
    from blunb.config import PREDATED, predated_defaults
    from blunb.train import train

    assert getattr(preset("tiny"), field) == default and PREDATED[field] == default
    assert predated_defaults()[field] == default
    old = json.loads(preset("tiny").to_json())
    del old[field]
    assert getattr(TrainConfig.from_dict(old), field) == default
    cfg = apply_overrides(preset("tiny"), ["optimizer=muon", f"{field}={other}", f"muon_ns_steps={steps}"])
    cfg.validate()
    assert getattr(TrainConfig.from_dict(json.loads(cfg.to_json())), field) == other
    setattr(cfg, field, bad)
    with pytest.raises(ConfigError, match=f"{field} must be one of .*{valid}.*got '{bad}'"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
