"""cuda_graph on the CPU: the setting's validation, the capture decision (a pure function of the config and the
device facts), runs that are unchanged by it, and the device-held learning rate giving the optimizers the same
bits as a host float (what lets a replay equal the eager step; the replay itself: tests/test_cuda_graph_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from blunb import kernels
from blunb.config import ConfigError, TrainConfig, apply_overrides, preset
from blunb.cuda_graph import WARMUP_STEPS, blockers, decide
from blunb.runs import TIMING_COLUMNS, load_run
from tests.distributed import REPO


def _cfg(*overrides: str) -> TrainConfig:
    """The tiny preset at cuda_graph=auto (the intended default), then the overrides."""
    return apply_overrides(preset("tiny"), ["cuda_graph=auto", *overrides])


# ---------------------------------------------------------------- the setting

def test_the_setting_takes_true_false_or_auto():
    assert preset("tiny").cuda_graph is False   # until bench/speed.py has measured where it wins
    assert _cfg("cuda_graph=auto").cuda_graph == "auto"
    assert _cfg("cuda_graph=on").cuda_graph is True and _cfg("cuda_graph=false").cuda_graph is False
    with pytest.raises(ConfigError, match="cuda_graph=maybe.*expected true, false or auto"):
        _cfg("cuda_graph=maybe")
    cfg = preset("tiny")
    cfg.cuda_graph = "yes"
    with pytest.raises(ConfigError, match="cuda_graph must be true, false or auto"):
        cfg.validate()
    # a config.json from before the setting ran without graphs
    old = json.loads(preset("tiny").to_json())
    del old["cuda_graph"]
    assert TrainConfig.from_dict(old).cuda_graph is False


@pytest.mark.parametrize("overrides, world_size, reason", [
    (["device=cpu"], 1, "the device is the CPU"),
    (["device=cuda"], 2, "world size 2"),
    (["optimizer=ddp_adamw"], 1, "optimizer=ddp_adamw keeps its learning rate on the host"),
    (["kernels=adamw=torch"], 1, "kernels adamw=torch"),
    (["diag=true"], 1, "diag=true"),
    (["fault_nan_grad=3:0"], 1, "fault_nan_grad"),
])
def test_true_where_the_step_cannot_be_captured_is_a_config_error(overrides, world_size, reason):
    cfg = _cfg("cuda_graph=true", *overrides)
    with pytest.raises(ConfigError, match=f"cuda_graph=true cannot capture this run's step: .*{reason}"):
        cfg.validate(world_size=world_size)
    _cfg("cuda_graph=auto", *overrides).validate(world_size=world_size)   # auto falls back instead


# ---------------------------------------------------------------- the decision

def test_auto_captures_on_cuda_at_one_rank_with_the_zero_sets():
    for optimizer in ("adamw", "muon"):
        d = decide(_cfg(f"optimizer={optimizer}"), "cuda", 1)
        assert d.on and d.why.startswith("auto: CUDA") and f"optimizer={optimizer}" in d.why
        assert d.facts("auto") == {"setting": "auto", "on": True, "why": d.why, "warmup_steps": WARMUP_STEPS}
    assert decide(_cfg("cuda_graph=true"), "cuda", 1).why.startswith("cuda_graph=true")
    assert decide(_cfg("cuda_graph=true", "compile=true", "deterministic=true"), "cuda", 1).on


@pytest.mark.parametrize("overrides, device, world_size, reason", [
    ([], "cpu", 1, "the device is the CPU"),
    ([], "cuda", 4, "world size 4: the ZeRO collectives"),
    (["optimizer=ddp_adamw"], "cuda", 1, "optimizer=ddp_adamw"),
    (["optimizer=adamw_bf16_nomaster"], "cuda", 1, "optimizer=adamw_bf16_nomaster"),
    (["kernels=adamw=torch"], "cuda", 1, "kernels adamw=torch"),
    (["diag=true"], "cuda", 1, "diag=true"),
    (["fault_nan_grad=1:0"], "cuda", 1, "fault_nan_grad"),
    (["model.fp8=tensorwise"], "cuda", 1, "model.fp8=tensorwise"),
])
def test_auto_falls_back_saying_why(overrides, device, world_size, reason):
    d = decide(_cfg(*overrides), device, world_size)
    assert not d.on and d.why.startswith("auto: ") and reason in d.why
    with pytest.raises(ConfigError, match=reason):
        decide(_cfg("cuda_graph=true", *overrides), device, world_size)


def test_false_is_off_everywhere_and_blockers_add_up():
    assert decide(_cfg("cuda_graph=false"), "cuda", 1) == decide(_cfg("cuda_graph=false", "diag=true"), "cpu", 8)
    assert not decide(_cfg("cuda_graph=false"), "cuda", 1).on
    assert len(blockers(_cfg("diag=true", "optimizer=ddp_adamw"), "cpu", 2)) == 4
    assert blockers(_cfg(), None, 1) == []   # the device not known yet: nothing said about it


# ---------------------------------------------------------------- the lr on the device

def test_the_fused_adamw_reads_a_device_lr_as_the_float_it_holds():
    from tests.test_fused_kernels import ADAMW_HYPER, _adamw_inputs

    segments, state, scalars = _adamw_inputs(torch.float16, torch.float32)
    table = kernels.adamw_block_table(segments, "cpu")
    lr = 2.7e-4 + 1e-12   # not an fp32 value: both must round it the same way
    outs = []
    for held in (lr, torch.tensor(lr, dtype=torch.float64)):
        out = {k: v.clone() for k, v in state.items()}
        kernels.adamw_update_(out["master"], out["exp_avg"], out["exp_avg_sq"], out["grad"], out["param"],
                              out["steps"], table, **{**ADAMW_HYPER, "lr": held}, **scalars, backend="triton")
        outs.append(out)
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in state)
    assert not torch.equal(outs[0]["master"], state["master"])


def test_muon_steps_the_same_bits_with_the_lr_on_the_device():
    from blunb.optim.muon import build_muon
    from tests.test_muon import _Toy

    lr, adamw_lr = 0.02 + 1e-11, 3e-3 + 1e-13
    torch.manual_seed(0)
    base = _Toy(False)
    x = torch.randint(0, 40, (4, 8))
    finals = []
    for on_device in (False, True):
        model = _Toy(False)
        model.load_state_dict(base.state_dict())
        opt = build_muon(model, lr=lr, adamw_lr=adamw_lr, max_grad_norm=1.0, verbose=False)
        if on_device:
            for g in opt.param_groups:
                g["lr"] = torch.tensor(g["lr"], dtype=torch.float64)
        for _ in range(3):
            h = model.wte(x)
            for b in model.blocks:
                h = b["norm"](h + b["wq"](h))
                h = h + b["up"](h)[..., :16]
            model.lm_head(model.norm_f(h)).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))
    assert not torch.equal(finals[0][0], base.wte.weight)


def test_set_lr_fills_the_device_lr_in_place():
    from blunb.model import BLU
    from blunb.optim.build import build_optimizers

    cfg = _cfg("optimizer=muon")
    model = BLU(cfg.model, device="cpu", seed=0)
    opt = build_optimizers(model, cfg, torch.device("cpu"), 1)
    floats = opt.set_lr(5)
    opt.keep_lr_on_device()
    held = [o.param_groups[0]["lr"] for _, o, _ in opt.groups]
    assert all(t.dtype == torch.float64 and t.dim() == 0 for t in held)
    assert opt.set_lr(5) == floats and [float(t) for t in held] == [floats["lr"], floats["lr_muon"]]
    later = opt.set_lr(95)   # the same tensors, this step's values
    assert all(o.param_groups[0]["lr"] is t for (_, o, _), t in zip(opt.groups, held))
    assert [float(t) for t in held] == [later["lr"], later["lr_muon"]] and later != floats


# ---------------------------------------------------------------- CPU runs

def _train(run_dir, *sets, check=True):
    cmd = [sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", "4", "--run-dir", str(run_dir)]
    for kv in ("global_batch=2048", *sets):
        cmd += ["--set", kv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cpu_runs_are_unchanged_and_say_why_there_is_no_graph(tmp_path):
    proc = _train(tmp_path / "auto", "cuda_graph=auto")
    _train(tmp_path / "off", "cuda_graph=false")
    auto, off = load_run(tmp_path / "auto"), load_run(tmp_path / "off")
    cols = [c for c in auto.metrics.columns if c not in TIMING_COLUMNS]
    pd.testing.assert_frame_equal(auto.metrics[cols], off.metrics[cols], check_exact=True)
    assert "cuda_graph: off (auto: the device is the CPU" in proc.stdout + proc.stderr
    assert auto.env["training"]["cuda_graph"] == {"setting": "auto", "on": False, "warmup_steps": None,
                                                  "why": "auto: the device is the CPU; CUDA graphs need CUDA"}
    assert off.env["training"]["cuda_graph"]["why"] == "cuda_graph=false"
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["cuda_graph"] is False   # what ran
    assert auto.metrics["opt_step_ms"].notna().all()


def test_true_on_the_cpu_stops_before_any_work(tmp_path):
    proc = _train(tmp_path / "r", "cuda_graph=true", check=False)
    assert proc.returncode == 2 and not (tmp_path / "r").exists()
    assert proc.stderr.strip() == ("error: cuda_graph=true cannot capture this run's step: the device is the CPU; "
                                   "CUDA graphs need CUDA. Set cuda_graph=false (or auto: on where it is supported)")
