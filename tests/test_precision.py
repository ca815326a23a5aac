"""The precision study's switches and instruments: all_bf16, the no-master counter-example, and the
arithmetic behind the seed's precision claims (blunb.studies.precision)."""

import json
import logging
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from blunb import fp8
from blunb.claims import load_spec
from blunb.config import BF16_STAGES, FP8_RECIPES, ConfigError, apply_overrides, preset
from blunb.model import BLU
from blunb.optim.build import NoMasterAdamW, build_optimizers
from blunb.runs import gpu_shared, load_run
from blunb.studies.precision import (
    FP8_ARMS,
    arm_costs,
    bf16_ulp,
    decay_moved_fraction,
    decay_only,
    fp8_arm_seeds,
    fp8_arms,
    fp8_arms_on,
    logits_memory,
    loss_dtype_sweep,
    loss_readings,
    representable_in_bf16,
    solo_first,
    solo_runs,
    timing_common,
)
from blunb.study import Study
from tests.distributed import REPO


@pytest.fixture(autouse=True)
def one_thread():
    """Shared cores: torch's intra-op threads would only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- the all-bf16 switch


@pytest.mark.parametrize("key", ["all_bf16", "model.all_bf16"])
def test_all_bf16_sets_exactly_the_three_stage_flags(key):
    cfg = apply_overrides(preset("tiny"), [f"{key}=true"])
    assert all(getattr(cfg.model, name) for name in BF16_STAGES)
    untouched = {k: v for k, v in vars(cfg.model).items() if k not in BF16_STAGES}
    assert untouched == {k: v for k, v in vars(preset("tiny").model).items() if k not in BF16_STAGES}
    assert {k: v for k, v in vars(cfg).items() if k != "model"} == \
        {k: v for k, v in vars(preset("tiny")).items() if k != "model"}
    assert "all_bf16" not in cfg.to_dict()["model"]  # the three flags are the record
    assert not any(getattr(apply_overrides(cfg, [f"{key}=false"]).model, n) for n in BF16_STAGES)


def test_a_later_per_stage_override_wins_as_the_seeds_knobs_do():
    cfg = apply_overrides(preset("tiny"), ["all_bf16=1", "bf16_embed=0"])  # BLU_ALL_BF16=1 BLU_BF16_EMBED=0
    assert (cfg.model.bf16_resid, cfg.model.bf16_logits, cfg.model.bf16_embed) == (True, True, False)
    with pytest.raises(ConfigError, match="override 'all_bf16=maybe': expected a boolean"):
        apply_overrides(preset("tiny"), ["all_bf16=maybe"])


def test_all_bf16_layout_moves_the_three_stages_and_nothing_else():
    base = BLU(preset("tiny").model, seed=0).precision_layout()
    layout = BLU(apply_overrides(preset("tiny"), ["all_bf16=true"]).model, seed=0).precision_layout()
    moved = {k for k in base if base[k] != layout[k]}
    assert moved == {"residual_stream_and_norms", "embedding", "logits", "bf16_stages"}
    assert all(layout[k] == "bf16" for k in moved - {"bf16_stages"})
    assert (base["bf16_stages"], layout["bf16_stages"]) == ("none", "all three (all_bf16)")
    assert layout["qk_norm_rope"] == "fp32 (always)" and layout["loss"] == "fp32"
    one = BLU(apply_overrides(preset("tiny"), ["bf16_logits=true"]).model, seed=0).precision_layout()
    assert one["bf16_stages"] == "logits"


# ---------------------------------------------------------------- the counter-example optimizer


def test_counter_example_rejects_zero_switches_and_all_fp32_parameters():
    with pytest.raises(ConfigError, match="optimizer=adamw_bf16_nomaster would ignore .*global_clip=True"):
        apply_overrides(preset("tiny"), ["optimizer=adamw_bf16_nomaster", "global_clip=true"]).validate()
    with pytest.raises(ConfigError, match="leaves every parameter fp32"):
        apply_overrides(preset("tiny"), ["optimizer=adamw_bf16_nomaster", "linear_dtype=fp32"]).validate()
    nomaster = ["optimizer=adamw_bf16_nomaster"]
    apply_overrides(preset("tiny"), [*nomaster, "linear_dtype=fp32", "bf16_embed=true"]).validate()
    apply_overrides(preset("tiny"), nomaster).validate()  # auto: bf16 Linears everywhere


def test_counter_example_trains_with_bf16_parameters_and_no_fp32_copy(caplog):
    torch.manual_seed(0)
    cfg = apply_overrides(preset("tiny"), ["optimizer=adamw_bf16_nomaster", "linear_dtype=bf16", "max_lr=1e-2"])
    model = BLU(cfg.model, seed=0)
    with caplog.at_level(logging.WARNING, logger="blunb"):
        opt = build_optimizers(model, cfg, torch.device("cpu"), world_size=1)
    assert isinstance(opt, NoMasterAdamW) and "COUNTER-EXAMPLE" in caplog.text
    facts = opt.describe()
    assert facts["label"].startswith("COUNTER-EXAMPLE") and facts["precision"]["masters"].startswith("NONE")
    assert facts["counter_example"]["bf16_param_fraction"] > 0.9
    wq = model.blocks[0].attn.wq.weight
    before = wq.detach().clone()
    x = torch.randint(0, cfg.model.vocab_size, (4, 32))
    losses = []
    for step in range(8):
        opt.set_lr(step)
        with opt.micro_step(last=True):
            _, loss = opt.forward_model(x, x)
            loss.backward()
        stats = opt.step()
        losses.append(loss.item())
        assert not bool(stats.skipped.any())
    assert losses[-1] < losses[0] - 0.5  # it learns (one batch, memorized)
    assert wq.dtype == torch.bfloat16 and not torch.equal(wq, before)
    bf16_params = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert len(bf16_params) == 6 * cfg.model.n_layers  # every Linear of every block
    for p in bf16_params:  # torch AdamW's state is all there is: bf16 moments, no fp32 master anywhere
        state = opt.opt.state[p]
        assert {k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape} == {"exp_avg", "exp_avg_sq"}
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_counter_example_run_folder_says_what_it_is(tmp_path):
    from blunb.data import write_shard
    from blunb.train import train

    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    for name in ("train_000.bin", "val_000.bin"):
        write_shard(tmp_path / "data" / name, rng.integers(0, 257, 40000))
    cfg = apply_overrides(preset("tiny"), ["optimizer=adamw_bf16_nomaster", f"data={tmp_path / 'data'}",
                                           "global_batch=1024", "val_tokens=1024"])
    cfg.rescale_schedule(3)
    train(cfg, tmp_path / "run")
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["training"]["precision"]["linear_weights"] == "bf16"  # auto means bf16 here, CPU too
    assert env["training"]["precision"]["optimizer_masters"].startswith("NONE: counter-example")
    assert env["training"]["optimizer"]["label"].startswith("COUNTER-EXAMPLE")
    assert "COUNTER-EXAMPLE" in (tmp_path / "run" / "log.txt").read_text()


# ---------------------------------------------------------------- blunb.studies.precision


def test_bf16_grid():
    assert bf16_ulp(10.8) == 0.0625 == 2.0 ** -4  # [8, 16)
    assert bf16_ulp(1.0) == 2.0 ** -7 and bf16_ulp(0.99) == 2.0 ** -8 and bf16_ulp(-3.0) == 2.0 ** -6
    assert representable_in_bf16([10.8125, 1.0, 0.0]).all() and not representable_in_bf16([10.8]).any()
    with pytest.raises(ValueError):
        bf16_ulp(0.0)


def test_bf16_loss_near_10_8_lies_on_the_0_0625_grid_and_fp32_does_not():
    sweep = loss_dtype_sweep(points=41)
    assert sweep["fp32"].between(10.3, 10.9).all() and sweep["fp32"].is_monotonic_decreasing
    steps = sweep["seed_bf16"] / 0.0625
    assert np.array_equal(steps, np.round(steps))  # every bf16 reading is a multiple of 0.0625
    assert sweep["seed_bf16"].nunique() <= 10 and sweep["fp32"].nunique() == len(sweep)
    assert not representable_in_bf16(sweep["fp32"]).any()
    assert (sweep["seed_bf16"] - sweep["fp32"]).abs().max() <= 0.0625 / 2 + 1e-3  # the same loss, rounded
    logits = torch.randn(16, 320).to(torch.bfloat16)
    targets = torch.randint(0, 320, (16,))
    readings = loss_readings(logits, targets)
    exact = torch.nn.functional.cross_entropy(logits.float(), targets).item()
    assert readings.fp32 == pytest.approx(exact, rel=1e-6) and representable_in_bf16([readings.seed_bf16])[0]


def test_decay_alone_rounds_away_without_a_master():
    one = torch.ones(1000, dtype=torch.bfloat16)
    assert decay_moved_fraction(one, lr=6e-4, weight_decay=0.1) == 0.0  # the seed's 1 - 6e-5
    assert decay_moved_fraction(one, lr=0.1, weight_decay=0.1) == 1.0  # 1 - 1e-2 crosses a grid step
    weights = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    assert decay_moved_fraction(weights, lr=6e-4, weight_decay=0.1) == 0.0  # at any magnitude
    with pytest.raises(ValueError, match="bf16"):
        decay_moved_fraction(weights.float(), 6e-4, 0.1)
    run = decay_only(weights, [6e-4] * 300, weight_decay=0.1)
    assert list(run.columns) == ["step", "lr", "moved_no_master", "moved_master", "shrink_no_master",
                                 "shrink_master", "shrink_exact"]
    assert (run["moved_no_master"] == 0).all() and (run["shrink_no_master"] == 1.0).all()
    assert run["moved_master"].sum() > 0.5  # the master accumulates; its bf16 copy steps now and then
    exact = (1 - 6e-5) ** 300
    assert run["shrink_exact"].iloc[-1] == pytest.approx(exact, rel=1e-12)
    assert run["shrink_master"].iloc[-1] == pytest.approx(exact, abs=2e-3)


def test_logits_memory_is_the_seeds_formula():
    mem = logits_memory(preset("124m"))  # B16 x T1024 = 16384 rows, the seed's B*T
    assert (mem.tokens, mem.vocab_size) == (16384, 50304)
    assert mem.fp32_bytes == 2 * 16384 * 50304 * 4 and round(mem.fp32_bytes / 2 / 1e9, 2) == 3.30
    assert mem.saved_bytes == 16384 * 50304 * 4 and mem.bf16_bytes == mem.fp32_bytes // 2
    assert round(mem.saved_bytes / 2**30, 2) == 3.07  # the seed's "frees ~3 GiB"
    tiny = preset("tiny")
    assert logits_memory(tiny).fp32_bytes == 2 * tiny.B * tiny.T * tiny.model.vocab_size * 4
    assert math.isclose(logits_memory(apply_overrides(preset("tiny"), ["B=4"])).saved_bytes * 2,
                        logits_memory(tiny).saved_bytes)


# ---------------------------------------------------------------- time figures from runs alone on their GPU

def _summary(rows, device="NVIDIA H200"):
    """Rows of arm, seed, run, tok/s, peak GiB, gpu_shared and optionally the device (else `device`)."""
    rows = [row if len(row) == 7 else [*row, device] for row in rows]
    return pd.DataFrame(rows, columns=["arm", "seed", "run", "steady_tok_per_sec", "peak_mem_gib", "gpu_shared",
                                       "device"])


def test_arm_costs_read_step_time_from_solo_runs_only():
    summary = _summary([
        ["base", 0, "base-s0", 1000.0, 10.0, False],
        ["base", 1, "base-s1", 1900.0, 12.0, True],       # shared: its tok/s is two runs' GPU, left out
        ["b", 0, "b-s0", 500.0, 8.0, np.False_],          # a numpy boolean is a record too
        ["b", 1, "b-s1", 700.0, 8.0, False],
        ["shared", 0, "shared-s0", 1800.0, 9.0, True],
        ["shared", 1, "shared-s1", 1800.0, 9.0, True],
        ["old", 0, "old-s0", 1000.0, 9.0, None],          # made before the record: unknown, never solo
        ["old", 1, "old-s1", 1000.0, 9.0, float("nan")],  # as a CSV round trip leaves None
    ])
    assert solo_runs(summary)["run"].tolist() == ["base-s0", "b-s0", "b-s1"]
    cost = arm_costs(summary, tokens_per_step=1000, base="base")
    assert cost.index.tolist() == ["base", "b", "shared", "old"]
    assert cost["runs"].tolist() == [2, 2, 2, 2] and cost["solo_runs"].tolist() == [1, 2, 0, 0]
    assert cost.loc["base", "tok_per_sec"] == 1000.0 and cost.loc["base", "step_ms"] == 1000.0
    assert cost.loc["b", "tok_per_sec"] == 600.0 and cost.loc["b", "tok_per_sec_vs_base"] == pytest.approx(0.6)
    for arm in ("shared", "old"):  # no shared timing stands in for a missing solo one
        assert cost.loc[arm, ["tok_per_sec", "step_ms", "tok_per_sec_vs_base"]].isna().all()
    assert "2 shared it, 0 have no record" in cost.loc["shared", "time_na"]
    assert "0 shared it, 2 have no record" in cost.loc["old", "time_na"]
    assert cost.loc["base", "time_na"] == cost.loc["b", "time_na"] == ""
    # peak memory is each process's own allocation: every run counts, shared or not
    assert cost.loc["base", "peak_mem_gib"] == 11.0 and cost.loc["b", "peak_mem_vs_base_gib"] == -3.0


def test_arm_costs_refuse_a_summary_without_the_record_or_the_base():
    summary = _summary([["base", 0, "base-s0", 1000.0, 10.0, False]])
    with pytest.raises(ValueError, match="gpu_shared"):
        solo_runs(summary.drop(columns="gpu_shared"))
    with pytest.raises(ValueError, match="gpu_shared"):
        arm_costs(summary.drop(columns="gpu_shared"), 1000, "base")
    with pytest.raises(ValueError, match="base arm 'fp32' is not in"):
        arm_costs(summary, 1000, "fp32")
    with pytest.raises(ValueError, match="device"):
        arm_costs(summary.drop(columns="device"), 1000, "base")


def test_arm_costs_never_mix_devices_in_a_time_or_a_ratio():
    """A borrowed GPU may be an H100 one day and an H200 the next: a mean or ratio across them is no setting's."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    summary = _summary([
        ["base", 0, "base-s0", 1000.0, 10.0, False, h200],
        ["same", 0, "same-s0", 800.0, 10.0, False, h200],
        ["other", 0, "other-s0", 700.0, 10.0, False, h100],
        ["mixed", 0, "mixed-s0", 900.0, 10.0, False, h200],
        ["mixed", 1, "mixed-s1", 600.0, 10.0, False, h100],
    ])
    cost = arm_costs(summary, tokens_per_step=1000, base="base")
    assert cost.loc["same", "tok_per_sec_vs_base"] == pytest.approx(0.8) and cost.loc["same", "time_na"] == ""
    # its own time stands (one device), its ratio to a base timed elsewhere does not
    assert cost.loc["other", "tok_per_sec"] == 700.0 and cost.loc["other", "device"] == h100
    assert math.isnan(cost.loc["other", "tok_per_sec_vs_base"])
    assert f"another device than base's ({h200})" in cost.loc["other", "time_na"]
    # two devices in one arm's solo runs: no mean of them
    assert cost.loc["mixed", ["tok_per_sec", "step_ms", "tok_per_sec_vs_base"]].isna().all()
    assert cost.loc["mixed", "device"] == f"{h200} / {h100}" and "different devices" in cost.loc["mixed", "time_na"]
    assert cost.loc["mixed", "peak_mem_gib"] == 10.0  # memory is each process's own, on any device


