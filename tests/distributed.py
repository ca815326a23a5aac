"""Run a worker script under a real multi-process torchrun (gloo on CPU) from a test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from blunb.launch import torchrun_command

REPO = Path(__file__).resolve().parent.parent


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks; raise with every rank's output if any rank fails."""
    cmd = torchrun_command([str(script), *args], nproc)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {Path(script).name} x{nproc} failed ({proc.returncode}):\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def gloo_threads() -> int:
    """gloo's worker and transport threads alive in this process (Linux: /proc)."""
    tasks = f"/proc/{os.getpid()}/task"
    return sum(open(f"{tasks}/{t}/comm").read().startswith(("pt_gloo", "gloo")) for t in os.listdir(tasks))
