"""``europa plan --runs FILE [--run ID]``: a published run planned through the same command
a user plans their own with, by europa-plan, with the same answer as ``europa-plan``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from europa.cli.app import run
from europa.plan import load_runs
from europa.plan.plan import plan_run

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PUBLISHED = BENCHMARKS / "published_runs.toml"
KIMI = "automodel-kimi-k2-h100-256g-bf16"


def test_a_published_run_planned_through_europa_plan_is_europa_plans_plan(capsys):
    assert run(["plan", "--runs", str(PUBLISHED), "--run", KIMI, "--json"]) == 0
    (planned,) = json.loads(capsys.readouterr().out)["runs"]
    expected = json.loads(json.dumps(plan_run(load_runs(PUBLISHED).run(KIMI))))
    assert planned == expected
    assert planned["time"]["published_step_s"] == 8.86 and planned["fits"]


def test_every_run_of_a_file_as_a_table_and_exit_1_when_one_does_not_fit(capsys):
    assert run(["plan", "--runs", str(PUBLISHED)]) == 0
    table = capsys.readouterr().out
    assert all(r.id in table for r in load_runs(PUBLISHED).runs) and "predicted" in table
    assert run(["plan", "--runs", str(BENCHMARKS / "more_published_runs.toml")]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--runs", str(PUBLISHED), "--set", "training.steps=2"], "--set = ['training.steps=2']"),
        (["tiny", "--runs", str(PUBLISHED)], "config = 'tiny': expected nothing else"),
        (["--runs", str(PUBLISHED), "--search"], "--search = True"),
        (["--run", KIMI], f"--run = '{KIMI}': expected only with --runs"),
        (["--runs", str(PUBLISHED), "--run", "nope"], '--run "nope": no such run'),
    ],
)
def test_what_does_not_go_with_runs_is_refused_in_one_line(capsys, argv, words):
    assert run(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("europa: error: ") and len(err.splitlines()) == 1, err
    assert words in err and "Traceback" not in err


def test_a_bad_runs_file_is_one_line_naming_the_run_and_key(capsys, tmp_path):
    bad = tmp_path / "runs.toml"
    text = PUBLISHED.read_text().replace("tp = 2\npp = 8", "tp = 3\npp = 8", 1)
    bad.write_text(text)
    assert run(["plan", "--runs", str(bad)]) == 2
    err = capsys.readouterr().err
    assert 'run "mbridge-25.09-h100-deepseek-v3-fp8-1024g": dp = 64' in err
    assert len(err.splitlines()) == 1


def test_a_config_europa_plan_prices_is_planned_by_it_too(capsys):
    """``europa plan`` prints europa-plan's step for the same run beside its own: the same
    answer ``europa-plan`` gives for the record europa-core makes of the config."""
    from europa.core.plan.plan_record import run_record
    from europa.core.plugins import EuropaPluginManager
    from europa.core.session import open_session

    argv = ["plan", "kimi-k2", "--hardware", "gh200-jupiter", "--nodes", "16", "--json"]
    assert run(argv) == 1  # FSDP2 alone does not fit Kimi-K2 on 64 GPUs
    checked = json.loads(capsys.readouterr().out)["europa_plan"]
    config, _ = open_session("kimi-k2", [], [], EuropaPluginManager())
    expected = plan_run(run_record(config, "gh200-jupiter", 64))["time"]["predicted_step_s"]
    assert checked["priced"] and checked["time"]["predicted_step_s"] == expected


def test_what_europa_plan_does_not_price_says_so_beside_the_plan(capsys):
    argv = ["plan", "debug", "--hardware", "gh200-jupiter", "-p", "flexshard"]
    run(argv)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.strip().startswith("europa-plan (checked on published runs): not priced:")
    assert "does not price flexshard yet" in line
