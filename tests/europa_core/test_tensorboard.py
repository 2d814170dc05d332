"""``[metrics] tensorboard = true``: the sink's records read back from the event files."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from europa.core.train.metrics import MetricsSink


def _record(step: int, loss: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "expert_imbalance": {"layers.1": 1.5},
        "expert_load": {"layers.1": [0.5, 0.25, 0.25, 0.0]},
        "offload_host_bytes": 4096,
        "plugin_flag": True,  # not a number: left out
    }


def _write(run_dir, start_step: int, records: list[dict]) -> None:
    sink = MetricsSink(
        run_dir, total_steps=4, start_step=start_step, progress=False, tensorboard=True
    )
    for record in records:
        sink(record)
    sink.close()


def _events(run_dir) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return events


def test_scalars_and_expert_load_histograms(tmp_path):
    _write(tmp_path, 0, [_record(1, 8.0), _record(2, 7.0)])

    events = _events(tmp_path)
    tags = events.Tags()
    assert set(tags["scalars"]) == {
        "loss",
        "lr",
        "tokens_per_s",
        "expert_imbalance/layers.1",
        "offload_host_bytes",
    }
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 8.0), (2, 7.0)]
    assert tags["histograms"] == ["expert_load/layers.1"]
    histogram = events.Histograms("expert_load/layers.1")[-1].histogram_value
    assert histogram.bucket == pytest.approx([0.5, 0.25, 0.25, 0.0])  # one bucket per expert
    assert histogram.bucket_limit == pytest.approx([0.5, 1.5, 2.5, 3.5])
    assert (histogram.min, histogram.max) == (0, 3)


def test_resume_replaces_the_steps_past_the_checkpoint(tmp_path):
    _write(tmp_path, 0, [_record(1, 8.0), _record(2, 7.0), _record(3, 6.0)])
    _write(tmp_path, 1, [_record(2, 7.5), _record(3, 6.5)])  # resumed from step 1

    loss = [(e.step, e.value) for e in _events(tmp_path).Scalars("loss")]
    assert loss == [(1, 8.0), (2, 7.5), (3, 6.5)]
