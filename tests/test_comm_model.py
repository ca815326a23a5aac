"""blunb.studies.overlap: the layouts against the optimizers' own, hand-checked collective times and exposures,
the equivalence table on hand-made run folders, and bench/overlap_timeline.py's CPU smoke mode."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from blunb.config import apply_overrides, preset
from blunb.model import BLU
from blunb.optim.build import build_optimizers
from blunb.optim.muon import ShardedMuon
from blunb.studies import overlap
from tests.distributed import REPO


@pytest.fixture
def fake_world():
    """A process group of any size in this one process (collectives are no-ops): the optimizers
    then build their W-rank layouts without W processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world: int, rank: int = 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _tiny_two_dtypes(optimizer, collective, reduce_dtype):
    """tiny with bf16 Linears (two AdamW dtype groups, as on a GPU) and small buckets."""
    cfg = preset("tiny")
    cfg.model = dataclasses.replace(cfg.model, linear_dtype="bf16")
    cfg.optimizer, cfg.reduce_dtype = optimizer, reduce_dtype
    cfg.collective = cfg.muon_collective = collective
    cfg.bucket_mb, cfg.overlap_refresh = 0.05, True    # overlap_refresh: the optimizers then hold a publish order
    return cfg


@pytest.mark.parametrize("world", [2, 3, 8])
def test_units_are_the_optimizers_own_layouts(world, fake_world):
    for optimizer, collective, reduce_dtype in itertools.product(("adamw", "muon"), ("rs_ag", "reduce_bcast"),
                                                                 ("param", "fp32", "bf16")):
        fake_world(world)
        cfg = _tiny_two_dtypes(optimizer, collective, reduce_dtype)
        model = BLU(cfg.model)
        opt = build_optimizers(model, cfg, torch.device("cpu"), world)
        units = overlap.comm_units(model, cfg, world)
        extra = overlap.reduce_buffer_bytes(units, world)
        names = {id(p): n for n, p in model.named_parameters()}
        case = (world, optimizer, collective, reduce_dtype)
        assert list(dict.fromkeys(units["group"])) == [name for name, _, _ in opt.groups], case
        for name, o, _ in opt.groups:
            u = units[units["group"] == name].sort_values("reduce_pos")
            if isinstance(o, ShardedMuon):
                real = [tuple(names[id(p)] for p in o._units[k]) for k in o._grad_order]
                wire = [o._buckets[k].chunk * world if collective == "rs_ag" else o._units[k][0].numel()
                        for k in o._grad_order]
                publish = [o._grad_order.index(k) for k in o._publish_order]
                buffers = sum(b.rflat.nbytes + b.rown.nbytes for b in o._buckets if b.rflat is not b.flat)
            else:
                real = [tuple(names[id(o._params[i])] for i in idx) for idx in o._buckets]
                wire = [c * world for c in o._bucket_chunk]
                publish = list(o._publish_order)
                buffers = o._extra_bytes(o.red_dtype) - o._extra_bytes(o.dtype)
            assert [tuple(p) for p in u["params"]] == real, case
            assert list(u["wire_numel"]) == wire, case
            assert list(u.sort_values("publish_pos")["reduce_pos"]) == publish, case
            assert extra[name] == buffers, case
        del opt
        dist.destroy_process_group()


def test_bytes_per_rank_by_hand():
    """tiny (fp32 on the CPU, 779,648 parameters, one 50 MB bucket) at W = 2: the bucket is
    779,648 elements (even: no padding); each phase sends half of its bytes from every rank."""
    model = overlap.shapes_model("tiny", "cpu")
    t = overlap.layout_table(model, "tiny", "adamw", topologies=[overlap.TOPOLOGIES[0]])
    row = t[(t["collective"] == "rs_ag") & (t["reduce_dtype"] == "param")].iloc[0]
    n = 779_648
    assert (row["units"], row["params"], row["padding"], row["calls_per_step"]) == (1, n, 0, 2)
    assert row["sent_mib_per_rank"] == pytest.approx(0.5 * (4 * n + 4 * n) / 2**20)
    bf16 = t[(t["collective"] == "rs_ag") & (t["reduce_dtype"] == "bf16")].iloc[0]
    assert bf16["reduce_mib"] == pytest.approx(row["reduce_mib"] / 2) and bf16["publish_mib"] == row["publish_mib"]
    rb = t[(t["collective"] == "reduce_bcast") & (t["reduce_dtype"] == "param")].iloc[0]
    assert rb["sent_mib_per_rank"] == row["sent_mib_per_rank"] and rb["calls_per_step"] == 4   # 2 chunks x 2 phases


def test_collective_times_by_hand():
    link = overlap.Link("test", 400.0, 0.9, 10.0, "by hand")          # 360 GB/s, 10 us per call
    gb = 1e9
    assert overlap.collective_ms(gb, 8, link, "rs_ag") == pytest.approx(0.010 + 7 / 8 * 1e3 / 360)
    # reduce_bcast: W chunk reduces, each hop carrying all of the chunk: W x alpha + n / bw
    assert overlap.collective_ms(gb, 8, link, "reduce_bcast", calls=8) == pytest.approx(0.080 + 1e3 / 360)
    assert overlap.collective_ms(gb, 1, link, "rs_ag") == 0.0