def test_solo_first_trains_every_arms_first_seed_alone_then_the_rest_two_per_gpu(tmp_path, fake_gpu_runs):
    grid = Study("p", {"a": [], "b": ["max_lr=1e-3"]}, seeds=[3, 5, 7], steps=4, root=tmp_path, runs_per_gpu=2,
                 progress=False)
    alone, everything = solo_first(grid)
    assert everything is grid and alone.folder == grid.folder and alone.runs_per_gpu == 1
    assert [p.name for p in alone._plan()] == ["a-s3", "b-s3"]
    for phase in (alone, everything):
        summary = phase.run()
    assert fake_gpu_runs == [("a-s3", "1", "0"), ("b-s3", "1", "0"),  # seed 3 alone, one run per GPU
                             ("a-s5", "2", "0"), ("b-s5", "2", "0"), ("a-s7", "2", "0"), ("b-s7", "2", "0")]
    assert summary.set_index("run")["action"].to_dict() == {"a-s3": "cached", "a-s5": "new", "a-s7": "new",
                                                             "b-s3": "cached", "b-s5": "new", "b-s7": "new"}
    summary["gpu_shared"] = [gpu_shared(json.loads((grid.folder / r / "env.json").read_text())) for r in summary["run"]]
    assert solo_runs(summary)["run"].tolist() == ["a-s3", "b-s3"]


