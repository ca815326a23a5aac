"""Distributed checkpoints of a training run (torch.distributed.checkpoint, DCP): save, find, check, load.

Built so that a folder is either a whole checkpoint or visibly not one: a save goes into a temporary
folder that is renamed only once every rank has finished and blunb's record (every file's size and
sha256) is on disk, and a folder counts as valid only when that record, the files and DCP's metadata
agree. The optimizer state is saved per parameter, keyed by the model's names, so a checkpoint saved at
one world size resumes at any other. Every function that takes an optimizer set is collective: every
rank calls it.

Details (the layout on disk, validity, the DCP keys, weights-only loads): docs/architecture.md, section
"blunb/checkpoint.py".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from blunb.config import ConfigError
from blunb.optim.state import ShardedStateful, quiet_dcp

log = logging.getLogger(__name__)

FORMAT = "blunb-dcp-2"   # 2: a sha256 per file and the payload's own step
META_FILE = "checkpoint.json"
INVALID_DIR = ".invalid"  # under checkpoints/: where find_resume moves a corrupt checkpoint
# under checkpoints/: where a run resumed from an older checkpoint moves the later ones (the timeline it left)
ABANDONED_DIR = ".abandoned"
DELAY_ENV = "BLUNB_TEST_CKPT_DELAY_S"   # test hook: seconds rank 0 waits between writing and committing
# Test hook, "STEP:RANK": that rank's save of that step fails as on a full disk, half-way through
# writing each of its data files.
ENOSPC_ENV = "BLUNB_TEST_CKPT_ENOSPC"
# The ModelConfig fields that set the shape (or the presence) of some weight: a checkpoint saved
# with another value cannot load, and the error names them before DCP reports a tensor size.
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "q_heads", "kv_heads", "head_dim", "ffn_hidden", "weight_tying")
_STEP_DIR = re.compile(r"step_(\d+)")
_META_KEYS = ("format", "step", "optimizer", "groups", "world_size", "files", "sha256")
_HASH_BLOCK = 16 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used here (missing, unfinished, corrupt, or from another kind of
    run); the message names the path and the problem. A ConfigError: the run stops before any work."""


# ---------------------------------------------------------------- the run's state

def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_rank0() -> bool:
    """Global rank 0, also before init_process_group under torchrun (then from $RANK)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _kind(opt_set) -> str:
    cfg = getattr(opt_set, "cfg", None)
    return getattr(cfg, "optimizer", None) or type(opt_set).__name__


def _group_names(opt_set) -> list[str]:
    return [name for name, _, _ in opt_set.groups]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _model_state(model: torch.nn.Module) -> dict:
    """model.state_dict() with tied tensors once (the same memory under two names)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if where not in seen:
            seen.add(where)
            out[name] = t
    return out


def _training_state(model: torch.nn.Module, opt_set, saving: bool) -> dict:
    """The collective part of the DCP state (identical keys on every rank): views of the live
    model and optimizer state, so a DCP load into it writes the state in place."""
    names = {p: name for name, p in model.named_parameters()}
    optim, groups, torch_optim = {}, {}, {}
    for gname, opt, _ in opt_set.groups:
        if isinstance(opt, ShardedStateful):
            sd = opt.state_dict(param_names=names)
            optim.update(sd.pop("state"))
            groups[gname] = sd
        else:
            if saving and not opt.state:  # torch's state_dict helper would invent one by stepping with lr 0
                raise RuntimeError(f"the torch optimizer of group {gname!r} has no state before its first step; "
                                   "checkpoint after a step")
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            torch_optim[gname] = get_optimizer_state_dict(model, opt)
    state = {"model": _model_state(model)}
    for key, part in (("optim", optim), ("optim_groups", groups), ("torch_optim", torch_optim)):
        if part:
            state[key] = part
    return state


def _rank_blob(loaders: dict) -> bytes:
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return pickle.dumps({"rng": rng, "loaders": {name: ld.state_dict() for name, ld in loaders.items()}})


