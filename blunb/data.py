"""Token shards, corpus preparation and the per-rank loader.

Shards use the llm.c / modded-nanogpt `.bin` format, so real FineWeb shards work as-is:
a header of 256 int32 (magic 20240520, version 1, token count, zeros) then uint16 tokens.

The embedded default corpus is the running Python's own standard-library source: present
on every machine, no network. It is tokenized at the byte level (256 byte values plus an
end-of-document token), prepared once and cached under $BLUNB_DATA_DIR (default
~/.cache/blunb/data), keyed by the Python version and the file list; its content hash is
recorded in meta.json and copied into every run folder.

`python -m blunb.data prepare [--src FOLDER] [--out DIR]` prepares the default corpus or a
folder of text files.

Facts that need a full read of a shard (its largest token id, its sha256) are cached in
`<shard>.blunb-cache.json` beside it, keyed by the file's size and mtime; in a read-only
folder they are simply recomputed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class DataError(ValueError):
    """A missing, corrupt or unusable data file, named in the message."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token 256. Needs no download."""

    name = "bytes-v1"
    eot = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


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


# ---------------------------------------------------------------- corpus preparation

def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="file", file=sys.stderr)


def prepare_corpus(files: list[Path], out_dir: str | Path, *, val_every: int = 20,
                   shard_tokens: int = 1 << 22, progress: bool = True, source: str = "") -> dict:
    """Tokenize `files` (sorted, one document each) into train/val shards in `out_dir`.

    Every `val_every`-th document goes to val. Written to a temporary folder and renamed
    into place, so an interrupted prepare leaves no half-made corpus behind.
    """
    # The split depends only on the file count: refuse before tokenizing anything.
    if val_every < 2 or len(files) < val_every:
        raise DataError(f"a corpus of {len(files)} file(s) is too small for a train/val split: every "
                        f"{val_every}th file goes to val, so it needs at least {max(val_every, 2)} files")
    tok = ByteTokenizer()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "meta.json").is_file():
        # The output folder is replaced wholesale; never do that to a folder we did not make.
        raise DataError(f"output folder {out_dir} is not empty and holds no prepared corpus (meta.json); "
                        f"refusing to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    digest = hashlib.sha256()
    buffers = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    shard_idx = {"train": 0, "val": 0}

    def flush(split, final=False):
        buf = np.concatenate(buffers[split]) if buffers[split] else np.zeros(0, np.uint16)
        while buf.size >= shard_tokens or (final and buf.size):
            write_shard(tmp / f"{split}_{shard_idx[split]:06d}.bin", buf[:shard_tokens])
            shard_idx[split] += 1
            buf = buf[shard_tokens:]
        buffers[split] = [buf] if buf.size else []

    try:
        for i, path in enumerate(_progress(files, len(files), "tokenizing", progress)):
            raw = Path(path).read_bytes()
            digest.update(raw)
            split = "val" if i % val_every == val_every - 1 else "train"
            arr = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
            buffers[split].append(np.append(arr, np.uint16(tok.eot)))
            counts[split] += arr.size + 1
            if sum(b.size for b in buffers[split]) >= shard_tokens:
                flush(split)
        flush("train", final=True)
        flush("val", final=True)
        meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot,
                "sha256": digest.hexdigest(), "num_files": len(files), "source": source,
                "train_tokens": counts["train"], "val_tokens": counts["val"], "format": "llm.c .bin v1"}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


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


def data_root() -> Path:
    return Path(os.environ.get("BLUNB_DATA_DIR", Path.home() / ".cache" / "blunb" / "data"))


def default_corpus_dir(files: list[Path] | None = None) -> Path:
    files = stdlib_files() if files is None else files
    key = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    return data_root() / f"stdlib-py{ver}-{key}"


