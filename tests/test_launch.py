"""blunb.launch: config errors before torchrun, a failure report that starts with the root cause, an
interrupt that leaves no process behind, and a two-node launch (c10d rendezvous) on one machine."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed import TCPStore

import blunb.launch
from blunb.config import ConfigError
from blunb.launch import LaunchError, launch, launch_error, parse_failure, torchrun_command
from blunb.runs import load_run
from tests.distributed import REPO

# Captured from launch(["--preset", "tiny", "--max-steps", "3", "--set", "max_lr=1e30", "--set", "grad_clip=0",
# "--set", "max_consecutive_skips=1"], nproc=2) (paths shortened, the MFU banner cut). Both ranks stop with a
# TrainingError; rank 1 then aborts at interpreter exit, so torchrun names it with SIGABRT. Rank 1's `error:`
# line landed in the middle of rank 0's step line (one pipe).
SKIPS = """\
blunb tiny: 779,648 params | world 2 x cpu | B 8 T 128 accum 2 -> 4,096 tokens/step
optimizer: ZeRO-1 adamw-fp32 over 2 rank(s), collective rs_ag, state 4.5 MiB on this rank
  G0 adamw-fp32: 779,648 params, lr 1e+30 -> 0.0003
  grad clip 0 (per group) covers 779,648 / 779,648 params (100.00%)
kernels: rms_norm=torch qk_norm_rope=torch flash_attention=torch swiglu=torch cross_entropy=torch syrk=torch
========================================================
step      0 | train 5.376492 | val 5.504950 | tok/s 10571.95 | norm 5.7869 | dt 387.44 ms | mfu n/a | TF/gpu 0.0 | lr 1.0000e+30 | G0(adamw-fp32) 5.7869
step      1 | train 5.768321 | val 5.504950 | tok/s 12744.42 | norm nan | dt 321.40 ms | mfu n/a | TF/gpu 0.0 | lr 1.0000e+30 | G0(adamw-fp32) nan | SKIPPED (non-finite gradient norm; 1 so far)error: the gradient norm was non-finite for 1 steps in a row (through step 1); stopping the run (max_consecutive_skips)

error: the gradient norm was non-finite for 1 steps in a row (through step 1); stopping the run (max_consecutive_skips)
terminate called without an active exception
W1201 09:57:00.532000 5954 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 5963 closing signal SIGTERM
E1201 09:57:00.602000 5954 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 5964) of binary: /venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
blunb.train FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_09:57:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5963)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 5963
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_09:57:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 5964)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 5964
======================================================
"""  # noqa: E501

# A 2-rank script: rank 1 raises RuntimeError (chained from a KeyError) after init_process_group, rank 0
# then dies in a barrier with gloo's "Connection closed by peer". Python traces carry torch's [rankN]: prefix.
TRACEBACK = """\
rank 1 up
rank 0 up
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/w.py", line 8, in <module>
[rank1]:     raise KeyError("inner")
[rank1]: KeyError: 'inner'

[rank1]: The above exception was the direct cause of the following exception:

[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/w.py", line 10, in <module>
[rank1]:     raise RuntimeError("boom on rank 1") from e
[rank1]: RuntimeError: boom on rank 1
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/w.py", line 11, in <module>
[rank0]:     dist.barrier()
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
[rank0]:     return func(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35539. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1201 10:00:27.792000 6860 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 6866 closing signal SIGTERM
E1201 10:00:27.824000 6860 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 6867) of binary: /venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
w.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_10:00:27
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 6866)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 6866
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_10:00:27
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 6867)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # noqa: E501

ERROR = ("error: the gradient norm was non-finite for 1 steps in a row (through step 1); stopping the run "
         "(max_consecutive_skips)")


def test_parse_failure_takes_root_cause_and_the_childs_error_line():
    f = parse_failure(SKIPS.splitlines())
    assert (f.rank, f.exit_code, f.signal) == (1, -6, "SIGABRT")  # "Root Cause", not the SIGTERMed rank 0
    assert f.error_line == ERROR  # the clean copy, not the one glued to a step line