def _set_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _gather(obj) -> list:
    """obj of every rank, in rank order (collective)."""
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(problem: str | None, step: int) -> bool:
    """True on every rank iff no rank has a problem (collective): how the ranks of a save agree on each
    phase. Global rank 0 logs every rank's problem, so the run's log says why a save failed."""
    problems = list(dict.fromkeys(p for p in _gather(problem) if p))   # DCP reports one failure on every rank
    if _rank_world()[0] == 0:
        for p in problems:
            log.warning("checkpoint step %d: not saved (the run goes on): %s", step, p)
    return not problems


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """Leaves of nested dicts by path (anything but a non-empty dict is a leaf)."""
    out = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


def _kill_inside(err: BaseException) -> BaseException | None:
    """The kill that `err` is or carries, else None. A kill (RunKilled from SIGTERM, Ctrl-C,
    SystemExit) is a BaseException that is no Exception; DCP catches every BaseException a rank
    raises inside it and re-raises them all as one CheckpointException (itself no Exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException):
        return None if isinstance(err, Exception) else err
    for failure in err.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack)
        if not isinstance(exc, Exception):
            return exc
    return None


def _one_line(err: BaseException, rank: int | None = None) -> str:
    """`[rank R: ]Type: message` of err (R: `rank`), of its first failure and the rank that raised
    it for a DCP CheckpointException, whose own str is every failed rank's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        rank, failure = next(iter(err.failures.items()))
        err = failure[0] if isinstance(failure, tuple) else failure
    lines = str(err).strip().splitlines()
    return f"{'' if rank is None else f'rank {rank}: '}{type(err).__name__}: {lines[0] if lines else ''}"


class _FullDisk:
    """ENOSPC_ENV's stream: writes half of the first block it is given, then fails like a full disk."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, data) -> int:
        block = memoryview(data).cast("B")
        self._stream.write(block[: len(block) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _disk_full_at(step: int, rank: int) -> bool:
    raw = os.environ.get(ENOSPC_ENV, "")
    if not raw:
        return False
    at_step, _, at_rank = raw.partition(":")
    try:
        return int(at_step) == step and int(at_rank or 0) == rank
    except ValueError:
        raise ValueError(f"{ENOSPC_ENV}={raw!r}: expected STEP:RANK") from None


def _unstored(md) -> list[str]:
    """The keys of DCP metadata `md` with a piece that no data file holds."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    stored = set(md.storage_data)
    missing = []
    for key, item in md.state_dict_metadata.items():
        wanted = ([MetadataIndex(key, chunk.offsets) for chunk in item.chunks]
                  if isinstance(item, TensorStorageMetadata) else [MetadataIndex(key)])
        if not all(w in stored for w in wanted):
            missing.append(key)
    return missing


