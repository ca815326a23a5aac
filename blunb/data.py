"""Token shards, corpus preparation and the per-rank loader.

Shards use the llm.c / modded-nanogpt `.bin` format, so real FineWeb shards work as-is. Corpora need no
network (the running Python's standard library by default, its site-packages, or a folder of text files),
and a prepared corpus is cached keyed by what it was made from, so runs on a machine read the same tokens
and record which (meta.json, copied into every run's env.json).

    blunb-data prepare [--source stdlib|site-packages|site-packages+headers|FOLDER]
                       [--tokenizer byte|bpe:<vocab>|gpt2] [--out DIR]      (or python -m blunb.data)

Details (the shard format, corpora and their cache, cached shard facts): docs/architecture.md, section
"blunb/data.py"; the loaders' order: its "The parts", Data.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import site
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from blunb.config import DATA_ORDERS, ConfigError
from blunb.tokenizer import (
    TOKENIZER_CHOICES,
    BPETokenizer,
    ByteTokenizer,
    GPT2Tokenizer,
    TokenizerError,
    load_tokenizer,
    padded_vocab_size,
    parse_tokenizer_spec,
    require_tokenizers,
)

log = logging.getLogger(__name__)

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class DataError(ValueError):
    """A missing, corrupt or unusable data file, named in the message."""


# ---------------------------------------------------------------- shard files

def write_shard(path: str | Path, tokens) -> None:
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: tokens must fit in uint16 for the .bin format")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)  # a crash never leaves a half-written shard under the real name


def read_header(path: str | Path) -> int:
    """Validate a shard's header and size; return its token count."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"shard not found: {path}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {MAGIC}); not an llm.c .bin token shard")
    if header[1] != VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {VERSION})")
    ntok = int(header[2])
    if size != HEADER_BYTES + 2 * ntok:
        raise DataError(f"{path}: header says {ntok} tokens ({HEADER_BYTES + 2 * ntok} bytes) "
                        f"but the file has {size} bytes; the shard is truncated or corrupt")
    return ntok


def read_shard(path: str | Path) -> np.ndarray:
    ntok = read_header(path)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(ntok,))


