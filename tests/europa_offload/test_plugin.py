"""``europa train -p offload``: exact results under FSDP2 and FlexShard, accounting, budgets."""

from __future__ import annotations

import pytest

from europa.cli.app import run
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

COMMON = [
    "training.steps=3",
    "training.grad_accum_steps=2",
    "training.batch_size=2",
    'optimizer.name="muon"',
    "optimizer.lr=0.02",
]
OFFLOAD = ["offload.min_tensor_kib=1"]
RECOMPUTE = ['activation_checkpointing.mode="full"']
STATE = ["offload.optimizer_state=true", "offload.optimizer_chunk_mib=1"]  # several chunks
RUNS = [
    Run("fsdp2", COMMON),
    Run("fsdp2-offload", [*COMMON, *OFFLOAD], ["offload"]),
    Run("fsdp2-recompute", [*COMMON, *RECOMPUTE]),
    Run("fsdp2-recompute-offload", [*COMMON, *RECOMPUTE, *OFFLOAD], ["offload"]),
    Run("flexshard", COMMON, ["flexshard"]),
    Run("flexshard-offload", [*COMMON, *OFFLOAD, *STATE], ["flexshard", "offload"]),
]
PAIRS = [
    ("fsdp2", "fsdp2-offload"),
    ("fsdp2-recompute", "fsdp2-recompute-offload"),
    ("flexshard", "flexshard-offload"),
]


@pytest.mark.distributed
def test_offload_changes_no_result_under_fsdp2_and_flexshard(tmp_path):
    runs = run_ranks(train_runs, 2, str(tmp_path), RUNS, timeout=300)[0]
    for plain, offloaded in PAIRS:
        for a, b in zip(runs[plain], runs[offloaded], strict=True):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (plain, a["step"])
        records = runs[offloaded]
        assert all(r["offload_bytes_offloaded"] > 0 for r in records), offloaded
        assert len({r["offload_pool_allocations"] for r in records}) == 1  # no growth after step 1
        assert all(r["offload_peak_saved_device_bytes"] >= 0 for r in records)
    # Checkpointing keeps only each block's input: far less to offload.
    assert (
        runs["fsdp2-recompute-offload"][0]["offload_bytes_offloaded"]
        < runs["fsdp2-offload"][0]["offload_bytes_offloaded"] / 4
    )


QUIET = ["--set", "metrics.progress=false"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        # The pre-flight plan refuses these before a worker starts (the runtime
        # pool checks the same budget for users of the plain API).
        (
            ["offload.host_memory_gib=0.001"],
            "tiny: 1 rank(s) on this cpu machine: each rank moves 41.9 MiB to host memory "
            "(activations 41.9 MiB) and has 1.0 MiB (offload.host_memory_gib = 0.001): "
            "expected a larger budget, more ranks, or less offloaded",
        ),
        (
            ["offload.optimizer_state=true", "offload.host_memory_gib=0.001"],
            "tiny: 1 rank(s) on this cpu machine: each rank moves 56.7 MiB to host memory "
            "(activations 41.9 MiB, optimizer_state 14.8 MiB) and has 1.0 MiB "
            "(offload.host_memory_gib = 0.001): expected a larger budget, more ranks, or less "
            "offloaded",
        ),
        (
            ["offload.blocks=['decoder.*']"],
            "offload.blocks = ['decoder.*']: no module of the model matches; expected patterns "
            "of block names such as 'layers.*'",
        ),
    ],
)
def test_a_budget_or_policy_that_cannot_hold_is_refused_in_one_line(
    tmp_path, capsys, settings, message
):
    sets = [arg for setting in settings for arg in ("--set", setting)]
    run_dir = str(tmp_path / "run")
    code = run(["train", "tiny", "-p", "offload", "--nproc", "1", *QUIET, *sets,
                "--set", "offload.min_tensor_kib=1", "--run-dir", run_dir])  # fmt: skip
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"europa: error: {message}"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_plan_hook_states_what_moves_to_host_memory():
    from types import SimpleNamespace

    from europa.core.session import open_session
    from europa.offload import plugin

    config, _ = open_session(
        "tiny",
        ["offload.optimizer_state=true", "offload.host_memory_gib=2", "offload.keep_last_blocks=2"],
        ["offload"],
    )
    plan = {}
    plugin.europa_plan(job=SimpleNamespace(config=config), plan=plan)
    assert plan["host_offload"] == {
        "activation_blocks": ["layers.*"],
        "keep_last_blocks": 2,
        "min_tensor_bytes": 256 * 1024,
        "optimizer_state": True,
        "optimizer_chunk_bytes": 256 * 2**20,
        "budget_bytes_per_rank": 2 * 2**30,
        "budget_setting": "offload.host_memory_gib = 2",
    }
