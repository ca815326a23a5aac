"""Run folders: where training writes, and how notebooks read them back into pandas.

results/<study>/<run_id>/{config.json, env.json, metrics.csv, log.txt, status.json[, run.ipynb]}

A folder has one owner at a time (FolderLock: a run, or a study over its folder); status.json
says how a run stands, and read_status() tells a run whose processes are gone from a live one.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd

import blunb
from blunb.config import ConfigError
from blunb.metrics import METRIC_COLUMNS, TIMING_COLUMNS  # noqa: F401  (declared there; read from here too)

log = logging.getLogger("blunb.runs")


def repo_root() -> Path:
    return Path(blunb.__file__).resolve().parent.parent


def results_root() -> Path:
    """Where studies write: $BLUNB_RESULTS (tests point it elsewhere) or the repo's results/."""
    return Path(os.environ.get("BLUNB_RESULTS", repo_root() / "results"))


def _git(args: list[str], cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=60).stdout


UNTRACKED_SOURCES = ("blunb", "bench", "notebooks")  # where an untracked .py file makes the tree dirty


def git_state(root: str | Path, max_files: int = 20) -> tuple[str, bool | None, list[str]]:
    """(HEAD sha, dirty, up to `max_files` dirty paths) of the git checkout holding `root`.

    Changed tracked files outside results/ count as dirty (`make study` rewrites the committed
    results/.../run.ipynb before training starts, which would otherwise mark every run dirty), and
    so do untracked (not ignored) .py files under UNTRACKED_SOURCES and notebooks under notebooks/: a
    new module or study notebook is code that ran but that no commit holds. Outside a git checkout (or
    without git): ("unknown", None, []).
    """
    try:
        top = _git(["rev-parse", "--show-toplevel"], root).strip()
        sha = _git(["rev-parse", "HEAD"], top).strip()
        out = _git(["status", "--porcelain=v1", "-z", "--untracked-files=no", "--", ".", ":(exclude)results"], top)
        new = _git(["ls-files", "-z", "--others", "--exclude-standard", "--",
                    *(f":(glob){d}/**/*.py" for d in UNTRACKED_SOURCES), ":(glob)notebooks/**/*.ipynb"], top)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None, []
    files, entries = [], iter(out.split("\0"))
    for entry in entries:
        if len(entry) < 4:
            continue
        files.append(entry[3:])
        if entry[0] in "RC":  # -z puts a rename's source path in the next entry
            next(entries, None)
    files += [path for path in new.split("\0") if path]
    return sha, bool(files), files[:max_files]


def git_sha() -> str:
    """HEAD of the checkout blunb runs from (whether it is dirty is env.json's git_dirty)."""
    return git_state(repo_root())[0]


