"""The memory estimate a run is checked against before any work (blunb.memory)."""

import os
import subprocess
import sys

import pytest
import torch

from blunb import memory
from blunb.config import ConfigError, apply_overrides, preset
from tests.distributed import REPO

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}

GIB = memory.GIB


def test_the_estimate_follows_the_batch_the_sharding_and_the_chunked_loss():
    cfg = preset("124m")
    base = memory.estimate(cfg, 1, "cpu")
    assert memory.estimate(apply_overrides(preset("124m"), ["B=32"]), 1, "cpu").activations == \
        pytest.approx(2 * base.activations)
    assert memory.estimate(cfg, 4, "cpu").optimizer == pytest.approx(base.optimizer / 4)
    assert memory.estimate(apply_overrides(preset("124m"), ["chunked_ce=true"]), 1, "cpu").logits == 0
    # on CUDA the Linears are bf16 and attention keeps no [T, T] scores
    assert memory.estimate(cfg, 1, "cuda").weights == base.weights / 2
    assert memory.estimate(cfg, 1, "cuda").activations < base.activations / 4


def test_a_cpu_run_that_cannot_fit_is_refused_naming_what_fits(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24.0 * GIB)
    with pytest.raises(ConfigError, match=r"needs about .* GiB .* what fits: --set B=(\d+)") as err:
        memory.check(preset("124m"), 2, torch.device("cpu"), local_ranks=2)
    fitting_b = int(err.value.args[0].split("--set B=")[1].split()[0])
    fits = apply_overrides(preset("124m"), [f"B={fitting_b}"])
    assert memory.estimate(fits, 2, "cpu").per_rank * 2 <= 24.0 * GIB
    assert memory.estimate(apply_overrides(preset("124m"), [f"B={2 * fitting_b}"]), 2, "cpu").per_rank * 2 > 24 * GIB


def test_a_run_whose_state_alone_is_too_big_is_told_to_use_fewer_ranks_or_a_gpu(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24.0 * GIB)
    with pytest.raises(ConfigError, match="state alone need .* fewer ranks here, a smaller preset or a GPU"):
        memory.check(preset("seed-4b"), 1, torch.device("cpu"), local_ranks=1)


def test_a_fitting_run_logs_its_estimate_and_cuda_only_warns(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24.0 * GIB)
    line = memory.check(preset("tiny"), 2, torch.device("cpu"), local_ranks=2)
    assert line.startswith("memory estimate: ") and "free 24.0 GiB" in line and "[!]" not in line
    monkeypatch.setattr(memory, "free_bytes", lambda device: 40.0 * GIB)
    assert "[!] close to the free memory" in memory.check(preset("1b"), 1, torch.device("cuda"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_estimate_is_not_below_what_a_real_run_takes(tmp_path):
    """A tiny run on the CPU, one rank: its own peak resident memory against the estimate (which errs high).
    The peak is the process's VmHWM (Linux), not getrusage's ru_maxrss: that one survives exec, so a child
    of a large pytest process starts at its parent's size."""
    from blunb.data import ensure_default_corpus

    ensure_default_corpus(progress=False)  # preparing the corpus in the run's process would count its memory too
    script = ("import re, sys; from blunb.train import main\n"
              "try:\n    main(sys.argv[1:])\n"
              "finally:\n    status = open('/proc/self/status').read()\n"
              "    print('maxrss_kib', re.search(r'VmHWM:\\s+(\\d+) kB', status)[1])")
    proc = subprocess.run([sys.executable, "-c", script, "--max-steps", "6", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = int(proc.stdout.split("maxrss_kib")[-1].split()[0]) * 1024
    estimated = memory.estimate(preset("tiny"), 1, "cpu").per_rank
    assert 0.8 * measured <= estimated <= 2.0 * measured, (estimated / GIB, measured / GIB)
