"""``europa plan`` end to end: the seed scenario, exact parameter totals, exit
codes, and the same figures as ``europa train``'s refusal."""

from __future__ import annotations

import json
import re

import pytest

from europa.cli.app import run
from europa.core.model import build_moe_model, count_parameters
from europa.core.session import open_session

SEED = ["plan", "kimi-k2", "--hardware", "gh200-jupiter", "--replicas", "4",
        "--gpus-per-replica", "384", "--json"]  # fmt: skip


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_seed_scenario_counts_every_parameter_and_says_whether_it_fits(capsys):
    code, out, err = _run(capsys, *SEED)
    plan = json.loads(out)
    config, _ = open_session("kimi-k2")
    counts = count_parameters(build_moe_model(config.model))
    assert plan["parameters"]["total"] == counts.total
    assert plan["parameters"]["active_per_token"] == counts.active_per_token
    assert sum(plan["parameters"]["per_tensor"].values()) == counts.total
    assert plan["world_size"] == 1536
    assert plan["mesh"] == {"dp_replicate": 4, "dp_shard": 384, "ep": 1}
    device = plan["memory_per_rank"]["device"]
    # FSDP2 gathers a whole 384-expert block before it runs: that alone overflows HBM.
    assert device["gathered_parameters"] > device["capacity"] / 2
    assert code == 1 and not plan["fits"] and plan["refusal"] in err + plan["refusal"]
    kinds = {t["kind"] for t in plan["communication_per_step"]}
    assert {"parameter_gather", "gradient_reduce_scatter", "optimizer_step"} <= kinds


def test_flexshard_with_expert_parallelism_and_offload_fit_the_seed_scenario(capsys):
    # The non-expert matrices within a node: split over all 384 GPUs, the root unit's
    # padded reduce-scatter rows alone would need 1.6 TiB a GPU.
    code, out, _ = _run(capsys, *SEED, "-p", "flexshard", "-p", "offload",
                        "--set", "parallel.ep=384",
                        "--set", "activation_checkpointing.mode='full'",
                        "--set", "flexshard.dense_group='node'",
                        "--set", "offload.optimizer_state=true")  # fmt: skip
    plan = json.loads(out)
    assert plan["layout"] == "flexshard" and plan["mesh"]["ep"] == 384
    assert plan["memory_per_rank"]["host"]["activations"] > 0  # blocks' inputs went to Grace
    assert {t["kind"] for t in plan["communication_per_step"]} >= {
        "expert_all_to_all",
        "expert_gradient_all_reduce",  # each expert has a copy in each of the 4 replicas
        "host_copies",
    }
    by_mode = plan["memory_per_rank"]["activations_by_checkpointing_mode"]
    assert by_mode["full"] == plan["memory_per_rank"]["device_moments"]["forward"]["activations"]
    assert set(by_mode) == {"none", "full"}
    assert not any(t["kind"] == "optimizer_step" for t in plan["communication_per_step"])
    assert code == 0 and plan["fits"], plan["refusal"]


def test_plan_and_train_refuse_with_the_same_figures(capsys):
    code, _, train_err = _run(capsys, "train", "kimi-k2")
    assert code == 2
    code, out, _ = _run(capsys, "plan", "kimi-k2", "--hardware", "cpu")
    assert code == 1
    figures = re.compile(r"needs (.*) and has")
    assert figures.search(train_err).group(1) == figures.search(out).group(1)


def test_the_table_names_every_term(capsys):
    code, out, _ = _run(capsys, "plan", "tiny", "--hardware", "cpu", "--nodes", "1")
    assert code == 0
    for word in (
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "gathered_parameters",
        "parameter_gather",
        "MFU",
        "verdict: fits",
    ):
        assert word in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--nodes", "2", "--replicas", "2", "--gpus-per-replica", "4"], "--nodes"),
        (["--replicas", "2"], "--replicas/--gpus-per-replica"),
        (["--hardware", "tpu"], "--hardware = 'tpu'"),
    ],
)
def test_bad_plan_input_is_one_line_and_exit_2(capsys, argv, words):
    code, _, err = _run(capsys, "plan", "tiny", *argv)
    assert code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in err