def source_digest(package: Path | None = None) -> dict:
    """sha256 over the package's .py files (each file's path relative to the package, its size and
    its bytes, in sorted path order): names the code that ran even where no git checkout does."""
    package = Path(blunb.__file__).resolve().parent if package is None else Path(package)
    h = hashlib.sha256()
    files = sorted(package.rglob("*.py"), key=lambda p: p.relative_to(package).as_posix())
    for path in files:
        data = path.read_bytes()
        h.update(f"{path.relative_to(package).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return {"sha256": h.hexdigest(), "files": len(files)}


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


GPU_SHARE_ENV = "BLUNB_RUNS_PER_GPU"  # set by blunb.study per launch: the most runs its GPUs take at once


def gpu_sharing(device, environ=None) -> dict:
    """env.json's `gpu_sharing`: {"shared": bool | None, "runs_per_gpu": int | None}.

    On a GPU the study runner says, through BLUNB_RUNS_PER_GPU, how many runs (this one included) it
    lets use the run's GPUs at once: shared is runs_per_gpu > 1 (an upper bound, not a measured overlap).
    Launched any other way (unset or empty) on a GPU the run cannot know: both None. On the CPU no GPU
    is shared: False. A value that is not an integer >= 1 is a ConfigError, before any work."""
    import torch

    raw = (os.environ if environ is None else environ).get(GPU_SHARE_ENV, "")
    runs = None
    if raw.strip():  # unset or empty: not told
        runs = int(raw) if raw.strip().isdigit() else 0
        if runs < 1:
            raise ConfigError(f"{GPU_SHARE_ENV} must be an integer >= 1 (the runs that share this run's GPUs), "
                              f"got {raw!r}")
    if torch.device(device).type != "cuda":
        return {"shared": False, "runs_per_gpu": None}
    return {"shared": None if runs is None else runs > 1, "runs_per_gpu": runs}


def gpu_shared(env: dict) -> bool | None:
    """Whether a run shared its GPU with other runs, from its env.json: False (alone on its GPUs, or on
    the CPU), True, or None (unknown: no record, as in runs made before blunb kept one, or a GPU run
    launched outside blunb.study). A resumed run's steps come from every launch of its chain
    (env["resumed"]["earlier_env"]): one shared launch makes it shared, else one unknown unknown."""
    launches, e = [], env
    while e is not None:
        record = e.get("gpu_sharing", {})
        shared = record.get("shared") if isinstance(record, dict) else record
        if not (shared is None or isinstance(shared, bool)) or not isinstance(record, dict):
            raise ValueError(f"env.json's gpu_sharing must be {{'shared': true | false | null, ...}}, got {record!r}")
        launches.append(shared)
        e = (e.get("resumed") or {}).get("earlier_env")
    if True in launches:
        return True
    return None if None in launches else False


def machine(env: dict) -> str:
    """The device a run trained on, as exactly as its env.json says: the GPU model and the card's uuid
    (`device_uuid`, recorded since 2026-12-07), else the model alone (the CPU: "cpu"). Step times compare
    only on one machine: two lent as the same model need not time alike (host, clocks). A resumed run
    whose launches (env["resumed"]["earlier_env"]) trained on different cards names each, joined by " + "."""
    launches, e = [], env
    while e is not None:
        name, uuid = e.get("device"), e.get("device_uuid")
        launches.append(f"{name} ({uuid})" if uuid else str(name))
        e = (e.get("resumed") or {}).get("earlier_env")
    return " + ".join(dict.fromkeys(reversed(launches)))


def environment(world_size: int, device, shards: list[Path] | None = None) -> dict:
    """What env.json records. With `shards`, also each shard's name, size and sha256 (cached per file)."""
    import numpy as np
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = torch.device(device)
    sha, dirty, dirty_files = git_state(repo_root())
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        # which card: two machines lent as the same GPU model differ in step time (host, clocks, neighbours)
        "device_uuid": str(torch.cuda.get_device_properties(dev).uuid) if dev.type == "cuda" else None,
        "world_size": world_size,
        "git_sha": sha,
        "git_dirty": dirty,
        "git_dirty_files": dirty_files,
        "blunb_sources": source_digest(),
        "blunb": blunb.__version__,
        "platform": platform.platform(),
        "argv": sys.argv,
        "hostname": socket.gethostname(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "gpu_sharing": gpu_sharing(dev),
    }
    if shards is not None:
        from blunb.data import shard_manifest

        env["shards"] = shard_manifest(shards)
    return env


# ---------------------------------------------------------------- writing run files

class RunWriteError(RuntimeError):
    """A run file could not be written (a full disk, a lost mount): the run cannot keep its record,
    so it stops, naming the file, rather than train on with lines or rows silently dropped."""


FAIL_WRITE_ENV = "BLUNB_TEST_FAIL_WRITE"  # testing aid: NAME:N, see check_write
_writes: dict[str, int] = {}


def check_write(path: Path) -> None:
    """Called before each write of a run file (a metrics row, a log record, a status update).
    With BLUNB_TEST_FAIL_WRITE=NAME:N, the N-th and every later write of a file named NAME in
    this process fail with ENOSPC, as on a disk that filled up."""
    spec = os.environ.get(FAIL_WRITE_ENV)
    if not spec:
        return
    name, _, n = spec.rpartition(":")
    if not name or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{FAIL_WRITE_ENV}={spec!r}: expected FILE_NAME:N (N >= 1), e.g. metrics.csv:5")
    if path.name == name:
        _writes[name] = _writes.get(name, 0) + 1
        if _writes[name] >= int(n):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({FAIL_WRITE_ENV})", str(path))


def write_failed(path: Path, err: OSError) -> RunWriteError:
    return RunWriteError(f"writing {path} failed ({err.strerror or err}); the run cannot keep its record")


# ---------------------------------------------------------------- status.json

RUN_STATES = ("running", "completed", "failed", "killed", "diverged")


def process_info() -> dict:
    """This process as status.json and lock files name it: pid, host and its start time (Linux:
    clock ticks since boot, so a pid reused by a later process is not taken for it)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid())}


def _process_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
    return None if fields[0] in "ZX" else int(fields[19])


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start and imports included); None off Linux."""
    start = _process_start(os.getpid())
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    return None if start is None else max(0.0, uptime - start / os.sysconf("SC_CLK_TCK"))


def process_alive(info: dict) -> bool:
    """Whether the process of a process_info() record (on this host) still runs."""
    pid, start = info.get("pid"), info.get("start")
    if start is not None and Path("/proc").is_dir():
        return _process_start(pid) == start   # None: gone or a zombie; another value: the pid was reused
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


def write_status(run_dir: str | Path, state: str, steps_done: int, steps_total: int, error: str | None = None,
                 **extra) -> None:
    """Write <run_dir>/status.json atomically (tmp + rename), so a reader never sees half a file.
    A running run also passes processes=[process_info() of each rank], which read_status checks.
    An OSError (a full disk) is raised as RunWriteError naming the file."""
    if state not in RUN_STATES:
        raise ValueError(f"run state must be one of {', '.join(RUN_STATES)}, got {state!r}")
    if "updated" in extra:
        raise TypeError("write_status sets 'updated' itself")
    status = {"state": state, "steps_done": int(steps_done), "steps_total": int(steps_total),
              "error": None if error is None else str(error),
              "updated": datetime.now().astimezone().isoformat(timespec="seconds"), **extra}
    path = Path(run_dir) / "status.json"
    tmp = path.with_name(f".status.json.{os.getpid()}.tmp")
    try:
        check_write(path)
        tmp.write_text(json.dumps(status, indent=2, default=str))
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, err) from err


