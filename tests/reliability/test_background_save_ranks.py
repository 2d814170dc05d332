"""Background saves on 2 gloo ranks, as a user runs them (``europa train``, a slow file
system emulated by ``checkpoint.max_write_mbps``): Ctrl-C during a background write
waits for it before the final save; a rank killed during one leaves the previous
checkpoint to resume from, bit-exactly, and the partial one is removed on resume.
FlexShard's background saves hold what its synchronous ones do."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils._pytree import keystr, tree_flatten_with_path

from europa.core.checkpoint.store import complete_checkpoints, step_dir
from europa.core.checkpoint.verify import verify_checkpoint
from europa.core.launch.progress import read_progress
from tests.conftest import run_ranks
from tests.trainer_runs import Run, train_runs

from .conftest import ctrl_c, europa_env, last_line, records, start_training, wait_for

# About 12 MB of state a rank (tiny, AdamW): some 1.5 s to write at 8 MB/s, tens of steps.
ASYNC = ["--set", 'checkpoint.mode="async"', "--set", "checkpoint.every=2",
         "--set", "checkpoint.keep=0"]  # fmt: skip
SLOW = ["--set", "checkpoint.max_write_mbps=8"]
MODES = ("sync", "async")


def _writing(run_dir, rank: int) -> list:
    """Partial checkpoints in which ``rank`` has begun its file."""
    return sorted((run_dir / "checkpoints").glob(f".step-*.partial/__{rank}_0.distcp"))


@pytest.mark.distributed
@pytest.mark.slow
def test_ctrl_c_and_a_killed_rank_during_background_writes(tmp_path, fault_plugin_dir):
    env, run_dir = europa_env(fault_plugin_dir), tmp_path / "run"
    many = ["--set", "training.steps=100000"]

    launcher = start_training(env, "--nproc", "2", "--run-dir", str(run_dir), *many, *ASYNC, *SLOW)
    wait_for(lambda: _writing(run_dir, 0), launcher)
    ctrl_c(launcher)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    done = len(records(run_dir))
    assert last_line(err) == (
        f"europa: stopped by SIGINT after step {done} of 100000, checkpoint saved; "
        f"continue with: europa train --resume --run-dir {run_dir}"
    )
    saved = [step for step, _ in complete_checkpoints(run_dir)]
    assert saved[0] == 2 and saved[-1] == done  # the write in flight finished, then the last
    for step in saved:
        assert verify_checkpoint(run_dir, step, progress=False).problem is None
    # each periodic save's times are in the next step's record
    waited = [r["step"] - 1 for r in records(run_dir) if "checkpoint_wait_s" in r]
    assert waited == list(range(2, done, 2))

    launcher = start_training(env, "--resume", "--run-dir", str(run_dir), *many, *ASYNC, *SLOW)
    wait_for(lambda: len(records(run_dir)) > done and _writing(run_dir, 1), launcher)
    newest = complete_checkpoints(run_dir)[-1][0]
    (writing,) = [p.parent for p in _writing(run_dir, 1)]
    os.kill(read_progress(run_dir)[1]["pid"], signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + 9, err
    assert "worker rank 1 was killed by SIGKILL" in last_line(err)
    assert complete_checkpoints(run_dir)[-1][0] == newest  # the write in flight never completed
    assert writing.is_dir()
    # the killed run's losses past the newest checkpoint (up to the save it was killed in)
    before = {r["step"]: r["loss"] for r in records(run_dir) if r["step"] > newest}
    assert before

    launcher = start_training(env, "--resume", "--run-dir", str(run_dir), *many, *ASYNC)
    wait_for(lambda: len(records(run_dir)) > max(before), launcher)  # past the killed run
    ctrl_c(launcher)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    done = len(records(run_dir))
    assert [r["step"] for r in records(run_dir)] == list(range(1, done + 1))
    # resumed from a background save, the run goes on bit-exactly as the killed one went
    again = {r["step"]: r["loss"] for r in records(run_dir)}
    assert {step: again[step] for step in before} == before
    assert not writing.exists()  # cleared on resume
    assert complete_checkpoints(run_dir)[-1][0] == done


def _saved(run_dir, step: int, into) -> dict:
    """Every value of checkpoint ``step``, as one process reads it."""
    dcp_to_torch_save(step_dir(run_dir, step), into)
    return torch.load(into, weights_only=False)


@pytest.mark.distributed
def test_a_flexshard_background_save_holds_what_a_synchronous_one_does(tmp_path):
    steps = ["training.steps=4", "checkpoint.every=2", "checkpoint.keep=0", "parallel.ep=2"]
    runs = [Run(mode, [*steps, f'checkpoint.mode="{mode}"'], ["flexshard"]) for mode in MODES]
    run_ranks(train_runs, 2, str(tmp_path), runs)
    for step in (2, 4):
        sync = _saved(tmp_path / "sync", step, tmp_path / "sync.pt")
        background = _saved(tmp_path / "async", step, tmp_path / "async.pt")
        sync_values, sync_keys = tree_flatten_with_path(sync)
        background_values, background_keys = tree_flatten_with_path(background)
        assert sync_keys == background_keys
        for (path, value), (_, other) in zip(sync_values, background_values, strict=True):
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, keystr(path)
