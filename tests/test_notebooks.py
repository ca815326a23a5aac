"""nbval over the notebooks: each runs top to bottom at its CPU defaults; cells marked
NBVAL_CHECK_OUTPUT must reproduce their stored output. Results go to a temporary folder, not the
committed results/. Every notebook in notebooks/ is picked up: a new study is tested by existing.

Every cell that draws a figure must carry it as an image in its executed outputs (what a person
opening the executed notebook sees): this module is also loaded into the nbval run as a plugin
(`-p tests.test_notebooks`), whose hook below records each executed cell's output types."""

import json
import os
import re
import subprocess
import sys

import pytest

from blunb import plots
from tests.distributed import REPO

pytestmark = pytest.mark.slow

NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
# What each notebook must leave in its scratch study folder, beyond running cleanly.
PRODUCTS = {"00_quickstart.ipynb": ("quickstart", ["summary.csv", "curves.png", "curves.svg"]),
            "10_clipping.ipynb": ("clipping", ["summary.csv", "metrics_long.csv", "claims.csv"]),
            "11_precision.ipynb": ("precision", ["summary.csv", "metrics_long.csv", "claims.csv", "loss_curves.png",
                                                 "cost.csv", "cost.png", "loss_dtype.png", "master_weights.png"]),
            "12_overlap.ipynb": ("overlap", ["equivalence.csv", "layouts.csv", "predictions.csv", "claims.csv",
                                             "timelines.png", "exposed.png"]),
            "13_muon_vs_adamw.ipynb": ("muon_vs_adamw", ["summary.csv", "metrics_long.csv", "claims.csv",
                                                         "val_loss_tokens_time.png"])}
# A cell draws a figure when it calls one of blunb.plots' functions or makes a pyplot figure.
_PLOT_FUNCTIONS = "|".join(name for name in dir(plots) if name.startswith("plot_"))
DRAWS = re.compile(rf"\b({_PLOT_FUNCTIONS})\(|\bplt\.(subplots|figure|subplot_mosaic)\(")
OUTPUT_LOG = "BLUNB_TEST_CELL_OUTPUTS"  # set for the nbval run: where the plugin appends its records


def pytest_runtest_teardown(item):
    """Plugin hook, active only inside the nbval run: one JSON line per executed cell."""
    outputs = getattr(item, "test_outputs", None)  # nbval's cell item, after it ran
    if os.environ.get(OUTPUT_LOG) and outputs is not None:
        kinds = sorted({kind for out in outputs for kind in out.get("data", {})})
        with open(os.environ[OUTPUT_LOG], "a") as log:
            log.write(json.dumps({"cell": item.cell_num, "source": item.cell.source, "data": kinds}) + "\n")


# A study notebook trains 15-19 tiny runs at its CPU defaults: minutes on a quiet 2-core machine, several
# times that on a loaded one; pyproject's 600 s per-test limit would cut it short before the subprocess's own.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_and_checked_outputs_match(notebook, tmp_path):
    output_log = tmp_path / "cell_outputs.jsonl"
    env = {**os.environ, "BLUNB_RESULTS": str(tmp_path), "PYTHONUNBUFFERED": "1", OUTPUT_LOG: str(output_log),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.test_notebooks",
                           "--nbval-lax", "--nbval-cell-timeout=900", "--timeout=900",
                           str(REPO / "notebooks" / notebook)],
                          capture_output=True, text=True, env=env, cwd=REPO / "notebooks", timeout=1700)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    study, files = PRODUCTS.get(notebook, (None, []))
    for name in files:
        assert (tmp_path / "scratch" / study / name).is_file(), f"{notebook} did not write {study}/{name}"
    cells = [json.loads(line) for line in output_log.read_text().splitlines()]
    assert cells, "the plugin recorded no executed cell"
    for c in (c for c in cells if DRAWS.search(c["source"])):
        assert "image/png" in c["data"], f"{notebook}, code cell {c['cell']} (from 0), shows no figure:\n{c['source']}"
