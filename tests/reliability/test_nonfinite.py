"""A non-finite loss skips its step (no update) up to training.max_skipped_steps, then
the run stops in one line naming the step: FSDP2 and FlexShard, one spawned group."""

from __future__ import annotations

import math

import pytest

from tests.trainer_runs import Run

NAN_ON_RANK_1_AT_STEP_2 = ["faults.nan_at_steps=[2]", "faults.rank=1"]
COMMON = ["training.steps=4", "training.max_skipped_steps=1", "checkpoint.every=2"]


def _runs_reporting_errors(rank, world, root, runs):
    """tests.trainer_runs.train_runs, one run at a time, with each run's error (the same
    on every rank) in place of its records."""
    from tests.trainer_runs import train_runs

    outcomes = {}
    for run in runs:
        try:
            outcomes.update(train_runs(rank, world, root, [run]))
        except Exception as err:
            outcomes[run.name] = f"{type(err).__name__}: {err}"
    return outcomes


RUNS = [
    Run("fsdp2", [*COMMON, *NAN_ON_RANK_1_AT_STEP_2], ["faults"]),
    Run("flexshard", [*COMMON, *NAN_ON_RANK_1_AT_STEP_2], ["faults", "flexshard"]),
    Run("too_many", [*COMMON, "faults.nan_at_steps=[2, 3]"], ["faults"]),
    Run("resumed", [*COMMON, *NAN_ON_RANK_1_AT_STEP_2], ["faults"], resume_from="fsdp2"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, fault_plugin_dir):
    import sys

    from tests.conftest import run_ranks

    sys.path.insert(0, str(fault_plugin_dir))
    try:
        root = tmp_path_factory.mktemp("nonfinite")
        by_rank = run_ranks(_runs_reporting_errors, 2, str(root), RUNS, timeout=240)
    finally:
        sys.path.remove(str(fault_plugin_dir))
    return root, by_rank


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2", "flexshard"])
def test_a_non_finite_step_is_skipped_without_an_update(outcomes, layout):
    root, by_rank = outcomes
    records = by_rank[0][layout]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["skipped"] for r in records] == [False, True, False, False]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    assert math.isnan(records[1]["loss"]) and not math.isnan(records[2]["loss"])
    weights = [r["faults_weight_sum"] for r in records]
    assert weights[1] == weights[0]  # the skipped step changed nothing
    assert weights[2] != weights[1]  # the next one trains again
    assert all(math.isfinite(w) for w in weights)
    checkpoints = sorted(p.name for p in (root / layout / "checkpoints").iterdir())
    assert checkpoints == ["step-00000002", "step-00000004"]


@pytest.mark.distributed
def test_more_non_finite_steps_than_allowed_stop_the_run_naming_the_step(outcomes):
    root, by_rank = outcomes
    message = (
        "ConfigError: training.max_skipped_steps = 1: step 3 has a non-finite loss or "
        "gradient (gradient norm nan), skipped step 2"
    )
    assert all(ranks["too_many"].startswith(message) for ranks in by_rank)
    assert "\n" not in by_rank[0]["too_many"]
    assert sorted(p.name for p in (root / "too_many" / "checkpoints").iterdir()) == [
        "step-00000002"
    ]


@pytest.mark.distributed
def test_the_count_of_skipped_steps_survives_a_resume(outcomes):
    _, by_rank = outcomes
    resumed = by_rank[0]["resumed"]  # steps 3-4 from fsdp2's step-2 checkpoint
    assert [(r["step"], r["skipped_steps"]) for r in resumed] == [(1, 0), (2, 1), (3, 1), (4, 1)]
