"""GPU: model.fp8 (blunb/fp8.py) where it runs, CUDA >= 8.9 with torchao: one converted Linear at 1b's shape
against the exact GEMM of its bf16 values, and a few tiny training steps of each recipe against bf16 (compiled,
the CUDA default, and eager) with what the run folder records. Skipped without CUDA, torchao or float8 tensor
cores. Two deterministic=true fp8 runs: tests/test_determinism_gpu.py."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from blunb import fp8
from blunb.config import FP8_RECIPES, apply_overrides, preset
from tests.test_fp8 import FLOAT8_MIN_REL_ERROR, linear_errors

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao.float8")

STEPS = 30
# |mean train loss over the last 5 of 30 tiny steps, fp8 - bf16|, same seed and data, must stay within twice what
# another init seed moves that mean in bf16. On the CPU that move was up to 0.025 (init_seed 1 and 2 against 0;
# torch's CPU float8 GEMM moved it by 0.004 tensorwise, 0.010 rowwise), the floor here; on the GPU the test
# measures it again (init seeds 1 and 2), since one H100 run moved it by 0.051 under eager rowwise fp8.
MIN_SEED_SPREAD = 0.025


@pytest.fixture(scope="module", autouse=True)
def float8_gpu(tmp_path_factory):
    if torch.cuda.is_available() and fp8.problems(torch.device("cuda", 0)):
        pytest.skip("; ".join(fp8.problems(torch.device("cuda", 0))))
    mp = pytest.MonkeyPatch()
    mp.setenv("BLUNB_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_converted_linear_at_1b_shape_rounds_as_float8_does(recipe):
    """1b's gate_up (K 2048 -> N 11264) over one micro-batch's 16384 tokens: output, input gradient and weight
    gradient within the float8 rounding bound of their operands' dtypes (tests/test_fp8.py), and above what a
    bf16 GEMM errs, so a Linear left in bf16 fails too."""
    for what, (error, bound) in linear_errors(recipe, "cuda", 16384, 2048, 11264).items():
        assert FLOAT8_MIN_REL_ERROR < error < bound, (what, error, bound)


def _run(run_dir, recipe: str, overrides: list[str]) -> tuple[pd.DataFrame, dict, str]:
    from blunb.train import train

    cfg = apply_overrides(preset("tiny"), ["device=cuda", "seed=0", f"model.fp8={recipe}", *overrides])
    cfg.rescale_schedule(STEPS)
    cfg.val_freq = 1000
    train(cfg, run_dir)
    assert json.loads((run_dir / "config.json").read_text())["model"]["fp8"] == recipe
    facts = json.loads((run_dir / "env.json").read_text())["training"]
    return pd.read_csv(run_dir / "metrics.csv"), facts, (run_dir / "log.txt").read_text()


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    metrics, facts, _ = _run(tmp_path_factory.mktemp("bf16") / "run", "off", [])
    assert facts["precision"]["body_gemms"] == "bf16" and "fp8" not in facts
    return metrics["train_loss"].to_numpy()


@pytest.fixture(scope="module")
def loss_tolerance(bf16_losses, tmp_path_factory):
    """Twice the largest move of the last-5-step mean loss that init seeds 1 and 2 make against seed 0 in bf16 on
    this device, at least MIN_SEED_SPREAD."""
    spreads = []
    for init_seed in (1, 2):
        metrics, _, _ = _run(tmp_path_factory.mktemp(f"bf16-init{init_seed}") / "run", "off",
                             [f"init_seed={init_seed}"])
        spreads.append(abs(metrics["train_loss"].to_numpy()[-5:].mean() - bf16_losses[-5:].mean()))
    print(f"bf16 init-seed spread of the last-5-step mean loss: {', '.join(f'{x:.4f}' for x in spreads)}")
    return 2 * max(MIN_SEED_SPREAD, *spreads)


@pytest.mark.parametrize("recipe, compiled", [("tensorwise", True), ("rowwise", True), ("rowwise", False)])
def test_a_few_training_steps_stay_near_bf16(recipe, compiled, bf16_losses, loss_tolerance, tmp_path):
    metrics, facts, log = _run(tmp_path / "run", recipe, [f"compile={str(compiled).lower()}"])
    losses = metrics["train_loss"].to_numpy()
    assert np.isfinite(losses).all() and len(losses) == STEPS
    assert losses[-5:].mean() < losses[:5].mean() - 1.0   # it learns
    assert not np.array_equal(losses, bf16_losses)          # float8 GEMMs did run
    assert abs(losses[-5:].mean() - bf16_losses[-5:].mean()) < loss_tolerance
    assert facts["fp8"]["recipe"] == recipe and facts["fp8"]["linears"] == 6 * preset("tiny").model.n_layers
    assert facts["precision"]["body_gemms"].startswith(f"fp8 {recipe} (torchao ")
    assert f"float8 training, {recipe}:" in log
    assert ("WARNING: model.fp8 with compile=false" in log) != compiled
