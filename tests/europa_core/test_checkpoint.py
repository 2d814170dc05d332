"""Checkpoints are found only when complete; the run directory is guarded."""

from __future__ import annotations

import pytest
import torch

from europa.core.checkpoint import store as checkpoint
from europa.core.config import load_config
from europa.core.errors import CheckpointError, ConfigError
from europa.core.launch.prepare import prepare_run_dir
from tests.conftest import run_ranks


def _fake_checkpoint(run_dir, step, complete=True):
    path = checkpoint.step_dir(run_dir, step)
    path.mkdir(parents=True)
    if complete:
        (path / checkpoint.MARKER).write_text("{}")
    return path


def test_only_complete_checkpoints_count(tmp_path):
    _fake_checkpoint(tmp_path, 5)
    _fake_checkpoint(tmp_path, 10, complete=False)  # died mid-save before the marker
    (tmp_path / "checkpoints" / ".step-00000015.partial").mkdir()
    assert checkpoint.latest_checkpoint(tmp_path) == (5, checkpoint.step_dir(tmp_path, 5))


def _save_twice_and_interrupt(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    for step in (1, 2, 3):
        state = checkpoint.TorchDistributedState(model, optimizer)
        checkpoint.save_checkpoint(tmp_path, step, state, {"step": step}, keep=2)
    return model, optimizer


def test_save_keeps_the_newest_and_round_trips(tmp_path):
    model, optimizer = _save_twice_and_interrupt(tmp_path)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [2, 3]
    assert not list((tmp_path / "checkpoints").glob(".*partial"))

    restored = torch.nn.Linear(3, 2)
    restored_opt = torch.optim.AdamW(restored.parameters())
    restored(torch.randn(4, 3)).sum().backward()
    restored_opt.step()
    state = checkpoint.load_checkpoint(
        checkpoint.step_dir(tmp_path, 3),
        checkpoint.TorchDistributedState(restored, restored_opt),
        {"step": 0},
    )
    assert state["step"] == 3
    for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    exp_avg = optimizer.state[model.weight]["exp_avg"]
    assert torch.equal(restored_opt.state[restored.weight]["exp_avg"], exp_avg)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
    _save_twice_and_interrupt(tmp_path)
    other = torch.nn.Linear(5, 2)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load_checkpoint(
            checkpoint.step_dir(tmp_path, 3),
            checkpoint.TorchDistributedState(other, torch.optim.AdamW(other.parameters())),
            {},
        )
    assert "\n" not in str(err.value)
    assert "does not match this model or optimizer (Size mismatch between saved" in str(err.value)


def test_a_used_run_directory_is_not_overwritten(tmp_path):
    config = load_config("tiny")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_run_dir(config, tmp_path, resume=False)
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        prepare_run_dir(load_config("tiny"), tmp_path, resume=True)


class _ManyTensors:
    """Many small tensors: a DCP plan large enough for gloo to copy it with an OpenMP team."""

    def __init__(self) -> None:
        self.tensors = {f"layer{i}.weight": torch.zeros(4) for i in range(1000)}

    def state_dict(self):
        return {"model": self.tensors}

    def load_state_dict(self, state):
        self.tensors = state["model"]


def _threads_around_save_and_load(rank: int, world: int, root: str) -> tuple[int, int]:
    """OS threads of this one-rank gloo process before and after a save and a load."""
    import os
    from pathlib import Path

    torch.set_num_threads(2)
    torch.ones(1 << 20).mul_(2)  # the main thread's OpenMP team exists before counting
    before = len(os.listdir("/proc/self/task"))
    state = _ManyTensors()
    path = checkpoint.save_checkpoint(Path(root), 1, state, {"step": 1})
    checkpoint.load_checkpoint(path, state, {"step": 0})
    return before, len(os.listdir("/proc/self/task"))


def test_a_one_rank_save_and_load_leave_no_openmp_team_on_gloos_thread(tmp_path):
    # Through the process group, DCP gathers its large plans on gloo's thread, whose copy
    # starts an OpenMP team there; libgomp then manages more threads than CPUs and stops
    # spinning between parallel regions: every later step of the run was about 20% slower.
    before, after = run_ranks(_threads_around_save_and_load, 1, str(tmp_path))[0]
    assert after == before


def test_a_load_reads_the_metadata_once(tmp_path, monkeypatch):
    """The check before DCP and DCP's own read share one read of ``.metadata``."""
    from pathlib import Path

    _save_twice_and_interrupt(tmp_path)
    reads = []
    read_bytes = Path.read_bytes

    def counted(path):
        reads.extend([path.name] if path.name == ".metadata" else [])
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", counted)
    restored = torch.nn.Linear(3, 2)
    state = checkpoint.TorchDistributedState(restored, torch.optim.AdamW(restored.parameters()))
    loaded = checkpoint.load_checkpoint(checkpoint.step_dir(tmp_path, 3), state, {"step": 0})
    assert loaded["step"] == 3
    assert reads == [".metadata"]