def find_shards(folder: str | Path, split: str) -> list[Path]:
    """Shards of a split in a folder: any `*{split}*.bin` (llm.c: fineweb_train_000001.bin)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder not found: {folder}")
    shards = sorted(p for p in folder.glob(f"*{split}*.bin"))
    if not shards:
        raise DataError(f"no '{split}' shards (*{split}*.bin) in {folder}")
    return shards


# ---------------------------------------------------------------- per-shard facts, cached

SCAN_CHUNK = 1 << 24  # tokens per read (32 MiB of uint16): bounded RAM on multi-GB shards
HASH_BLOCK = 1 << 20


def _cache_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".blunb-cache.json")


def _file_key(shard: Path) -> dict:
    st = shard.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_get(shard: Path, key: dict, field: str):
    """A cached fact about `shard`, or None when absent, stale (size or mtime changed) or unreadable."""
    try:
        entry = json.loads(_cache_path(shard).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in key.items()):
        return None
    return entry.get(field)


def _cache_put(shard: Path, key: dict, field: str, value) -> None:
    """Record a fact next to the shard; silently skipped where the folder is not writable."""
    path = _cache_path(shard)
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in key.items()):
            entry = {}
    except (OSError, ValueError):
        entry = {}
    entry.update(key)
    entry[field] = value
    try:
        # A unique temporary name: several ranks may fill the cache of the same shard at once.
        fd, tmp = tempfile.mkstemp(dir=shard.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; others sharing the data folder should read it
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _scan_max_id(shard: Path) -> int:
    """Largest token id in a shard (-1 when empty), read in chunks."""
    tokens = read_shard(shard)
    top = -1
    for start in range(0, len(tokens), SCAN_CHUNK):
        top = max(top, int(tokens[start:start + SCAN_CHUNK].max()))
    return top


def _first_at_least(shard: Path, limit: int) -> tuple[int, int]:
    """(offset, id) of the first token id >= limit; only called once a shard is known to hold one."""
    tokens = read_shard(shard)
    for start in range(0, len(tokens), SCAN_CHUNK):
        hits = np.flatnonzero(tokens[start:start + SCAN_CHUNK] >= limit)
        if hits.size:
            return start + int(hits[0]), int(tokens[start + hits[0]])
    raise AssertionError(f"{shard}: no token id >= {limit}")


def shard_max_id(shard: str | Path) -> int:
    """The largest token id in a shard, computed once per file version and cached beside it."""
    shard = Path(shard)
    read_header(shard)  # a corrupt shard is named as such, not as a bad id
    key = _file_key(shard)
    top = _cache_get(shard, key, "max_id")
    if not isinstance(top, int):
        top = _scan_max_id(shard)
        _cache_put(shard, key, "max_id", top)
    return top


def check_token_ids(shards: list[Path], vocab_size: int) -> None:
    """Refuse shards holding token ids the model's embedding cannot look up (ids >= vocab_size).

    Without this, e.g. GPT-2-tokenized shards under a small-vocabulary model fail in the first
    forward with a bare IndexError (or a device-side assert on CUDA) that names no file.
    """
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    for shard in shards:
        shard = Path(shard)
        top = shard_max_id(shard)
        if top >= vocab_size:
            offset, tok = _first_at_least(shard, vocab_size)
            raise DataError(f"{shard}: token id {tok} at offset {offset} is >= model.vocab_size {vocab_size} "
                            f"(the shard's largest id is {top}; set model.vocab_size > {top} or use shards "
                            f"made with the model's tokenizer)")


def shard_sha256(shard: str | Path) -> str:
    """sha256 of a shard file (streamed), cached beside it like the max id."""
    shard = Path(shard)
    key = _file_key(shard)
    digest = _cache_get(shard, key, "sha256")
    if not isinstance(digest, str):
        h = hashlib.sha256()
        with open(shard, "rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
        digest = h.hexdigest()
        _cache_put(shard, key, "sha256", digest)
    return digest


def shard_manifest(shards: list[Path]) -> list[dict]:
    """What a run read: {"name", "bytes", "sha256"} per shard, for env.json."""
    return [{"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": shard_sha256(p)} for p in shards]


# ---------------------------------------------------------------- corpus sources

HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".cuh")
NAMED_SOURCES = ("stdlib", "site-packages", "site-packages+headers")
# Part of every cache folder's name: a change to what prepare writes must not reuse older folders.
PREPARE_VERSION = 2


@dataclass(frozen=True)
class CorpusSource:
    """The documents of a corpus (one file each, in a fixed order) and how to describe them."""

    name: str          # a NAMED_SOURCES entry, or the folder given
    files: list[Path]
    description: str   # meta.json "source"
    dedupe: bool       # drop files whose content is already in the corpus


def stdlib_files(max_bytes: int = 24 << 20) -> list[Path]:
    """The standard library's .py files in a fixed order, capped at `max_bytes` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        size = p.stat().st_size
        if total + size > max_bytes:
            break
        files.append(p)
        total += size
    return files


def site_package_roots() -> list[Path]:
    """This Python's site-packages / dist-packages folders (user site included), none inside another."""
    paths = sysconfig.get_paths()
    candidates = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"], paths["platlib"]]
    roots = sorted({Path(p).resolve() for p in candidates if Path(p).is_dir()})
    return [r for r in roots if not any(other != r and other in r.parents for other in roots)]


def _walk_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    # os.walk, not rglob: it never follows symlinked folders (no loops, no files outside the root).
    return [Path(folder) / name for folder, _, names in os.walk(root) for name in names if name.endswith(suffixes)]


def site_packages_files(headers: bool = False) -> list[Path]:
    """Every .py file under site_package_roots(), sorted; with `headers`, also the C/C++ headers there
    and in this Python's include folders. Duplicates by content are dropped when preparing."""
    roots = site_package_roots()
    files = {p for root in roots for p in _walk_files(root, (".py",))}
    if headers:
        paths = sysconfig.get_paths()
        include = {Path(paths[k]).resolve() for k in ("include", "platinclude") if Path(paths[k]).is_dir()}
        files |= {p for root in [*roots, *include] for p in _walk_files(root, HEADER_SUFFIXES)}
    return sorted(p for p in files if p.is_file())


def corpus_source(source: str) -> CorpusSource:
    """A named source (NAMED_SOURCES) or a folder of *.txt, *.md and *.py files; DataError otherwise."""
    python = f"python {sys.version.split()[0]}"
    if source == "stdlib":
        return CorpusSource(source, stdlib_files(), f"{python} stdlib", dedupe=False)
    if source in ("site-packages", "site-packages+headers"):
        headers = source.endswith("+headers")
        files = site_packages_files(headers=headers)
        if not files:
            raise DataError(f"--source {source}: no files found under {[str(r) for r in site_package_roots()]}")
        what = "site-packages .py and C/C++ headers" if headers else "site-packages .py"
        return CorpusSource(source, files, f"{python} {what}, deduplicated", dedupe=True)
    folder = Path(source)
    if not folder.exists():
        raise DataError(f"--source {source!r} is neither a folder nor a known corpus ({', '.join(NAMED_SOURCES)})")
    if not folder.is_dir():
        raise DataError(f"--source must be a folder of text files or one of {', '.join(NAMED_SOURCES)}, "
                        f"but {folder} is a file")
    files = sorted(p for ext in ("*.txt", "*.md", "*.py") for p in folder.rglob(ext))
    if not files:
        raise DataError(f"no *.txt, *.md or *.py files under {folder}")
    return CorpusSource(str(folder), files, str(folder), dedupe=False)


