"""The tokenizers a corpus can be prepared with: `byte`, `bpe:<vocab>` and `gpt2`.

- `byte` (ByteTokenizer): UTF-8 bytes as ids 0..255 plus an end-of-document id 256. No file.
- `bpe:<vocab>` (BPETokenizer): a byte-level BPE trained with the `tokenizers` library on the
  corpus itself; saved as `tokenizer.json` beside the shards. Training is deterministic: the same
  documents give the same file (checked across processes with tokenizers 0.23).
- `gpt2` (GPT2Tokenizer): tiktoken's GPT-2 encoding (50257 ids, end of text 50256), the one the
  llm.c / modded-nanogpt FineWeb shards use. Read only from tiktoken's local cache: nothing is
  downloaded, so an offline machine gets an error naming the missing files instead of a hang.

Every tokenizer encodes a batch of raw documents (bytes) to uint16 arrays and describes itself
for a corpus's meta.json: its name, vocab_size, eot, tokenizer_file and tokenizer_sha256.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SHARD_ID_LIMIT = 1 << 16  # .bin shards store uint16 ids
TOKENIZER_CHOICES = "byte | bpe:<vocab> | gpt2"
EOT_TEXT = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer that cannot be made or loaded here; the message says what is missing."""


def padded_vocab_size(n_ids: int, multiple: int = 64) -> int:
    """The model vocab_size for a tokenizer of n_ids: rounded up to a multiple of 64, like the presets
    (257 -> 320, GPT-2's 50257 -> 50304), for tensor-core friendly embedding and lm_head shapes."""
    return -(-n_ids // multiple) * multiple


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """("byte", None), ("bpe", vocab) or ("gpt2", None); a TokenizerError for anything else."""
    kind, _, arg = spec.partition(":")
    if kind in ("byte", "gpt2") and not arg:
        return kind, None
    if kind == "bpe":
        try:
            vocab = int(arg)
        except ValueError:
            raise TokenizerError(f"--tokenizer {spec!r}: bpe needs a vocabulary size, e.g. bpe:8192") from None
        # 256 byte symbols and the end-of-text token come first; ids must fit the uint16 shards.
        if not 258 <= vocab <= SHARD_ID_LIMIT:
            raise TokenizerError(f"--tokenizer {spec!r}: the vocabulary size must be in 258..{SHARD_ID_LIMIT} "
                                 f"(256 bytes + end of text + merges; shards store uint16 ids)")
        return kind, vocab
    raise TokenizerError(f"unknown --tokenizer {spec!r}; choose {TOKENIZER_CHOICES}")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token 256. Needs no download."""

    name = "bytes-v1"
    eot = 256
    vocab_size = 257

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(raw, dtype=np.uint8).astype(np.uint16) for raw in documents]

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens if t < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        # A fixed definition, no file: nothing to hash.
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot": self.eot,
                "tokenizer_file": None, "tokenizer_sha256": None}


def _as_text(raw: bytes) -> str:
    # Source files are almost always UTF-8; the rare other bytes become U+FFFD rather than failing.
    return raw.decode("utf-8", errors="replace")


def require_tokenizers():
    """The `tokenizers` package, or a TokenizerError saying how to install it (checked before any work)."""
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("--tokenizer bpe:<vocab> needs the tokenizers package, which is not installed: "
                             "pip install 'tokenizers>=0.20'") from None
    return tokenizers


class BPETokenizer:
    """A byte-level BPE (the GPT-2 scheme: byte alphabet, GPT-2 pre-tokenizer regex) from `tokenizers`."""

    file_name = "tokenizer.json"

    def __init__(self, tokenizer, name: str, path: Path):
        # A document's own "<|endoftext|>" text (tiktoken's source has some) is text, not a document end.
        tokenizer.encode_special_tokens = True
        self._tok = tokenizer
        self.name = name
        self.path = Path(path)
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot = tokenizer.token_to_id(EOT_TEXT)
        self.sha256 = _file_sha256(self.path)

    @classmethod
    def train(cls, documents: Iterable[bytes], vocab_size: int, out_path: Path, *, progress: bool) -> BPETokenizer:
        """Train on `documents` (streamed) and save to out_path (the hash covers that file)."""
        lib = require_tokenizers()
        tok = lib.Tokenizer(lib.models.BPE())
        # add_prefix_space=False: decode(encode(text)) == text, which the shards' decoded text relies on.
        tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = lib.decoders.ByteLevel()
        trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=progress,
                                          initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(map(_as_text, documents), trainer)
        if tok.get_vocab_size() < vocab_size:
            log.warning(f"bpe: the corpus supports only {tok.get_vocab_size()} ids of the {vocab_size} asked for")
        tok.save(str(out_path))
        return cls(tok, f"bpe-{vocab_size}", out_path)

    @classmethod
    def load(cls, path: Path, name: str, sha256: str) -> BPETokenizer:
        """The tokenizer saved at `path`, which must be the file whose hash the corpus recorded."""
        lib = require_tokenizers()
        if not Path(path).is_file():
            raise TokenizerError(f"BPE tokenizer file not found: {path}")
        if _file_sha256(Path(path)) != sha256:
            raise TokenizerError(f"{path} does not match the tokenizer_sha256 in its meta.json: it is not the "
                                 f"tokenizer these shards were made with")
        try:
            tokenizer = lib.Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for an unreadable file
            raise TokenizerError(f"{path}: not a readable tokenizers file ({err})") from None
        return cls(tokenizer, name, path)

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch_fast([_as_text(raw) for raw in documents], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint16) for e in encodings]

    def decode(self, tokens) -> str:
        return self._tok.decode([int(t) for t in tokens], skip_special_tokens=True)

    def describe(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot": self.eot,
                "tokenizer_file": self.path.name, "tokenizer_sha256": self.sha256,
                "tokenizer_library": f"tokenizers {require_tokenizers().__version__}"}


# The GPT-2 release files tiktoken builds its encoding from, with the sha256 tiktoken checks.
GPT2_FILES = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}


def tiktoken_cache_dir() -> Path:
    """Where tiktoken looks for downloaded files (its own rule: TIKTOKEN_CACHE_DIR, DATA_GYM_CACHE_DIR,
    then <tmp>/data-gym-cache); each file is named by the sha1 of its URL."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


class GPT2Tokenizer:
    """tiktoken's GPT-2 encoding, used only when its files are already in tiktoken's local cache."""

    name = "gpt2"
    eot = 50256
    vocab_size = 50257

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("--tokenizer gpt2 needs the tiktoken package, which is not installed: "
                                 "pip install 'tiktoken>=0.7'") from None
        self._check_cached_files()
        self._enc = tiktoken.get_encoding("gpt2")
        self._tiktoken_version = tiktoken.__version__

    def _check_cached_files(self) -> None:
        cache = tiktoken_cache_dir()
        missing, digest = [], hashlib.sha256()
        for name, (url, expected) in GPT2_FILES.items():
            path = cache / hashlib.sha1(url.encode()).hexdigest()
            if not path.is_file():
                missing.append(f"{name} ({url}) as {path}")
                continue
            content = path.read_bytes()
            if hashlib.sha256(content).hexdigest() != expected:
                missing.append(f"{name}: {path} is corrupt (sha256 differs from {expected})")
            digest.update(content)
        if missing:
            raise TokenizerError(
                "--tokenizer gpt2: tiktoken's GPT-2 files are not in its local cache, and nothing is downloaded "
                f"here. Missing: {'; '.join(missing)}. On a machine with network run "
                "`python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"`, then copy that machine's tiktoken "
                f"cache folder here as {cache} (or point TIKTOKEN_CACHE_DIR at a folder holding the two files)")
        self.sha256 = digest.hexdigest()  # of vocab.bpe + encoder.json, in that order

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        encoded = self._enc.encode_ordinary_batch([_as_text(raw) for raw in documents],
                                                num_threads=os.cpu_count() or 1)
        return [np.asarray(ids, dtype=np.uint16) for ids in encoded]

    def decode(self, tokens) -> str:
        return self._enc.decode([int(t) for t in tokens if t != self.eot])

    def describe(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot": self.eot,
                "tokenizer_file": " + ".join(GPT2_FILES) + " (tiktoken's cache)",
                "tokenizer_sha256": self.sha256, "tokenizer_library": f"tiktoken {self._tiktoken_version}"}


def load_tokenizer(meta: dict, folder: Path):
    """The tokenizer a prepared corpus was made with, from its meta.json (to decode its shards)."""
    name = meta.get("tokenizer")
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    if name == GPT2Tokenizer.name:
        return GPT2Tokenizer()
    if isinstance(name, str) and name.startswith("bpe-") and meta.get("tokenizer_file"):
        return BPETokenizer.load(Path(folder) / meta["tokenizer_file"], name, meta.get("tokenizer_sha256"))
    raise TokenizerError(f"{folder}: no known tokenizer recorded in meta.json (tokenizer={name!r})")
