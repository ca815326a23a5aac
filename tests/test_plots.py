"""blunb.plots: what the standard figure says (title, units, lr_muon, MFU left out when n/a), the files
it writes, and the backend it picks (Agg in scripts, the session's own in IPython)."""

import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from blunb.plots import MFU_NOTE, plot_runs
from blunb.runs import Run
from tests.distributed import REPO


def fake_run(name="r0", optimizer="adamw", world_size=2, mfu=None, lr_muon=None, steps=6) -> Run:
    step = np.arange(steps)
    metrics = pd.DataFrame({"step": step, "train_loss": 5.0 - 0.1 * step, "val_loss": [5.1] + [np.nan] * (steps - 1),
                            "tok_per_sec": 1e4, "grad_norm": 1.0, "dt_ms": 300.0, "lr": 1e-3, "elapsed_min": step / 60,
                            "mfu": np.nan if mfu is None else mfu, "mfu_palm": np.nan, "tflops_per_gpu": 0.0,
                            "tokens": (step + 1) * 4096, "lr_muon": np.nan if lr_muon is None else lr_muon})
    return Run(Path(name), {"preset": "tiny", "optimizer": optimizer, "global_batch": 4096},
               {"world_size": world_size}, metrics)


@pytest.fixture
def close_figures():
    yield
    plt.close("all")


def _panel(fig, title):
    (ax,) = [ax for ax in fig.axes if ax.get_title() == title]
    return ax


def test_cpu_run_figure_names_what_was_trained_and_leaves_mfu_out(tmp_path, close_figures):
    fig = plot_runs([fake_run()], out=tmp_path / "curves.png")
    assert fig.get_suptitle() == "preset tiny | optimizer adamw | world size 2"
    assert _panel(fig, "loss vs step").get_ylabel() == "loss (nats)"
    assert _panel(fig, "loss vs tokens").get_ylabel() == "train loss (nats)"
    assert [line.get_label() for line in _panel(fig, "learning rate").lines] == ["r0"]  # no lr_muon column values
    assert not any(ax.get_title().startswith("MFU") for ax in fig.axes)
    assert any(t.get_text() == MFU_NOTE for ax in fig.axes for t in ax.texts)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in (tmp_path / "curves.svg").read_text()


def test_muon_run_plots_lr_muon_and_mfu_when_known(tmp_path, close_figures):
    runs = [fake_run("a", mfu=0.4), fake_run("m", optimizer="muon", mfu=0.3, lr_muon=2e-2)]
    fig = plot_runs(runs)
    assert fig.get_suptitle() == "preset tiny | optimizer adamw, muon | world size 2"
    assert [line.get_label() for line in _panel(fig, "learning rate").lines] == ["a", "m lr", "m lr_muon"]
    mfu = _panel(fig, "MFU (causal count)")
    assert mfu.axison and [line.get_label() for line in mfu.lines] == ["a", "m"]
    assert list(mfu.lines[0].get_ydata()) == pytest.approx([40.0] * 6)
    assert not list(tmp_path.iterdir())  # no `out`: no files


@pytest.mark.parametrize("setup, env, backend", [
    ("", {}, "agg"),                                               # a script: off-screen
    ("", {"MPLBACKEND": "svg"}, "svg"),                            # the user's choice wins
    ("from IPython.core.interactiveshell import InteractiveShell; InteractiveShell.instance(); "
     "import matplotlib; matplotlib.use('svg'); ", {}, "svg"),     # IPython: its backend is left alone
])
def test_backend_is_forced_only_in_plain_scripts(setup, env, backend):
    code = setup + "import blunb.plots, matplotlib; print(matplotlib.get_backend().lower())"
    clean = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == backend
