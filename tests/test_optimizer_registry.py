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