def read_status(run_dir: str | Path) -> dict | None:
    """status.json of a run folder, or None where the run never wrote one (older runs).

    A status that says running while every process it names on this host is gone (killed with
    SIGKILL, out of memory, a stopped rank its job killed) is returned as state "killed" with
    error "process gone: ...", "process_gone": True and the steps_done it last recorded; the file
    itself is left as it is (settle_status writes it back)."""
    path = Path(run_dir) / "status.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        status = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    procs = status.get("processes") or []
    here = [p for p in procs if p.get("host") == socket.gethostname()]
    if status.get("state") == "running" and here and not any(process_alive(p) for p in here):
        pids = ", ".join(str(p["pid"]) for p in here)
        status.update(state="killed", process_gone=True,
                      error=f"process gone: the run's process(es) {pids} on {here[0]['host']} no longer run "
                            f"(its last status update: {status.get('updated')}, step {status.get('steps_done')})")
    return status


def settle_status(run_dir: str | Path) -> dict | None:
    """read_status(), writing a gone run's "killed" back to status.json: what a launcher calls once the
    run's processes have exited, so the file says what happened."""
    status = read_status(run_dir)
    if status is not None and status.get("process_gone"):
        extra = {k: v for k, v in status.items()
                 if k not in ("state", "steps_done", "steps_total", "error", "updated", "processes")}
        write_status(run_dir, "killed", status["steps_done"], status["steps_total"], status["error"], **extra)
    return status


