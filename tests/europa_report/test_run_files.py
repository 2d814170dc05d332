"""What a real run leaves for the report and for TensorBoard."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.europa_report.conftest import STEPS

TOKENS_PER_STEP = 8 * 128  # tiny: batch 8 × sequence 128, one rank


def test_job_file_and_records_hold_what_the_config_does_not_say(tiny_run):
    job = json.loads((tiny_run / "job.json").read_text())
    assert job["world_size"] == 1
    assert job["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "ep": 1}
    assert job["parameters"] == json.loads((tiny_run / "summary.json").read_text())["parameters"]

    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in records] == [TOKENS_PER_STEP * s for s in range(1, STEPS + 1)]
    assert all(r["memory_peak_bytes"] > 10 << 20 for r in records)  # a process with torch in it


def test_tensorboard_events_hold_the_same_scalars_and_expert_load(tiny_run):
    events = EventAccumulator(str(tiny_run / "tensorboard"))
    events.Reload()

    record = json.loads((tiny_run / "metrics.jsonl").read_text().splitlines()[-1])
    scalars = set(events.Tags()["scalars"])
    for key, value in record.items():
        # a flag such as "skipped" is a bool, not a scalar to plot
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
            assert key in scalars, key
    assert {f"expert_imbalance/{layer}" for layer in record["expert_imbalance"]} <= scalars
    assert [e.step for e in events.Scalars("loss")] == list(range(1, STEPS + 1))
    histograms = sorted(events.Tags()["histograms"])
    assert histograms == sorted(f"expert_load/{layer}" for layer in record["expert_load"])