def test_solo_first_trains_the_first_of_an_arms_own_seeds_alone(tmp_path, fake_gpu_runs):
    """The precision grid with fp8 arms: fp32_layout and the fp8 arms have more seeds (arm_seeds) than the rest."""
    grid = Study("p", {"base": [], "b": ["max_lr=1e-3"], "c": ["max_lr=2e-3"]}, seeds=[0, 1],
                 arm_seeds={"base": [0, 1, 2], "c": [4, 5]}, steps=4, root=tmp_path, runs_per_gpu=2, progress=False)
    alone, everything = solo_first(grid)
    assert everything is grid and alone.runs_per_gpu == 1 and grid.arm_seeds == {"base": [0, 1, 2], "c": [4, 5]}
    assert [p.name for p in alone._plan()] == ["base-s0", "b-s0", "c-s4"]
    for phase in (alone, everything):
        phase.run()
    assert fake_gpu_runs[:3] == [("base-s0", "1", "0"), ("b-s0", "1", "0"), ("c-s4", "1", "0")]
    assert sorted(fake_gpu_runs[3:]) == [("b-s1", "2", "0"), ("base-s1", "2", "0"), ("base-s2", "2", "0"),
                                         ("c-s5", "2", "0")]
    with pytest.raises(ValueError, match="no seeds for c"):
        solo_first(Study("p", {"a": [], "c": []}, seeds=[0], arm_seeds={"c": []}, root=tmp_path))


