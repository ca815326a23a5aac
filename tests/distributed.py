"""Run a worker script under a real multi-process torchrun (gloo on CPU) from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks; raise with every rank's output if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script), *args]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {Path(script).name} x{nproc} failed ({proc.returncode}):\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc
