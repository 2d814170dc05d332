"""benchmarks/e2e.py holds each run to issue 25's done-lines: which configuration each
ratio compares, and None where the run lacks one side."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _e2e_report import GPU_TARGETS, keep_fastest, ratios_and_targets


def _run(system: str, config: str, ranks: int, tokens_per_s: float, mfu: float = 0.5):
    return {
        "system": system,
        "config": config,
        "ranks": ranks,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
    }


def test_each_target_compares_the_configurations_it_names():
    configs = [
        _run("europa", "core", 1, 1000, mfu=0.81),
        _run("europa", "flexshard", 1, 970),
        _run("torchtitan", "torchtitan-shipped", 1, 700),
        _run("torchtitan", "torchtitan-fp32-experts", 1, 810),
        _run("europa", "core-ddp", 2, 900),
        _run("europa", "flexshard-ep2+overlap", 2, 860),
        _run("torchtitan", "torchtitan-shipped-hsdp", 2, 600),
        _run("torchtitan", "torchtitan-fp32-experts", 2, 740),
    ]
    targets = ratios_and_targets(configs)["targets"]
    assert {name: t["value"] for name, t in targets.items()} == {
        "core_mfu_1_rank": 0.81,
        "core_over_torchtitan_1_rank": 1000 / 810,  # torchtitan's fastest of both dtypes
        "europa_over_torchtitan_2_ranks": 900 / 740,
        "flexshard_over_core_1_rank": 0.97,
        "flexshard_ep2_overlap_over_europa_best_2_ranks": 860 / 900,
    }
    assert {name: t["met"] for name, t in targets.items()} == {
        "core_mfu_1_rank": True,
        "core_over_torchtitan_1_rank": False,
        "europa_over_torchtitan_2_ranks": False,
        "flexshard_over_core_1_rank": False,
        "flexshard_ep2_overlap_over_europa_best_2_ranks": True,
    }


def test_a_target_this_run_cannot_measure_is_none():
    targets = ratios_and_targets([_run("europa", "core", 1, 1000, mfu=0.7)])["targets"]
    assert targets["core_mfu_1_rank"] == {"value": 0.7, "at_least": 0.80, "met": False}
    for name in (
        "core_over_torchtitan_1_rank",
        "europa_over_torchtitan_2_ranks",
        "flexshard_over_core_1_rank",
        "flexshard_ep2_overlap_over_europa_best_2_ranks",
    ):
        assert targets[name]["value"] is None and targets[name]["met"] is None


def test_the_gpu_run_is_held_to_the_gpu_goals_only():
    configs = [
        _run("europa", "core", 1, 1200, mfu=0.4),
        _run("europa", "flexshard", 1, 1190),
        _run("torchtitan", "torchtitan-shipped", 1, 1000),
    ]
    targets = ratios_and_targets(configs, GPU_TARGETS)["targets"]
    assert targets == {
        "core_over_torchtitan_1_rank": {"value": 1.2, "at_least": 1.10, "met": True},
        "flexshard_over_core_1_rank": {"value": 1190 / 1200, "at_least": 0.98, "met": True},
    }


def test_rounds_keep_each_configurations_fastest_round_whole_and_every_rounds_figure():
    kept: dict[str, dict] = {}
    keep_fastest(kept, {"core": {"tokens_per_s": 500, "step_s": 2.0},
                        "ddp": {"tokens_per_s": 700, "step_s": 1.4}})  # fmt: skip
    keep_fastest(kept, {"core": {"tokens_per_s": 600, "step_s": 1.7},
                        "ddp": {"tokens_per_s": 650, "step_s": 1.5}})  # fmt: skip
    keep_fastest(kept, {"core": {"tokens_per_s": 550, "step_s": 1.8}})  # ddp failed here
    assert kept["core"] == {
        "tokens_per_s": 600,
        "step_s": 1.7,
        "tokens_per_s_by_round": [500, 600, 550],
    }
    assert kept["ddp"] == {"tokens_per_s": 700, "step_s": 1.4, "tokens_per_s_by_round": [700, 650]}
