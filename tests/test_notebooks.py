"""nbval over the notebooks: each runs top to bottom at its CPU defaults; cells marked
NBVAL_CHECK_OUTPUT must reproduce their stored output. Results go to a temporary folder, not the
committed results/. Every notebook in notebooks/ is picked up: a new study is tested by existing."""

import os
import subprocess
import sys

import pytest

from tests.distributed import REPO

pytestmark = pytest.mark.slow

NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
# What each notebook must leave in its scratch study folder, beyond running cleanly.
PRODUCTS = {"00_quickstart.ipynb": ("quickstart", ["summary.csv", "curves.png"]),
            "10_clipping.ipynb": ("clipping", ["summary.csv", "metrics_long.csv", "claims.csv"])}


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_and_checked_outputs_match(notebook, tmp_path):
    env = {**os.environ, "BLUNB_RESULTS": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                           "--nbval-cell-timeout=900", str(REPO / "notebooks" / notebook)],
                          capture_output=True, text=True, env=env, cwd=REPO / "notebooks", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    study, files = PRODUCTS.get(notebook, (None, []))
    for name in files:
        assert (tmp_path / "scratch" / study / name).is_file(), f"{notebook} did not write {study}/{name}"
