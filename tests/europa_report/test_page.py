"""``europa report`` on a real tiny run: every chart is on the page, with what it should draw."""

from __future__ import annotations

import json
import shutil

import plotly.graph_objects as go
import pytest

from europa.cli.app import run
from europa.report import write_report
from tests.europa_report.conftest import STEPS
from tests.europa_report.pages import read_page

LAYERS = ["layers.1", "layers.2", "layers.3"]  # tiny: 4 layers, the first dense
EXPERTS = 8
CORE_CHARTS = {
    "loss",
    "loss_by_tokens",
    "lr",
    "lr_by_tokens",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "memory_peak_bytes",
    "expert_imbalance",
    "skipped_steps",
}


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _plugin_charts(record: dict) -> set[str]:
    """What the report promises for europa-offload's keys: its byte counts in one
    memory chart, every other key in a chart of its own."""
    keys = [key for key in record if key.startswith("offload_")]
    assert any(key.endswith("_bytes") for key in keys), "europa-offload reports no bytes"
    return {"offload_memory"} | {key for key in keys if not key.endswith("_bytes")}


def test_the_page_holds_every_chart_of_a_tiny_run(tiny_run, tmp_path):
    out = write_report([tiny_run], tmp_path / "report.html")
    elements, figures, page = read_page(out)

    heatmaps = {f"expert_load_0_{layer}" for layer in LAYERS}
    expected = CORE_CHARTS | heatmaps | _plugin_charts(_records(tiny_run)[-1])
    assert sorted(elements) == sorted(expected)
    assert figures.keys() == expected
    assert page.external == []  # nothing to fetch: opens with no network

    steps = list(range(1, STEPS + 1))
    for chart_id, figure in figures.items():
        go.Figure(figure)  # plotly's own validation: every property is one plotly.js knows
        for trace in figure["data"]:
            assert trace["x"], f"{chart_id}: an empty trace"
            if trace["type"] == "scatter" and not chart_id.endswith("_by_tokens"):
                assert trace["x"] == steps, chart_id
    assert figures["loss_by_tokens"]["data"][0]["x"] == [
        r["tokens_seen"] for r in _records(tiny_run)
    ]
    assert {t["name"] for t in figures["expert_imbalance"]["data"]} == set(LAYERS)
    for layer in LAYERS:
        (heatmap,) = figures[f"expert_load_0_{layer}"]["data"]
        assert heatmap["type"] == "heatmap" and heatmap["x"] == steps
        assert len(heatmap["z"]) == EXPERTS
        for column in zip(*heatmap["z"], strict=True):  # shares of one step sum to 1
            assert sum(column) == pytest.approx(1.0, abs=1e-3)


def test_the_page_shows_counts_world_size_mesh_summary_and_config(tiny_run, tmp_path):
    _, _, page = read_page(write_report([tiny_run], tmp_path / "report.html"))
    text = "\n".join(page.text)

    summary = json.loads((tiny_run / "summary.json").read_text())
    for shown in (
        f"finished: step {STEPS} of {STEPS}",
        "1.94 M total, 1.28 M active per token, 0.88 M in routed experts",
        "dp_replicate=1 × dp_shard=1 × ep=1",
        "offload",
        json.dumps(summary, indent=2),
        (tiny_run / "config.toml").read_text().strip(),  # the resolved config
    ):
        assert shown in text, shown
    world = page.text.index("world size")
    assert page.text[world + 1] == "1"


def test_several_runs_overlay_their_curves(tiny_run, tmp_path):
    other = shutil.copytree(tiny_run, tmp_path / "other")
    _, figures, _ = read_page(write_report([tiny_run, other], tmp_path / "both.html"))

    for chart_id in ("loss", "lr_by_tokens", "tokens_per_s", "offload_memory"):
        names = [trace["name"] for trace in figures[chart_id]["data"]]
        assert names[0].startswith(tiny_run.name) and names[-1].startswith("other"), chart_id
    assert len(figures["loss"]["data"]) == 2
    assert {f"expert_load_{i}_{layer}" for i in (0, 1) for layer in LAYERS} <= figures.keys()


def test_the_command_writes_the_page_beside_the_run(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir = shutil.copytree(tiny_run, tmp_path / "run")
    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)

    assert run(["report", str(run_dir), "--open"]) == 0
    assert (run_dir / "report.html").is_file()
    assert opened == [(run_dir / "report.html").resolve().as_uri()]
    assert f"report written to {run_dir / 'report.html'}" in capsys.readouterr().err


def test_a_run_with_validation_draws_it_in_a_validation_section(tmp_path):
    from tests.conftest import run_ranks
    from tests.trainer_runs import Run, train_runs

    run_ = Run(
        "validated",
        ["training.steps=4", "data.validation_fraction=0.2", "metrics.eval_every=2"],
        [],
    )
    run_ranks(train_runs, 1, str(tmp_path), [run_])
    run_dir = tmp_path / run_.name
    evaluated = [r["step"] for r in _records(run_dir) if "val_loss" in r]
    assert evaluated == [2, 4]
    out = write_report([run_dir], tmp_path / "report.html")
    elements, figures, _ = read_page(out)
    assert {"val_loss", "val_perplexity"} <= set(elements)
    for key in ("val_loss", "val_perplexity"):
        (trace,) = figures[key]["data"]
        assert trace["x"] == evaluated and all(y is not None for y in trace["y"])
    html = out.read_text()
    assert 'data-section="Validation"' in html and "Plugin: val" not in html


def test_a_clipped_run_draws_each_layers_largest_logit_against_tau(tmp_path):
    records = [
        {"step": s, "loss": 8.0, "qk_logit_max": {"layers.0": 0.1 * s, "layers.1": 0.2},
         "qk_heads_clipped": s - 1}
        for s in (1, 2, 3)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.toml").write_text("[optimizer]\nqk_clip = true\nqk_clip_tau = 0.15\n")

    _, figures, page = read_page(write_report([tmp_path], tmp_path / "report.html"))
    lines = {t["name"]: (t["x"], t["y"]) for t in figures["qk_logit_max"]["data"]}
    assert lines == {
        "layers.0": ([1, 2, 3], [0.1, 0.2, pytest.approx(0.3)]),
        "layers.1": ([1, 2, 3], [0.2, 0.2, 0.2]),
        "tau": ([1, 3], [0.15, 0.15]),
    }
    assert figures["qk_heads_clipped"]["data"][0]["y"] == [0, 1, 2]
    assert "Attention logits (QK-clip)" in page.text
    assert not any(chart.startswith("Plugin: qk") for chart in page.text)
