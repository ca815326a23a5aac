import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from blunb import data, tokenizer
from blunb.data import (
    MAGIC,
    ByteTokenizer,
    DataError,
    ShardLoader,
    check_token_ids,
    corpus_meta,
    corpus_source,
    corpus_tokenizer,
    prepare_corpus,
    read_header,
    read_shard,
    shard_manifest,
    shard_max_id,
    write_shard,
)
from blunb.tokenizer import padded_vocab_size


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
    assert a.where() == b.where() and a.where()[0][0] == "train_1.bin"
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
    assert err == (f"error: --source '{tmp_path / 'nope'}' is neither a folder nor a known corpus "
                   f"(stdlib, site-packages, site-packages+headers)\n")


def test_prepare_cli_src_is_a_file(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("hello")
    err = _prepare_error(capsys, "--src", str(tmp_path / "one.txt"), "--out", str(tmp_path / "out"))
    assert err.startswith("error: --source must be a folder") and "one.txt is a file" in err


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
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --source '{tmp_path / 'nope'}' is neither")
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- tokenizers: byte, bpe:<vocab>, gpt2

def _documents(folder, n=20):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"doc{i:02d}.py"
        body = f"def function_{i}(value):\n    # ünïcode ≠ ascii {i}\n    return value * {i} + '<|endoftext|>'\n"
        path.write_text(body * (i + 3))
        paths.append(path)
    return paths


def _decoded_documents(folder, split, tok):
    tokens = np.concatenate([np.asarray(read_shard(p)) for p in sorted(folder.glob(f"{split}_*.bin"))])
    ends = np.flatnonzero(tokens == tok.eot)
    return [tok.decode(piece) for piece in np.split(tokens, ends + 1)[:-1]]


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    """A bpe:300 corpus of 20 small documents (whose "<|endoftext|>" text must stay text), every 5th to val,
    shards of 256 tokens."""
    root = tmp_path_factory.mktemp("bpe")
    docs = _documents(root / "src")
    meta = prepare_corpus(docs, root / "out", tokenizer="bpe:300", val_every=5, shard_tokens=256, progress=False)
    return docs, root / "out", meta


def test_bpe_shards_decode_to_the_documents(bpe_corpus):
    docs, out, meta = bpe_corpus
    tok = corpus_tokenizer(out)
    assert _decoded_documents(out, "train", tok) == [p.read_text() for i, p in enumerate(docs) if i % 5 != 4]
    assert _decoded_documents(out, "val", tok) == [p.read_text() for i, p in enumerate(docs) if i % 5 == 4]
    assert len(list(out.glob("train_*.bin"))) > 1
    # The vocabulary was learned from the train split only.
    assert meta["bpe_trained_on"] == {"files": 16, "bytes": sum(p.stat().st_size for i, p in enumerate(docs)
                                                                  if i % 5 != 4), "of": "the whole train split"}


def test_bpe_meta_names_the_tokenizer_and_its_file(bpe_corpus):
    _, out, meta = bpe_corpus
    assert meta == corpus_meta(out)
    assert meta["tokenizer"] == "bpe-300" and meta["vocab_size"] == 300 and meta["tokenizer_file"] == "tokenizer.json"
    assert meta["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["tokenizer_library"].startswith("tokenizers ")
    assert 0 <= meta["eot"] < 300 and meta["train_tokens"] == sum(read_header(p) for p in out.glob("train_*.bin"))
    assert max(shard_max_id(p) for p in out.glob("*.bin")) < 300


def test_bpe_prepare_is_deterministic(bpe_corpus, tmp_path):
    docs, out, _ = bpe_corpus
    prepare_corpus(docs, tmp_path / "again", tokenizer="bpe:300", val_every=5, shard_tokens=256, progress=False)
    def made(folder):  # without the readers' caches other tests leave beside the shards
        return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".blunb-cache.json"))

    names = made(out)
    assert names == made(tmp_path / "again") and "tokenizer.json" in names
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_a_changed_tokenizer_file_is_refused(bpe_corpus, tmp_path):
    _, out, _ = bpe_corpus
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + "\n")
    with pytest.raises(DataError, match="not the tokenizer these shards were made with"):
        corpus_tokenizer(copy)