def test_model_is_monotone():
    model = overlap.shapes_model("1b")
    t = overlap.layout_table(model, "1b", "adamw")
    rs = t[(t["collective"] == "rs_ag") & (t["reduce_dtype"] == "param")].groupby("topology")["serial_comm_ms"].sum()
    assert rs["1x2"] < rs["1x4"] < rs["1x8"] < rs["2x8"]          # more ranks, then the NIC
    in_node = t[(t["collective"] == "rs_ag") & (t["topology"] == "1x8")]
    by_dtype = in_node.groupby("reduce_dtype")["sent_mib_per_rank"].sum()
    assert by_dtype["bf16"] < by_dtype["param"] < by_dtype["fp32"]  # the fp32 embedding group / the bf16 Linears
    layouts = t[(t["reduce_dtype"] == "param")].groupby(["topology", "collective"])["serial_comm_ms"].sum()
    assert all(layouts[(topo, "rs_ag")] < layouts[(topo, "reduce_bcast")] for topo in ("1x2", "1x4", "1x8", "2x8"))


def _units(rows):
    base = {"group": "g", "group_pos": 0, "kind": "rs_ag", "calls": 1}
    return pd.DataFrame([{**base, **r} for r in rows])


def test_exposure_of_a_known_timeline():
    # Two buckets ready at 2 and 8 ms of a 10 ms backward, 3 ms each: the second ends at 11 -> 1 ms exposed.
    units = _units([{"reduce_pos": 0, "ready_ms": 2.0, "reduce_ms": 3.0},
                    {"reduce_pos": 1, "ready_ms": 8.0, "reduce_ms": 3.0}])
    assert overlap.exposed_reduce_ms(units, 10.0, overlap=True) == pytest.approx(1.0)
    assert overlap.exposed_reduce_ms(units, 10.0, overlap=False) == pytest.approx(6.0)
    # Launched strictly in order: bucket 1 ready first still waits for bucket 0 (ready at 9): ends at 15.
    units = _units([{"reduce_pos": 0, "ready_ms": 9.0, "reduce_ms": 3.0},
                    {"reduce_pos": 1, "ready_ms": 1.0, "reduce_ms": 3.0}])
    assert overlap.exposed_reduce_ms(units, 10.0, overlap=True) == pytest.approx(5.0)
    # Refresh: stage 0 (needed at 0) waits 3 ms for its unit; stage 1 is needed 5 ms later, at 8,
    # after its unit landed (6): 3 ms exposed, the embedding's publish, as the seed says it must be.
    units = _units([{"publish_pos": 0, "stages": (0,), "publish_ms": 3.0},
                    {"publish_pos": 1, "stages": (1,), "publish_ms": 3.0}])
    assert overlap.exposed_refresh_ms(units, [0.0, 5.0], overlap=True) == pytest.approx(3.0)
    assert overlap.exposed_refresh_ms(units, [0.0, 1.0], overlap=True) == pytest.approx(5.0)
    assert overlap.exposed_refresh_ms(units, [0.0, 5.0], overlap=False) == pytest.approx(6.0)


def _timeline(name="tiny", optimizer="adamw"):
    model = overlap.shapes_model(name, "cpu")
    params = list(model.named_parameters())
    n = len(params)
    backward = pd.DataFrame({"param": [p for p, _ in params], "numel": [t.numel() for _, t in params],
                             "dtype": "fp32", "grad_ready_ms": [10.0 * (n - i) / n for i in range(n)]})
    forward = pd.DataFrame({"stage": range(5), "module": "m", "needed_ms": [0.0, 0.1, 1.0, 2.0, 3.0]})
    return overlap.Timeline(name, optimizer, 8, 128, 4, backward, forward, 4.0, 10.0, 1.0, float("nan"), 1)


def test_overlaps_never_cost_and_predictions_cover_the_grid():
    pred = overlap.predictions([_timeline(), _timeline(optimizer="muon")])
    assert len(pred) == 2 * 4 * 4 * 2 * 3
    keys = ["optimizer", "topology", "collective", "reduce_dtype"]
    e = pred.pivot_table(index=keys, columns="overlap", values="exposed_ms")
    at_most = lambda a, b: bool((e[a] <= e[b] + 1e-9).all())  # noqa: E731  (1e-9 ms: rounding)
    assert at_most("both", "backward") and at_most("both", "refresh")
    assert at_most("backward", "off") and at_most("refresh", "off")
    best = overlap.best_variants(pred)
    assert len(best) == 2 * 4 and (best["step_ms"] <= best["step_ms_serial"]).all()


