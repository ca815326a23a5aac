"""Run `torchrun ... -m blunb.train` from a notebook cell.

Validates the training arguments in the notebook's own process first (a config error is
raised as ConfigError, once, before any rank starts), streams the ranks' output live
(training prints on rank 0 only), leaves the rendezvous port to torchrun's standalone mode,
kills the whole process group on interrupt or error, and on failure raises LaunchError whose
message starts with the root cause: the failing rank, its exit code and its own error line.

`python -m blunb.launch [torchrun arguments]` is torchrun itself, quiet when a signal stops the
job (torchrun_main); torchrun_command, and so every blunb launch, starts ranks through it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from blunb.config import ConfigError
from blunb.runs import settle_status


class LaunchError(RuntimeError):
    """A torchrun training that exited non-zero. `output`: every line the ranks and torchrun printed;
    `rank`, `exit_code`: torchrun's root cause (the first rank observed failing; exit_code falls back
    to torchrun's own exit status, rank to None); `error_line`: that failure's own message
    (`error: ...` from blunb.train, else the last line of a Python traceback), or None."""

    def __init__(self, message: str, output: list[str] | None = None, rank: int | None = None,
                 exit_code: int | None = None, error_line: str | None = None, command: list[str] | None = None):
        super().__init__(message)  # keyword defaults: the exception still pickles from its message alone
        self.output, self.rank, self.exit_code, self.error_line = output or [], rank, exit_code, error_line
        self.command = command


def torchrun_command(target: list[str], nproc: int) -> list[str]:
    """torchrun on `nproc` local ranks; `target` is a script and its arguments, or ["-m", module, ...].

    torchrun as `python -m blunb.launch` (torchrun_main: torchrun, quiet when a signal stops the job).
    --standalone lets torchrun's own rendezvous bind a free port itself: probing for a free port
    first and passing it on races with every other process on the machine between the probe and
    torchrun's bind (parallel runs made that race real)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "blunb.launch", "--standalone", f"--nproc_per_node={nproc}", *target]


class _QuietStop(logging.Filter):
    """Drops torchrun's warnings about a stop signal (the one it received, the ones it passes on to the
    ranks): the ranks' own line says what stopped the job and where. Other warnings pass."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "death signal" in message:
            _QuietStop.stopping = True
        return not (_QuietStop.stopping and ("death signal" in message or "closing signal" in message))


def torchrun_main(argv: list[str] | None = None) -> None:
    """`python -m blunb.launch [torchrun arguments]`: torchrun (torch.distributed.run) itself, except
    that a job stopped by a signal (Ctrl-C, SIGTERM) ends without torchrun's traceback and shutdown
    warnings (blunb.train's ranks print one line saying where they stopped), with exit status 128 +
    the signal. A job that fails otherwise is reported as torchrun reports it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    quiet = _QuietStop()
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)
    try:
        main(argv)
    except SignalException as err:
        sys.exit(128 + int(err.sigval))


def check_train_args(train_args: list[str], nproc: int, env: dict | None = None):
    """blunb.train's startup config checks, run here (the arguments, every setting at this world size,
    BLUNB_PEAK_TFLOPS, BLUNB_DETERMINISM_EXCEPT): raises ConfigError; returns the parsed arguments (None for
    --help). Data and run-folder errors are still the ranks' to find."""
    from blunb.determinism import Determinism
    from blunb.mfu import peak_tflops_from_env
    from blunb.train import parse_args  # lazy: pulls in torch and the model

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            cfg, args = parse_args(list(train_args))
    except SystemExit as exc:  # argparse: an unknown flag or a bad value
        if exc.code in (0, None):
            return  # --help: let the real command print it
        msg = captured.getvalue().strip().splitlines()
        raise ConfigError(msg[-1] if msg else f"bad training arguments {train_args}") from None
    cfg.validate(world_size=nproc)
    env = env if env is not None else os.environ
    peak_tflops_from_env(env)
    Determinism(cfg, env)  # $BLUNB_DETERMINISM_EXCEPT: its names, and deterministic=true beside it
    return args


def launch(train_args: list[str], nproc: int = 1, env: dict | None = None, echo: bool = True,
           tail_lines: int = 40) -> list[str]:
    """Run blunb.train under torchrun on `nproc` local ranks; return every output line.

    A config error is raised as ConfigError before torchrun starts. On a non-zero exit, raise
    LaunchError: root cause first, then the command, then the last `tail_lines` lines the ranks
    printed (torchrun's own report left out; LaunchError.output has everything). Ctrl-C / a
    notebook interrupt kills every rank. Once the job has exited, a status.json still saying
    running (its processes were killed) is settled to killed (blunb.runs.settle_status).
    """
    cmd = torchrun_command(["-m", "blunb.train", *train_args], nproc)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    parsed = check_train_args(train_args, nproc, full_env)
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    repo = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = repo + os.pathsep + full_env.get("PYTHONPATH", "")
    lines: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)  # own process group: one killpg reaches every rank
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if echo:
                print(line, flush=True)
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    if parsed is not None and parsed.run_dir:
        settle_status(parsed.run_dir)
    if rc != 0:
        raise launch_error(cmd, lines, rc, tail_lines)
    return lines