# ---------------------------------------------------------------- corpus preparation

ENCODE_BATCH_BYTES = 8 << 20  # documents handed to the tokenizer at once: its threads share a batch
SHARD_TOKENS = 1 << 22        # 8 MiB per shard
BPE_SAMPLE_BYTES = 128 << 20  # bpe training text: bounds its time and memory on GPU-scale corpora


class _ShardWriter:
    """One split's documents, each followed by the end-of-document token, cut into shards of
    `shard_tokens`. A final remainder under half a shard joins the last shard instead of becoming
    a stub too short for the loader's B*T*world_size window."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, eot: int):
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.eot = np.array([eot], dtype=np.uint16)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.written: list[Path] = []
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        self.pending += [tokens, self.eot]
        self.pending_tokens += tokens.size + 1
        self.tokens += tokens.size + 1
        if self.pending_tokens >= self.shard_tokens:
            buf = np.concatenate(self.pending)
            while buf.size >= self.shard_tokens:
                self._write(buf[:self.shard_tokens])
                buf = buf[self.shard_tokens:]
            self.pending, self.pending_tokens = [buf], buf.size

    def close(self) -> None:
        if not self.pending_tokens:
            return
        buf = np.concatenate(self.pending)
        if self.written and buf.size < self.shard_tokens // 2:
            write_shard(self.written[-1], np.concatenate([read_shard(self.written[-1]), buf]))
        else:
            self._write(buf)

    def _write(self, tokens: np.ndarray) -> None:
        path = self.folder / f"{self.split}_{len(self.written):06d}.bin"
        write_shard(path, tokens)
        self.written.append(path)


def _check_split(n_files: int, val_every: int) -> None:
    if val_every < 2 or n_files < val_every:
        raise DataError(f"a corpus of {n_files} file(s) is too small for a train/val split: every "
                        f"{val_every}th file goes to val, so it needs at least {max(val_every, 2)} files")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "meta.json").is_file():
        # The output folder is replaced wholesale; never do that to a folder we did not make.
        raise DataError(f"output folder {out_dir} is not empty and holds no prepared corpus (meta.json); "
                        f"refusing to replace it")


def _survey(files: list[Path], dedupe: bool, progress: bool) -> tuple[list[Path], list[int], str, int]:
    """One read of every file: (documents kept, their sizes, sha256 of their bytes in order, duplicates dropped)."""
    digest, seen = hashlib.sha256(), set()
    kept, sizes = [], []
    with tqdm(total=sum(p.stat().st_size for p in files), desc="hashing", unit="B", unit_scale=True,
              file=sys.stderr, disable=not progress) as bar:
        for path in files:
            raw = path.read_bytes()
            bar.update(len(raw))
            if dedupe:
                key = hashlib.sha256(raw).digest()
                if key in seen:
                    continue
                seen.add(key)
            digest.update(raw)
            kept.append(path)
            sizes.append(len(raw))
    return kept, sizes, digest.hexdigest(), len(files) - len(kept)


def _batches(sizes: list[int]):
    """Consecutive runs of document indices holding about ENCODE_BATCH_BYTES each."""
    batch, size = [], 0
    for i in range(len(sizes)):
        batch.append(i)
        size += sizes[i]
        if size >= ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _check_settings(tokenizer: str, shard_tokens: int, bpe_sample_bytes: int) -> tuple[str, int | None]:
    """The parsed tokenizer spec, once the settings are known to be usable (DataError otherwise)."""
    try:
        spec = parse_tokenizer_spec(tokenizer)
    except TokenizerError as err:
        raise DataError(str(err)) from None
    if shard_tokens < 1 or bpe_sample_bytes < 1:
        raise DataError(f"shard_tokens and bpe_sample_bytes must be positive, got {shard_tokens}, {bpe_sample_bytes}")
    return spec


def prepare_corpus(files: list[Path], out_dir: str | Path, *, tokenizer: str = "byte", val_every: int = 20,
                   shard_tokens: int = SHARD_TOKENS, progress: bool = True, source: str = "", dedupe: bool = False,
                   bpe_sample_bytes: int = BPE_SAMPLE_BYTES) -> dict:
    """Tokenize `files` (one document each, in this order) into train/val shards in `out_dir`; return its meta.

    tokenizer: "byte", "bpe:<vocab>" (trained here on at most `bpe_sample_bytes` of the train split, an
    even stride through it, so validation text never shapes the vocabulary) or "gpt2". Every
    `val_every`-th document goes to val; with `dedupe`, a file whose content was already seen is skipped.
    Files are streamed: memory holds one encoding batch and one shard per split, whatever the corpus
    size. Written to a temporary folder and renamed into place, so an interrupted prepare leaves no
    half-made corpus behind. Bad settings and a missing tokenizer are refused before any file is read.
    """
    kind, bpe_vocab = _check_settings(tokenizer, shard_tokens, bpe_sample_bytes)
    tok = ByteTokenizer() if kind == "byte" else None  # bpe: trained below, once the documents are known
    try:  # the packages and files a tokenizer needs are checked before any document is read
        if kind == "gpt2":
            tok = GPT2Tokenizer()
        elif kind == "bpe":
            require_tokenizers()
    except TokenizerError as err:
        raise DataError(str(err)) from None
    # The split depends only on the file count: refuse before reading anything.
    _check_split(len(files), val_every)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; others sharing the data folder should read it
        log.info(f"reading {len(files)} files")
        t0 = time.perf_counter()   # each phase's seconds are logged: a borrowed GPU machine prepares the corpus first
        docs, sizes, corpus_sha, duplicates = _survey([Path(p) for p in files], dedupe, progress)
        log.info(f"read and hashed in {time.perf_counter() - t0:.0f} s")
        _check_split(len(docs), val_every)
        is_val = [i % val_every == val_every - 1 for i in range(len(docs))]
        extra = {"duplicates_dropped": duplicates} if dedupe else {}
        if kind == "bpe":
            train_idx = [i for i in range(len(docs)) if not is_val[i]]
            stride = max(1, -(-sum(sizes[i] for i in train_idx) // bpe_sample_bytes))
            sample = train_idx[::stride]
            extra["bpe_trained_on"] = {"files": len(sample), "bytes": sum(sizes[i] for i in sample),
                                       "of": f"the train split, 1 file in {stride}" if stride > 1
                                       else "the whole train split"}
            log.info(f"training a {bpe_vocab}-id byte-level BPE on {extra['bpe_trained_on']['bytes'] / 1e6:.1f} MB "
                     f"({len(sample)} train files)")
            t0 = time.perf_counter()
            tok = BPETokenizer.train((docs[i].read_bytes() for i in sample), bpe_vocab,
                                     tmp / BPETokenizer.file_name, progress=progress)
            log.info(f"trained in {time.perf_counter() - t0:.0f} s")
        writers = {split: _ShardWriter(tmp, split, shard_tokens, tok.eot) for split in ("train", "val")}
        log.info(f"tokenizing {sum(sizes) / 1e6:.1f} MB with {tok.name}")
        t0 = time.perf_counter()
        with tqdm(total=sum(sizes), desc=f"tokenizing ({tok.name})", unit="B", unit_scale=True,
                  file=sys.stderr, disable=not progress) as bar:
            for batch in _batches(sizes):
                encoded = tok.encode_documents([docs[i].read_bytes() for i in batch])
                for i, tokens in zip(batch, encoded):
                    writers["val" if is_val[i] else "train"].add(tokens)
                bar.update(sum(sizes[i] for i in batch))
        for writer in writers.values():
            writer.close()
        log.info(f"tokenized and written in {time.perf_counter() - t0:.0f} s")
        meta = {**tok.describe(), "sha256": corpus_sha, "num_files": len(docs), "bytes": sum(sizes),
                "source": source, **extra, "train_tokens": writers["train"].tokens,
                "val_tokens": writers["val"].tokens, "format": "llm.c .bin v1"}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def data_root() -> Path:
    return Path(os.environ.get("BLUNB_DATA_DIR", Path.home() / ".cache" / "blunb" / "data"))


def corpus_cache_dir(source: CorpusSource, settings: dict) -> Path:
    """The cache folder of a named source, keyed by the Python version, the file list and the
    prepare settings (tokenizer, shard size, ...)."""
    listing = "\n".join(f"{p}:{p.stat().st_size}" for p in source.files)
    key = hashlib.sha256(f"v{PREPARE_VERSION}\n{json.dumps(settings, sort_keys=True)}\n{listing}".encode())
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    tokenizer = settings["tokenizer"]
    suffix = "" if tokenizer == "byte" else "-" + tokenizer.replace(":", "")
    return data_root() / f"{source.name}-py{ver}-{key.hexdigest()[:12]}{suffix}"


@contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on lock_path: independent runs or tests asking for the same cache folder
    at once prepare it one at a time (the others then find it made)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(source: str = "stdlib", tokenizer: str = "byte", out: str | Path | None = None, *,
            shard_tokens: int = SHARD_TOKENS, bpe_sample_bytes: int = BPE_SAMPLE_BYTES, progress: bool = True) -> Path:
    """Prepare `source` (see corpus_source) with `tokenizer` into `out` and return the folder.

    Without `out`, a named source goes to its cache folder (corpus_cache_dir, keyed by these settings)
    and is prepared only once; a folder source needs `out`.
    """
    kind, _ = _check_settings(tokenizer, shard_tokens, bpe_sample_bytes)
    settings = {"tokenizer": tokenizer, "shard_tokens": shard_tokens}
    if kind == "bpe":
        settings["bpe_sample_bytes"] = bpe_sample_bytes
    corpus = corpus_source(source)
    if out is None and corpus.name not in NAMED_SOURCES:
        raise DataError("--out is required with a folder --source")
    folder = Path(out) if out is not None else corpus_cache_dir(corpus, settings)

    def make():
        log.info(f"preparing {corpus.description} ({len(corpus.files)} files, tokenizer {tokenizer}) into {folder}")
        prepare_corpus(corpus.files, folder, progress=progress, source=corpus.description, dedupe=corpus.dedupe,
                       **settings)

    if out is not None:
        make()
        return folder
    with _exclusive(folder.with_name(folder.name + ".lock")):
        if not (folder / "meta.json").is_file():
            if folder.exists():  # what an interrupted prepare left in our own cache folder
                log.warning(f"replacing the unfinished corpus folder {folder}")
                shutil.rmtree(folder)
            make()
    return folder


def ensure_default_corpus(progress: bool = True) -> Path:
    """The embedded corpus (stdlib, byte tokens), prepared on first use; return its folder (cached afterwards)."""
    return prepare("stdlib", "byte", progress=progress)


def corpus_meta(folder: str | Path) -> dict:
    """meta.json of a prepared corpus, or a description built from the shard headers."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    return {"tokenizer": "unknown (external shards)", "source": str(folder),
            "train_tokens": sum(read_header(p) for p in find_shards(folder, "train"))}


