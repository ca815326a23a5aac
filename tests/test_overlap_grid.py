"""The ZeRO-1 overlap grid: overlap_backward x overlap_refresh x collective x reduce_dtype for
both optimizer sets (adamw, muon) at W = 2 and 3, real multi-process gloo runs (one torchrun
launch per world size; tests/workers/overlap_grid_worker.py asserts as it goes).

Every overlapped variant must equal the serial path bit for bit: both issue the same
collectives on the same bytes, so anything short of torch.equal is a bug, not noise.
"""

from __future__ import annotations

import pytest

from tests.distributed import REPO, torchrun

WORKER = REPO / "tests" / "workers" / "overlap_grid_worker.py"


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_paths_are_bit_identical_to_serial(world):
    proc = torchrun(WORKER, world, timeout=600)    # generous: CI machines are often loaded
    assert proc.stdout.count(f"OK W={world} ") == 8, proc.stdout + proc.stderr   # 2 optimizers x 2 x 2
    assert proc.stdout.count("clean exit") == world, proc.stdout + proc.stderr
