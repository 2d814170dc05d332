"""A rank that dies (killed, or an exception of its own) ends the whole run within
seconds; the launcher's one line names the rank and the step, and the last complete
checkpoint resumes. A rank killed inside a checkpoint save leaves the previous checkpoint
to resume from and its ``.partial`` is never loaded."""

from __future__ import annotations

import time

import pytest

from europa.core.train.checkpoint import complete_checkpoints

from .conftest import QUIET, europa_env, last_line, records, run_europa


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_killed_inside_a_save_ends_the_run_and_the_previous_checkpoint_resumes(
    tmp_path, fault_plugin_dir
):
    env, run_dir = europa_env(fault_plugin_dir), tmp_path / "run"
    began = time.monotonic()
    killed = run_europa(env, "train", "--nproc", "2", "-p", "faults", "--run-dir", str(run_dir),
                        "--set", "training.steps=6", "--set", "checkpoint.every=2",
                        "--set", "faults.kill_in_save_of_step=4", *QUIET)  # fmt: skip
    assert time.monotonic() - began < 60
    assert killed.returncode == 128 + 9, killed.stderr
    assert last_line(killed.stderr) == (
        "europa: error: worker rank 1 was killed by SIGKILL while saving the checkpoint of "
        "step 4; the newest complete checkpoint is step-00000002; continue with: "
        f"europa train --resume --run-dir {run_dir}"
    )
    assert "Traceback" not in killed.stderr
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2]
    assert (run_dir / "checkpoints" / ".step-00000004.partial").is_dir()

    resumed = run_europa(env, "train", "--resume", "--run-dir", str(run_dir),
                         "--set", "faults.kill_in_save_of_step=0")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000004",
        "step-00000006",
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_an_exception_on_one_flexshard_rank_then_a_damaged_checkpoint(tmp_path, fault_plugin_dir):
    """Rank 1 raises at step 3: the launcher names it. Then the newest checkpoint is
    truncated: --resume refuses naming it; --resume-from-older continues from step 1."""
    env, run_dir = europa_env(fault_plugin_dir), tmp_path / "run"
    began = time.monotonic()
    failed = run_europa(env, "train", "--nproc", "2", "-p", "faults", "-p", "flexshard",
                        "--run-dir", str(run_dir), "--set", "training.steps=3",
                        "--set", "checkpoint.every=1", "--set", "faults.raise_at_step=3",
                        *QUIET)  # fmt: skip
    assert time.monotonic() - began < 60
    assert failed.returncode == 1, failed.stderr
    assert "RuntimeError: injected fault at step 3" in failed.stderr  # the rank's own traceback
    assert last_line(failed.stderr) == (
        "europa: error: worker rank 1 exited with code 1 (its error is printed above) at "
        "step 3; the newest complete checkpoint is step-00000002; continue with: "
        f"europa train --resume --run-dir {run_dir}"
    )

    newest = run_dir / "checkpoints" / "step-00000002"
    shard = sorted(newest.glob("*.distcp"))[-1]
    size = shard.stat().st_size
    with shard.open("r+b") as file:
        file.truncate(size // 2)
    refused = run_europa(env, "train", "--resume", "--run-dir", str(run_dir))
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"europa: error: --resume: checkpoint {str(newest)!r} is damaged (its file "
        f"{shard.name} has {size // 2} bytes, {size} when saved); expected an intact "
        "checkpoint: add --resume-from-older to continue from step-00000001, the newest "
        "intact one"
    )

    resumed = run_europa(env, "train", "--resume", "--resume-from-older", "--run-dir",
                         str(run_dir), "--set", "faults.raise_at_step=0")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "europa: step-00000002 is damaged; resuming from step-00000001" in resumed.stderr
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2, 3]