def ensure_default_corpus(progress: bool = True) -> Path:
    """Prepare the embedded corpus on first use; return its folder (cached afterwards)."""
    files = stdlib_files()
    out = default_corpus_dir(files)
    if not (out / "meta.json").is_file():
        log.info(f"preparing the default corpus ({len(files)} stdlib files) into {out}")
        prepare_corpus(files, out, progress=progress, source=f"python {sys.version.split()[0]} stdlib")
    return out


def corpus_meta(folder: str | Path) -> dict:
    """meta.json of a prepared corpus, or a description built from the shard headers."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    return {"tokenizer": "unknown (external shards)", "source": str(folder),
            "train_tokens": sum(read_header(p) for p in find_shards(folder, "train"))}


# ---------------------------------------------------------------- loader

class ShardLoader:
    """Strided per-rank batches, like the seed's DataLoaderLite.

    Each call of next_batch() gives rank r the B*T(+1) tokens at `position`, then advances
    every rank by B*T*world_size, so ranks read disjoint, interleaved windows. At the end
    of a shard it moves to the next one (wrapping around), restarting at offset B*T*rank.
    """

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

    def where(self) -> tuple[str, int]:
        """(shard file name, token offset) of the next batch, for diagnostics."""
        return self.shards[self.shard_idx].name, self.position

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

    def state_dict(self) -> dict:
        """Where the stream is, independent of the world size: the shard order (by file name), the
        current shard and the offset in it of the next step's first token (this rank's position
        less its B*T*rank stagger). Every rank's dict is the same, except just before a shard end,
        where the last ranks move on to the next shard one micro-batch before the first ones."""
        return {"shards": [p.name for p in self.shards], "shard_idx": self.shard_idx,
                "offset": self.position - self.B * self.T * self.rank, "B": self.B, "T": self.T,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue where state_dict() was taken, at any world size: with the same B*T*world_size
        per micro-batch exactly, otherwise at the same tokens until the next shard end (where the
        tail a rank skips depends on the world size). A rank whose first window would run past
        the shard's end starts the next shard, as the loader itself would."""
        names, saved = [p.name for p in self.shards], list(state["shards"])
        if saved != names:
            at = next((i for i, (a, b) in enumerate(zip(saved, names)) if a != b), min(len(saved), len(names)))
            raise DataError(f"the saved data stream reads {len(saved)} shard(s), this loader {len(names)}; they "
                            f"first differ at position {at} ({saved[at] if at < len(saved) else 'none'} vs "
                            f"{names[at] if at < len(names) else 'none'}): resuming would read other data")
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
        if len(windows) < n_seq:
            raise DataError(f"the val shards ({', '.join(p.name for p in shards)}) hold {len(windows)} windows of "
                            f"T = {T} tokens; val_tokens asks for {n_seq}")
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
    ap = argparse.ArgumentParser(prog="python -m blunb.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize a corpus into train/val .bin shards")
    p.add_argument("--src", help="folder of text files (*.txt, *.md, *.py); default: the stdlib corpus")
    p.add_argument("--out", help="output folder (default: the cache folder of the default corpus)")
    args = ap.parse_args(argv)
    try:
        if args.src is None:
            if args.out is None:
                out = ensure_default_corpus()
            else:
                prepare_corpus(stdlib_files(), args.out, source="python stdlib")
                out = Path(args.out)
        else:
            src = Path(args.src)
            if not src.exists():
                _fail(f"--src folder not found: {src}")
            if not src.is_dir():
                _fail(f"--src must be a folder of text files, but {src} is a file")
            if args.out is None:
                _fail("--out is required with --src")
            files = sorted(p for ext in ("*.txt", "*.md", "*.py") for p in src.rglob(ext))
            if not files:
                _fail(f"no *.txt, *.md or *.py files under {src}")
            prepare_corpus(files, args.out, source=str(src))
            out = Path(args.out)
    except DataError as e:
        _fail(str(e))
    print(json.dumps(corpus_meta(out), indent=2))
    print(out)


if __name__ == "__main__":
    main()