def _dcp_save(tree: dict, path: Path, disk_full: bool = False) -> None:
    """Write the leaves of `tree` with DCP; raises what any writer thread raised. (DCP only prints
    the exception of a writer thread other than the main one and then records a complete-looking
    checkpoint without that thread's data: a disk filling up there went unnoticed.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    flat = {".".join(p): v for p, v in _flatten(tree).items()}
    # Several writer threads per rank: one thread wrote a 1b checkpoint at ~0.3 GB/s on an H200 host.
    writer = FileSystemWriter(str(path), thread_count=min(8, os.cpu_count() or 1))
    failures: list[BaseException] = []
    open_stream = writer.fs.create_stream

    @contextlib.contextmanager
    def watched_stream(file, mode):
        try:
            with open_stream(file, mode) as stream:
                yield _FullDisk(stream) if disk_full and str(file).endswith(".distcp") else stream
        except BaseException as err:
            failures.append(err)
            raise

    writer.fs.create_stream = watched_stream
    with quiet_dcp():
        dcp.save(flat, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False))
    if failures:
        raise failures[0]
    _read_metadata(path)   # what DCP wrote (rank 0, before save returned) indexes data for every key


def _dcp_load(tree: dict, path: Path, problem: str, no_dist: bool = False) -> None:
    """Load the leaves of `tree` in place (tensors) or by replacement (objects); a failure is a
    CheckpointError "checkpoint <path>: <problem> (<DCP's error, one line>)", a kill propagates.

    Flattened here rather than by DCP: DCP's own flattening takes a checkpoint holding keys the
    caller does not ask for (another rank's state, the optimizer state of a weights-only load) for
    a pre-2.4 checkpoint and then looks for keys of that old format. (No nested ShardedTensors
    here, and without that pass the loaded objects land in `flat` itself.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    leaves = _flatten(tree)
    flat = {".".join(p): v for p, v in leaves.items()}
    try:
        with quiet_dcp():
            planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
            dcp.load(flat, checkpoint_id=str(path), planner=planner, no_dist=no_dist)
    except BaseException as err:  # DCP's CheckpointException is no Exception
        kill = _kill_inside(err)
        if kill is not None:
            raise kill from None
        raise CheckpointError(f"checkpoint {path}: {problem} ({_one_line(err)})") from err
    for p in leaves:
        node = tree
        for key in p[:-1]:
            node = node[key]
        node[p[-1]] = flat[".".join(p)]


def _read_metadata(path: Path):
    """DCP's index of the checkpoint at `path`; CheckpointError when it cannot be read or lacks data."""
    import torch.distributed.checkpoint as dcp

    try:
        with quiet_dcp():
            md = dcp.FileSystemReader(str(path)).read_metadata()
        missing = _unstored(md)
    except Exception as err:  # noqa: BLE001  (unpickling bad bytes raises anything)
        raise CheckpointError(f"checkpoint {path}: its DCP .metadata is unreadable ({_one_line(err)})") from None
    if missing:
        raise CheckpointError(f"checkpoint {path}: its DCP .metadata holds no data for {len(missing)} key(s) "
                              f"({', '.join(missing[:3])}): the save lost a writer's files")
    return md


def _payload_step(path: Path) -> int:
    """The step the DCP payload itself was saved at (read alone, by this process only)."""
    state = {"step": torch.zeros((), dtype=torch.int64)}
    _dcp_load(state, path, "its step counter cannot be read", no_dist=True)
    return int(state["step"])


def _check_model_fits(path: Path, meta: dict, model: torch.nn.Module, md) -> None:
    """CheckpointError, before any DCP load, when the checkpoint holds another model: naming the
    SHAPE_FIELDS that differ between the saved config and this model's, else the first weight whose
    saved shape differs (or that only one side has)."""
    saved = (meta.get("config") or {}).get("model") or {}
    now = getattr(model, "cfg", None)
    differ = [f"saved {f}={saved[f]}, this run {getattr(now, f)}" for f in SHAPE_FIELDS
              if now is not None and f in saved and saved[f] != getattr(now, f)]
    if not differ:
        live = {f"model.{name}": tuple(t.shape) for name, t in _model_state(model).items()}
        stored = {key: tuple(item.size) for key, item in md.state_dict_metadata.items() if key.startswith("model.")}
        differ = [f"{key}: saved {list(stored[key]) if key in stored else 'none'}, this model "
                  f"{list(live[key]) if key in live else 'none'}"
                  for key in [*live, *(k for k in stored if k not in live)] if live.get(key) != stored.get(key)][:3]
    if differ:
        raise CheckpointError(f"checkpoint {path} holds another model ({'; '.join(differ)}): resume with the "
                              "model settings it was saved with, or start fresh")


def _sha256(path: Path) -> str:
    digest, block = hashlib.sha256(), bytearray(_HASH_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def _checksums(folder, names: list[str]) -> dict[str, str]:
    """{name: sha256} of the files `names` in `folder`, read from disk, several at a time (file reads
    and hashlib release the GIL): sha256 with the CPU's SHA extensions runs at ~1.5 GB/s per core."""
    folder = Path(folder)
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(folder / name), names)))


# ---------------------------------------------------------------- folders