def test_launch_error_message_puts_the_root_cause_first():
    cmd = ["python", "-m", "torch.distributed.run", "-m", "blunb.train", "--preset", "tiny"]
    err = launch_error(cmd, SKIPS.splitlines(), returncode=1)
    first, second = str(err).splitlines()[:2]
    assert first == f"training failed on rank 1 (exit code -6, SIGABRT): {ERROR}"
    assert second.startswith("command: python -m torch.distributed.run")
    assert "step      0 |" in str(err)
    assert "ChildFailedError" not in str(err) and "Sending process" not in str(err)  # torchrun's report: dropped
    assert err.output == SKIPS.splitlines() and (err.rank, err.exit_code, err.error_line) == (1, -6, ERROR)


def test_parse_failure_takes_the_root_cause_ranks_final_exception():
    lines = TRACEBACK.splitlines()
    f = parse_failure(lines)
    assert (f.rank, f.exit_code, f.signal) == (1, 1, None)
    assert f.error_line == "RuntimeError: boom on rank 1"  # the chain's last exception, not KeyError
    # Ranks' tracebacks arrive in any order: rank 0's gloo error printed first still loses to the root cause.
    rank0 = [line for line in lines if line.startswith("[rank0]:")]
    reordered = rank0 + [line for line in lines if not line.startswith("[rank0]:")]
    assert parse_failure(reordered).error_line == "RuntimeError: boom on rank 1"
    # Without torchrun's summary: the first traceback's exception, the agent's log line for rank / exit code.
    cut = lines[:lines.index("Traceback (most recent call last):")]
    f = parse_failure(cut)
    assert (f.rank, f.exit_code, f.error_line) == (1, 1, "RuntimeError: boom on rank 1")


def test_torchrun_binds_its_own_port():
    # No port probed here and handed on (that raced with other processes between probe and bind):
    # --standalone's rendezvous and the ranks' store both bind port 0, the OS picks.
    cmd = torchrun_command(["-m", "blunb.train"], 2)
    assert cmd[1:5] == ["-m", "blunb.launch", "--standalone", "--nproc_per_node=2"]  # torchrun, quiet on a signal
    assert not any(a.startswith(("--master", "--rdzv")) for a in cmd)
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        torchrun_command(["x.py"], 0)


def test_failure_without_any_torchrun_output_still_reports():
    err = launch_error(["python", "-m", "torch.distributed.run"], [], returncode=-9)
    assert (err.rank, err.exit_code, err.error_line, err.output) == (None, -9, None, [])
    assert str(err).startswith("training failed on torchrun (exit code -9)")


def test_config_error_is_raised_in_the_parent_before_torchrun(monkeypatch):
    def no_popen(*a, **k):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(blunb.launch.subprocess, "Popen", no_popen)
    with pytest.raises(ConfigError, match="kv_heads"):
        launch(["--preset", "tiny", "--set", "kv_heads=3"], nproc=2)
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        launch(["--preset", "tiny", "--bogus"], nproc=2)
    with pytest.raises(ConfigError, match="world_size 2"):  # validated at the launch's world size
        launch(["--preset", "tiny", "--set", "fault_nan_grad=3:2"], nproc=2)
    with pytest.raises(ConfigError, match="BLUNB_PEAK_TFLOPS"):
        launch(["--preset", "tiny"], nproc=2, env={"BLUNB_PEAK_TFLOPS": "-5"})


