"""A long run is thinned to what a page can draw, keeping its last step."""

from __future__ import annotations

import json

import pytest

from europa.report import write_report
from europa.report.series import MAX_HEATMAP_COLUMNS, MAX_LINE_POINTS
from tests.europa_report.pages import read_page

STEPS = 10_001


def test_curves_and_heatmaps_of_a_long_run_are_thinned(tmp_path):
    with (tmp_path / "metrics.jsonl").open("w") as metrics:
        for step in range(1, STEPS + 1):
            share = 0.75 if step > STEPS // 2 else 0.5  # expert 0's share doubles half-way
            record = {"step": step, "loss": 1.0, "expert_load": {"layers.1": [share, 1 - share]}}
            metrics.write(json.dumps(record) + "\n")

    _, figures, _ = read_page(write_report([tmp_path], tmp_path / "report.html"))
    (loss,) = figures["loss"]["data"]
    assert len(loss["x"]) <= MAX_LINE_POINTS and loss["x"][-1] == STEPS
    assert set(loss["y"]) == {1.0}
    (heatmap,) = figures["expert_load_0_layers.1"]["data"]
    assert len(heatmap["x"]) <= MAX_HEATMAP_COLUMNS and heatmap["x"][-1] == STEPS
    assert heatmap["z"][0][0] == pytest.approx(0.5) and heatmap["z"][0][-1] == pytest.approx(0.75)