# ---------------------------------------------------------------- one owner per folder

LOCK_NAME = ".lock"


class FolderInUse(ConfigError):
    """Another live process holds the folder's lock (FolderLock)."""


# A holder that is going away (a stop signal reached it, the kernel is finishing it, or its launcher died:
# blunb.train's ranks stop with their torchrun) lets go of the lock a moment later, which on a busy machine
# can be seconds after its parent was reaped: re-issuing the command at once (the --resume auto recipe)
# waits up to this long for such a holder. A live holder is refused at once.
LOCK_GRACE_S = 30.0
# A new holder writes its record just after it takes the lock: on a loaded machine a second process can look
# in between, find no record, and would name nobody; it waits this long for the record to appear.
LOCK_RECORD_WAIT_S = 10.0


def _holder_going_away(holder: dict) -> bool:
    """Whether a lock record's process is stopping: it said so (mark_stopping), or on this host the
    kernel is finishing it (a zombie, a SIGKILL pending) or its parent is no longer the one that
    started it (a launcher's death; the ranks get SIGTERM with it)."""
    if holder.get("stopping"):
        return True
    if not holder.get("pid") or holder.get("host") != socket.gethostname():
        return False
    try:
        with open(f"/proc/{holder['pid']}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True  # gone: the kernel frees its lock as it exits
    if fields.get("State", "").strip()[:1] in ("Z", "X"):
        return True
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    if pending & (1 << (9 - 1)):  # SIGKILL
        return True
    ppid = holder.get("ppid")
    return ppid is not None and int(fields.get("PPid", ppid)) != ppid


def _take_flock(fd: int) -> bool:
    """Lock fd; a holder that is going away gets LOCK_GRACE_S to let go. False: a live holder has it."""
    deadline = None
    record_deadline = time.monotonic() + LOCK_RECORD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            now = time.monotonic()
            holder = _lock_record(fd)
            if not holder.get("pid") and now < record_deadline:  # the holder is still writing its record
                time.sleep(0.02)
                continue
            if not _holder_going_away(holder) or (deadline is not None and now >= deadline):
                return False
            deadline = deadline or now + LOCK_GRACE_S
            time.sleep(0.1)


class FolderLock:
    """One owner per folder: an exclusive flock on <folder>/.lock, from acquire() to release().

    The kernel drops a flock when its holder dies, however it dies, so a crashed owner never
    leaves the folder locked; the file's record (pid, host, start, command) then tells the next
    owner whose stale lock it took over (`taken_over`). A second process gets FolderInUse naming
    the holder, before it has touched anything else in the folder. release() removes the file
    (and the folder, when acquire() created it and it is still empty). Not for folders shared
    between hosts on a filesystem without working flock."""

    def __init__(self, folder: str | Path, what: str = "run", hint: str = ""):
        self.folder, self.what, self.hint = Path(folder), what, hint
        self.path = self.folder / LOCK_NAME
        self.taken_over: dict | None = None
        self._record: dict = {}
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> FolderLock:
        missing = [d for d in (self.folder, *self.folder.parents) if not d.exists()]
        self.folder.mkdir(parents=True, exist_ok=True)
        self._created = missing  # deepest first
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if not _take_flock(fd):
                holder = _lock_record(fd)
                os.close(fd)
                self._remove_created()
                raise FolderInUse(f"{self.folder} is in use: another {self.what} holds its lock "
                                  f"({describe_holder(holder)})" + (f"; {self.hint}" if self.hint else "")) from None
            try:  # a holder's release() may have removed the file between our open and flock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise RuntimeError(f"could not lock {self.path}: it was replaced ten times while locking it")
        self.taken_over = _lock_record(fd) or None  # a record left behind: its holder died holding it
        self._record = {**process_info(), "ppid": os.getppid(), "what": self.what,
                        "started": datetime.now().astimezone().isoformat(timespec="seconds"), "argv": sys.argv}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self._record).encode(), 0)
        except OSError as err:
            os.close(fd)
            raise write_failed(self.path, err) from err
        self._fd = fd
        return self

    def mark_stopping(self) -> None:
        """Say in the record that this holder is stopping (a stop signal), so a process that wants the
        folder waits for the release rather than calling it in use. The record only grows: no truncate,
        and a reader never sees it empty."""
        if self._fd is None:
            return
        try:
            os.pwrite(self._fd, json.dumps({**self._record, "stopping": True}).encode(), 0)
        except OSError:
            pass  # a full disk: the waiting process then fails fast naming this holder, as before

    def stale_note(self) -> str | None:
        """The line to log when acquire() took over a dead holder's lock."""
        if self.taken_over is None:
            return None
        return f"took over the stale lock of {self.folder}: its holder is gone ({describe_holder(self.taken_over)})"

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still holding it: see acquire's inode check
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for d in self._created:
            try:
                d.rmdir()
            except OSError:
                break  # not empty: it holds something now
        self._created = []

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _lock_record(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:
        return {"note": "unreadable lock record"}


def describe_holder(holder: dict) -> str:
    """A process_info()/lock record in words: pid 123 on host, started ..., command ..."""
    if not holder.get("pid"):
        return holder.get("note", "no record of its holder")
    text = f"pid {holder['pid']} on {holder.get('host', '?')}"
    if holder.get("started"):
        text += f", started {holder['started']}"
    if holder.get("argv"):
        text += f": {' '.join(map(str, holder['argv']))}"
    return text


def set_aside_rows_from(path: Path, step: int) -> Path | None:
    """A resume at `step`: move the rows of steps >= step in the CSV at `path` (metrics.csv,
    diag.csv: a `step` column) to `<stem>.discarded_from_step_<step>.csv` beside it (.<n>.csv when that
    exists), keeping the earlier rows in place, so the continued file has one row per step. Returns the
    aside file."""
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames or [], list(reader)
    is_later = [bool(r.get("step")) and int(r["step"]) >= step for r in rows]
    if not any(is_later):
        return None
    aside, n = path.with_name(f"{path.stem}.discarded_from_step_{step}.csv"), 0
    while aside.exists():  # a second resume at the same step: the first one's rows stay
        n += 1
        aside = path.with_name(f"{path.stem}.discarded_from_step_{step}.{n}.csv")
    later = [r for r, x in zip(rows, is_later) if x]
    earlier = [r for r, x in zip(rows, is_later) if not x]
    for target, keep in ((aside, later), (path, earlier)):
        tmp = target.with_name(f".{target.name}.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(keep)
        os.replace(tmp, target)
    return aside


class MetricsWriter:
    """Appends one row per step and flushes, so a crashed run keeps every finished step.
    append=True continues an existing file (a resume), rewriting it first when its columns differ."""

    def __init__(self, path: Path, extra_columns: list[str], append: bool = False):
        self.path = path
        self._failed = False
        self.columns = METRIC_COLUMNS + extra_columns
        kept = []
        if append and path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames == self.columns:
                    kept = None
                else:
                    kept = [{k: r.get(k, "") for k in self.columns} for r in reader]
        try:
            if kept is not None:  # a new file, or a resumed one with other columns: written whole, then renamed
                tmp = path.with_name(f".{path.name}.tmp")
                with open(tmp, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=self.columns)
                    w.writeheader()
                    w.writerows(kept)
                os.replace(tmp, path)
            self._f = open(path, "a", newline="")
        except OSError as err:
            raise write_failed(path, err) from err
        self._w = csv.DictWriter(self._f, fieldnames=self.columns)

    def write(self, row: dict) -> None:
        """One row, flushed; an OSError (a full disk) is raised as RunWriteError naming the file."""
        try:
            check_write(self.path)
            self._w.writerow({k: ("" if v is None else v) for k, v in row.items()})
            self._f.flush()
        except OSError as err:
            self._failed = True
            raise write_failed(self.path, err) from err

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            if not self._failed:  # after a failed write its error is the one that counts
                raise


@dataclass
class Run:
    path: Path
    config: dict
    env: dict
    metrics: pd.DataFrame
    status: dict | None = None  # status.json; None for runs that predate it

    @property
    def run_id(self) -> str:
        return self.path.name


def load_run(path: str | Path) -> Run:
    path = Path(path)
    missing = [n for n in ("config.json", "env.json", "metrics.csv") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a complete run folder: missing {', '.join(missing)}")
    metrics = pd.read_csv(path / "metrics.csv")
    return Run(path, json.loads((path / "config.json").read_text()), json.loads((path / "env.json").read_text()),
               metrics, read_status(path))


def load_study(study_dir: str | Path) -> list[Run]:
    """Every run folder (one with metrics.csv) directly under a study folder, sorted by name.

    Unfinished and failed runs are included; summarize() flags them (status, complete).
    """
    study_dir = Path(study_dir)
    return [load_run(p) for p in sorted(study_dir.iterdir()) if (p / "metrics.csv").is_file()]


def steady_aggregates(steady: pd.DataFrame) -> dict:
    """Steady-state throughput as the MFU meter aggregates it: total tokens / total time and
    total model FLOPs / (total time x peak), never a median or mean of per-step ratios."""
    secs = steady["dt_ms"].sum() / 1e3
    if not len(steady) or secs <= 0:
        return {"steady_tok_per_sec": float("nan"), "steady_mfu": float("nan")}
    tokens = (steady["tok_per_sec"] * steady["dt_ms"] / 1e3).sum()
    flops_share = (steady["mfu"] * steady["dt_ms"]).sum(min_count=1)  # mfu x dt = FLOPs / peak of each step
    return {"steady_tok_per_sec": float(tokens / secs), "steady_mfu": float(flops_share / steady["dt_ms"].sum())}


def summarize(runs: list[Run]) -> pd.DataFrame:
    """One row per run: what was trained, on what, and how it ended.

    Runs that did not finish are kept and flagged: `status` (status.json's state, "unknown"
    without one), `steps_done` / `steps_total` and `complete`. A run that died before its
    first step (header-only metrics.csv) has steps 0 and NaN losses.
    """
    nan = float("nan")
    rows = []
    for r in runs:
        m, cfg, st = r.metrics, r.config, r.status or {}
        val = m["val_loss"].dropna()
        steps = int(m["step"].max()) + 1 if m["step"].notna().any() else 0
        steady = m[m["step"] >= min(cfg.get("mfu_warmup", 5), len(m) - 1)]
        state = st.get("state", "unknown")
        steps_done = st.get("steps_done") if st.get("steps_done") is not None else steps
        steps_total = st.get("steps_total") if st.get("steps_total") is not None else cfg.get("max_steps")
        rows.append({
            "run": r.run_id,
            "preset": cfg.get("preset"),
            "optimizer": cfg.get("optimizer"),
            "world_size": r.env.get("world_size"),
            "device": r.env.get("device"),
            "steps": steps,
            "first_train_loss": float(m["train_loss"].iloc[0]) if len(m) else nan,
            "final_train_loss": float(m["train_loss"].iloc[-1]) if len(m) else nan,
            "final_val_loss": float(val.iloc[-1]) if len(val) else nan,
            **steady_aggregates(steady),
            "status": state,
            "steps_done": steps_done,
            "steps_total": steps_total,
            "complete": bool(state == "completed" and steps_done == steps_total),
        })
    return pd.DataFrame(rows)