def test_shards_read_like_llm_c_and_modded_nanogpt(bpe_corpus):
    """Read a shard the way llm.c's and modded-nanogpt's loaders do, without blunb's reader."""
    _, out, _ = bpe_corpus
    raw = (out / "train_000000.bin").read_bytes()
    header = np.frombuffer(raw[:256 * 4], dtype="<i4")
    assert header[0] == 20240520 and header[1] == 1 and not header[3:].any()
    tokens = np.frombuffer(raw[256 * 4:], dtype="<u2")
    assert len(raw) == 1024 + 2 * header[2] and tokens.size == header[2] == 256
    assert np.array_equal(tokens, read_shard(out / "train_000000.bin"))


def test_short_remainders_join_the_last_shard(tmp_path):
    docs = []
    for i, size in enumerate([99] * 19 + [29]):  # 20 documents of 100 / 30 tokens with their end token
        docs.append(tmp_path / f"d{i:02d}.txt")
        docs[-1].write_bytes(b"x" * size)
    prepare_corpus(docs, tmp_path / "out", val_every=20, shard_tokens=300, progress=False)
    # train: 1900 tokens = 6 shards of 300 + 100 (< half a shard): the last shard takes them.
    assert [read_header(p) for p in sorted((tmp_path / "out").glob("train_*.bin"))] == [300] * 5 + [400]
    assert [read_header(p) for p in (tmp_path / "out").glob("val_*.bin")] == [30]


@pytest.mark.parametrize("spec, message", [
    ("wordpiece", "unknown --tokenizer 'wordpiece'; choose byte | bpe:<vocab> | gpt2"),
    ("bpe", "bpe needs a vocabulary size, e.g. bpe:8192"),
    ("bpe:lots", "bpe needs a vocabulary size"),
    ("bpe:100", "must be in 258..65536"),
    ("bpe:70000", "must be in 258..65536"),
    ("byte:8", "unknown --tokenizer 'byte:8'"),
])
def test_bad_tokenizer_specs_are_refused_before_any_work(tmp_path, capsys, monkeypatch, spec, message):
    monkeypatch.setattr(data, "corpus_source", lambda source: pytest.fail("the source was read"))
    err = _prepare_error(capsys, "--tokenizer", spec, "--out", str(tmp_path / "out"))
    assert message in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec, package", [("gpt2", "tiktoken"), ("bpe:512", "tokenizers")])
def test_a_missing_tokenizer_package_is_named_before_any_work(tmp_path, capsys, monkeypatch, spec, package):
    monkeypatch.setitem(sys.modules, package, None)  # importing it now fails
    monkeypatch.setattr(data, "_survey", lambda *a: pytest.fail("files were read"))
    err = _prepare_error(capsys, "--tokenizer", spec, "--out", str(tmp_path / "out"))
    assert f"needs the {package} package, which is not installed: pip install '{package}>=" in err
    assert not (tmp_path / "out").exists()


