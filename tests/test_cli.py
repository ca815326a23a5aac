"""The command line as a user meets it: usage names the command typed, a config error is one line
whatever the launch path (`--nproc` checks the settings before torchrun starts any rank)."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import REPO

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "blunb.train", *args], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=timeout)


def test_usage_names_the_installed_command_when_started_by_it():
    script = os.path.join(os.path.dirname(sys.executable), "blunb-train")
    if not os.path.exists(script):
        pytest.skip("blunb-train is not installed next to this python")
    out = subprocess.run([script, "--help"], capture_output=True, text=True, env=ENV, timeout=120).stdout
    assert out.startswith("usage: blunb-train")
    assert _train("--help").stdout.startswith("usage: python -m blunb.train")


def test_a_config_error_with_nproc_is_one_line_before_any_rank_starts(tmp_path):
    proc = _train("--nproc", "2", "--set", "max_lrr=1", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown setting 'max_lrr' in override 'max_lrr=1'; did you mean max_lr or min_lr?"]
    assert "ChildFailedError" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


def test_a_world_size_error_is_found_at_the_given_nproc(tmp_path):
    proc = _train("--nproc", "3", "--set", "global_batch=4096", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "world_size" in proc.stderr


@pytest.mark.slow
def test_nproc_starts_that_many_ranks(tmp_path):
    run = tmp_path / "run"
    proc = _train("--nproc", "2", "--max-steps", "3", "--run-dir", str(run), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run / "env.json").read_text())["world_size"] == 2
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
