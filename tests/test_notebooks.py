"""nbval over the notebooks: each runs top to bottom; cells marked NBVAL_CHECK_OUTPUT must
reproduce their stored output. Results go to a temporary folder, not the committed results/."""

import os
import subprocess
import sys

import pytest

from tests.distributed import REPO

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("notebook", ["00_quickstart.ipynb"])
def test_notebook_runs_and_checked_outputs_match(notebook, tmp_path):
    env = {**os.environ, "BLUNB_RESULTS": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                           "--nbval-cell-timeout=900", str(REPO / "notebooks" / notebook)],
                          capture_output=True, text=True, env=env, cwd=REPO / "notebooks", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert (tmp_path / "scratch" / "quickstart" / "summary.csv").is_file()
    assert (tmp_path / "scratch" / "quickstart" / "curves.png").is_file()