def test_measured_rows_get_predictions(tmp_path):
    (tmp_path / "overlap").mkdir()
    row = {"preset": "tiny", "optimizer": "adamw", "world_size": 2, "nodes": 1, "collective": "rs_ag",
           "muon_collective": "rs_ag", "reduce_dtype": "param", "overlap_backward": True, "overlap_refresh": False,
           "bucket_mb": 50, "muon_buckets": 6, "B": 4, "T": 128, "global_batch": 1024, "step_ms": 20.0,
           "device": "x", "torch": "y"}
    pd.DataFrame([row]).to_csv(tmp_path / "overlap" / "multi_gpu_test.csv", index=False)
    measured = overlap.load_measured(tmp_path)
    assert len(measured) == 1 and measured["source"].iloc[0] == "overlap/multi_gpu_test.csv"
    both = overlap.predict_measured(measured, [_timeline()])
    # half the timeline's tokens per micro-batch: half its 14 ms compute, plus the W=2 optimizer step
    assert both["predicted_step_ms"].iloc[0] == pytest.approx(7.0 + 0.5, abs=0.2)
    assert overlap.load_measured(tmp_path / "none").empty


def test_arms_name_every_switch_once():
    quick, cover, full = (overlap.equivalence_arms(grid=g) for g in overlap.GRIDS)
    assert (len(quick), len(cover), len(full)) == (8, 14, 24 + 48) and set(quick) <= set(cover) <= set(full)
    for arm, overrides in full.items():
        opt, tokens = overlap.arm_tokens(arm)
        assert overlap.arm_name(opt, tokens) == arm and len(set(overrides)) == len(overrides)
        apply_overrides(preset("tiny"), overrides).validate(world_size=2)


def _fake_run(folder, name, losses, checksums, world=2):
    d = folder / name
    d.mkdir(parents=True)
    val = [losses[0]] + [None] * (len(losses) - 1)
    pd.DataFrame({"step": range(len(losses)), "train_loss": losses, "val_loss": val,
                  "grad_norm": 1.0}).to_csv(d / "metrics.csv", index=False)
    pd.DataFrame({"step": range(len(checksums)), "item": "replica_checksum_match", "rank": "", "micro": "",
                  "value": 1, "detail": [f"r0={c} r1={c}" for c in checksums]}).to_csv(d / "diag.csv", index=False)
    return {"arm": name.rsplit("-s", 1)[0], "seed": 0, "world_size": world, "status": "completed", "run_dir": str(d)}


def test_equivalence_table_is_bit_exact(tmp_path):
    loss = [5.387327671051025, 4.909249782562256]
    rows = [_fake_run(tmp_path, "adamw.serial-s0", loss, ["0xa", "0xb"]),
            _fake_run(tmp_path, "adamw.ob+or-s0", loss, ["0xa", "0xb"]),
            _fake_run(tmp_path, "adamw.rb-s0", [loss[0], 4.909249782562257], ["0xa", "0xc"])]   # one ulp off
    table = overlap.equivalence_table(pd.DataFrame(rows)).set_index("arm")
    assert table.loc["adamw.ob+or", ["metrics_identical", "params_identical"]].tolist() == [True, True]
    assert table.loc["adamw.rb", ["metrics_identical", "params_identical"]].tolist() == [False, False]
    assert table.loc["adamw.rb", "kind"] == "layout" and table.loc["adamw.ob+or", "kind"] == "overlap"
    assert 0 < table.loc["adamw.rb", "max_abs_loss_diff"] < 1e-14


def test_timeline_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "overlap"
    cmd = [sys.executable, "bench/overlap_timeline.py", "--device", "cpu", "--presets", "tiny", "--B", "2", "--T", "32",
           "--iters", "1", "--warmup", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    timelines = overlap.load_timelines(out)
    assert [(t.preset, t.optimizer, t.B, t.T) for t in timelines] == [("tiny", "adamw", 2, 32), ("tiny", "muon", 2, 32)]
    for t in timelines:
        assert len(t.backward) == len(list(overlap.shapes_model("tiny", "cpu").parameters()))
        assert t.backward["grad_ready_ms"].between(0, t.bwd_ms).all()
        assert len(t.forward) == 1 + 4 and t.forward["needed_ms"].is_monotonic_increasing
    assert overlap.read_meta(out)["presets"]["tiny"] == {"B": 2, "T": 32, "n_layers": 4}
    assert len(pd.read_csv(out / "buckets.csv"))
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, "bench/overlap_timeline.py"], capture_output=True, text=True, cwd=REPO,
                              env=env, timeout=120)
        assert proc.returncode != 0 and "needs CUDA" in proc.stderr


def test_best_bucket_size_prefers_fewer_collectives_on_a_flat_curve():
    sweep = pd.DataFrame({"bucket_mb": [1, 10, 100, 1000], "exposed_ms": [2.0, 1.0, 1.005, 3.0]})
    assert overlap.best_bucket_size(sweep)["bucket_mb"] == 100          # within 1% of the minimum, larger
    muon = pd.DataFrame({"muon_buckets": [1, 6, 12, 24], "exposed_ms": [9.0, 1.004, 1.0, 1.0]})
    assert overlap.best_bucket_size(muon)["muon_buckets"] == 6          # the fewest buckets