def _checkpoint_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step_<N> folder, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def step_folders(path) -> list[Path]:
    """The checkpoint folders `path` names, valid or not: itself when it is one (a step_<N> folder or
    one holding checkpoint.json or DCP's .metadata), else every step_<N> of the run folder `path`
    (or of `path` when it is a run's checkpoints/ folder), newest first."""
    path = Path(path)
    if _STEP_DIR.fullmatch(path.name) or (path / META_FILE).exists() or (path / ".metadata").exists():
        return [path] if path.is_dir() else []
    root = _checkpoint_root(path)
    return [p for _, p in _step_dirs(root if root.is_dir() else path)]


def _leftovers(root: Path) -> list[Path]:
    """Temporary folders of saves that never finished."""
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(".step_")) if root.is_dir() else []


def _remove(path: Path, why: str) -> None:
    log.warning("removing %s: %s", path, why)
    shutil.rmtree(path, ignore_errors=True)


def move_into(path: Path, folder: Path) -> Path:
    """Move `path` into `folder` (created), under a name not taken there yet; the new path (OSError on failure)."""
    target = folder / path.name
    n = 0
    while target.exists():
        n += 1
        target = folder / f"{path.name}.{n}"
    folder.mkdir(exist_ok=True)
    os.replace(path, target)
    return target


def _quarantine(path: Path, why: str) -> None:
    """Move a corrupt checkpoint to checkpoints/.invalid/ (kept for inspection, out of every search)."""
    try:
        target = move_into(path, path.parent / INVALID_DIR)
    except OSError as err:
        log.warning("could not move %s to %s (%s); it stays where it is", path, path.parent / INVALID_DIR, err)
        return
    log.warning("moved %s to %s (%s); delete it once inspected", path, target, why)


def set_aside_later(run_dir, step: int, resumed_from) -> list[Path]:
    """A run resumed at `step` has left the timeline of the run folder's later checkpoints (and of a step_<step>
    other than the one it resumed from): they move to checkpoints/.abandoned/, out of `--resume auto`'s search
    (which would otherwise go back to them if this run stops before its next save), kept. Their new paths."""
    moved = []
    for n, path in _step_dirs(_checkpoint_root(run_dir)):
        if n > step or (n == step and path.resolve() != Path(resumed_from).resolve()):
            moved.append(move_into(path, path.parent / ABANDONED_DIR))
    return moved


