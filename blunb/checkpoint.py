"""Distributed checkpoints of a training run (torch.distributed.checkpoint, DCP): save, find, check, load.

On disk, one folder per checkpoint, N being the next step to run:

    <run_dir>/checkpoints/step_<N>/
        .metadata, __<r>_0.distcp   DCP's index and each rank's data file
        checkpoint.json             blunb's record, written last: step, optimizer kind and groups,
                                    world size, config, extra, time, and every file with its size

A save writes into `.step_<N>.tmp/` and rank 0 renames it to `step_<N>` only once every rank has
finished and checkpoint.json is on disk, so a run killed mid-save leaves a `.tmp` folder, never a
`step_<N>` that looks finished. A folder is a valid checkpoint when checkpoint.json is complete and
every file it lists has the recorded size (a truncated data file is caught without reading it).

What the DCP state holds (keys flattened with "."):

    model.<fqn>                  the weights; replicated, so DCP writes them once
    optim.<fqn>.<field>          the ZeRO optimizers' state per parameter, keyed by the model's FQN:
                                 each element written by the one rank that owns it, each rank reading
                                 back exactly its new slices, so a checkpoint resumes at any world
                                 size, collective, bucket size or dtype grouping
    optim_groups.<group>.*       each ZeRO group's kind and counters (skipped steps, ...)
    torch_optim.<group>.*        a plain torch optimizer's state (DDPAdamW): replicated, written once
    rank_state.<r>               rank r's RNG states and data-loader positions (one pickled blob)

Every function that takes an optimizer set is collective: every rank calls it. find_resume and
validate only read files (find_resume's clean-up of unfinished saves runs on global rank 0 only).

Weights alone: load_weights() loads only `model.*` and re-seeds the optimizers' fp32 masters from
them (resync_masters); a master left stale would silently revert the weights at the next step.
Anything else that changes the weights in place must call resync_masters(opt_set) itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from blunb.config import ConfigError

log = logging.getLogger(__name__)

FORMAT = "blunb-dcp-1"
META_FILE = "checkpoint.json"
DELAY_ENV = "BLUNB_TEST_CKPT_DELAY_S"   # test hook: seconds rank 0 waits between writing and committing
_STEP_DIR = re.compile(r"step_(\d+)")
_META_KEYS = ("format", "step", "optimizer", "groups", "world_size", "files")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used here (missing, unfinished, corrupt, or from another kind of
    run); the message names the path and the problem. A ConfigError: the run stops before any work."""


# ---------------------------------------------------------------- helpers the optimizers use

@contextlib.contextmanager
def _quiet_dcp():
    # DCP's own planner touches ShardedTensor through deprecated paths on every call, and warns at
    # every single-process save; neither says anything a user of blunb can act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def state_keys(params: list, param_names=None) -> list[str]:
    """The state-dict key of each parameter: param_names[p] (e.g. the model's FQN), else "p<index>"."""
    if param_names is None:
        return [f"p{i}" for i in range(len(params))]
    missing = [i for i, p in enumerate(params) if p not in param_names]
    if missing:
        raise ValueError(f"param_names has no name for parameter(s) {missing} (shape "
                         f"{tuple(params[missing[0]].shape)}, ...)")
    return [param_names[p] for p in params]


def sharded_tensor(local: torch.Tensor | None, shape, pieces, *, device, dtype=torch.float32, process_group=None):
    """A ShardedTensor of global `shape` made of `pieces`, [(group rank, offsets, sizes)] of EVERY
    rank in the same order on every rank (at most one per rank); `local` is this rank's piece, None
    where it holds none. Built without communication: every rank derives the same layout itself."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    def global_rank(q):  # placements name global ranks
        return q if process_group is None else dist.get_global_rank(process_group, q)

    me = dist.get_rank()
    metas = [ShardMetadata(list(off), list(size), f"rank:{global_rank(q)}/{device}") for q, off, size in pieces]
    mine = [m for m in metas if m.placement.rank() == me]
    if len(mine) != (local is not None):
        raise AssertionError(f"rank {me}: {len(mine)} piece(s) in the layout but local={local is not None}")
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    with _quiet_dcp():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, mine[0])] if mine else [], ShardedTensorMetadata(metas, torch.Size(shape), props),
            process_group=process_group)


def local_piece(t, offsets, sizes, shape, what: str) -> torch.Tensor:
    """This rank's piece (at `offsets`, of `sizes`) of a loaded tensor of global `shape`: the
    matching local shard of a ShardedTensor (what a DCP load into state_dict() gives), or the
    slice of a full tensor (any tensor with the right number of elements)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(t, ShardedTensor):
        with _quiet_dcp():
            if tuple(t.size()) != tuple(shape):
                raise ValueError(f"{what}: saved shape {tuple(t.size())}, expected {tuple(shape)}")
            for s in t.local_shards():
                if tuple(s.metadata.shard_offsets) == tuple(offsets) and tuple(s.metadata.shard_sizes) == tuple(sizes):
                    return s.tensor
        raise ValueError(f"{what}: the loaded ShardedTensor holds no local piece at {tuple(offsets)} of {tuple(sizes)}")
    t = torch.as_tensor(t)
    if t.numel() != int(np.prod(shape)):
        raise ValueError(f"{what}: {t.numel()} elements, expected {int(np.prod(shape))} (shape {tuple(shape)})")
    return t.reshape(shape)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def check_state_kind(state_dict: dict, kind: str) -> None:
    """Refuse another optimizer class's state (a dict without "kind" is taken to be ours)."""
    got = state_dict.get("kind", kind)
    if got != kind:
        raise ValueError(f"{kind}.load_state_dict got the state of a {got}: optimizer state does not carry "
                         "over between kinds of optimizer (optimizer=adamw and optimizer=muon checkpoints do not mix)")


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


