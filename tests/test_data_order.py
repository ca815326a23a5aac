"""data_order=windows (blunb.data.WindowLoader): seeds that change the data, the same stream at every world
size and across a resume, epochs that cover every window once; data_seed and init_seed apart; the legacy
shard order kept for the runs made before it, and the study cache telling the two apart."""

from __future__ import annotations

import csv
import json
import pickle

import numpy as np
import pytest
import torch

from blunb.config import ConfigError, TrainConfig, apply_overrides, preset
from blunb.data import DataError, ShardLoader, WindowLoader, build_train_loader, read_shard, write_shard
from tests.run_folders import write_completed

T = 16


def _shards(folder, sizes, split="train"):
    """Shards of random byte tokens, one per size; find_shards' (sorted) order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(sizes))
    paths = []
    for i, n in enumerate(sizes):
        path = folder / f"{split}_{i:03d}.bin"
        write_shard(path, rng.integers(0, 257, n))
        paths.append(path)
    return paths


def _windows_read(loader, n_batches):
    """The (shard, offset) of every row this loader reads in its next n_batches, checked against its tokens."""
    maps = {p.name: read_shard(p) for p in loader.shards}
    out = []
    for _ in range(n_batches):
        rows = loader.where()
        x, y = loader.next_batch()
        for k, (name, offset) in enumerate(rows):
            window = torch.from_numpy(maps[name][offset: offset + loader.T + 1].astype(np.int64))
            assert torch.equal(x[k], window[:-1]) and torch.equal(y[k], window[1:]), (name, offset)
        out += rows
    return out


def _overlap(a, b, T):
    """The fraction of the input-token positions of windows `a` that windows `b` read too."""
    def positions(windows):
        return {(name, offset + i) for name, offset in windows for i in range(T)}
    return len(positions(a) & positions(b)) / (len(a) * T)


def test_two_data_seeds_share_almost_no_windows_and_the_legacy_order_fails_that(tmp_path):
    shards = _shards(tmp_path, [100_000] * 4)                  # 24,996 windows of T + 1 = 17 tokens
    first = {s: _windows_read(build_train_loader(shards, 8, T, order="windows", data_seed=s), 25) for s in (0, 1, 2)}
    assert all(len(w) == 200 for w in first.values())
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert _overlap(first[a], first[b], T) < 0.05, (a, b)

    # The legacy order permutes 4 shards only: two seeds that start on the same shard read the same 200 windows.
    def first_shard(seed):
        return int(np.random.default_rng(seed).permutation(len(shards))[0])
    twin = next(s for s in range(1, 100) if first_shard(s) == first_shard(0))
    legacy = [_windows_read(build_train_loader(shards, 8, T, order="shards", data_seed=s), 25) for s in (0, twin)]
    assert _overlap(legacy[0], legacy[1], T) == 1.0


def test_one_seed_always_reads_the_same_stream_and_where_names_its_rows(tmp_path):
    shards = _shards(tmp_path, [3000, 2100, 800])              # 368 windows: 300 batches of 2 cross an epoch
    a, b = (WindowLoader(shards, 2, T, data_seed=7) for _ in range(2))
    assert a.n_windows == 2999 // T + 2099 // T + 799 // T
    for _ in range(300):
        assert a.where() == b.where()
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.shape == (2, T) and xa.dtype == torch.int64
    _windows_read(WindowLoader(shards, 2, T, data_seed=7), 300)   # where() names exactly the tokens read


def test_every_world_size_and_micro_batch_reads_the_same_global_rows(tmp_path):
    """One global batch of 6 rows per step: W=1 with accum 3 (B=2), W=3 without (B=2), W=2 (B=3), W=1 (B=6)
    read the same rows in the same order, step after step, across shard ends and the epoch end (where the
    legacy loader's rows part: the tail of a shard it skips depends on B*W)."""
    shards = _shards(tmp_path, [4000, 4000])   # 498 windows: 100 steps of 6 rows cross an epoch

    def stream(B, W):
        loaders = [WindowLoader(shards, B, T, r, W, data_seed=3) for r in range(W)]
        accum = 6 // (B * W)
        rows = []
        for _ in range(100):
            for _ in range(accum):
                rows += [ld.next_batch()[0] for ld in loaders]
        return torch.cat(rows)

    reference = stream(2, 1)
    assert reference.shape == (600, T)
    for B, W in ((2, 3), (3, 2), (6, 1)):
        assert torch.equal(stream(B, W), reference), (B, W)


def test_resume_mid_epoch_is_bit_exact_at_the_same_and_another_world_size(tmp_path):
    shards = _shards(tmp_path, [3000, 3000])                   # 374 windows

    def ranks(B, W):
        return [WindowLoader(shards, B, T, r, W, data_seed=11) for r in range(W)]

    two = ranks(3, 2)
    for ld in two:
        ld.skip_batches(40)                                    # 240 rows in: mid-epoch
    saved = [pickle.loads(pickle.dumps(ld.state_dict())) for ld in two]   # as checkpoint.py stores it
    assert saved[0] == saved[1] and (saved[0]["epoch"], saved[0]["position"]) == (0, 240)
    again = ranks(3, 2)
    for ld, st in zip(again, saved):
        ld.load_state_dict(st)
    for _ in range(60):                                        # on across the epoch end: the same batches
        for a, b in zip(two, again):
            assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))

    fresh = ranks(3, 2)
    for _ in range(40):                                        # skip_batches == reading
        for ld in fresh:
            ld.next_batch()
    assert [ld.state_dict() for ld in fresh] == saved

    three = ranks(2, 3)                                        # another W and B, the same 6 rows a step
    for ld in three:
        ld.load_state_dict(saved[0])
    again = ranks(3, 2)
    for ld, st in zip(again, saved):
        ld.load_state_dict(st)
    for _ in range(50):
        assert torch.equal(torch.cat([ld.next_batch()[0] for ld in again]),
                           torch.cat([ld.next_batch()[0] for ld in three]))


