"""bench/overlap_grid.py: the exposed-communication interval arithmetic, the kernel filter on a
synthetic profiler trace, bad input rejected before any work, and a real W = 2 gloo launch (--smoke)
whose CSV blunb.studies.overlap.load_measured (the overlap notebook's section 4) reads."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from bench.overlap_grid import comm_ms, default_grid, exposed_time, main, merge
from blunb.studies.overlap import MEASURED_KEYS, load_measured
from tests.distributed import REPO, torchrun

SCRIPT = REPO / "bench" / "overlap_grid.py"


@pytest.mark.parametrize("comm, compute, busy, exposed", [
    ([], [], 0.0, 0.0),                                   # empty
    ([], [(0, 5)], 0.0, 0.0),
    ([(0, 10)], [], 10.0, 10.0),                          # nothing to hide behind
    ([(0, 10)], [(20, 30)], 10.0, 10.0),                  # disjoint
    ([(0, 10)], [(5, 15)], 10.0, 5.0),                    # overlapping the end
    ([(5, 15)], [(0, 10)], 10.0, 5.0),                    # overlapping the start
    ([(0, 10)], [(2, 4), (6, 8)], 10.0, 6.0),             # compute nested in communication
    ([(2, 4)], [(0, 10)], 2.0, 0.0),                      # communication nested in compute
    ([(0, 10), (5, 20)], [(8, 12)], 20.0, 16.0),          # overlapping communication counted once
    ([(0, 4), (6, 10)], [(3, 7)], 8.0, 6.0),              # one compute interval across two comm ones
    ([(6, 10), (0, 4)], [(9, 30), (1, 2), (1, 3)], 8.0, 5.0),   # unsorted, overlapping compute
])
def test_exposed_time(comm, compute, busy, exposed):
    assert exposed_time(comm, compute) == (busy, exposed)


def test_merge_unions_intervals():
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [[0, 4], [5, 6]]


class _Trace:
    """A profiler stand-in: export_chrome_trace writes the given events."""

    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        Path(path).write_text(json.dumps({"traceEvents": self.events}))


def _event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_comm_ms_counts_nccl_kernels_against_compute_kernels_only():
    events = [_event("kernel", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 0, 1000),
              _event("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 0, 400),
              _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 400, 600),   # not compute
              _event("gpu_user_annotation", "ProfilerStep#3", 0, 2000),            # not a kernel
              _event("cpu_op", "nccl:reduce_scatter", 0, 1000)]
    assert comm_ms(_Trace(events), steps=2) == (0.5, 0.3)
    assert all(math.isnan(v) for v in comm_ms(_Trace([_event("cpu_op", "aten::mm", 0, 5)]), steps=1))


@pytest.mark.parametrize("argv, env, message", [
    (["--variants", "adamw.ob+bogus"], {}, "variant adamw.ob+bogus: tokens must be"),
    (["--variants", "sgd.serial"], {}, "the optimizer must be adamw or muon"),
    (["--variants", "adamw.mrb"], {}, "mrb for muon only"),
    (["--variants", "fancy"], {}, "variant fancy: unknown"),
    (["--optimizers", "lion"], {}, "unknown optimizers"),
    (["--preset", "7b"], {}, "unknown preset"),
    (["--T", "4096"], {}, "exceeds model.context_length"),   # 1b: 2048
    ([], {"WORLD_SIZE": "1"}, "needs W >= 2"),
    ([], {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "not a multiple of LOCAL_WORLD_SIZE"),
])
def test_bad_input_is_rejected_before_any_work(argv, env, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "never" / "grid.csv"
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not out.parent.exists()


def test_default_grid_has_every_combination():
    grid = default_grid()
    assert len(grid) == len(set(grid)) == 2 + 2 * 24
    assert {"adamw.serial", "adamw.ob+or+rb+bf16", "muon.or+mrb+fp32", "ddp_adamw", "torch_zero"} <= set(grid)


VARIANTS = ["ddp_adamw", "torch_zero", "adamw.serial", "adamw.ob+or+rb+bf16", "muon.serial", "muon.ob+or+mrb+fp32"]


@pytest.mark.slow
def test_smoke_launch_writes_the_measured_csv(tmp_path):
    out = tmp_path / "grid.csv"
    torchrun(SCRIPT, 2, "--smoke", "--variants", ",".join(VARIANTS), "--out", str(out), timeout=600)  # loaded CI
    df = pd.read_csv(out)
    assert list(df["variant"]) == VARIANTS
    assert set(MEASURED_KEYS + ["step_ms", "device", "torch"]) <= set(df.columns)
    assert (df["world_size"] == 2).all() and (df["preset"] == "tiny").all() and (df["device"] == "cpu").all()
    assert (df["global_batch"] == df["B"] * df["T"] * 2).all()
    assert list(df["optimizer"]) == ["ddp_adamw", "torch_zero", "adamw", "adamw", "muon", "muon"]
    zero = df.set_index("variant").loc[VARIANTS[2:]]
    assert list(zero["overlap_backward"]) == list(zero["overlap_refresh"]) == [False, True, False, True]
    assert list(zero["collective"]) == ["rs_ag", "reduce_bcast", "rs_ag", "rs_ag"]
    assert list(zero["muon_collective"]) == ["rs_ag", "rs_ag", "rs_ag", "reduce_bcast"]
    assert list(zero["reduce_dtype"]) == ["param", "bf16", "param", "fp32"]
    assert (df["step_ms"] > 0).all() and (df["tok_per_s"] > 0).all() and (df["speedup_vs_w1"] > 0).all()
    assert df["step_vs_ddp"].iloc[1:].gt(0).all() and df["loss_last"].map(math.isfinite).all()
    assert df["exposed_comm_ms"].isna().all()              # no kernels on the CPU
    results = tmp_path / "results"
    (results / "overlap").mkdir(parents=True)
    shutil.copy(out, results / "overlap" / "multi_gpu_smoke.csv")
    measured = load_measured(results)
    assert len(measured) == len(VARIANTS) and set(measured["source"]) == {"overlap/multi_gpu_smoke.csv"}
