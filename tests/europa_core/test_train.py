"""End to end: ``europa train`` on 2 gloo worker processes (through torch's launcher)."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from europa.cli.app import run
from europa.core.checkpoint.store import complete_checkpoints
from tests.checkpoint_bytes import state_bytes_on_disk
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

QUIET = ["--set", "metrics.progress=false"]


def _train(run_dir: Path, *args: str) -> None:
    code = run(["train", "--run-dir", str(run_dir), *QUIET, *args])
    assert code == 0, f"europa train exited {code}"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _records(run_dir)]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    """One ``europa train --nproc 2`` of 20 steps (checkpoints at 10 and 20): the tests
    below read it, or resume and extend copies of it."""
    run_dir = tmp_path_factory.mktemp("two-rank") / "run"
    _train(run_dir, "--nproc", "2", "--set", "training.steps=20", "--set", "checkpoint.every=10")
    return run_dir


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


def test_tiny_on_two_ranks_learns_and_leaves_a_complete_run_directory(two_rank_run):
    run_dir = two_rank_run
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 21))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)
    for record in records:
        assert {"loss", "tokens_per_s", "lr", "grad_norm", "expert_load"} <= record.keys()
        for layer, shares in record["expert_load"].items():
            assert len(shares) == 8
            assert sum(shares) == pytest.approx(1.0, abs=1e-6), layer
            assert record["expert_imbalance"][layer] == pytest.approx(max(shares) * 8)

    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert written["training"]["steps"] == 20
    assert written["parallel"]["nproc"] == 2
    assert [step for step, _ in complete_checkpoints(run_dir)] == [10, 20]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["final_loss"] == records[-1]["loss"]


def test_resume_reproduces_the_uninterrupted_run_exactly(two_rank_run, tmp_path):
    """From a synchronous save (from a background one: test_background_save_ranks.py)."""
    whole = two_rank_run

    # An interrupted run: the same directory as it stood after step 10.
    interrupted = _copy(whole, tmp_path / "interrupted")
    shutil.rmtree(interrupted / "checkpoints" / "step-00000020")
    (interrupted / "summary.json").unlink()
    _train(interrupted, "--resume")

    assert _losses(interrupted) == _losses(whole)  # bitwise equal on CPU fp32
    assert [r["step"] for r in _records(interrupted)] == list(range(1, 21))
    assert json.loads((interrupted / "summary.json").read_text())["resumed_from"] == 10


def test_hsdp_matches_fsdp_on_four_ranks(tmp_path):
    runs = [
        Run("fsdp", ["training.steps=2"]),
        Run("hsdp", ["training.steps=2", "parallel.dp_replicate=2"]),
    ]
    losses = _losses_of(run_ranks(train_runs, 4, str(tmp_path), runs, timeout=300)[0])
    assert losses["hsdp"] == pytest.approx(losses["fsdp"], rel=1e-6)
    written = tomllib.loads((tmp_path / "hsdp" / "config.toml").read_text())
    assert written["parallel"]["dp_replicate"] == 2
    _assert_each_byte_once(tmp_path / "hsdp", world=4)  # two replicas of two shards


# What changes memory or arithmetic but not the model's course: these runs share one
# spawned group of 2 ranks (each run is what a rank of `europa train` does).
ACCUMULATE_2 = "training.grad_accum_steps=2"
REPLICATED_RECOMPUTED = [
    "training.steps=3",
    "training.batch_size=4",
    "parallel.dp_replicate=2",
    'activation_checkpointing.mode="full"',
]
VARIANTS = [
    Run("plain", ["training.steps=3", "training.batch_size=8"]),
    Run("replicated", ["training.steps=3", "training.batch_size=8", "parallel.dp_replicate=2"]),
    Run("replicated-recomputed-accumulated", [*REPLICATED_RECOMPUTED, ACCUMULATE_2]),
    Run("recomputed", ["training.steps=3", 'activation_checkpointing.mode="full"']),
    Run("accumulated", ["training.steps=3", "training.batch_size=4", ACCUMULATE_2]),
    Run("bf16", ["training.steps=3", 'training.dtype="bfloat16"']),
    Run("muon", ["training.steps=15", 'optimizer.name="muon"', "optimizer.lr=0.02"]),
]


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    root = tmp_path_factory.mktemp("variants")
    return root, run_ranks(train_runs, 2, str(root), VARIANTS, timeout=300)[0]


@pytest.fixture(scope="module")
def variants(variant_runs) -> dict[str, list[dict]]:
    return variant_runs[1]


@pytest.mark.parametrize("name", ["plain", "replicated", "muon"])
def test_a_checkpoint_holds_each_byte_once_as_the_plan_says(variant_runs, name):
    """FSDP2 shards, DDP replicas, Muon's state: the bytes on disk are the unique state
    bytes ``europa plan`` reports, not that figure times the replicas."""
    _assert_each_byte_once(variant_runs[0] / name, world=2)


def _assert_each_byte_once(run_dir: Path, world: int) -> None:
    from europa.core.plan import load_profile, make_plan
    from europa.core.session import open_session

    config, plugins = open_session(str(run_dir / "config.toml"))
    plan = make_plan(config, plugins, load_profile("cpu"), world)
    (checkpoint,) = sorted((run_dir / "checkpoints").glob("step-*"))[-1:]
    disk = state_bytes_on_disk(checkpoint, {p.name for p in plan.shapes.parameters})
    assert disk["files"] == disk["indexed"]  # nothing written that is not indexed once
    assert disk["state_payload"] == plan.checkpoint_bytes
    # what each item adds to its tensor's bytes is torch.save's container, under 2 KiB
    assert 0 < disk["state_written"] - disk["state_payload"] < 2048 * disk["state_items"]


def _losses_of(runs: dict[str, list[dict]]) -> dict[str, list[float]]:
    return {name: [r["loss"] for r in records] for name, records in runs.items()}


def test_two_ranks_equal_one_process_on_the_same_global_batch(variants, tmp_path):
    # Initialisation does not depend on the world size, the data split does not
    # change the global batch, and FSDP averages equal-sized rank means. The 2-rank
    # run is the shared group's "plain" (3 steps, 8 sequences per rank).
    single = tmp_path / "single"
    _train(single, "--nproc", "1", "--set", "training.steps=3", "--set", "training.batch_size=16")
    assert _losses_of(variants)["plain"] == pytest.approx(_losses(single), rel=1e-5)


def test_ddp_replicas_train_like_fsdp2_shards(variants):
    # dp_replicate = 2 in fp32 is DDP (plugins/builtin/fsdp.py), "plain" is FSDP2 over
    # the same 2 ranks: both average the same two rank gradients.
    losses = _losses_of(variants)
    assert losses["replicated"] == pytest.approx(losses["plain"], rel=1e-5)
    assert variants["replicated"][-1]["expert_load"] == variants["plain"][-1]["expert_load"]
    # DDP reduces once per micro-batch backward, recomputed blocks included
    assert losses["replicated-recomputed-accumulated"] == pytest.approx(losses["plain"], rel=1e-5)


def test_activation_checkpointing_changes_memory_not_results(variants):
    losses = _losses_of(variants)
    assert losses["recomputed"] == pytest.approx(losses["plain"], rel=1e-6)
    assert variants["recomputed"][-1]["expert_load"] == variants["plain"][-1]["expert_load"]


def test_gradient_accumulation_matches_a_larger_batch(variants):
    losses = _losses_of(variants)
    assert losses["accumulated"] == pytest.approx(losses["plain"], rel=1e-5)


def test_bfloat16_mixed_precision_tracks_fp32(variants):
    losses = _losses_of(variants)
    assert losses["bf16"] == pytest.approx(losses["plain"], rel=1e-2)
    assert losses["bf16"] != losses["plain"]  # bf16 compute really ran


def test_muon_trains(variants):
    losses = _losses_of(variants)["muon"]
    assert losses[-1] < losses[0] - 0.5, losses


def test_resume_of_a_run_without_checkpoints_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    assert run(["train", "--run-dir", str(run_dir), "--resume", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"europa: error: --resume: {str(run_dir)!r} holds no complete checkpoint; "
        "expected checkpoints/step-* from an earlier run"
    )


def test_resume_can_extend_a_finished_run_but_not_shorten_it(two_rank_run, tmp_path, capsys):
    run_dir = _copy(two_rank_run, tmp_path / "run")  # finished at step 20

    shorter = ["train", "--run-dir", str(run_dir), "--resume", "--set", "training.steps=19"]
    assert run([*shorter, *QUIET]) == 2
    checkpoint_dir = run_dir / "checkpoints" / "step-00000020"
    assert capsys.readouterr().err.strip().splitlines() == [
        "europa: error: training.steps = 19: expected at least the 20 steps the checkpoint "
        f"{str(checkpoint_dir)!r} has already done"
    ]

    config_before = (run_dir / "config.toml").read_bytes()
    reshaped = ["train", "--run-dir", str(run_dir), "--resume", "--set", "model.dim=64"]
    assert run([*reshaped, *QUIET]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"europa: error: checkpoint {str(checkpoint_dir)!r} does not match this model or "
        "optimizer (model.tok_embeddings.weight is (2048, 128) there, (2048, 64) here); "
        "expected a checkpoint written by the same config"
    ]
    assert (run_dir / "config.toml").read_bytes() == config_before  # nothing lost

    _train(run_dir, "--resume")
    assert "nothing left to train at step 20" in capsys.readouterr().err

    _train(run_dir, "--resume", "--set", "training.steps=22")
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 23))
    assert [step for step, _ in complete_checkpoints(run_dir)] == [20, 22]  # keeps 2


def test_an_error_inside_the_workers_is_reported_once_in_one_line(tmp_path, capfd):
    from europa.core.config import load_config
    from europa.core.errors import LaunchedRunError
    from europa.core.launch.launcher import launch_local_workers
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.launch.resume import ResumeChoice

    run_dir = tmp_path / "run"
    prepare_run_dir(load_config("tiny"), run_dir, resume=False)
    # Damaged after the launcher checked it: only the workers can find out.
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("steps = 200\n", "step = 3\n"))
    with pytest.raises(LaunchedRunError) as err:
        launch_local_workers(2, run_dir, ResumeChoice(None, lambda: None))
    assert str(err.value) == "training.step = 3: unknown key; did you mean training.steps?"
    assert "training.step = 3" not in capfd.readouterr().err  # the workers printed nothing