def test_a_saved_stream_of_other_data_is_refused(tmp_path):
    shards = _shards(tmp_path, [3000, 3000])
    state = WindowLoader(shards, 2, T, data_seed=1).state_dict()
    with pytest.raises(DataError, match="data_seed=1, this loader data_seed=2"):
        WindowLoader(shards, 2, T, data_seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="T=16, this loader T=8"):
        WindowLoader(shards, 2, 8, data_seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="first differ at position 1"):
        WindowLoader(shards[:1], 2, T, data_seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="data_order=shards, this run reads data_order=windows"):
        WindowLoader(shards, 2, T, data_seed=1).load_state_dict(ShardLoader(shards, 2, T).state_dict())
    with pytest.raises(DataError, match="data_order=windows, this run reads data_order=shards"):
        ShardLoader(shards, 2, T).load_state_dict(state)
    legacy = ShardLoader(shards, 2, T).state_dict()
    del legacy["order"]                                        # a checkpoint saved before data_order existed
    ShardLoader(shards, 2, T).load_state_dict(legacy)


def test_an_epoch_reads_every_window_once_and_the_next_a_fresh_order(tmp_path):
    """B*W = 6 rows a micro-step do not divide the 205 windows: an epoch ends inside a micro-batch."""
    shards = _shards(tmp_path, [1700, 1000, 600, 10])         # the last holds no window of 17 tokens
    every = {(s.name, j * T) for s, n in zip(shards, [1700, 1000, 600, 10]) for j in range((n - 1) // T)}
    loaders = [WindowLoader(shards, 2, T, r, 3, data_seed=5) for r in range(3)]
    N = loaders[0].n_windows
    assert N == len(every) == 205
    stream = []
    for _ in range(2 * N // 6 + 1):
        stream += [row for ld in loaders for row in _windows_read(ld, 1)]
    epoch0, epoch1 = stream[:N], stream[N: 2 * N]
    assert len(set(epoch0)) == N and set(epoch0) == every     # every window once: none twice, none left out
    assert len(set(epoch1)) == N and set(epoch1) == every
    assert sum(a == b for a, b in zip(epoch0, epoch1)) < 10   # a fresh permutation, not the same one again
    assert not np.array_equal(loaders[0].permutation(0), WindowLoader(shards, 2, T, data_seed=6).permutation(0))


def test_the_window_loader_checks_the_split_and_its_token_ids(tmp_path):
    shards = _shards(tmp_path, [40, 40])                       # 2 windows each
    WindowLoader(shards, 2, T, 0, 2, data_seed=0)
    with pytest.raises(DataError, match="hold 4 window.*B\\*world_size = 6"):
        WindowLoader(shards, 2, T, 0, 3, data_seed=0)
    bad = tmp_path / "bad" / "train_000.bin"
    bad.parent.mkdir()
    write_shard(bad, np.r_[np.zeros(100, dtype=np.int64), 5000])
    with pytest.raises(DataError, match="token id 5000 at offset 100"):
        WindowLoader([bad], 2, T, data_seed=0, vocab_size=320)
    with pytest.raises(ConfigError, match="data_order must be one of"):
        build_train_loader(shards, 2, T, order="random", data_seed=0)


# ---------------------------------------------------------------- the config fields

def test_data_seed_and_init_seed_default_to_seed_and_parse_as_optional_integers():
    cfg = preset("tiny")
    assert (cfg.data_seed, cfg.init_seed, cfg.data_order) == (None, None, "windows")
    assert (cfg.resolved_data_seed(), cfg.resolved_init_seed()) == (cfg.seed, cfg.seed)
    cfg = apply_overrides(preset("tiny"), ["seed=4", "data_seed=9", "init_seed=2.0"])
    assert (cfg.resolved_data_seed(), cfg.resolved_init_seed()) == (9, 2)
    assert apply_overrides(cfg, ["data_seed=none"]).resolved_data_seed() == 4
    with pytest.raises(ConfigError, match="data_seed=x.*expected an integer"):
        apply_overrides(preset("tiny"), ["data_seed=x"])
    for bad, message in ((["init_seed=-1"], "init_seed must be an integer >= 0 or None"),
                         (["seed=-1"], "seed must be an integer >= 0, got -1"),
                         (["data_order=random"], "data_order must be one of")):
        with pytest.raises(ConfigError, match=message):
            apply_overrides(preset("tiny"), bad).validate()


def test_an_old_config_json_is_read_as_the_legacy_shard_order():
    old = json.loads(preset("tiny").to_json())
    for key in ("data_seed", "init_seed", "data_order"):
        del old[key]
    cfg = TrainConfig.from_dict(old)
    assert (cfg.data_order, cfg.data_seed, cfg.init_seed) == ("shards", None, None)
    assert TrainConfig.from_dict(json.loads(preset("tiny").to_json())).data_order == "windows"


def test_the_study_cache_does_not_take_an_old_run_for_a_windows_run(tmp_path):
    from blunb.study import Study

    (plan,) = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path)._plan()
    old = json.loads(json.dumps(plan.config))
    for key in ("data_seed", "init_seed", "data_order"):
        del old[key]                                           # a run made before these fields
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "config.json").write_text(json.dumps(old))
    (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1}))
    write_completed(plan.run_dir, 4)
    assert Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path)._plan()[0].action == "overwrite"
    legacy = Study("s", {"a": []}, seeds=[0], steps=4, root=tmp_path, common=["data_order=shards"])
    assert legacy._plan()[0].action == "cached"                # what a notebook re-rendering old runs passes


