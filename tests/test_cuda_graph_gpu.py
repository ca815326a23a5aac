"""GPU: cuda_graph=true replays what the eager step computes, bit for bit. Per optimizer (AdamW, Muon), a 30-step
deterministic tiny run with graphs (3 eager steps, then the captured step replayed, validation between replays)
against the same run without: identical metrics.csv (every column but the timings, pandas check_exact) and
identical checkpoints at step 20 (model and optimizer state after 17 replays, as eager holds it). Then a run
resumed from the graph run's step-10 checkpoint (eager again for 3 steps, then captured afresh) equals the
uninterrupted one from there on. Each run is its own process with its own empty SYRK verdict cache; the
model is tests/test_determinism_gpu.py's: tiny at T=512, 2 micro-batches per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from bench.determinism import first_difference
from blunb.runs import TIMING_COLUMNS, load_run
from tests.distributed import REPO

pytestmark = pytest.mark.gpu

STEPS = 30
CASES = {"adamw": ["optimizer=adamw"], "muon": ["optimizer=muon"]}
SETTINGS = ["device=cuda", "deterministic=true", "model.context_length=512", "T=512", "B=4", "global_batch=4096",
            "val_freq=10", "ckpt_freq=10", "ckpt_keep=3"]


def _run(run_dir, overrides, cache, *extra):
    cmd = [sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", str(STEPS), "--run-dir",
           str(run_dir), *extra]
    for kv in SETTINGS + overrides:
        cmd += ["--set", kv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "BLUNB_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return load_run(run_dir), proc.stdout + proc.stderr


def _comparable(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[[c for c in metrics.columns if c not in TIMING_COLUMNS]].reset_index(drop=True)


def _tensors(step_dir, out) -> dict:
    """Every tensor of a checkpoint (a DCP folder), by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(out))
    flat = {}

    def walk(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                flat[f"{prefix}{k}"] = v

    walk(torch.load(out, weights_only=False))
    return flat


@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_eager_and_resumes(case, tmp_path):
    eager, _ = _run(tmp_path / "eager", CASES[case] + ["cuda_graph=false"], tmp_path / "cache0")
    graph, out = _run(tmp_path / "graph", CASES[case] + ["cuda_graph=true"], tmp_path / "cache1")
    assert "cuda_graph: on (cuda_graph=true" in out and "the training step was captured at step 3" in out, out[-3000:]
    assert graph.env["training"]["cuda_graph"]["on"] and not eager.env["training"]["cuda_graph"]["on"]
    assert json.loads((graph.path / "config.json").read_text())["cuda_graph"] is True
    assert len(graph.metrics) == STEPS and graph.metrics["val_loss"].notna().sum() == 4
    a, b = _comparable(eager.metrics), _comparable(graph.metrics)
    assert {"train_loss", "grad_norm", "val_loss", "lr"} <= set(a.columns)
    assert first_difference(a, b) is None, first_difference(a, b)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert graph.metrics["opt_step_ms"].iloc[3:].isna().all()   # replayed: the update is inside the graph
    # a replay allocates nothing: its peak is the capture's (step 3), the activations in the graph's pool
    peaks = graph.metrics["peak_mem_gib"]
    assert (peaks.iloc[4:] >= peaks.iloc[3]).all(), peaks.tolist()

    # the state the replays left equals eager's, tensor for tensor
    ta = _tensors(eager.path / "checkpoints" / "step_20", tmp_path / "a.pt")
    tb = _tensors(graph.path / "checkpoints" / "step_20", tmp_path / "b.pt")
    assert ta.keys() == tb.keys() and any("opt" in k for k in ta)
    differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not differ, differ

    # resumed from step 10 under graphs (3 eager steps, a fresh capture): the uninterrupted run's rows
    resumed, out = _run(tmp_path / "resumed", CASES[case] + ["cuda_graph=true"], tmp_path / "cache2",
                        "--resume", str(graph.path / "checkpoints" / "step_10"))
    assert "the training step was captured at step 13" in out, out[-3000:]
    whole = _comparable(graph.metrics[graph.metrics["step"] >= 10])
    pd.testing.assert_frame_equal(_comparable(resumed.metrics[resumed.metrics["step"] >= 10]), whole,
                                  check_exact=True)
