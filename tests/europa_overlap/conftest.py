"""One spawned group of 2 gloo ranks for every distributed check of europa-overlap:
the chunked all-to-all's numerics, then the trainer runs (``tests.trainer_runs``)."""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks


def _group_rank(rank: int, world: int, root: str) -> dict:
    from tests.europa_overlap.test_experts import (
        compare_rank,
        held_shared_results_after_recomputation,
    )
    from tests.europa_overlap.test_plugin import RUNS
    from tests.trainer_runs import train_runs

    return {
        "numerics": compare_rank(rank, world),
        "held_shared_results": held_shared_results_after_recomputation(rank, world),
        "runs": train_runs(rank, world, root, RUNS),
    }


@pytest.fixture(scope="session")
def overlap_group(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap-runs")
    results = run_ranks(_group_rank, 2, str(root), timeout=300)
    return root, results
