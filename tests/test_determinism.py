"""deterministic=true on the CPU: the config field, the process-wide settings a run applies, records and puts back,
and the fused kernels' untimed choices under torch's deterministic mode (the GPU side: test_determinism_gpu.py,
bench/determinism.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
import triton
import triton.language as tl

import blunb.train as train_mod
from blunb import kernels
from blunb.config import ConfigError, apply_overrides, preset
from blunb.determinism import Determinism, fixed_kernel_configs
from blunb.kernels.fused import _common
from blunb.kernels.fused import flash_attention as fa
from blunb.kernels.fused import syrk as fused_syrk
from blunb.report import determinism_lines
from blunb.runs import TIMING_COLUMNS, read_status
from tests.distributed import REPO


def _tiny(*overrides):
    cfg = apply_overrides(preset("tiny"), ["n_layers=1", "B=2", "T=32", "global_batch=64", "val_tokens=64",
                                           "device=cpu", *overrides])
    cfg.rescale_schedule(3)
    return cfg


@pytest.fixture
def torch_deterministic():
    """torch's deterministic mode on for the test, off again after it (whatever the test did)."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


# ---------------------------------------------------------------- the config field

def test_deterministic_is_a_bool_setting_off_by_default():
    assert preset("124m").deterministic is False
    assert apply_overrides(preset("tiny"), ["deterministic=true"]).deterministic is True
    with pytest.raises(ConfigError, match="expected a boolean"):
        apply_overrides(preset("tiny"), ["deterministic=maybe"])
    cfg = preset("tiny")
    cfg.deterministic = "yes"
    with pytest.raises(ConfigError, match="deterministic must be true or false"):
        cfg.validate()


# ---------------------------------------------------------------- the run's settings

def test_a_deterministic_run_sets_records_and_puts_back_the_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    seen = []
    real_step = train_mod.train_step

    def recording_step(run, step, *args, **kw):
        seen.append((torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
                     torch.backends.cudnn.benchmark,
                     os.environ.get("CUBLAS_WORKSPACE_CONFIG"), _common.deterministic()))
        return real_step(run, step, *args, **kw)

    monkeypatch.setattr(train_mod, "train_step", recording_step)
    run_dir = tmp_path / "det"
    train_mod.train(_tiny("deterministic=true"), run_dir)
    assert read_status(run_dir)["state"] == "completed"
    assert seen == [(True, False, True, False, ":4096:8", True)] * 3
    # put back for the caller; the cuBLAS variable stays (torch read it once: it cannot be unread)
    assert not torch.are_deterministic_algorithms_enabled()
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == before
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    d = json.loads((run_dir / "env.json").read_text())["training"]["determinism"]
    assert d["deterministic"] and d["torch_deterministic_algorithms"] and d["warn_only"] is False
    assert d["cublas_workspace_config"] == ":4096:8" and d["cudnn_deterministic"] and not d["cudnn_benchmark"]
    assert d["triton_configs"] == "fixed" and d["notes"] == []
    assert json.loads((run_dir / "config.json").read_text())["deterministic"] is True
    log = (run_dir / "log.txt").read_text()
    assert "determinism: deterministic=true: torch.use_deterministic_algorithms(True)" in log
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in log


def test_a_default_run_changes_nothing_and_says_it_is_not_reproducible(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    run_dir = tmp_path / "default"
    train_mod.train(_tiny(), run_dir)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0" and not torch.are_deterministic_algorithms_enabled()
    d = json.loads((run_dir / "env.json").read_text())["training"]["determinism"]
    assert d["deterministic"] is False and d["torch_deterministic_algorithms"] is False
    assert d["triton_configs"] == "autotuned (timed)"
    assert "determinism: off (deterministic=false)" in (run_dir / "log.txt").read_text()


def test_the_settings_are_put_back_when_the_run_fails(tmp_path):
    with pytest.raises(Exception, match="no such|does not exist|not found|No such"):
        train_mod.train(_tiny("deterministic=true", f"data={tmp_path / 'missing'}"), tmp_path / "r")
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("given, kept", [(":16:8", True), (":4096:8", True), (":4096:2:16:8", False)])
def test_a_cublas_setting_is_kept_only_if_reproducible(given, kept, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
    knobs = Determinism(_tiny("deterministic=true"))
    knobs.apply()
    try:
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == (given if kept else ":4096:8")
        assert bool(knobs.notes) is (not kept)
        if not kept:
            assert given in knobs.notes[0] and "replaced by :4096:8" in knobs.notes[0]
            assert any(line.startswith("  WARNING: ") for line in determinism_lines(knobs.facts()))
    finally:
        knobs.restore()
    assert not torch.are_deterministic_algorithms_enabled()


def test_compile_under_deterministic_sets_inductor_deterministic_and_puts_it_back():
    import torch._inductor.config as inductor_config

    before = inductor_config.deterministic
    knobs = Determinism(_tiny("deterministic=true", "compile=true"))
    knobs.apply()
    try:
        assert inductor_config.deterministic is True and knobs.facts()["inductor_deterministic"] is True
        assert "Inductor deterministic" in determinism_lines(knobs.facts())[0]
    finally:
        knobs.restore()
    assert inductor_config.deterministic is before


# ---------------------------------------------------------------- the bisection: one part left out

def _flags():
    return {"algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8",
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (True, False),
            "kernels": fixed_kernel_configs()}


@pytest.mark.parametrize("part", ["algorithms", "cublas", "cudnn", "kernels"])
def test_each_part_of_deterministic_mode_can_be_left_out_alone(part, monkeypatch):
    """BLUNB_DETERMINISM_EXCEPT=<part>: that part stays as it was, every other is set; put back after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _flags()
    assert not any(before.values())
    knobs = Determinism(_tiny("deterministic=true"), env={"BLUNB_DETERMINISM_EXCEPT": part})
    knobs.apply()
    try:
        assert _flags() == {p: p != part for p in before}
        facts = knobs.facts()
        assert facts["left_out"] == [part]
        assert facts["triton_configs"] == ("autotuned (timed)" if part == "kernels" else "fixed")
        assert _common.deterministic() is (part != "kernels")   # what every fused kernel asks
    finally:
        knobs.restore()
    assert {p: v for p, v in _flags().items() if p != "cublas"} == {p: False for p in before if p != "cublas"}
    assert fixed_kernel_configs() is False  # back to following torch's flag


def test_the_inductor_part_can_be_left_out():
    import torch._inductor.config as inductor_config

    before = inductor_config.deterministic
    knobs = Determinism(_tiny("deterministic=true", "compile=true"), env={"BLUNB_DETERMINISM_EXCEPT": "inductor"})
    knobs.apply()
    try:
        assert inductor_config.deterministic is before and torch.are_deterministic_algorithms_enabled()
    finally:
        knobs.restore()


@pytest.mark.parametrize("value, overrides, match", [
    ("kernel", ["deterministic=true"], r"BLUNB_DETERMINISM_EXCEPT names \['kernel'\]: the parts .* are algorithms, "),
    ("kernels,bogus", ["deterministic=true"], r"names \['bogus'\]"),
    ("kernels", [], "this run has deterministic=false"),
])
def test_a_bad_bisection_setting_is_refused_before_any_work(value, overrides, match, tmp_path, monkeypatch):
    from blunb.launch import check_train_args

    with pytest.raises(ConfigError, match=match):
        Determinism(_tiny(*overrides), env={"BLUNB_DETERMINISM_EXCEPT": value})
    monkeypatch.setenv("BLUNB_DETERMINISM_EXCEPT", value)
    with pytest.raises(ConfigError, match=match):   # the launcher's check, before torchrun starts the ranks
        check_train_args(["--preset", "tiny", *[a for o in overrides for a in ("--set", o)]], 2)
    with pytest.raises(ConfigError, match=match):
        train_mod.train(_tiny(*overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert Determinism(_tiny("deterministic=true"), env={"BLUNB_DETERMINISM_EXCEPT": " "}).left_out == ()


def test_a_bisection_run_records_what_it_left_out(tmp_path, monkeypatch):
    monkeypatch.setenv("BLUNB_DETERMINISM_EXCEPT", "kernels")
    run_dir = tmp_path / "except"
    train_mod.train(_tiny("deterministic=true"), run_dir)
    d = json.loads((run_dir / "env.json").read_text())["training"]["determinism"]
    assert d["left_out"] == ["kernels"] and d["torch_deterministic_algorithms"] is True
    assert d["triton_configs"] == "autotuned (timed)"
    assert "deterministic=true except kernels (BLUNB_DETERMINISM_EXCEPT" in (run_dir / "log.txt").read_text()
    assert not torch.are_deterministic_algorithms_enabled() and fixed_kernel_configs() is False


# ---------------------------------------------------------------- the kernels: fixed configs, nothing timed

@triton.jit
def _write_block(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 1), tl.full([1], BLOCK, tl.int32))


def _no_timing(*args, **kwargs):
    raise AssertionError("a kernel config or backend was chosen by timing")


def _tuned_block_writer():
    """An autotuner over two configs that would time them (with _no_timing), fixed to the second one."""
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    return _common.Tuned(triton.autotune(configs=configs, key=[], do_bench=_no_timing)(_write_block), configs[1])


def test_a_tuned_kernel_launches_its_fixed_config_untimed_under_deterministic_mode(torch_deterministic):
    out = torch.zeros(1, dtype=torch.int32)
    _tuned_block_writer()[(1,)](out)
    assert out.item() == 32


def test_without_deterministic_mode_the_same_kernel_is_timed():
    with pytest.raises(AssertionError, match="chosen by timing"):
        _tuned_block_writer()[(1,)](torch.zeros(1, dtype=torch.int32))


def test_every_autotuned_fused_kernel_has_a_fixed_config():
    from blunb.kernels.fused import cross_entropy, qk_norm_rope, rms_norm, swiglu

    tuned = [cross_entropy._ce_fwd_tuned, cross_entropy._ce_fwd_inplace, qk_norm_rope._qk_fwd, qk_norm_rope._qk_bwd,
             rms_norm._rms_norm_fwd, rms_norm._rms_norm_bwd, swiglu._swiglu_fwd, swiglu._swiglu_bwd,
             fa._fwd_kernel, fa._bwd_kernel]
    for kernel in tuned:
        assert isinstance(kernel, _common.Tuned), kernel
        assert kernel.fixed_config({"HEAD_DIM": 64}) in kernel.autotuner.configs, kernel.base_fn.__name__


def test_flash_attention_fixed_config_is_a_function_of_the_head_dim(monkeypatch):
    monkeypatch.setattr(fa, "INTERPRET", False)  # the GPU tables (under the interpreter there is one config)
    pick = fa._fixed_by_head_dim(fa._FWD_GPU, fa._FWD_NAMES, fa._FWD_CONFIGS)
    for hd, table_hd in ((16, 64), (32, 64), (64, 64), (128, 128)):
        c = pick({"HEAD_DIM": hd})
        assert (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == fa._FWD_GPU[table_hd][0]
    assert pick({"HEAD_DIM": 64}) is pick({"HEAD_DIM": 64})


def _qkv(dtype, hd=64):
    q = torch.randn(1, 4, 256, hd, dtype=dtype)
    k = torch.randn(1, 2, 256, hd, dtype=dtype)
    return q, k, k.clone()


def test_flash_attention_choice_is_untimed_under_deterministic_mode(monkeypatch, torch_deterministic):
    monkeypatch.setattr(fa, "_bench_ms", _no_timing)
    monkeypatch.setattr(fa, "_choice", {})
    assert fa.prefer(*_qkv(torch.bfloat16), True)          # Triton wherever it supports the shape
    assert not fa.prefer(*_qkv(torch.float32), True)       # fp32 stays on SDPA
    assert not fa.prefer(*_qkv(torch.bfloat16, hd=48), True)
    assert fa._choice == {}  # a later run without deterministic mode still times


def test_flash_attention_choice_is_timed_otherwise(monkeypatch):
    monkeypatch.setattr(fa, "_bench_ms", _no_timing)
    monkeypatch.setattr(fa, "_choice", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(AssertionError, match="chosen by timing"):
        fa.prefer(*_qkv(torch.bfloat16), True)


@pytest.fixture
def fake_cuda_syrk(monkeypatch):
    """syrk's choice as for a CUDA tensor (the interpreter off), with its timed verdict forbidden."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fused_syrk, "interpreting", lambda: False)
    monkeypatch.setattr(fused_syrk, "verdict", _no_timing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv("BLUNB_KERNELS", raising=False)
    return torch.randn(64, 96)


def test_syrk_is_cublas_under_deterministic_mode_unless_forced(fake_cuda_syrk, monkeypatch, torch_deterministic):
    x = fake_cuda_syrk
    assert not fused_syrk.use_triton(x, has_c=False) and not fused_syrk.prefer(x)
    monkeypatch.setenv("BLUNB_KERNELS", "syrk=triton")
    assert fused_syrk.use_triton(x, has_c=True)
    launched = []
    monkeypatch.setattr(fused_syrk, "_launch", lambda x3, out3, c3, alpha, beta, config: launched.append(config))
    fused_syrk.triton_syrk(x)
    assert launched == [fused_syrk.FIXED_CONFIG]


def test_syrk_follows_a_forced_backend_and_times_only_on_auto(fake_cuda_syrk, monkeypatch):
    x = fake_cuda_syrk
    monkeypatch.setenv("BLUNB_KERNELS", "syrk=torch")  # Newton-Schulz asks use_triton: kernels=syrk=torch holds there
    assert not fused_syrk.use_triton(x, has_c=False)
    monkeypatch.setenv("BLUNB_KERNELS", "auto")
    with pytest.raises(AssertionError, match="chosen by timing"):
        fused_syrk.use_triton(x, has_c=False)


def test_the_run_log_names_the_fixed_choices(monkeypatch, torch_deterministic):
    monkeypatch.delenv("BLUNB_KERNELS", raising=False)
    described = kernels.describe("cuda")
    assert described["flash_attention"] == fa.DETERMINISTIC_CHOICE
    assert described["syrk"] == fused_syrk.DETERMINISTIC_CHOICE
    assert described["swiglu"] == described["cross_entropy"] == "triton (fixed config)"
    assert described["rms_norm"] == "torch"


# ---------------------------------------------------------------- bench/determinism.py

def test_first_difference_names_the_step_and_column():
    from bench.determinism import first_difference

    a = pd.DataFrame({"step": [0, 1, 2], "train_loss": [3.0, 2.0, 1.0], "val_loss": [3.1, None, 1.1],
                      "dt_ms": [5.0, 6.0, 7.0]})
    assert first_difference(a, a.assign(dt_ms=[1.0, 1.0, 1.0])) is None  # timings are not compared
    assert first_difference(a, a.assign(train_loss=[3.0, 2.0 + 2**-40, 1.5])) == (1, "train_loss")
    assert first_difference(a, a.assign(val_loss=[3.1, 0.0, 1.1])) == (1, "val_loss")  # NaN against a number
    assert first_difference(a, a.iloc[:2]) == (2, "rows")
    assert first_difference(a, a.assign(extra=1.0)) == (0, "columns: extra")
    assert set(TIMING_COLUMNS) >= {"dt_ms", "tok_per_sec", "opt_step_ms", "peak_mem_gib"}


def test_the_bisection_lets_go_one_thing_per_pair_of_deterministic_runs():
    from bench.determinism import EXCEPT_PARTS, bisection_probes

    probes = {v.name: v for v in bisection_probes("124m", muon=True, adamw=True)}
    for part in EXCEPT_PARTS["adamw"]:
        v = probes[f"probe except:{part}"]
        assert v.overrides == ["deterministic=true"] and v.env == {"BLUNB_DETERMINISM_EXCEPT": part}
    assert probes["probe except:kernels (muon)"].overrides == ["optimizer=muon", "deterministic=true"]
    swiglu = probes["probe timed:swiglu"]
    assert swiglu.env == {"BLUNB_DETERMINISM_EXCEPT": "kernels"} and swiglu.overrides[0] == "deterministic=true"
    forced = dict(kv.split("=") for kv in swiglu.overrides[1].removeprefix("kernels=").split(","))
    assert "swiglu" not in forced and set(forced.values()) == {"torch"} and len(forced) == len(kernels.OPS) - 1
    assert probes["probe timed:syrk (muon)"].overrides[0] == "optimizer=muon" and "probe timed:syrk" not in probes
    assert all(v.steps == 3 and v.together and v.kind == "probe" for v in probes.values())
    assert [v.name for v in bisection_probes("124m", muon=False, adamw=False)] == []


def _row(variant, identical, optimizer="adamw", status="ok"):
    return {"preset": "124m", "variant": variant, "optimizer": optimizer, "status": status, "identical": identical}


def test_the_bisection_summary_names_causes_only_where_the_full_setting_repeats():
    from bench.determinism import summary_lines

    rows = [_row("probe deterministic", True), _row("probe except:algorithms", False),
            _row("probe except:cublas", True), _row("probe timed:swiglu", False), _row("probe timed:adamw", True),
            _row("probe muon-deterministic", False, "muon"), _row("probe except:kernels (muon)", False, "muon")]
    table = pd.DataFrame(rows).assign(first_diff_step=0, first_diff_column="grad_norm",
                                      step0_grad_norm_identical=False, steps=3, tok_per_sec_vs_default=float("nan"))
    lines = summary_lines(table)
    assert ("124m bisection (adamw): deterministic=true without algorithms: DIFFERS, cublas: identical" in lines)
    assert "124m bisection (adamw): timed configs of swiglu: DIFFERS, adamw: identical" in lines
    # Muon's own full pair differed: none of its probes can name a cause
    assert "124m bisection (muon): inconclusive, the full deterministic=true pair itself differed" in lines
    assert not any("(muon): deterministic=true without" in ln for ln in lines)
    no_base = table[table["variant"] != "probe deterministic"]
    inconclusive = "124m bisection (adamw): inconclusive, the full deterministic=true pair did not run"
    assert inconclusive in summary_lines(no_base)


@pytest.mark.slow
def test_the_bench_runs_on_the_cpu_in_quick_mode(tmp_path):
    """--quick (tiny cut to one layer, 6 steps) with two of its variants: the deterministic pair (one run after
    the other, timed) and a bisection probe (a pair started together); the CSV has a row per variant with the
    verdict, the log says what ran. `python bench/determinism.py --quick` alone runs every quick variant."""
    out = tmp_path / "determinism.csv"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "bench/determinism.py", "--quick", "--out", str(out), "--work",
                           str(tmp_path / "work"), "--variants", "deterministic,probe timed:qk_norm_rope"],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = pd.read_csv(out)
    assert {"variant", "preset", "optimizer", "identical", "first_diff_step", "first_diff_column",
            "steady_tok_per_sec", "tok_per_sec_vs_default", "status", "device", "torch"} <= set(table.columns)
    assert list(table["variant"]) == ["deterministic", "probe timed:qk_norm_rope"], table.to_string()
    assert (table["status"] == "ok").all() and table["identical"].all(), table.to_string()
    det = table.iloc[0]
    assert det["preset"] == "tiny" and det["device"] == "cpu" and det["steady_tok_per_sec"] > 0
    log = out.with_suffix(".log").read_text()
    assert "tiny deterministic: identical" in log and "determinism: deterministic=true" in log