def _is_zero(opt) -> bool:
    from blunb.optim.muon import ShardedMuon
    from blunb.optim.zero_adamw import ShardedAdamW

    return isinstance(opt, (ShardedAdamW, ShardedMuon))


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
        if _is_zero(opt):
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


def _all_ok(ok: bool) -> bool:
    """True on every rank iff it is True on every rank: how the ranks of a save agree on each phase."""
    if _rank_world()[1] == 1:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


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


def _dcp_save(tree: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    flat = {".".join(p): v for p, v in _flatten(tree).items()}
    # Several writer threads per rank: one thread wrote a 1b checkpoint at ~0.3 GB/s on an H200 host.
    writer = FileSystemWriter(str(path), thread_count=min(8, os.cpu_count() or 1))
    with _quiet_dcp():
        dcp.save(flat, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False))


def _dcp_load(tree: dict, path: Path) -> None:
    """Load the leaves of `tree` in place (tensors) or by replacement (objects).

    Flattened here rather than by DCP: DCP's own flattening takes a checkpoint holding keys the
    caller does not ask for (another rank's state, the optimizer state of a weights-only load) for
    a pre-2.4 checkpoint and then looks for keys of that old format. (No nested ShardedTensors
    here, and without that pass the loaded objects land in `flat` itself.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    leaves = _flatten(tree)
    flat = {".".join(p): v for p, v in leaves.items()}
    with _quiet_dcp():
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        dcp.load(flat, checkpoint_id=str(path), planner=planner)
    for p in leaves:
        node = tree
        for key in p[:-1]:
            node = node[key]
        node[p[-1]] = flat[".".join(p)]


def _saved_keys(path: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    with _quiet_dcp():
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


# ---------------------------------------------------------------- folders

def _checkpoint_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step_<N> folder, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def _leftovers(root: Path) -> list[Path]:
    """Temporary folders of saves that never finished."""
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(".step_")) if root.is_dir() else []


def _remove(path: Path, why: str) -> None:
    log.warning("removing %s: %s", path, why)
    shutil.rmtree(path, ignore_errors=True)


def validate(path) -> dict:
    """The checkpoint.json record of the checkpoint at `path`; CheckpointError naming the problem
    when `path` is not a complete, intact checkpoint (checks every file's recorded size)."""
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
    return meta


def find_resume(run_dir) -> Path | None:
    """The newest valid checkpoint in <run_dir>/checkpoints, or None (a fresh start).

    Skipped, with a log message: folders whose save never finished (removed, by global rank 0)
    and corrupt ones, e.g. a truncated data file (kept for inspection; the next save's pruning
    removes them). An explicit path is checked by validate() instead, which raises."""
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
            if not (path / META_FILE).exists():
                if rank0:
                    _remove(path, f"not a finished checkpoint ({err})")
            else:
                log.warning("skipping a corrupt checkpoint: %s", err)
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
            validate(path)
        except CheckpointError as err:
            _remove(path, str(err))
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
    """Rank 0, once every rank has written: record the files, write checkpoint.json, rename."""
    meta["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
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
    ({name: ShardLoader}) and every rank's RNG states; checkpoint.json records step, optimizer kind
    and groups, world size, opt_set.cfg, `extra` (JSON: e.g. last_val_loss) and the files. Staged
    parameter refreshes are installed first. Afterwards only the `keep` newest valid checkpoints
    remain (keep <= 0: all). Returns True on every rank once the checkpoint is committed; on any
    failure logs a warning and returns False on every rank (the run can go on), leaving no folder
    that looks valid.
    """
    started = time.perf_counter()
    loaders = loaders or {}
    root = _checkpoint_root(run_dir)
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    rank, world = _rank_world()
    cfg = getattr(opt_set, "cfg", None)
    meta = {"format": FORMAT, "step": int(step), "optimizer": _kind(opt_set), "groups": _group_names(opt_set),
            "world_size": world, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix_time": time.time(),
            "torch": torch.__version__, "config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
            "extra": extra or {}}
    ok = True
    try:
        json.dumps(meta)  # an extra that cannot be recorded fails here, before any collective
        opt_set.drain()   # the checkpoint holds this step's weights, not the previous step's
        state = _training_state(_unwrap(model), opt_set, saving=True)
        state["rank_state"] = {str(rank): _rank_blob(loaders)}
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except Exception as err:  # noqa: BLE001  (a failed save must not stop the run)
        log.warning("checkpoint step %d: not saved (rank %d: %s: %s)", step, rank, type(err).__name__, err)
        ok = False
    if not _all_ok(ok):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return False
    try:
        _dcp_save(state, tmp)
    except Exception as err:  # noqa: BLE001
        log.warning("checkpoint step %d: writing %s failed (rank %d: %s: %s)", step, tmp, rank,
                    type(err).__name__, err)
        ok = False
    ok = _all_ok(ok)   # every rank has written its part
    if ok and rank == 0:
        try:
            delay = float(os.environ.get(DELAY_ENV) or 0)
            if delay > 0:
                log.warning("checkpoint step %d: written to %s; %s=%g: waiting before the commit",
                            step, tmp, DELAY_ENV, delay)
                time.sleep(delay)
            _commit(tmp, final, meta)
        except Exception as err:  # noqa: BLE001
            log.warning("checkpoint step %d: committing %s failed (%s: %s)", step, final, type(err).__name__, err)
            ok = False
    ok = _all_ok(ok)   # rank 0's verdict reaches every rank
    if rank == 0:
        if ok:
            log.info("checkpoint step %d: saved %s in %.2f s", step, final, time.perf_counter() - started)
            try:
                _prune(root, step, keep)
            except OSError as err:
                log.warning("checkpoint step %d: pruning %s failed: %s", step, root, err)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return ok


def load(path, model: torch.nn.Module, opt_set, loaders: dict | None = None, *, restore_rng: bool = True) -> dict:
    """Restore the checkpoint at `path` (validated first) into a freshly built run; collective.

    Restores the weights, every optimizer group's state re-cut for this world size (fp32 masters
    and replicated weights re-seeded together), its step counts and counters, `loaders`' positions
    and, with restore_rng, each rank's RNG states (torch CPU, CUDA, numpy, python random; a rank
    beyond the saved world size keeps its own). Returns the checkpoint.json record: "step" (the
    next step to run), "extra" (e.g. last_val_loss), "config", "world_size", ... Raises
    CheckpointError for an invalid checkpoint or one from another kind of optimizer.
    """
    started = time.perf_counter()
    path = Path(path)
    loaders = loaders or {}
    meta = validate(path)
    kind, groups = _kind(opt_set), _group_names(opt_set)
    if meta["optimizer"] != kind:
        raise CheckpointError(f"checkpoint {path} was saved by an optimizer={meta['optimizer']} run (groups "
                              f"{', '.join(meta['groups'])}) but this run has optimizer={kind} (groups "
                              f"{', '.join(groups)}): optimizer state does not carry over between them; resume "
                              f"with optimizer={meta['optimizer']} or start fresh")
    model = _unwrap(model)
    rank, world = _rank_world()
    saved_world = int(meta["world_size"])
    opt_set.drain()   # a refresh still in flight would land on top of the loaded weights
    state = _training_state(model, opt_set, saving=False)
    present = _saved_keys(path)
    for gname in list(state.get("optim_groups", {})):
        if f"optim_groups.{gname}.kind" not in present:  # a grouping the saved run did not have
            log.info("checkpoint %s has no counters for group %s; they start at 0", path, gname)
            del state["optim_groups"][gname]
    # Loader positions: at the saved world size each rank's own, at another rank 0's (they are world-size
    # independent); RNG states: each rank's own, where the saved run had that rank.
    own = rank < saved_world
    wanted = ({rank} if own else set()) | ({0} if world != saved_world else set())
    state["rank_state"] = {str(r): b"" for r in sorted(wanted)}
    try:
        _dcp_load(state, path)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path} does not fit this run: {type(err).__name__}: {err}") from err

    names = {p: name for name, p in model.named_parameters()}
    for gname, opt, _ in opt_set.groups:
        if _is_zero(opt):
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
        if _is_zero(opt):
            opt.resync_masters_from_params()


def load_weights(path, model: torch.nn.Module, opt_set=None) -> dict:
    """Load only the weights of the checkpoint at `path` (any optimizer kind, any world size) and,
    with `opt_set`, resync its masters so the next step starts from them; collective. Returns the
    checkpoint.json record."""
    path = Path(path)
    meta = validate(path)
    if opt_set is not None:
        opt_set.drain()
    state = {"model": _model_state(_unwrap(model))}
    try:
        _dcp_load(state, path)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: its weights do not fit this model: {type(err).__name__}: "
                              f"{err}") from err
    if opt_set is not None:
        resync_masters(opt_set)
    return meta
