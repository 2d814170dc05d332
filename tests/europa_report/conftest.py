"""One short tiny run shared by the report's tests: 5 steps on 1 gloo rank, with
europa-offload switched on (a plugin's keys) and TensorBoard events."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

STEPS = 5


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report-runs")
    run = Run("tiny", [f"training.steps={STEPS}", "metrics.tensorboard=true"], ["offload"])
    run_ranks(train_runs, 1, str(root), [run])
    return root / run.name
