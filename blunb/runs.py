"""Run folders: where training writes, and how notebooks read them back into pandas.

results/<study>/<run_id>/{config.json, env.json, metrics.csv, log.txt[, run.ipynb]}
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
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


def git_sha() -> str:
    """HEAD of the checkout blunb runs from, with '-dirty' when it has uncommitted changes."""
    try:
        root = repo_root()
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(world_size: int, device) -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = torch.device(device)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "world_size": world_size,
        "git_sha": git_sha(),
        "blunb": blunb.__version__,
        "platform": platform.platform(),
        "argv": sys.argv,
    }


class MetricsWriter:
    """Appends one row per step and flushes, so a crashed run keeps every finished step."""

    def __init__(self, path: Path, extra_columns: list[str]):
        self.columns = METRIC_COLUMNS + extra_columns
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=self.columns)
        self._w.writeheader()
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
               metrics)


def load_study(study_dir: str | Path) -> list[Run]:
    """Every complete run folder directly under a study folder, sorted by name."""
    study_dir = Path(study_dir)
    return [load_run(p) for p in sorted(study_dir.iterdir()) if (p / "metrics.csv").is_file()]


def summarize(runs: list[Run]) -> pd.DataFrame:
    """One row per run: what was trained, on what, and how it ended."""
    rows = []
    for r in runs:
        m, cfg = r.metrics, r.config
        val = m["val_loss"].dropna()
        steady = m[m["step"] >= min(cfg.get("mfu_warmup", 5), len(m) - 1)]
        rows.append({
            "run": r.run_id,
            "preset": cfg.get("preset"),
            "optimizer": cfg.get("optimizer"),
            "world_size": r.env.get("world_size"),
            "device": r.env.get("device"),
            "steps": int(m["step"].max()) + 1,
            "first_train_loss": float(m["train_loss"].iloc[0]),
            "final_train_loss": float(m["train_loss"].iloc[-1]),
            "final_val_loss": float(val.iloc[-1]) if len(val) else float("nan"),
            "steady_tok_per_sec": float(steady["tok_per_sec"].median()),
            "steady_mfu": float(steady["mfu"].median()) if steady["mfu"].notna().any() else float("nan"),
        })
    return pd.DataFrame(rows)
