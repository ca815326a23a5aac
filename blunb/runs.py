"""Run folders: where training writes, and how notebooks read them back into pandas.

results/<study>/<run_id>/{config.json, env.json, metrics.csv, log.txt, status.json[, run.ipynb]}
"""

from __future__ import annotations

import csv
import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd

import blunb

METRIC_COLUMNS = ["step", "train_loss", "val_loss", "tok_per_sec", "grad_norm", "dt_ms", "lr", "elapsed_min",
                  "mfu", "mfu_palm", "tflops_per_gpu"]


def repo_root() -> Path:
    return Path(blunb.__file__).resolve().parent.parent


def results_root() -> Path:
    """Where studies write: $BLUNB_RESULTS (tests point it elsewhere) or the repo's results/."""
    return Path(os.environ.get("BLUNB_RESULTS", repo_root() / "results"))


def _git(args: list[str], cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=60).stdout


def git_state(root: str | Path, max_files: int = 20) -> tuple[str, bool | None, list[str]]:
    """(HEAD sha, dirty, up to `max_files` dirty paths) of the git checkout holding `root`.

    Only tracked files outside results/ count as dirty: `make study` rewrites the committed
    results/.../run.ipynb before training starts, which would otherwise mark every run dirty.
    Outside a git checkout (or without git): ("unknown", None, []).
    """
    try:
        top = _git(["rev-parse", "--show-toplevel"], root).strip()
        sha = _git(["rev-parse", "HEAD"], top).strip()
        out = _git(["status", "--porcelain=v1", "-z", "--untracked-files=no", "--", ".", ":(exclude)results"], top)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None, []
    files, entries = [], iter(out.split("\0"))
    for entry in entries:
        if len(entry) < 4:
            continue
        files.append(entry[3:])
        if entry[0] in "RC":  # -z puts a rename's source path in the next entry
            next(entries, None)
    return sha, bool(files), files[:max_files]


def git_sha() -> str:
    """HEAD of the checkout blunb runs from (whether it is dirty is env.json's git_dirty)."""
    return git_state(repo_root())[0]


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


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
        "world_size": world_size,
        "git_sha": sha,
        "git_dirty": dirty,
        "git_dirty_files": dirty_files,
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
    }
    if shards is not None:
        from blunb.data import shard_manifest

        env["shards"] = shard_manifest(shards)
    return env


# ---------------------------------------------------------------- status.json

RUN_STATES = ("running", "completed", "failed", "killed")


def write_status(run_dir: str | Path, state: str, steps_done: int, steps_total: int, error: str | None = None,
                 **extra) -> None:
    """Write <run_dir>/status.json atomically, so a reader never sees half a file."""
    if state not in RUN_STATES:
        raise ValueError(f"run state must be one of {', '.join(RUN_STATES)}, got {state!r}")
    if "updated" in extra:
        raise TypeError("write_status sets 'updated' itself")
    status = {"state": state, "steps_done": int(steps_done), "steps_total": int(steps_total),
              "error": None if error is None else str(error),
              "updated": datetime.now().astimezone().isoformat(timespec="seconds"), **extra}
    path = Path(run_dir) / "status.json"
    tmp = path.with_name(f".status.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(status, indent=2, default=str))
    os.replace(tmp, path)


def read_status(run_dir: str | Path) -> dict | None:
    """status.json of a run folder, or None where the run never wrote one (older runs)."""
    path = Path(run_dir) / "status.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def set_aside_rows_from(path: Path, step: int) -> Path | None:
    """A resume at `step`: move the rows of steps >= step in the CSV at `path` (metrics.csv,
    diag.csv: a `step` column) to `<stem>.discarded_from_step_<step>.csv` beside it, keeping the
    earlier rows in place, so the continued file has one row per step. Returns the aside file."""
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames or [], list(reader)
    is_later = [bool(r.get("step")) and int(r["step"]) >= step for r in rows]
    if not any(is_later):
        return None
    aside = path.with_name(f"{path.stem}.discarded_from_step_{step}.csv")
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
        self.columns = METRIC_COLUMNS + extra_columns
        kept = []
        if append and path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames == self.columns:
                    kept = None
                else:
                    kept = [{k: r.get(k, "") for k in self.columns} for r in reader]
        self._f = open(path, "a" if kept is None else "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=self.columns)
        if kept is not None:
            self._w.writeheader()
            self._w.writerows(kept)
        self._f.flush()

    def write(self, row: dict) -> None:
        self._w.writerow({k: ("" if v is None else v) for k, v in row.items()})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


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