def test_gpt2_without_its_cached_files_names_them(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_survey", lambda *a: pytest.fail("files were read"))
    err = _prepare_error(capsys, "--tokenizer", "gpt2", "--out", str(tmp_path / "out"))
    assert "tiktoken's GPT-2 files are not in its local cache" in err and "nothing is downloaded" in err
    for name, (url, _) in tokenizer.GPT2_FILES.items():
        assert f"{name} ({url}) as {tmp_path / 'cache' / hashlib.sha1(url.encode()).hexdigest()}" in err
    assert "TIKTOKEN_CACHE_DIR" in err and not (tmp_path / "out").exists()


def test_padded_vocab_size():
    assert [padded_vocab_size(n) for n in (257, 300, 8192, 8193, 50257)] == [320, 320, 8192, 8256, 50304]


def test_model_vocab_below_the_tokenizer_stops_the_trainer_before_any_work(bpe_corpus, tmp_path):
    from blunb.config import ConfigError, preset
    from blunb.train import train

    _, out, _ = bpe_corpus
    cfg = preset("tiny")
    cfg.data, cfg.model.vocab_size = str(out), 299
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    assert str(err.value) == (f"{out} was tokenized with bpe-300 (300 ids) but model.vocab_size is 299: set "
                              f"model.vocab_size=320 (--set model.vocab_size=320; the smallest multiple of 64 >= 300)")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- corpus sources

def test_site_packages_source_is_deduplicated_sorted_and_hashed(tmp_path, monkeypatch):
    root = tmp_path / "site-packages"
    for rel, text in [("b/mod.py", "b = 1\n"), ("a/__init__.py", ""), ("b/__init__.py", ""),
                      ("a/copy_of_b.py", "b = 1\n"), ("a/include/a.h", "int a;\n"), ("a/notes.txt", "not code")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "a" / "loop").symlink_to(root)  # os.walk must not follow it
    for i in range(30):
        (root / "c" / f"m{i:02d}.py").parent.mkdir(exist_ok=True)
        (root / "c" / f"m{i:02d}.py").write_text(f"value = {i}\n")
    monkeypatch.setattr(data, "site_package_roots", lambda: [root])
    source = corpus_source("site-packages")
    rel = [p.relative_to(root).as_posix() for p in source.files]
    assert rel[:4] == ["a/__init__.py", "a/copy_of_b.py", "b/__init__.py", "b/mod.py"] and len(rel) == 34
    assert source.dedupe and "site-packages .py" in source.description
    assert root / "a" / "include" / "a.h" in corpus_source("site-packages+headers").files

    meta = prepare_corpus(source.files, tmp_path / "out", progress=False, dedupe=True, source=source.description)
    kept = [p for p in source.files if p not in (root / "b" / "__init__.py", root / "b" / "mod.py")]
    assert meta["duplicates_dropped"] == 2 and meta["num_files"] == len(kept) == 32
    assert meta["sha256"] == hashlib.sha256(b"".join(p.read_bytes() for p in kept)).hexdigest()
    tok = ByteTokenizer()
    assert _decoded_documents(tmp_path / "out", "train", tok)[:2] == ["", "b = 1\n"]


def test_named_sources_are_cached_per_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("BLUNB_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(data, "stdlib_files", lambda: _documents(tmp_path / "src"))
    first = data.prepare("stdlib", "byte", progress=False)
    assert first.parent == tmp_path and first.name.startswith("stdlib-py")
    bpe = data.prepare("stdlib", "bpe:300", progress=False)
    assert bpe != first and bpe.name.endswith("-bpe300") and corpus_meta(bpe)["tokenizer"] == "bpe-300"
    monkeypatch.setattr(data, "prepare_corpus", lambda *a, **k: pytest.fail("prepared again"))
    assert data.prepare("stdlib", "bpe:300", progress=False) == bpe and data.ensure_default_corpus() == first


@pytest.mark.slow
def test_bpe_8192_on_the_default_corpus_trains_a_tiny_model(tmp_path, capsys):
    """The issue's done-criterion: `prepare --tokenizer bpe:8192` on the default corpus, then a training run."""
    out = tmp_path / "bpe8192"
    data.main(["prepare", "--tokenizer", "bpe:8192", "--out", str(out), "--no-progress"])
    meta = corpus_meta(out)
    assert meta["tokenizer"] == "bpe-8192" and meta["vocab_size"] == 8192 and meta["source"].endswith("stdlib")
    assert meta["sha256"] == corpus_meta(data.ensure_default_corpus(progress=False))["sha256"]  # the same documents
    assert meta["train_tokens"] > 5_000_000 and meta["val_tokens"] > 200_000
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "blunb.train", "--preset", "tiny", "--max-steps", "3", "--data",
                           str(out), "--run-dir", str(run_dir), "--set", "model.vocab_size=8192"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = pd.read_csv(run_dir / "metrics.csv")
    assert list(metrics["step"]) == [0, 1, 2] and abs(metrics["train_loss"][0] - math.log(8192)) < 0.5
    corpus = json.loads((run_dir / "env.json").read_text())["corpus"]
    assert {k: corpus[k] for k in ("tokenizer", "vocab_size", "tokenizer_sha256")} == \
        {k: meta[k] for k in ("tokenizer", "vocab_size", "tokenizer_sha256")}
