import numpy as np
import pytest

from blunb.data import (
    MAGIC,
    ByteTokenizer,
    DataError,
    ShardLoader,
    prepare_corpus,
    read_header,
    read_shard,
    write_shard,
)


def test_shard_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50304, 1000)
    write_shard(tmp_path / "a.bin", tokens)
    header = np.fromfile(tmp_path / "a.bin", dtype=np.int32, count=3)
    assert list(header) == [MAGIC, 1, 1000]
    assert np.array_equal(read_shard(tmp_path / "a.bin"), tokens)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:100], "shorter than"),
    (lambda b: b[:-2], "truncated or corrupt"),
    (lambda b: b"\x00" * 4 + b[4:], "bad magic"),
    (lambda b: b[:4] + np.int32(7).tobytes() + b[8:], "unsupported shard version"),
])
def test_corrupt_shards_name_the_file(tmp_path, damage, message):
    good = tmp_path / "good.bin"
    write_shard(good, np.arange(100))
    bad = tmp_path / "val_bad.bin"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(DataError, match=message) as err:
        read_header(bad)
    assert "val_bad.bin" in str(err.value)


def test_uint16_overflow_is_refused(tmp_path):
    with pytest.raises(DataError, match="uint16"):
        write_shard(tmp_path / "x.bin", [70000])


def _loader_shards(tmp_path, n_shards=2, ntok=5000):
    paths = []
    for i in range(n_shards):
        p = tmp_path / f"train_{i}.bin"
        write_shard(p, np.arange(i * ntok, (i + 1) * ntok) % 65536)
        paths.append(p)
    return paths


def test_loader_ranks_are_disjoint_and_targets_shifted(tmp_path):
    shards = _loader_shards(tmp_path)
    B, T, W = 2, 16, 3
    seen = []
    for rank in range(W):
        loader = ShardLoader(shards, B, T, rank, W)
        for _ in range(20):
            x, y = loader.next_batch()
            assert x.shape == (B, T) and np.array_equal(y.numpy().ravel()[:-1], x.numpy().ravel()[1:])
            seen.append(x.numpy().ravel())
    flat = np.concatenate(seen)
    assert len(np.unique(flat)) == len(flat)  # tokens are distinct ids here, so no window is read twice


def test_skip_batches_matches_reading(tmp_path):
    shards = _loader_shards(tmp_path)
    a, b = ShardLoader(shards, 2, 16, 1, 2), ShardLoader(shards, 2, 16, 1, 2)
    for _ in range(90):  # crosses into the second shard
        a.next_batch()
    b.skip_batches(90)
    assert a.where() == b.where() and a.where()[0] == "train_1.bin"
    assert np.array_equal(a.next_batch()[0], b.next_batch()[0])


def test_short_shard_is_refused(tmp_path):
    write_shard(tmp_path / "train_0.bin", np.arange(50))
    with pytest.raises(DataError, match="train_0.bin.*too short"):
        ShardLoader([tmp_path / "train_0.bin"], 2, 16, 0, 2)


def test_prepare_corpus(tmp_path):
    docs = []
    for i in range(10):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(f"document {i} é\n" * 3)
        docs.append(p)
    meta = prepare_corpus(docs, tmp_path / "out", val_every=5, shard_tokens=64, progress=False)
    tok = ByteTokenizer()
    assert meta["tokenizer"] == tok.name and len(meta["sha256"]) == 64
    train = sorted((tmp_path / "out").glob("train_*.bin"))
    val = sorted((tmp_path / "out").glob("val_*.bin"))
    assert len(train) > 1 and len(val) >= 1
    assert sum(read_header(p) for p in train) == meta["train_tokens"]
    first = np.asarray(read_shard(train[0]))
    text = tok.decode(first[: first.tolist().index(tok.eot)])
    assert text == "document 0 é\n" * 3
    assert not list(tmp_path.glob(".out.*"))  # no temporary folder left behind
