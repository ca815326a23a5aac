"""GPU: two identical 50-step runs with deterministic=true write identical metrics.csv (every column but the
timings, pandas check_exact), AdamW, Muon, and AdamW with each model.fp8 recipe where torchao and float8 tensor
cores are (torch._scaled_mm raises no nondeterminism alert and torchao's scales are max-reductions, exact in
any order, so deterministic=true does not refuse fp8: it must repeat too), each run its own process (a fresh
one, as a re-run would be) with its own empty SYRK verdict cache. The model: tiny at T=512 in the CUDA layout
(bf16 Linears, every fused kernel on auto: Triton with its fixed config), 2 micro-batches per step, validation
at 0, 25 and 49."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from bench.determinism import first_difference
from blunb import fp8
from blunb.kernels.fused import flash_attention as fa
from blunb.runs import TIMING_COLUMNS, load_run
from tests.distributed import REPO

pytestmark = pytest.mark.gpu

CASES = {"adamw": [], "muon": ["optimizer=muon"], "fp8-tensorwise": ["model.fp8=tensorwise"],
         "fp8-rowwise": ["model.fp8=rowwise"]}
SETTINGS = ["device=cuda", "deterministic=true", "model.context_length=512", "T=512", "B=4", "global_batch=4096",
            "val_freq=25"]


def _run(run_dir, overrides, cache):
    cmd = [sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", "50", "--run-dir", str(run_dir)]
    for kv in SETTINGS + overrides:
        cmd += ["--set", kv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "BLUNB_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return load_run(run_dir)


@pytest.mark.parametrize("case", list(CASES))
def test_two_deterministic_runs_are_bit_identical(case, tmp_path):
    if case.startswith("fp8") and fp8.problems(torch.device("cuda", 0)):
        pytest.skip("; ".join(fp8.problems(torch.device("cuda", 0))))
    a, b = (_run(tmp_path / f"run{i}", CASES[case], tmp_path / f"cache{i}") for i in range(2))
    assert len(a.metrics) == 50 and a.metrics["val_loss"].notna().sum() == 3
    compared = [c for c in a.metrics.columns if c not in TIMING_COLUMNS]
    assert {"train_loss", "grad_norm", "val_loss", "lr"} <= set(compared)
    assert first_difference(a.metrics, b.metrics) is None, first_difference(a.metrics, b.metrics)
    pd.testing.assert_frame_equal(a.metrics[compared], b.metrics[compared], check_exact=True)
    training = a.env["training"]
    assert training["determinism"]["deterministic"] and training["determinism"]["cublas_workspace_config"]
    assert training["kernels"]["flash_attention"] == fa.DETERMINISTIC_CHOICE
    assert training["kernels"]["cross_entropy"] == "triton (fixed config)"
    assert json.loads((a.path / "config.json").read_text())["deterministic"] is True
    assert ("fp8" in training) == case.startswith("fp8")