def test_config_error_from_a_fresh_process_stops_before_torchrun_and_is_printed_once(tmp_path):
    # A fresh interpreter, as a notebook kernel's first launch: the parent-side check raises before
    # torchrun starts (no torch.distributed output, no run folder). No timing is asserted: a loaded
    # machine makes any bound flaky.
    code = ("from blunb.launch import launch\n"
            "launch(['--preset', 'tiny', '--run-dir', %r, '--set', 'kv_heads=3'], nproc=2)" % str(tmp_path / "r"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1 and proc.stderr.count("divisible by model.kv_heads") == 1, proc.stderr
    assert "ConfigError" in proc.stderr and "torch.distributed" not in proc.stdout + proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_real_two_rank_failure_reports_the_error_line_first(tmp_path):
    args = ["--preset", "tiny", "--max-steps", "3", "--run-dir", str(tmp_path / "run"), "--set", "max_lr=1e30",
            "--set", "grad_clip=0", "--set", "max_consecutive_skips=1"]
    with pytest.raises(LaunchError) as info:
        launch(args, nproc=2, echo=False, env={"OMP_NUM_THREADS": "1"})
    err = info.value
    assert err.error_line == ERROR
    assert err.rank in (0, 1) and err.exit_code != 0
    assert str(err).splitlines()[0].endswith(ERROR)
    assert any(line.startswith("step      1 |") for line in err.output)


# ---------------------------------------------------------------- real launches: interrupt, two nodes

def _train_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live, non-zombie process (Linux /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if entry.isdigit() and fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), fields[19])
    return table


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of pid: {pid: start time} (the start time tells a reused pid apart)."""
    table, found, frontier = _process_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def _survivors(tree: dict[int, str]) -> list[int]:
    """The processes of `tree` still running (the same pid with the same start time)."""
    return [pid for pid, (_, start) in _process_table().items() if tree.get(pid) == start]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc is None or proc.poll() is None, f"exited early ({proc.returncode}) while waiting: {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting: {what}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks the process tree through /proc")
def test_an_interrupted_launch_leaves_no_process_behind(tmp_path):
    """A notebook interrupt is SIGINT to the kernel alone: launch() must take torchrun and every rank down."""
    run_dir = tmp_path / "run"
    # A kernel always handles SIGINT, but a child of a background job inherits SIGINT ignored (POSIX): the
    # handler is installed here, or the test would depend on how the suite itself was started.
    code = ("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from blunb.launch import launch\n"
            f"launch(['--preset', 'tiny', '--max-steps', '100000', '--run-dir', {str(run_dir)!r}], nproc=2)")
    with open(tmp_path / "out.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=_train_env(),
                                cwd=REPO, start_new_session=True)
    tree: dict[int, str] = {}
    try:
        metrics = run_dir / "metrics.csv"
        _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) > 2, 300, "step 1", proc)
        tree = _descendants(proc.pid)  # torchrun and its two ranks
        assert len(tree) >= 3, tree
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        _wait_for(lambda: not _survivors(tree), 60, "torchrun and its ranks to exit")
    finally:  # a failed test still leaves nothing running
        for pid in [proc.pid] * (proc.poll() is None) + _survivors(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in (tmp_path / "out.log").read_text()


def _run_launchers(commands: dict[str, list[str]], tmp_path, timeout: float = 900) -> None:
    """Start every command at once (each in its own process group), wait for all; on any failure or
    timeout kill them all and fail with each one's output tail."""
    procs, logs = {}, {name: tmp_path / f"{name}.log" for name in commands}
    try:
        for name, cmd in commands.items():
            with open(logs[name], "w") as out:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_train_env(), cwd=REPO,
                                               start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs.values()]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break  # all done, or one failed: the others would wait for it in vain
            time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    report = {name: (p.returncode, logs[name].read_text()[-4000:]) for name, p in procs.items()}
    assert all(rc == 0 for rc, _ in report.values()), "\n".join(f"--- {n} (exit {rc}):\n{tail}"
                                                               for n, (rc, tail) in report.items())


@pytest.mark.slow
def test_two_local_nodes_train_exactly_like_one_launcher_with_two_ranks(tmp_path):
    """Two torchrun launchers (--nnodes=2, one rank each) meeting at one c10d rendezvous endpoint on
    localhost give the same losses, bit for bit, as one launcher with two ranks."""
    train = ["-m", "blunb.train", "--preset", "tiny", "--max-steps", "6"]
    _run_launchers({"single": torchrun_command([*train, "--run-dir", str(tmp_path / "single")], 2)}, tmp_path)
    # The rendezvous endpoint: a store bound to a port the OS picked (no probe-then-bind race), so both
    # launchers join it as clients (is_host=0); node 0 of a real job hosts it itself.
    endpoint = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{endpoint.port}", f"--rdzv_id=blunb-{os.getpid()}",
            "--rdzv_conf=is_host=0", "--local_addr=127.0.0.1", *train, "--run-dir", str(tmp_path / "nodes")]
    _run_launchers({"node0": node, "node1": node}, tmp_path)
    single, nodes = load_run(tmp_path / "single"), load_run(tmp_path / "nodes")
    assert nodes.env["world_size"] == single.env["world_size"] == 2
    assert nodes.metrics["train_loss"].tolist() == single.metrics["train_loss"].tolist()
    assert len(nodes.metrics) == 6 and nodes.metrics["val_loss"].dropna().tolist() == \
        single.metrics["val_loss"].dropna().tolist()
