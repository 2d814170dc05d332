"""A rank that dies (killed, or an exception of its own) ends the whole run within
seconds; the launcher's one line names the rank and the step, and the last complete
checkpoint resumes. A rank killed inside a checkpoint save leaves the previous checkpoint
to resume from and its ``.partial`` is never loaded. Ctrl-C to the launcher, first and
second, on the resumed run; a damaged checkpoint on the FlexShard one."""

from __future__ import annotations

import os
import time

import pytest

from europa.core.checkpoint.store import complete_checkpoints
from europa.core.launch.progress import read_progress

from .conftest import (
    QUIET,
    ctrl_c,
    europa_env,
    last_line,
    records,
    run_here,
    start_training,
    wait_for,
)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_rank_killed_in_a_save_then_the_resumed_run_stopped_by_ctrl_c_twice(
    tmp_path, faults_here, capfd
):
    """One run directory, three launches: rank 1 is killed inside the save of step 4 (the
    launcher names it; step 2 stays the newest checkpoint); the resume is stopped by a
    first Ctrl-C (step, checkpoint, resume command); the next resume is stopped by a second
    Ctrl-C while the workers save (every process gone at once, the checkpoints kept)."""
    env, run_dir = europa_env(faults_here), tmp_path / "run"
    began = time.monotonic()
    code, err = run_here(capfd, "train", "--nproc", "2", "-p", "faults", "--run-dir",
                          str(run_dir), "--set", "training.steps=100000",
                          "--set", "checkpoint.every=2", "--set", "faults.kill_in_save_of_step=4",
                          *QUIET)  # fmt: skip
    assert time.monotonic() - began < 60
    assert code == 128 + 9, err
    assert last_line(err) == (
        "europa: error: worker rank 1 was killed by SIGKILL while saving the checkpoint of "
        "step 4; the newest complete checkpoint is step-00000002; continue with: "
        f"europa train --resume --run-dir {run_dir}"
    )
    assert "Traceback" not in err
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2]
    assert (run_dir / "checkpoints" / ".step-00000004.partial").is_dir()

    launcher = start_training(env, "--resume", "--run-dir", str(run_dir),
                              "--set", "faults.kill_in_save_of_step=0")  # fmt: skip
    wait_for(lambda: len(records(run_dir)) > 4, launcher)  # past what the killed run left
    ctrl_c(launcher)
    _, err = launcher.communicate(timeout=120)
    done = len(records(run_dir))
    assert launcher.returncode == 0, err
    assert last_line(err) == (
        f"europa: stopped by SIGINT after step {done} of 100000, checkpoint saved; "
        f"continue with: europa train --resume --run-dir {run_dir}"
    )
    assert [r["step"] for r in records(run_dir)] == list(range(1, done + 1))
    assert complete_checkpoints(run_dir)[-1][0] == done
    assert not list((run_dir / "checkpoints").glob(".*.partial"))  # cleared on resume

    launcher = start_training(env, "--resume", "--run-dir", str(run_dir),
                              "--set", "faults.hold_saves=true")  # fmt: skip
    wait_for(lambda: len(records(run_dir)) > done, launcher)
    ctrl_c(launcher)
    wait_for(lambda: any(run_dir.glob("holding-save-rank-*")), launcher)
    workers = [record["pid"] for record in read_progress(run_dir).values()]
    ctrl_c(launcher)
    _, err = launcher.communicate(timeout=20)
    assert launcher.returncode == 130, err
    assert last_line(err) == (
        "europa: error: stopped at once by a second Ctrl-C (SIGINT); the newest complete "
        f"checkpoint is step-{done:08d}; continue with: europa train --resume --run-dir {run_dir}"
    )
    assert "Traceback" not in err
    assert complete_checkpoints(run_dir)[-1][0] == done
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.distributed
@pytest.mark.slow
def test_an_exception_on_one_flexshard_rank_then_a_damaged_checkpoint(tmp_path, faults_here, capfd):
    """Rank 1 raises at step 3: the launcher names it. Then the newest checkpoint is
    truncated: --resume refuses naming it; --resume-from-older continues from step 1."""
    run_dir = tmp_path / "run"
    began = time.monotonic()
    code, err = run_here(capfd, "train", "--nproc", "2", "-p", "faults", "-p", "flexshard",
                          "--run-dir", str(run_dir), "--set", "training.steps=3",
                          "--set", "checkpoint.every=1", "--set", "faults.raise_at_step=3",
                          *QUIET)  # fmt: skip
    assert time.monotonic() - began < 60
    assert code == 1, err
    assert "RuntimeError: injected fault at step 3" in err  # the rank's own traceback
    assert last_line(err) == (
        "europa: error: worker rank 1 exited with code 1 (its error is printed above) at "
        "step 3; the newest complete checkpoint is step-00000002; continue with: "
        f"europa train --resume --run-dir {run_dir}"
    )

    newest = run_dir / "checkpoints" / "step-00000002"
    shard = sorted(newest.glob("*.distcp"))[-1]
    size = shard.stat().st_size
    with shard.open("r+b") as file:
        file.truncate(size // 2)
    code, err = run_here(capfd, "train", "--resume", "--run-dir", str(run_dir))
    assert code == 2
    assert err.strip() == (
        f"europa: error: --resume: checkpoint {str(newest)!r} is damaged (its file "
        f"{shard.name} has {size // 2} bytes, {size} when saved); expected an intact "
        "checkpoint: add --resume-from-older to continue from step-00000001, the newest "
        "intact one"
    )

    code, err = run_here(capfd, "train", "--resume", "--resume-from-older", "--run-dir",
                          str(run_dir), "--set", "faults.raise_at_step=0")  # fmt: skip
    assert code == 0, err
    assert "europa: step-00000002 is damaged; resuming from step-00000001" in err
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2, 3]
