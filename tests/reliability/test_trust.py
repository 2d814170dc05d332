"""A checkpoint someone else wrote is read, never run: its ``.metadata`` through a
restricted unpickler, its stored values with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from europa.cli.app import run
from europa.core.checkpoint import store as checkpoint
from europa.core.checkpoint.reader import read_metadata
from europa.core.config import load_config
from europa.core.errors import CheckpointError
from europa.core.launch.prepare import prepare_run_dir


class MakesADirectory:
    """Unpickling this calls ``os.mkdir(path)``: what a crafted checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _crafted_run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run directory whose one checkpoint's .metadata would make ``target``."""
    run_dir, target = tmp_path / "run", tmp_path / "written-by-the-checkpoint"
    prepare_run_dir(load_config("tiny"), run_dir, resume=False)
    step = checkpoint.step_dir(run_dir, 1)
    step.mkdir(parents=True)
    (step / checkpoint.MARKER).write_text('{"step": 1}\n')
    metadata = step / ".metadata"
    metadata.write_bytes(pickle.dumps(MakesADirectory(target)))
    return run_dir, metadata, target


def test_the_crafted_metadata_would_run_code_under_plain_pickle(tmp_path):
    _, metadata, target = _crafted_run(tmp_path)
    pickle.loads(metadata.read_bytes())  # what torch's FileSystemReader does
    assert target.is_dir()


def test_resume_refuses_crafted_metadata_in_one_line_and_runs_nothing(tmp_path, capsys):
    run_dir, metadata, target = _crafted_run(tmp_path)
    before = _snapshot(run_dir)
    code = run(["train", "--resume", "--run-dir", str(run_dir), "--set", "metrics.progress=false"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"europa: error: checkpoint metadata {str(metadata)!r} asks to load posix.mkdir, which "
        "is not checkpoint metadata; refused without running it (expected only "
        "torch.distributed.checkpoint's metadata classes)"
    ]
    assert not target.exists()
    assert _snapshot(run_dir) == before


def test_every_rank_refuses_crafted_metadata(tmp_path):
    # What each rank's Trainer.restore calls, under torchrun as under europa's launcher.
    _, metadata, target = _crafted_run(tmp_path)
    model = torch.nn.Linear(3, 2)
    state = checkpoint.TorchDistributedState(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError, match=re.escape("asks to load posix.mkdir")):
        checkpoint.load_checkpoint(metadata.parent, state, {"step": 0})
    assert not target.exists()


def _checkpoint_with_a_crafted_value(path: Path, target: Path) -> checkpoint.TorchDistributedState:
    model = torch.nn.Linear(3, 2)
    state = checkpoint.TorchDistributedState(model, torch.optim.AdamW(model.parameters()))
    dcp.save(
        {**state.state_dict(), "trainer": {"step": MakesADirectory(target)}},
        checkpoint_id=path,
        no_dist=True,
    )
    return state


def test_a_crafted_value_in_a_shard_file_is_refused(tmp_path):
    target = tmp_path / "written-by-the-checkpoint"
    state = _checkpoint_with_a_crafted_value(tmp_path / "ckpt", target)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load_checkpoint(tmp_path / "ckpt", state, {"step": 0})
    assert str(err.value).startswith(
        "checkpoint value 'trainer.step' is not plain data (Weights only load failed"
    )
    assert "\n" not in str(err.value)
    assert not target.exists()

    # torch's default planner unpickles stored values with weights_only=False:
    dcp.load({"trainer": {"step": 0}}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert target.is_dir()


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = checkpoint.TorchDistributedState(model, torch.optim.AdamW(model.parameters()))
    dcp.save(state.state_dict(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    metadata = read_metadata(tmp_path / "ckpt")
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=re.escape("names the shard file '../../etc/passwd'")):
        read_metadata(tmp_path / "ckpt")


@given(st.binary(max_size=300))
def test_any_metadata_bytes_load_or_fail_in_one_line(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("metadata")
    (folder / ".metadata").write_bytes(data)
    try:
        read_metadata(folder)
    except CheckpointError as err:
        assert "\n" not in str(err)
        assert str(folder / ".metadata") in str(err)