# ----------------------------------------------------------------- failure report

@dataclass
class Failure:
    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None       # e.g. "SIGABRT" when the root-cause rank died of a signal
    error_line: str | None = None


_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?(.*)$")    # torch's excepthook after init_process_group
_ERROR = re.compile(r"(?<![\w-])error: \S")               # blunb.train's / argparse's `error: msg`
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?::.*)?$")  # `SomeError: msg`, `KeyboardInterrupt`
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_AGENT_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")  # torchrun's own log lines
_AGENT_FAIL = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_TB = "Traceback (most recent call last):"


def _final_exceptions(stream: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(index, line) of the last exception line of each traceback chain in one rank's stream."""
    out: list[tuple[int, str]] = []
    in_tb, pending = False, None
    for i, text in stream:
        if text.startswith(_TB):
            in_tb = True
            continue
        if in_tb:
            # Frames are indented; other processes' lines may land mid-traceback, so wait for
            # something shaped like an exception.
            if text and not text[0].isspace() and _EXCEPTION.match(text):
                in_tb, pending = False, (i, text)
            continue
        if pending and text.strip():
            if not text.startswith(_CHAINED):
                out.append(pending)
            pending = None  # a chained traceback follows: its exception supersedes this one
    if pending:
        out.append(pending)
    return [(i, t) for i, t in out if not t.split(":", 1)[0].endswith("ChildFailedError")]


def parse_failure(lines: list[str]) -> Failure:
    """Pull the root cause out of a failed torchrun's combined output; any part may be missing."""
    f = Failure()
    # torchrun's summary: "Root Cause (first observed failure):" then `rank : N (local_rank: N)`,
    # `exitcode : X (pid: P) (SIGNAME)`, up to the closing ==== rule.
    starts = [i for i, line in enumerate(lines) if line.startswith("Root Cause")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if line.startswith("==="):
                break
            if m := re.match(r"\s*rank\s*:\s*(\d+)", line):
                f.rank = int(m.group(1))
            elif m := re.match(r"\s*exitcode\s*:\s*(-?\d+)", line):
                f.exit_code = int(m.group(1))
                if s := re.search(r"\((SIG[A-Z0-9]+)\)", line):
                    f.signal = s.group(1)
    if f.rank is None or f.exit_code is None:  # no summary (cut short): the agent's own log line
        for line in lines:
            if m := _AGENT_FAIL.search(line):
                f.exit_code = int(m.group(1)) if f.exit_code is None else f.exit_code
                f.rank = int(m.group(2)) if f.rank is None else f.rank  # single node: local rank = rank
                break

    streams: dict[int | None, list[tuple[int, str]]] = {}
    errors: list[tuple[bool, int, str]] = []
    for i, line in enumerate(lines):
        m = _RANK_PREFIX.match(line)
        rank, text = (int(m.group(1)), m.group(2)) if m else (None, line)
        streams.setdefault(rank, []).append((i, text))
        if not _AGENT_LOG.match(text) and (e := _ERROR.search(text)):
            # Ranks share one pipe, so a message can land mid-way through another rank's line:
            # prefer one that starts its line.
            errors.append((e.start() != 0, i, text[e.start():].strip()))
    if errors:
        f.error_line = min(errors)[2]
        return f
    if f.rank in streams and (exc := _final_exceptions(streams[f.rank])):
        f.error_line = exc[0][1]
    else:
        found = sorted(e for s in streams.values() for e in _final_exceptions(s))
        f.error_line = found[0][1] if found else None
    return f


def _rank_output(lines: list[str]) -> list[str]:
    """The ranks' lines: torchrun's own log lines and its closing traceback + summary dropped."""
    end = len(lines)
    agent = [i for i, line in enumerate(lines) if line.startswith("torch.distributed.elastic") and
             "ChildFailedError" in line]
    if agent:
        tbs = [i for i in range(agent[-1]) if lines[i].startswith(_TB)]
        end = tbs[-1] if tbs else agent[-1]
    return [line for line in lines[:end] if not _AGENT_LOG.match(line)]


def launch_error(cmd: list[str], lines: list[str], returncode: int, tail_lines: int = 40) -> LaunchError:
    """The LaunchError for a failed torchrun: root cause, then the command, then the ranks' last lines."""
    f = parse_failure(lines)
    exit_code = f.exit_code if f.exit_code is not None else returncode
    where = f"rank {f.rank}" if f.rank is not None else "torchrun"
    code = f"exit code {exit_code}" + (f", {f.signal}" if f.signal else "")
    head = f"training failed on {where} ({code})" + (f": {f.error_line}" if f.error_line else "")
    tail = _rank_output(lines)[-tail_lines:] if tail_lines > 0 else []
    msg = (f"{head}\ncommand: {shlex.join(cmd)}\n"
           f"last output ({len(tail)} lines; torchrun's report left out, LaunchError.output has all):\n"
           + "\n".join(tail))
    return LaunchError(msg, output=lines, rank=f.rank, exit_code=exit_code, error_line=f.error_line, command=cmd)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    torchrun_main()
