"""The processes of a study's runs: starting a run's command with its output in console.txt, and
stopping it. Both ways blunb.study launches a run use these: a local subprocess (the default) and a
submitted job (Study(executor=...)), whose function is run_command.

Standard library only: a cluster job unpickles run_command by reference, so importing this module
is all the job does before it starts the run (no pandas, no torch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def command_env(base: Mapping[str, str], pythonpath: str) -> dict[str, str]:
    """`base` plus what every run's command gets: unbuffered output (console.txt stays current while it
    trains) and `pythonpath` (blunb's checkout) first on PYTHONPATH."""
    return {**base, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath + os.pathsep + base.get("PYTHONPATH", "")}


def start(cmd: Sequence[str], console, env: Mapping[str, str]) -> subprocess.Popen:
    """`cmd` with stdout and stderr into the open file `console`, in a process group of its own, so one
    signal reaches torchrun and every rank (and a Ctrl-C at the terminal reaches only the launcher)."""
    return subprocess.Popen(list(cmd), stdout=console, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process's group at once (the trainer records 'killed' and lets go of its run folder),
    then SIGKILL the groups still there after grace_s."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


class _Stopped(BaseException):
    """A stop signal reached the job (not an Exception: nothing on the way may swallow it)."""


def run_command(cmd: Sequence[str], console: str, env: Mapping[str, str] | None = None,
                pythonpath: str | None = None, grace_s: float = 30.0) -> int:
    """A submitted job's function: run `cmd` (a run's blunb.train or torchrun command) with its output in
    `console` (the run's console.txt) and return its exit status, as the local path would see it.

    The environment is the job's own (the node's CUDA_VISIBLE_DEVICES, the scheduler's variables) with
    `env` over it and `pythonpath` first on PYTHONPATH. When the job is stopped (SIGTERM: a cancelled or
    preempted SLURM job; SIGINT: submitit's LocalExecutor cancelling; submitit's time-limit signal) the
    run gets SIGTERM and up to grace_s to record 'killed' before it is SIGKILLed; the job then fails."""
    full_env = {**os.environ, **(env or {})}
    if pythonpath:
        full_env = command_env(full_env, pythonpath)
    Path(console).parent.mkdir(parents=True, exist_ok=True)
    with open(console, "w") as out:
        proc = start(cmd, out, full_env)
        stopping = False

        def stop(signum, frame):
            nonlocal stopping
            if not stopping:  # once: a second signal must not cut the cleanup short
                stopping = True
                raise _Stopped(f"stopped by {signal.Signals(signum).name}")

        # submitit's job ignores SIGTERM (it waits for its time-limit signal): here it stops the run.
        previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() \
            else None
        try:
            return proc.wait()
        except BaseException:
            terminate([proc], grace_s)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