def validate(path, checksums: bool = True) -> dict:
    """The checkpoint.json record of the checkpoint at `path`; CheckpointError naming the problem
    (and the file) when `path` is not a complete, intact checkpoint: every file's recorded size
    and, with `checksums`, its sha256 (a full read), DCP's .metadata, and the payload's step."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such folder")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path}: no {META_FILE}, so its save never finished "
                              "(or the folder is not a blunb checkpoint)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} is unreadable ({err})") from None
    missing = [k for k in _META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} lacks {', '.join(missing)}")
    if meta["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta['format']!r}, this blunb reads {FORMAT!r}")
    if not (isinstance(meta["files"], dict) and isinstance(meta["sha256"], dict) and type(meta["step"]) is int):
        raise CheckpointError(f"checkpoint {path}: {META_FILE} is malformed (files, sha256 or step)")
    if ".metadata" not in meta["files"]:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} lists no DCP .metadata")
    for name, size in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing ({META_FILE} lists it)")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(f"checkpoint {path}: file {name} has {actual} bytes, {META_FILE} records {size}: "
                                  "truncated or corrupt")
    # Every file of the save is listed (_commit lists the folder): one it does not list means an edited list, and
    # an unlisted data file would be read by DCP unchecked.
    unlisted = sorted(f.name for f in path.iterdir() if f.is_file() and f.name != META_FILE
                      and f.name not in meta["files"])
    if unlisted:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} does not list {', '.join(unlisted)} (its list was "
                              "edited, or files were added after the save)")
    unsummed = sorted(set(meta["files"]) - set(meta["sha256"]))
    if unsummed:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} records no sha256 for {', '.join(unsummed)}")
    if checksums:
        try:
            actual = _checksums(path, sorted(meta["files"]))
        except OSError as err:
            raise CheckpointError(f"checkpoint {path}: a file cannot be read ({err})") from None
        for name, digest in actual.items():
            if digest != meta["sha256"][name]:
                raise CheckpointError(f"checkpoint {path}: file {name} is corrupt (its sha256 differs from the one "
                                      f"{META_FILE} records; its size is unchanged)")
    _read_metadata(path)
    saved_step = _payload_step(path)
    if saved_step != meta["step"]:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} says step {meta['step']} but its data was saved at "
                              f"step {saved_step} ({META_FILE} was edited or belongs to another checkpoint)")
    return meta


def find_resume(run_dir) -> Path | None:
    """The newest valid checkpoint in <run_dir>/checkpoints (validate(), checksums included), or None
    (a fresh start).

    Skipped, with a warning naming the problem and the file: temporary folders of saves that never
    finished (removed) and invalid step_<N> folders, e.g. a truncated or corrupt data file, an
    unreadable .metadata or a missing or edited checkpoint.json (moved to checkpoints/.invalid/,
    never deleted); both by global rank 0 only. An explicit path is checked by validate()
    instead, which raises."""
    root = _checkpoint_root(run_dir)
    rank0 = _is_rank0()
    for path in _leftovers(root):
        if rank0:
            _remove(path, "the leftovers of a save that never finished")
    for _, path in _step_dirs(root):
        try:
            validate(path)
            return path
        except CheckpointError as err:
            log.warning("skipping a corrupt checkpoint: %s", err)
            if rank0:
                _quarantine(path, "corrupt")
    return None


def _prune(root: Path, newest: int, keep: int) -> None:
    """Keep the `keep` newest valid checkpoints up to step `newest` (all of them for keep <= 0);
    remove the rest, unfinished saves and those past `newest`: a run resumed from an older
    checkpoint has left that timeline, and `--resume auto` must not go back to it."""
    kept = 0
    for step, path in _step_dirs(root):
        if step > newest:
            _remove(path, f"step {step} is past this save's step {newest} (a timeline this run left by resuming "
                          "from an older checkpoint)")
            continue
        try:
            validate(path, checksums=False)   # reading every kept checkpoint at every save costs too much
        except CheckpointError as err:
            _quarantine(path, str(err))
            continue
        kept += 1
        if 0 < keep < kept:
            _remove(path, f"ckpt_keep={keep}")
    for path in _leftovers(root):
        _remove(path, "the leftovers of a save that never finished")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path, meta: dict) -> None:
    """Rank 0, once every rank has written and hashed its share (meta["sha256"]): record the files,
    write checkpoint.json, rename."""
    meta["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    if set(meta["files"]) != set(meta["sha256"]):
        raise RuntimeError(f"the files in {tmp} changed while they were hashed: "
                           f"{sorted(set(meta['files']) ^ set(meta['sha256']))}")
    record = tmp / (META_FILE + ".tmp")
    with open(record, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(record, tmp / META_FILE)
    if final.exists():  # the same step saved again (after a resume from an older checkpoint)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


# ---------------------------------------------------------------- save / load

def save(run_dir, step: int, model: torch.nn.Module, opt_set, loaders: dict | None = None,
         extra: dict | None = None, *, keep: int = 2) -> bool:
    """Write <run_dir>/checkpoints/step_<step>/ (`step` = the next step to run); collective.

    Holds the model, every optimizer group's state (each rank its own shard), `loaders`' positions
    ({name: WindowLoader or ShardLoader}) and every rank's RNG states; checkpoint.json records step, optimizer kind
    and groups, world size, opt_set.cfg, `extra` (JSON: e.g. last_val_loss), the files with their
    sha256 (each rank hashes a share of them, read back from disk) and the seconds spent writing and
    hashing. Staged parameter refreshes are installed first. Afterwards only the `keep` newest valid
    checkpoints remain (keep <= 0: all). Returns True on every rank once the checkpoint is committed;
    on any failure (a full disk and DCP's CheckpointException included) logs a warning and returns
    False on every rank (the run can go on), leaving no folder that looks valid. A kill (SIGTERM's
    RunKilled, Ctrl-C: no Exception) is not a failed save: it removes the unfinished folder and
    propagates, so the run ends killed.
    """
    root = _checkpoint_root(run_dir)
    tmp = root / f".step_{step}.tmp"
    try:
        return _save(root, tmp, step, model, opt_set, loaders or {}, extra, keep)
    except BaseException:  # a kill, or a collective that failed because a rank died
        if _rank_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(root: Path, tmp: Path, step: int, model, opt_set, loaders: dict, extra, keep: int) -> bool:
    started = time.perf_counter()
    final = root / f"step_{step}"
    rank, world = _rank_world()
    cfg = getattr(opt_set, "cfg", None)
    meta = {"format": FORMAT, "step": int(step), "optimizer": _kind(opt_set), "groups": _group_names(opt_set),
            "world_size": world, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix_time": time.time(),
            "torch": torch.__version__, "config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
            "extra": extra or {}}
    problem = None
    try:
        json.dumps(meta)  # an extra that cannot be recorded fails here, before any collective
        disk_full = _disk_full_at(step, rank)
        opt_set.drain()   # the checkpoint holds this step's weights, not the previous step's
        state = _training_state(_unwrap(model), opt_set, saving=True)
        state["rank_state"] = {str(rank): _rank_blob(loaders)}
        state["step"] = torch.tensor(int(step), dtype=torch.int64)   # validate() checks checkpoint.json against it
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except Exception as err:  # noqa: BLE001  (a failed save must not stop the run)
        problem = _one_line(err, rank)
    if not _agree(problem, step):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return False
    try:
        _dcp_save(state, tmp, disk_full)
    except BaseException as err:  # DCP's CheckpointException is no Exception
        kill = _kill_inside(err)
        if kill is not None:
            raise kill from None
        problem = f"writing {tmp} failed on {_one_line(err, rank)}"
    ok = _agree(problem, step)   # every rank has written its part
    written = time.perf_counter()
    if ok:
        try:
            names = sorted(p.name for p in tmp.iterdir() if p.is_file())
            share = _checksums(tmp, names[rank::world])   # each rank hashes a share, read back from disk
        except OSError as err:
            share, problem = {}, f"hashing {tmp} failed on rank {rank}: {err}"
        ok = _agree(problem, step)
        meta["sha256"] = {name: digest for share in _gather(share) for name, digest in share.items()} if ok else {}
    meta["seconds"] = {"write": round(written - started, 3), "sha256": round(time.perf_counter() - written, 3)}
    if ok and rank == 0:
        try:
            delay = float(os.environ.get(DELAY_ENV) or 0)
            if delay > 0:
                log.warning("checkpoint step %d: written to %s; %s=%g: waiting before the commit",
                            step, tmp, DELAY_ENV, delay)
                time.sleep(delay)
            _commit(tmp, final, meta)
        except Exception as err:  # noqa: BLE001
            problem = f"committing {final} failed: {_one_line(err)}"
    ok = ok and _agree(problem, step)   # rank 0's verdict reaches every rank
    if rank == 0:
        if ok:
            log.info("checkpoint step %d: saved %s in %.2f s (sha256 of its files %.2f s)", step, final,
                     time.perf_counter() - started, meta["seconds"]["sha256"])
            try:
                _prune(root, step, keep)
            except OSError as err:
                log.warning("checkpoint step %d: pruning %s failed: %s", step, root, err)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return ok


def load(path, model: torch.nn.Module, opt_set, loaders: dict | None = None, *, restore_rng: bool = True,
         verify: bool = True) -> dict:
    """Restore the checkpoint at `path` (validated first: with `verify`, every file's sha256 too, on
    every rank; pass verify=False only right after validate() has checked it) into a freshly built
    run; collective.

    Restores the weights, every optimizer group's state re-cut for this world size (fp32 masters
    and replicated weights re-seeded together), its step counts and counters, `loaders`' positions
    and, with restore_rng, each rank's RNG states (torch CPU, CUDA, numpy, python random; a rank
    beyond the saved world size keeps its own). Returns the checkpoint.json record: "step" (the
    next step to run), "extra" (e.g. last_val_loss), "config", "world_size", ... Raises
    CheckpointError, before anything is loaded, for an invalid checkpoint or one from another kind
    of optimizer or of another model.
    """
    started = time.perf_counter()
    path = Path(path)
    loaders = loaders or {}
    meta = validate(path, checksums=verify)
    kind, groups = _kind(opt_set), _group_names(opt_set)
    if meta["optimizer"] != kind:
        raise CheckpointError(f"checkpoint {path} was saved by an optimizer={meta['optimizer']} run (groups "
                              f"{', '.join(meta['groups'])}) but this run has optimizer={kind} (groups "
                              f"{', '.join(groups)}): optimizer state does not carry over between them; resume "
                              f"with optimizer={meta['optimizer']} or start fresh")
    model = _unwrap(model)
    md = _read_metadata(path)
    _check_model_fits(path, meta, model, md)
    rank, world = _rank_world()
    saved_world = int(meta["world_size"])
    opt_set.drain()   # a refresh still in flight would land on top of the loaded weights
    state = _training_state(model, opt_set, saving=False)
    present = set(md.state_dict_metadata)
    for gname in list(state.get("optim_groups", {})):
        if f"optim_groups.{gname}.kind" not in present:  # a grouping the saved run did not have
            log.info("checkpoint %s has no counters for group %s; they start at 0", path, gname)
            del state["optim_groups"][gname]
    # Loader positions: at the saved world size each rank's own, at another rank 0's (they are world-size
    # independent); RNG states: each rank's own, where the saved run had that rank.
    own = rank < saved_world
    wanted = ({rank} if own else set()) | ({0} if world != saved_world else set())
    state["rank_state"] = {str(r): b"" for r in sorted(wanted)}
    _dcp_load(state, path, "it does not fit this run")

    names = {p: name for name, p in model.named_parameters()}
    for gname, opt, _ in opt_set.groups:
        if isinstance(opt, ShardedStateful):
            opt.load_state_dict({**state.get("optim_groups", {}).get(gname, {}), "state": state["optim"]},
                                param_names=names)
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(model, opt, state["torch_optim"][gname])
    blobs = {int(r): pickle.loads(v) for r, v in state["rank_state"].items()}
    positions = blobs[rank if world == saved_world else 0]["loaders"]
    for name, loader in loaders.items():
        if name not in positions:
            raise CheckpointError(f"checkpoint {path} holds no position for data loader {name!r} "
                                  f"(it has {sorted(positions)})")
        loader.load_state_dict(positions[name])
    if restore_rng:
        if own:
            _set_rng(blobs[rank]["rng"])
        else:
            log.info("rank %d: the checkpoint (world size %d) holds no RNG state for it; keeping its own",
                     rank, saved_world)
    if rank == 0:
        log.info("loaded %s in %.2f s: step %d (saved at world size %d, loaded at %d)", path,
                 time.perf_counter() - started, meta["step"], saved_world, world)
    return meta


def resync_masters(opt_set) -> None:
    """Re-seed every ZeRO group's fp32 masters from the current weights; call it after changing
    the weights outside the optimizer (moments and step counts are kept)."""
    for _, opt, _ in opt_set.groups:
        if isinstance(opt, ShardedStateful):
            opt.resync_masters_from_params()


def load_weights(path, model: torch.nn.Module, opt_set=None) -> dict:
    """Load only the weights of the checkpoint at `path` (any optimizer kind, any world size) and,
    with `opt_set`, resync its masters so the next step starts from them; collective. Returns the
    checkpoint.json record (validated first, sha256 included)."""
    path = Path(path)
    meta = validate(path)
    model = _unwrap(model)
    _check_model_fits(path, meta, model, _read_metadata(path))
    if opt_set is not None:
        opt_set.drain()
    state = {"model": _model_state(model)}
    _dcp_load(state, path, "its weights do not fit this model")
    if opt_set is not None:
        resync_masters(opt_set)
    return meta
