"""The optimizer registry: CONTRIBUTING.md's "An optimizer" recipe, followed for a toy set (torch SGD
on every parameter, world size 1) and trained through the real entry point; unknown names refused."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext

import pandas as pd
import pytest
import torch

from blunb.config import ConfigError, apply_overrides, preset
from blunb.optim import build, wsd_lr
from blunb.optim.interface import OptimizerSet, StepStats
from blunb.train import train


class PlainSGD:
    """The recipe's optimizer set: torch SGD over every parameter, no clip, one process."""

    def __init__(self, model, cfg, device, world_size):
        assert world_size == 1, "the toy set has no gradient averaging"
        self.cfg, self.forward_model, self.steps = cfg, model, 0
        self.params = list(model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=cfg.max_lr)
        self.groups = [("sgd", self.opt, (cfg.max_lr, cfg.min_lr))]

    def micro_step(self, last):
        return nullcontext()

    def eval_context(self):
        return nullcontext()

    def set_lr(self, step):
        c = self.cfg
        lr = wsd_lr(step, c.max_lr, c.min_lr, c.warmup_steps, c.max_steps, c.stable_steps)
        self.opt.param_groups[0]["lr"] = lr
        return {"lr": lr}

    def step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.params, math.inf).float()   # the norm only: no clip
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return StepStats(["sgd"], norm[None], torch.ones(1), torch.zeros(1, dtype=torch.bool),
                         scalars={"sgd_steps": torch.tensor(self.steps)})

    def drain(self):
        pass

    def describe(self):
        n = sum(p.numel() for p in self.params)
        return {"label": "toy SGD", "world_size": 1, "precision": {"masters": "none"},
                "groups": [{"name": "sgd", "params": n, "lr_max": self.cfg.max_lr, "lr_min": self.cfg.min_lr}],
                "clip": {"max_norm": 0.0, "mode": "none", "covered_params": 0, "total_params": n},
                "decayed_params": 0, "non_decayed_params": n}


@pytest.fixture
def toy_sgd(monkeypatch):
    """optimizer=toy_sgd registered for this test only; yields the sets it built."""
    built = []

    def build_sgd(*args) -> OptimizerSet:
        built.append(PlainSGD(*args))
        return built[-1]
    monkeypatch.setitem(build.OPTIMIZERS, "toy_sgd", build.OptimizerSpec(build_sgd))
    return built


def test_a_registered_optimizer_trains_through_the_trainer(toy_sgd, tmp_path):
    cfg = apply_overrides(preset("tiny"), ["optimizer=toy_sgd"])
    cfg.rescale_schedule(4)
    run_dir = train(cfg, tmp_path / "sgd")
    (opt,) = toy_sgd
    assert opt.steps == 4
    m = pd.read_csv(run_dir / "metrics.csv")
    assert list(m["step"]) == [0, 1, 2, 3] and m["train_loss"].map(math.isfinite).all()
    assert (m["norm_sgd"] > 0).all() and (m["clip_sgd"] == 1).all()
    assert m["ns_rejected"].isna().all()             # Muon's columns stay empty for another set
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
    assert json.loads((run_dir / "config.json").read_text())["optimizer"] == "toy_sgd"


def test_a_registered_optimizer_without_zero_switches_refuses_them(toy_sgd):
    with pytest.raises(ConfigError, match="optimizer=toy_sgd would ignore .*overlap_refresh=True"):
        apply_overrides(preset("tiny"), ["optimizer=toy_sgd", "overlap_refresh=true"]).validate()


def test_an_unknown_optimizer_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="optimizer must be one of") as err:
        apply_overrides(preset("tiny"), ["optimizer=lion"]).validate()
    assert all(name in str(err.value) for name in build.OPTIMIZERS)
    assert set(build.OPTIMIZERS) >= {"adamw", "muon", "ddp_adamw", "adamw_bf16_nomaster"}


class _FixedBatches:
    """evaluate()'s validation set: one fixed batch."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def batches(self, B):
        yield self.x, self.y


def test_validation_runs_in_the_precision_training_runs_in():
    """DDPAdamW trains under bf16 autocast (on CUDA): its validation must too, or the val loss measures another
    model than the one trained (fp32 matmuls). Autocast is forced on here, on the CPU, to see it: the validation
    loss equals the training forward's under micro_step, and differs from the fp32 one. The ZeRO sets' model
    carries its own dtypes: no context."""
    from blunb.model import BLU
    from blunb.train import evaluate

    cfg = apply_overrides(preset("tiny"), ["optimizer=ddp_adamw"])
    model = BLU(cfg.model, device="cpu", seed=0)
    opt = build.DDPAdamW(model, cfg, torch.device("cpu"), 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=gen)
    y = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=gen)
    val = _FixedBatches(x, y)
    fp32 = evaluate(model, val, 2, torch.device("cpu"), 1)

    opt.autocast = True
    with torch.no_grad(), opt.micro_step(last=True):
        trained = model(x, y)[1].double().item()
    with opt.eval_context():
        validated = evaluate(model, val, 2, torch.device("cpu"), 1)
    assert validated == trained and validated != fp32

    zero = build.ZeroOptimizers(BLU(cfg.model, device="cpu", seed=0), apply_overrides(preset("tiny"), []),
                                torch.device("cpu"), 1)
    assert isinstance(zero.eval_context(), nullcontext)


def test_the_trainer_validates_inside_the_sets_eval_context(monkeypatch, tmp_path):
    """The loop's validation passes run inside eval_context: DDPAdamW with autocast forced on (the CPU), each
    evaluate() call finds autocast on, and the run's val losses are finite."""
    import blunb.train as train_module

    def build_autocast(model, cfg, device, world_size):
        opt = build.DDPAdamW(model, cfg, device, world_size)
        opt.autocast = True
        return opt
    monkeypatch.setitem(build.OPTIMIZERS, "ddp_autocast", build.OptimizerSpec(build_autocast, linear_dtype="fp32"))
    seen, evaluate = [], train_module.evaluate

    def spy(*args, **kw):
        seen.append(torch.is_autocast_enabled("cpu"))
        return evaluate(*args, **kw)
    monkeypatch.setattr(train_module, "evaluate", spy)
    cfg = apply_overrides(preset("tiny"), ["optimizer=ddp_autocast"])
    cfg.rescale_schedule(3)
    m = pd.read_csv(train(cfg, tmp_path / "run") / "metrics.csv")
    assert seen and all(seen) and m["val_loss"].dropna().map(math.isfinite).all()