def check_model_vocab(folder: str | Path, meta: dict, vocab_size: int) -> None:
    """A ConfigError when the model cannot embed every id of the corpus's tokenizer (vocab_size too small)."""
    n_ids = meta.get("vocab_size")
    if isinstance(n_ids, int) and n_ids > vocab_size:
        fit = padded_vocab_size(n_ids)
        raise ConfigError(f"{folder} was tokenized with {meta.get('tokenizer')} ({n_ids} ids) but model.vocab_size "
                          f"is {vocab_size}: set model.vocab_size={fit} (--set model.vocab_size={fit}; the "
                          f"smallest multiple of 64 >= {n_ids})")


def checked_shards(folder: str | Path, vocab_size: int) -> tuple[list[Path], list[Path]]:
    """A data folder's train and val shards, its tokenizer checked against the model's vocab_size (DataError /
    ConfigError naming the problem); the scan of the token ids is the caller's (check_token_ids)."""
    train, val = find_shards(folder, "train"), find_shards(folder, "val")
    check_model_vocab(folder, corpus_meta(folder), vocab_size)
    return train, val


def corpus_tokenizer(folder: str | Path):
    """The tokenizer a prepared corpus was made with (encode / decode its shards)."""
    try:
        return load_tokenizer(corpus_meta(folder), Path(folder))
    except TokenizerError as err:
        raise DataError(str(err)) from None


