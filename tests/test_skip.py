"""A non-finite gradient norm skips the whole step on every rank (nan_policy=step), for every
optimizer set the trainer builds; tests/workers/skip_worker.py has the cases."""

import pytest

from tests.distributed import REPO, torchrun
from tests.workers.skip_worker import CASES

WORKER = REPO / "tests" / "workers" / "skip_worker.py"


@pytest.mark.parametrize("world", [1, 2])
def test_a_poisoned_rank_skips_the_step_everywhere(world):
    if world == 1:  # no torch.distributed at all
        from tests.workers.skip_worker import run_all
        run_all()
        return
    out = torchrun(WORKER, world).stdout
    assert out.count(f"OK W={world}") == len(CASES) + 1, out
