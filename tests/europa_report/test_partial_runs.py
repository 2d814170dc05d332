"""Runs caught mid-way, stopped early, or not runs at all; values a chart cannot draw."""

from __future__ import annotations

import json
import shutil

import pytest

from europa.cli.app import run
from europa.report import write_report
from tests.europa_report.pages import read_page


def _copy(tiny_run, tmp_path, keep_steps: int):
    run_dir = shutil.copytree(tiny_run, tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:keep_steps]))
    return run_dir


def test_a_run_still_going_is_reported_as_far_as_it_got(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path, keep_steps=3)
    (run_dir / "summary.json").unlink()
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 4, "loss": 7.9')  # the trainer is writing this line now

    _, figures, page = read_page(write_report([run_dir], tmp_path / "report.html"))
    assert figures["loss"]["data"][0]["x"] == [1, 2, 3]
    assert "no summary yet: step 3 of 5 logged (still going, or ended without a summary)" in (
        page.text
    )
    # job.json, written when training starts, has what summary.json would have said
    assert "1.94 M total, 1.28 M active per token, 0.88 M in routed experts" in page.text
    assert "pp=1 × dp_replicate=1 × dp_shard=1 × ep=1" in page.text


def test_a_run_stopped_early_says_by_what(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path, keep_steps=2)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps(summary | {"stopped_by": "SIGTERM"}))

    _, figures, page = read_page(write_report([run_dir], tmp_path / "report.html"))
    assert "stopped by SIGTERM at step 2 of 5" in page.text
    assert len(figures["expert_load_0_layers.1"]["data"][0]["x"]) == 2


def test_non_finite_values_are_gaps_and_plugin_keys_get_charts(tmp_path):
    records = [
        {"step": 1, "loss": 8.0, "myplugin_queue": 3, "myplugin_rank_s": {"0": 0.5, "1": 0.7}},
        {"step": 2, "loss": float("nan"), "myplugin_queue": 4, "myplugin_flag": True},
        {"step": 3, "loss": float("inf"), "myplugin_queue": 2, "myplugin_rank_s": {"0": 0.4}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    _, figures, page = read_page(write_report([tmp_path], tmp_path / "report.html"))
    assert figures["loss"]["data"][0]["y"] == [8.0, None, None]
    assert figures["myplugin_queue"]["data"][0]["y"] == [3, 4, 2]
    rank_s = {t["name"]: t["y"] for t in figures["myplugin_rank_s"]["data"]}
    assert rank_s == {"0": [0.5, None, 0.4], "1": [0.7, None, None]}
    assert "myplugin_flag" not in figures  # not a number
    assert "no config.toml" in " ".join(page.text)


def _report(capsys, *args: str) -> tuple[int, list[str]]:
    code = run(["report", *args])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("metrics", [None, "", "\n"])
def test_a_directory_without_metrics_gets_one_line_and_exit_2(tmp_path, capsys, metrics):
    if metrics is not None:
        (tmp_path / "metrics.jsonl").write_text(metrics)
    code, err = _report(capsys, str(tmp_path))
    assert code == 2
    assert err == [
        f"europa: error: RUN_DIR = {str(tmp_path)!r}: no step recorded in metrics.jsonl yet; "
        "expected a run directory written by `europa train` with at least one logged step"
    ]
    assert not (tmp_path / "report.html").exists()


def test_bad_input_gets_one_line_and_exit_2(tiny_run, tmp_path, capsys):
    code, err = _report(capsys, str(tmp_path / "missing"))
    assert (code, len(err)) == (2, 1)
    assert "RUN_DIR = " in err[0] and "not a directory" in err[0]

    code, err = _report(capsys, str(tiny_run), "--out", str(tmp_path / "no" / "page.html"))
    assert (code, len(err)) == (2, 1)
    assert "--out = " in err[0] and "no directory" in err[0]

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    code, err = _report(capsys, str(tmp_path))
    assert (code, len(err)) == (2, 1)
    assert f"{tmp_path / 'metrics.jsonl'}:2: not a metrics record" in err[0]