# ---------------------------------------------------------------- through the trainer

def _diag_rows(run_dir):
    with open(run_dir / "diag.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    micro = [r["detail"] for r in rows if r["item"] == "micro_loss"]
    checksum0 = next(r["detail"] for r in rows if r["item"] == "replica_checksum_match" and r["step"] == "0")
    return micro, checksum0


def test_data_seed_and_init_seed_are_separable_in_the_trainer(tmp_path):
    """Same data_seed, other init_seed: the same rows (diag names each one), other initial weights (diag's
    checksum at step 0, before any update); the other way round: other rows, the same initial weights."""
    from blunb.train import train

    data = tmp_path / "data"
    train_shards = _shards(data, [6000, 6000])
    _shards(data, [2000], split="val")
    base = ["T=16", "B=2", "global_batch=64", "val_tokens=256", f"data={data}", "diag=true", "seed=1"]
    runs = {"base": [], "init": ["init_seed=2"], "data": ["data_seed=5"]}
    out = {}
    for name, extra in runs.items():
        cfg = apply_overrides(preset("tiny"), base + extra)
        cfg.rescale_schedule(3)
        train(cfg, tmp_path / name)
        out[name] = _diag_rows(tmp_path / name)
    (base_rows, base_sum), (init_rows, init_sum), (data_rows, data_sum) = out["base"], out["init"], out["data"]
    assert len(base_rows) == 3 * 2 and all(len(d.split()) == 2 for d in base_rows)   # 3 steps x accum 2, B rows
    assert init_rows == base_rows and init_sum != base_sum
    assert data_rows != base_rows and data_sum == base_sum

    # diag named the rows the loader reads: a fresh loader of the run's data_seed reads them, in order
    loader = WindowLoader(train_shards, 2, 16, data_seed=1)
    assert base_rows == [" ".join(f"{s}:{o}" for s, o in _windows_read(loader, 1)) for _ in range(6)]

    config = json.loads((tmp_path / "init" / "config.json").read_text())
    assert (config["seed"], config["data_seed"], config["init_seed"], config["data_order"]) == (1, None, 2, "windows")
    facts = json.loads((tmp_path / "init" / "env.json").read_text())["training"]["data"]
    assert facts == {"order": "windows", "data_seed": 1, "init_seed": 2, "windows": 748, "window_tokens": 17,
                     "stride": 16, "shards": 2}
    log = (tmp_path / "init" / "log.txt").read_text()
    assert "data order: windows, data_seed 1: 748 windows of 17 tokens (stride 16) over 2 shard(s)" in log
    assert "; init_seed 2" in log


def test_the_legacy_order_in_the_trainer_reads_whole_shards_permuted_by_data_seed(tmp_path):
    from blunb.train import train

    data = tmp_path / "data"
    shards = _shards(data, [6000, 6000, 6000])
    _shards(data, [2000], split="val")
    cfg = apply_overrides(preset("tiny"), ["T=16", "B=2", "global_batch=64", "val_tokens=256", f"data={data}",
                                           "diag=true", "seed=1", "data_seed=4", "data_order=shards"])
    cfg.rescale_schedule(3)
    train(cfg, tmp_path / "run")
    rows, _ = _diag_rows(tmp_path / "run")
    order = [shards[i].name for i in np.random.default_rng(4).permutation(3)]   # what runs before data_order did
    assert rows == [f"{order[0]}:{32 * k}" for k in range(6)]                   # one contiguous span per micro-batch
    assert f"legacy, whole shards permuted ({', '.join(order)})" in (tmp_path / "run" / "log.txt").read_text()
