import hashlib
import subprocess
import sys

import numpy as np
import pytest

from blunb import data
from blunb.data import (
    MAGIC,
    ByteTokenizer,
    DataError,
    ShardLoader,
    check_token_ids,
    prepare_corpus,
    read_header,
    read_shard,
    shard_manifest,
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


# ---------------------------------------------------------------- token ids vs the model's vocabulary

def _bad_shard(tmp_path, name="train_000001.bin", bad_at=617, bad_id=50256):
    tokens = np.arange(1000) % 300
    tokens[bad_at] = bad_id
    path = tmp_path / name
    write_shard(path, tokens)
    return path


def test_out_of_range_token_id_names_file_offset_and_id(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SCAN_CHUNK", 64)  # the bad id sits in the 10th chunk: offsets must add up
    good = tmp_path / "train_000000.bin"
    write_shard(good, np.arange(1000) % 300)
    bad = _bad_shard(tmp_path)
    check_token_ids([good], 320)
    with pytest.raises(DataError) as err:
        check_token_ids([good, bad], 320)
    msg = str(err.value)
    assert str(bad) in msg and "token id 50256 at offset 617 is >= model.vocab_size 320" in msg


def test_token_id_check_is_cached_per_shard_file(tmp_path, monkeypatch):
    good = tmp_path / "train_000000.bin"
    write_shard(good, np.arange(1000) % 300)
    bad = _bad_shard(tmp_path, "val_000000.bin")
    check_token_ids([good], 320)
    with pytest.raises(DataError):
        check_token_ids([bad], 320)
    assert (tmp_path / "train_000000.bin.blunb-cache.json").is_file()

    def no_scan(path):
        raise AssertionError(f"{path} was scanned again")

    monkeypatch.setattr(data, "_scan_max_id", no_scan)
    check_token_ids([good], 320)  # answered from the cache
    with pytest.raises(DataError, match="offset 617"):
        check_token_ids([bad], 320)
    # A rewritten shard (new size / mtime) is scanned again, not trusted from a stale entry.
    write_shard(good, np.arange(2000) % 300)
    with pytest.raises(AssertionError, match="scanned again"):
        check_token_ids([good], 320)


def test_token_id_check_works_without_a_writable_folder(tmp_path, monkeypatch):
    good = tmp_path / "train_000000.bin"
    write_shard(good, np.arange(1000) % 300)

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(data.tempfile, "mkstemp", read_only)
    check_token_ids([good], 320)
    check_token_ids([good], 320)
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob(".*"))


def test_loader_checks_token_ids_when_given_the_vocab_size(tmp_path):
    bad = _bad_shard(tmp_path)
    ShardLoader([bad], 2, 16)  # no vocab_size: unchanged behaviour
    with pytest.raises(DataError, match="train_000001.bin: token id 50256 at offset 617"):
        ShardLoader([bad], 2, 16, vocab_size=320)
    ShardLoader([bad], 2, 16, vocab_size=50257)


def test_shard_manifest_hashes_and_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "HASH_BLOCK", 100)  # several blocks per file
    shards = _loader_shards(tmp_path)
    manifest = shard_manifest(shards)
    assert manifest == [{"name": p.name, "bytes": p.stat().st_size,
                         "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in shards]

    def no_hash(*args, **kwargs):
        raise AssertionError("hashed again")

    monkeypatch.setattr(data.hashlib, "sha256", no_hash)
    assert shard_manifest(shards) == manifest


# ---------------------------------------------------------------- python -m blunb.data prepare

def _prepare_error(capsys, *argv):
    with pytest.raises(SystemExit) as exit_:
        data.main(["prepare", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    return err


def test_prepare_cli_missing_src(tmp_path, capsys):
    err = _prepare_error(capsys, "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert err == f"error: --src folder not found: {tmp_path / 'nope'}\n"


def test_prepare_cli_src_is_a_file(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("hello")
    err = _prepare_error(capsys, "--src", str(tmp_path / "one.txt"), "--out", str(tmp_path / "out"))
    assert err.startswith("error: --src must be a folder") and "one.txt is a file" in err


def test_prepare_cli_source_too_small_for_a_split(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.txt").write_text("hello")
    err = _prepare_error(capsys, "--src", str(tmp_path / "src"), "--out", str(tmp_path / "out"))
    assert err.startswith("error: a corpus of 1 file(s) is too small for a train/val split")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_prepare_refuses_to_replace_a_folder_it_did_not_make(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    for i in range(20):
        (tmp_path / "src" / f"d{i}.txt").write_text(f"doc {i}")
    keep = tmp_path / "mine" / "notes.txt"
    keep.parent.mkdir()
    keep.write_text("precious")
    err = _prepare_error(capsys, "--src", str(tmp_path / "src"), "--out", str(keep.parent))
    assert "refusing to replace" in err and keep.read_text() == "precious"
    data.main(["prepare", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "corpus")])
    data.main(["prepare", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "corpus")])  # a corpus: replaced


def test_prepare_cli_error_has_no_traceback_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "blunb.data", "prepare", "--src", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == f"error: --src folder not found: {tmp_path / 'nope'}\n"