# ---------------------------------------------------------------- loaders

def _check_order(state: dict, order: str) -> None:
    """A DataError unless the saved stream was read in data_order `order` (a state without the key
    is the legacy shard loader's)."""
    saved = state.get("order", "shards")
    if saved != order:
        raise DataError(f"the saved data stream is data_order={saved}, this run reads data_order={order}: resuming "
                        f"would read other data (resume with data_order={saved})")


def _check_same_shards(saved: list[str], names: list[str]) -> None:
    """A DataError unless the saved stream read the same shard files, in the same order, as this loader."""
    if saved != names:
        at = next((i for i, (a, b) in enumerate(zip(saved, names)) if a != b), min(len(saved), len(names)))
        raise DataError(f"the saved data stream reads {len(saved)} shard(s), this loader {len(names)}; they "
                        f"first differ at position {at} ({saved[at] if at < len(saved) else 'none'} vs "
                        f"{names[at] if at < len(names) else 'none'}): resuming would read other data")


class WindowLoader:
    """Per-rank batches of windows in a seeded order over the whole train split (data_order=windows).

    The split is cut, shard by shard, into windows of T+1 tokens at stride T (a row's targets are its
    inputs shifted by one; a shard's last < T+1 tokens start no window). Epoch e reads every window
    exactly once, in the order of a permutation seeded by (data_seed, e); the epochs' orders, one after
    the other, are one stream of rows, so two data seeds share almost no window order and one seed
    always reads the same stream.

    Each next_batch() gives rank r the B stream rows from cursor + B*r, then advances the cursor by
    B*world_size (as ShardLoader strides tokens). A step of accum micro-batches therefore reads stream
    rows [s*R, (s+1)*R), R = global_batch / T, at every world size and B: W=1 with accum 3 reads, micro
    by micro, the rows that ranks 0, 1, 2 read at W=3 without accumulation. state_dict() is the
    cursor as (epoch, position in its permutation): the same on every rank, so it resumes at any W.

    Every shard stays memory-mapped for the loader's life: a row is one slice of a map (page-cache
    reads), never a file opened per row.
    """

    order = "windows"

    def __init__(self, shards: list[Path], B: int, T: int, rank: int = 0, world_size: int = 1, *,
                 data_seed: int, vocab_size: int | None = None):
        if not shards:
            raise DataError("no shards given to the loader")
        self.shards = [Path(p) for p in shards]
        self.B, self.T, self.rank, self.world_size, self.data_seed = B, T, rank, world_size, data_seed
        self._maps = [read_shard(p) for p in self.shards]
        per_shard = [max(len(m) - 1, 0) // T for m in self._maps]
        self._first = np.cumsum([0, *per_shard])  # the global index of each shard's first window
        self.n_windows = int(self._first[-1])
        need = B * world_size
        if self.n_windows < need:
            raise DataError(f"the train shards ({', '.join(p.name for p in self.shards)}) hold {self.n_windows} "
                            f"window(s) of T+1 = {T + 1} tokens; one micro-batch over every rank needs "
                            f"B*world_size = {need}")
        if vocab_size is not None:
            check_token_ids(self.shards, vocab_size)
        self._perms: dict[int, np.ndarray] = {}
        self.cursor = 0  # the stream row of the next micro-batch's first row (rank 0's)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s window order (global window indices), seeded by (data_seed, epoch)."""
        if epoch not in self._perms:
            if len(self._perms) == 2:  # a micro-batch spans at most two epochs: keep the two latest
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng([self.data_seed, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def _locate(self, first_row: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, token offset) of the B windows at stream rows first_row, first_row + 1, ..."""
        epochs, positions = np.divmod(np.arange(first_row, first_row + self.B), self.n_windows)
        windows = np.empty(self.B, dtype=np.int64)
        for e in np.unique(epochs):
            at = epochs == e
            windows[at] = self.permutation(int(e))[positions[at]]
        shard = np.searchsorted(self._first, windows, side="right") - 1
        return shard, (windows - self._first[shard]) * self.T

    def where(self) -> list[tuple[str, int]]:
        """(shard file name, token offset) of each row of this rank's next batch, for diagnostics."""
        shard, offset = self._locate(self.cursor + self.B * self.rank)
        return [(self.shards[s].name, int(o)) for s, o in zip(shard, offset)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.T
        shard, offset = self._locate(self.cursor + self.B * self.rank)
        rows = np.stack([self._maps[s][o:o + T + 1] for s, o in zip(shard, offset)])
        buf = torch.from_numpy(rows.astype(np.int64))
        self.cursor += self.B * self.world_size
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    def skip_batches(self, n: int) -> None:
        """Advance past n batches without reading them (resume at the same data position)."""
        self.cursor += n * self.B * self.world_size

    def describe(self) -> dict:
        """What defines the stream (env.json, the start lines)."""
        return {"order": self.order, "data_seed": self.data_seed, "windows": self.n_windows,
                "window_tokens": self.T + 1, "stride": self.T, "shards": len(self.shards)}

    def state_dict(self) -> dict:
        """Where the stream is: the epoch and the position in its permutation of the next micro-batch's
        first row, with what the permutation depends on (shards, T, data_seed, the window count).
        The same on every rank and independent of B and the world size."""
        epoch, position = divmod(self.cursor, self.n_windows)
        return {"order": self.order, "shards": [p.name for p in self.shards], "T": self.T,
                "windows": self.n_windows, "data_seed": self.data_seed, "epoch": epoch, "position": position}

    def load_state_dict(self, state: dict) -> None:
        """Continue where state_dict() was taken, bit-exactly, at any world size and B (the next step
        reads the rows the saved run's next step would have read)."""
        _check_order(state, self.order)
        _check_same_shards(list(state["shards"]), [p.name for p in self.shards])
        for key, mine in (("T", self.T), ("data_seed", self.data_seed), ("windows", self.n_windows)):
            if state[key] != mine:
                raise DataError(f"the saved data stream has {key}={state[key]}, this loader {key}={mine}: "
                                f"resuming would read other data")
        self.cursor = int(state["epoch"]) * self.n_windows + int(state["position"])


class ShardLoader:
    """The legacy order (data_order=shards): strided per-rank batches, like the seed's DataLoaderLite.

    Each call of next_batch() gives rank r the B*T(+1) tokens at `position`, then advances
    every rank by B*T*world_size, so ranks read disjoint, interleaved windows. At the end
    of a shard it moves to the next one (wrapping around), restarting at offset B*T*rank.
    Every epoch reads the same windows in the same order; kept to reproduce the runs made
    before WindowLoader (their config.json has no data_order).
    """

    order = "shards"

    def __init__(self, shards: list[Path], B: int, T: int, rank: int = 0, world_size: int = 1, *,
                 vocab_size: int | None = None):
        if not shards:
            raise DataError("no shards given to the loader")
        self.shards = [Path(p) for p in shards]
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        need = B * T * world_size + 1
        for p in self.shards:
            ntok = read_header(p)
            if ntok < need:
                raise DataError(f"{p}: {ntok} tokens is too short for one step of B*T*world_size+1 = {need}")
        if vocab_size is not None:
            check_token_ids(self.shards, vocab_size)
        self.reset()

    def reset(self) -> None:
        self.shard_idx = 0
        self.tokens = read_shard(self.shards[0])
        self.position = self.B * self.T * self.rank

    def where(self) -> list[tuple[str, int]]:
        """[(shard file name, token offset)] of the next batch (one contiguous span), for diagnostics."""
        return [(self.shards[self.shard_idx].name, self.position)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.B, self.T
        buf = torch.from_numpy(self.tokens[self.position:self.position + B * T + 1].astype(np.int64))
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self._advance()
        return x, y

    def skip_batches(self, n: int) -> None:
        """Advance past n batches without reading them (resume at the same data position)."""
        for _ in range(n):
            self._advance()

    def describe(self) -> dict:
        """What defines the stream (env.json, the start lines)."""
        return {"order": self.order, "shards": [p.name for p in self.shards]}

    def state_dict(self) -> dict:
        """Where the stream is, independent of the world size: the shard order (by file name), the
        current shard and the offset in it of the next step's first token (this rank's position
        less its B*T*rank stagger). Every rank's dict is the same, except just before a shard end,
        where the last ranks move on to the next shard one micro-batch before the first ones."""
        return {"order": self.order, "shards": [p.name for p in self.shards], "shard_idx": self.shard_idx,
                "offset": self.position - self.B * self.T * self.rank, "B": self.B, "T": self.T,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue where state_dict() was taken, at any world size: with the same B*T*world_size
        per micro-batch exactly, otherwise at the same tokens until the next shard end (where the
        tail a rank skips depends on the world size). A rank whose first window would run past
        the shard's end starts the next shard, as the loader itself would."""
        _check_order(state, self.order)
        _check_same_shards(list(state["shards"]), [p.name for p in self.shards])
        self.shard_idx = int(state["shard_idx"])
        self.tokens = read_shard(self.shards[self.shard_idx])
        self.position = int(state["offset"]) + self.B * self.T * self.rank
        if self.position + self.B * self.T + 1 > len(self.tokens):
            self.shard_idx = (self.shard_idx + 1) % len(self.shards)
            self.tokens = read_shard(self.shards[self.shard_idx])
            self.position = self.B * self.T * self.rank

    def _advance(self) -> None:
        step = self.B * self.T * self.world_size
        self.position += step
        if self.position + step + 1 > len(self.tokens):
            self.shard_idx = (self.shard_idx + 1) % len(self.shards)
            self.tokens = read_shard(self.shards[self.shard_idx])
            self.position = self.B * self.T * self.rank


def build_train_loader(shards: list[Path], B: int, T: int, rank: int = 0, world_size: int = 1, *,
                       order: str, data_seed: int, vocab_size: int | None = None) -> WindowLoader | ShardLoader:
    """The train loader of data_order `order` (config.DATA_ORDERS) over `shards` (find_shards' order),
    seeded by `data_seed`; every rank builds the same stream."""
    if order == "windows":
        return WindowLoader(shards, B, T, rank, world_size, data_seed=data_seed, vocab_size=vocab_size)
    if order == "shards":
        perm = np.random.default_rng(data_seed).permutation(len(shards))  # the legacy order: whole shards only
        return ShardLoader([shards[i] for i in perm], B, T, rank, world_size, vocab_size=vocab_size)
    raise ConfigError(f"data_order must be one of {DATA_ORDERS}, got {order!r}")


class ValidationSet:
    """A fixed validation set: the first n_tokens // T windows of T tokens (+1 for the shifted
    target) of the val shards, in order. Window j belongs to rank j % world_size, so the set,
    and the token-weighted mean loss over it, is the same at every world size."""

    def __init__(self, shards: list[Path], n_tokens: int, T: int, rank: int = 0, world_size: int = 1):
        n_seq = n_tokens // T
        if n_seq < 1:
            raise DataError(f"a validation set of {n_tokens} tokens holds no window of T = {T} tokens")
        windows = []
        for path in shards:
            tokens = read_shard(path)
            for start in range(0, len(tokens) - T, T):
                if len(windows) == n_seq:
                    break
                windows.append((path, start))
        if not windows:
            raise DataError(f"the val shards ({', '.join(p.name for p in shards)}) hold no window of T = {T} "
                            f"tokens: train with a smaller T or on a corpus with a larger val split")
        if len(windows) < n_seq:
            raise DataError(f"the val shards ({', '.join(p.name for p in shards)}) hold {len(windows)} windows of "
                            f"T = {T} tokens; val_tokens ({n_tokens}) asks for {n_seq}: set --set "
                            f"val_tokens={len(windows) * T} (all of them) or less, or train on a larger corpus")
        self.T, self.n_seq = T, n_seq
        self._mine = windows[rank::world_size]

    def batches(self, B: int):
        """This rank's windows as (x, y) int64 batches of up to B rows."""
        T, maps = self.T, {}
        for k in range(0, len(self._mine), B):
            rows = []
            for path, start in self._mine[k: k + B]:
                if path not in maps:
                    maps[path] = read_shard(path)
                rows.append(maps[path][start: start + T + 1].astype(np.int64))
            buf = torch.from_numpy(np.stack(rows))
            yield buf[:, :-1], buf[:, 1:]


def _fail(message: str) -> None:
    """A user error from the command line: one line on stderr, exit 2 (argparse's code), no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress lines on stderr
    ap = argparse.ArgumentParser(prog="blunb-data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into train/val .bin shards",
                       description="Tokenize a corpus into llm.c / modded-nanogpt .bin shards; prints its meta.json "
                                   "and folder.")
    p.add_argument("--source", "--src", default="stdlib",
                   help="stdlib (default: this Python's standard library, 24 MB), site-packages (every .py of its "
                        "site-packages, deduplicated), site-packages+headers (also the C/C++ headers there and in "
                        "its include folder), or a folder of *.txt, *.md and *.py files")
    p.add_argument("--tokenizer", default="byte",
                   help=f"{TOKENIZER_CHOICES} (default byte; bpe trains on the corpus, gpt2 needs tiktoken's "
                        f"files cached locally)")
    p.add_argument("--out", help="output folder (default, for a named source: its cache folder under "
                                 "$BLUNB_DATA_DIR, reused once made)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help=f"tokens per shard (default {SHARD_TOKENS})")
    p.add_argument("--bpe-sample-mb", type=int, default=BPE_SAMPLE_BYTES >> 20,
                   help=f"bpe: train on at most this many MiB of the train split (default {BPE_SAMPLE_BYTES >> 20})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    try:
        out = prepare(args.source, args.tokenizer, args.out, progress=not args.no_progress,
                      shard_tokens=args.shard_tokens, bpe_sample_bytes=args.bpe_sample_mb << 20)
    except DataError as e:
        _fail(str(e))
    print(json.dumps(corpus_meta(out), indent=2))
    print(out)


if __name__ == "__main__":
    main()
