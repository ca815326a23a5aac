"""Run `torchrun ... -m blunb.train` from a notebook cell.

Streams the ranks' output live (training prints on rank 0 only), picks a free
rendezvous port, kills the whole process group on interrupt or error, and on failure
raises LaunchError carrying the last lines the ranks printed.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(target: list[str], nproc: int) -> list[str]:
    """torchrun on `nproc` local ranks with a free rendezvous port; `target` is a script and its
    arguments, or ["-m", module, ...]."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *target]


def launch(train_args: list[str], nproc: int = 1, env: dict | None = None, echo: bool = True,
           tail_lines: int = 40) -> list[str]:
    """Run blunb.train under torchrun on `nproc` local ranks; return every output line.

    On a non-zero exit, raise LaunchError with the last `tail_lines` lines (the failing
    rank's traceback is among them). Ctrl-C / a notebook interrupt kills every rank.
    """
    cmd = torchrun_command(["-m", "blunb.train", *train_args], nproc)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    repo = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = repo + os.pathsep + full_env.get("PYTHONPATH", "")
    lines: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)  # own process group: one killpg reaches every rank
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            tail.append(line)
            if echo:
                print(line, flush=True)
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    if rc != 0:
        raise LaunchError(f"training failed (exit code {rc}) with `{' '.join(cmd[2:])}`; last output:\n"
                          + "\n".join(tail))
    return lines


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