# ---------------------------------------------------------------- the fp8 arms: where they run, their seeds

NO_CUDA = "float8 GEMMs need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer); this run's device is cpu"
NO_TORCHAO = "torchao is not importable"


def test_fp8_arms_are_fp32_layouts_settings_plus_each_recipe():
    assert FP8_ARMS == {"fp8_tensorwise": "model.fp8=tensorwise", "fp8_rowwise": "model.fp8=rowwise"}
    assert [v.removeprefix("model.fp8=") for v in FP8_ARMS.values()] == list(FP8_RECIPES)


@pytest.mark.parametrize("problems", [[], [NO_CUDA], [NO_TORCHAO], [NO_CUDA, NO_TORCHAO]])
def test_fp8_arms_auto_runs_them_exactly_where_float8_can(problems):
    """auto: on exactly where fp8.problems (the trainer's own check, tested in test_fp8) finds none."""
    on, why = fp8_arms_on("auto", problems)
    assert on is (not problems)
    if on:
        assert why.startswith("fp8_arms=auto: on here (torchao ")
    else:
        assert why == "fp8_arms=auto: off here: " + "; ".join(problems)


def test_fp8_arms_on_and_off_are_forced_and_anything_else_refused():
    for problems in ([], [NO_CUDA, NO_TORCHAO]):
        assert fp8_arms_on("on", problems) == (True, "fp8_arms=on")
        assert fp8_arms_on("off", problems) == (False, "fp8_arms=off")
    for bad in ("true", "", "tensorwise"):
        with pytest.raises(ValueError, match="fp8_arms must be one of"):
            fp8_arms_on(bad, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_fp8_arms_forced_on_a_machine_that_cannot_stops_with_fp8s_problems_before_training():
    on, why = fp8_arms("auto")
    assert on is False and why.startswith("fp8_arms=auto: off here: ") and NO_CUDA in why
    assert fp8_arms("off") == (False, "fp8_arms=off")
    with pytest.raises(ConfigError) as err:
        fp8_arms("on")
    assert str(err.value).startswith("fp8_arms=on, but model.fp8 cannot run here: ")
    assert f"compute capability >= {'.'.join(map(str, fp8.MIN_CAPABILITY))}" in str(err.value)
    # rendering runs trained elsewhere checks nothing: nothing trains
    assert fp8_arms("on", render_only=True) == (True, "fp8_arms=on")


def test_fp8_arms_auto_when_rendering_follows_the_study_folder(tmp_path):
    """GPU runs render on a laptop, and a folder without fp8 runs renders without them on a GPU machine."""
    for problems in ([], [NO_CUDA, NO_TORCHAO]):
        assert fp8_arms_on("auto", problems, render_only=True, fp8_runs=12)[0] is True
        on, why = fp8_arms_on("auto", problems, render_only=True, fp8_runs=0)
        assert not on and why == "fp8_arms=auto, render_only: off, the study folder holds no fp8 run"
        assert fp8_arms_on("off", problems, render_only=True, fp8_runs=12) == (False, "fp8_arms=off")
    assert fp8_arms("auto", render_only=True, folder=tmp_path)[0] is False
    (tmp_path / "fp8_rowwise-s3").mkdir()
    (tmp_path / "fp32_layout-s0").mkdir()
    assert fp8_arms("auto", render_only=True, folder=tmp_path) == (
        True, "fp8_arms=auto, render_only: on, the study folder holds 1 fp8 run(s)")


def test_fp8_arm_seeds_pair_the_fp8_arms_with_the_base_at_fp8_seeds():
    assert fp8_arm_seeds(False, [0, 1], [0, 1, 2, 3, 4, 5], "fp32_layout") == {}
    six = list(range(6))
    assert fp8_arm_seeds(True, [0, 1, 2, 3], six, "fp32_layout") == {
        "fp32_layout": six, "fp8_tensorwise": six, "fp8_rowwise": six}
    with pytest.raises(ConfigError, match=r"must hold every seed of seeds \[0, 1, 2\].*missing \[2\]"):
        fp8_arm_seeds(True, [0, 1, 2], [0, 1], "fp32_layout")


def test_the_committed_124m_runs_render_with_their_sharing_unknown(tmp_path):
    """results/precision's runs predate the GPU-sharing record, the fp8 arms and the timing pass: rendered
    render_only (the README's parameters, timing_steps 0), they give the committed claims.csv row for row, the fp8
    claims (declared since) n/a saying why, and no arm's step time is reported."""
    shutil.copytree(REPO / "results" / "precision", tmp_path / "precision",
                    ignore=shutil.ignore_patterns("*.png", "*.svg", "run.ipynb", "claims.csv"))
    assert all(gpu_shared(load_run(d).env) is None for d in (tmp_path / "precision").glob("*-s*"))
    common = "['global_batch=16384', 'val_freq=50', 'val_tokens=65536', 'data_order=shards']"
    proc = subprocess.run([sys.executable, "-m", "blunb.study", "notebooks/11_precision.ipynb", "--script",
                           "-p", "preset", "124m", "-p", "steps", "300", "-p", "publish", "True",
                           "-p", "render_only", "True", "-p", "timing_steps", "0", "-p", "common", common],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "BLUNB_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = tmp_path / "precision"
    committed = pd.read_csv(REPO / "results/precision/claims.csv", dtype=str, keep_default_na=False)
    rendered = pd.read_csv(folder / "claims.csv", dtype=str, keep_default_na=False)
    pd.testing.assert_frame_equal(rendered, committed)
    fp8 = rendered[rendered["id"].str.startswith("prec.fp8_")]
    assert fp8["id"].tolist() == ["prec.fp8_body_gemms_only", "prec.fp8_tensorwise_equivalent",
                                  "prec.fp8_rowwise_equivalent"]
    assert (fp8["result"] == "n/a").all() and (fp8["verdict"] == "n/a").all()
    assert fp8["detail"].str.startswith("n/a: no fp8").all()
    assert fp8["detail"].str.contains("fp8_arms=auto, render_only: off, the study folder holds no fp8 run").all()
    cost = pd.read_csv(folder / "cost.csv", index_col="arm")
    assert (cost["solo_runs"] == 0).all() and cost["tok_per_sec"].isna().all()
    assert cost["time_na"].str.contains("0 shared it, 2 have no record").all()
    assert cost["peak_mem_gib"].notna().all()  # memory does not depend on sharing: still reported
    assert "step time and tok/s n/a" in proc.stdout


def test_the_committed_gpu_study_renders_to_its_committed_claims_and_costs(tmp_path):
    """results/precision-gpu (issue 31's scale: 38 runs and the timing pass) rendered render_only with the parameters
    its spec declares (GPU_SCALE; the corpus at the folder the runs read it from) gives the committed claims.csv and
    cost.csv: every committed verdict and time figure recomputes from the run folders."""
    committed_folder = REPO / "results" / "precision-gpu"
    shutil.copytree(committed_folder, tmp_path / "precision-gpu",  # the run folders; no rendered output
                    ignore=lambda folder, names: [] if "metrics.csv" in names else
                    [n for n in names if n.endswith((".csv", ".png", ".svg", ".ipynb", ".json"))])
    declared = dict(load_spec(REPO / "notebooks" / "11_precision_claims.py").gpu_scale["parameters"])
    declared["common"] = ["data=/data/sp-bpe16k" if o.startswith("data=") else o for o in declared["common"]]
    params = {**declared, "publish": True, "render_only": True}
    args = [arg for key, value in params.items() for arg in ("-p", key, str(value))]
    proc = subprocess.run([sys.executable, "-m", "blunb.study", "notebooks/11_precision.ipynb", "--script", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "BLUNB_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for table in ("claims.csv", "cost.csv"):
        committed = pd.read_csv(committed_folder / table, dtype=str, keep_default_na=False)
        rendered = pd.read_csv(tmp_path / "precision-gpu" / table, dtype=str, keep_default_na=False)
        pd.testing.assert_frame_equal(rendered, committed)
    assert "time figures from the timing runs (150 steps each)" in proc.stdout


def test_the_timing_pass_keeps_the_grids_settings_but_not_its_schedule(tmp_path):
    """At GPU scale the grid's common overrides pin a 2000-step schedule (warmup 200, stable 1400), which no
    150-step timing run can hold: timing_common drops the schedule and validation cadence, keeps the rest, and
    Study.check refuses the grid's overrides at 150 steps before anything runs (the notebook checks the timing
    pass before the grid)."""
    gpu_scale = load_spec(REPO / "notebooks/11_precision_claims.py").module.GPU_SCALE
    spec_common = [o if not o.startswith("data=") else "data=default"   # the spec's corpus placeholder
                   for o in gpu_scale["parameters"]["common"]]
    common = ["model.linear_dtype=bf16", *spec_common]
    timed = timing_common(common, 150)
    assert timed == ["model.linear_dtype=bf16", "global_batch=16384", "val_tokens=1048576", "data=default",
                     "model.vocab_size=16384", "val_freq=150"]
    arms = {"fp32_layout": ["global_clip=true"], "no_fp32_master": ["optimizer=adamw_bf16_nomaster"]}

    def timing(overrides):
        return Study("timing", arms, seeds=[0], preset="124m", steps=150, common=overrides, root=tmp_path,
                     max_parallel=1)

    timing(timed).check()
    assert not (tmp_path / "timing").exists()   # checked, nothing launched
    with pytest.raises(ConfigError, match="no decay tail"):
        timing(common).check()
    assert timing_common([" warmup_steps = 5", "B=4"], 12) == ["B=4", "val_freq=12"]
    for bad in (2, True, 12.0):
        with pytest.raises(ValueError, match="timing steps must be an integer >= 3"):
            timing_common(common, bad)
