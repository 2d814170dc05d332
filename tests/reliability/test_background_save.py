"""Background saves (``checkpoint.mode = "async"``) on one process: the state is copied
before training goes on, into the same host buffers every time; one save in flight."""

from __future__ import annotations

import pytest
import torch

from europa.core.checkpoint import store as checkpoint
from europa.core.checkpoint.background import BackgroundSaves
from europa.core.checkpoint.verify import verify_checkpoint

SLOW = 2e6  # bytes per second: each save below takes about half a second to write


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(300, 300)  # 360 KB of weights, 1.1 MB with AdamW's state
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    optimizer.step()
    return model, optimizer


def _weights_of(path) -> torch.Tensor:
    model, optimizer = _model_and_optimizer(seed=1)
    checkpoint.load_checkpoint(path, checkpoint.TorchDistributedState(model, optimizer), {})
    return model.weight.detach().clone()


def test_a_background_save_holds_the_state_of_its_step_while_training_changes_it(tmp_path):
    model, optimizer = _model_and_optimizer()
    state = checkpoint.TorchDistributedState(model, optimizer)
    saves = BackgroundSaves(torch.device("cpu"), max_bytes_per_s=SLOW)
    at_save = model.weight.detach().clone()

    saves.save(tmp_path, 1, state, {})
    assert saves.in_flight  # training goes on while it writes
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step changes the weights in place
    first = {key: t.data_ptr() for key, t in saves.staged["model"].items()}
    saves.save(tmp_path, 2, state, {})  # waits for the first: one save in flight
    assert checkpoint.latest_checkpoint(tmp_path)[0] == 1
    assert {key: t.data_ptr() for key, t in saves.staged["model"].items()} == first
    assert saves.staging_bytes >= sum(t.numel() * 4 for t in model.parameters()) * 3
    saves.wait()
    saves.close()

    assert torch.equal(_weights_of(checkpoint.step_dir(tmp_path, 1)), at_save)
    assert torch.equal(_weights_of(checkpoint.step_dir(tmp_path, 2)), at_save + 1.0)
    for step in (1, 2):
        assert verify_checkpoint(tmp_path, step, progress=False).problem is None


def test_a_failed_background_save_is_raised_where_training_next_waits(tmp_path):
    model, optimizer = _model_and_optimizer()
    state = checkpoint.TorchDistributedState(model, optimizer)
    saves = BackgroundSaves(torch.device("cpu"))
    (tmp_path / "checkpoints").write_text("a file where the folder goes")
    saves.save(tmp_path, 1, state, {})  # returns: the writer fails in the background
    with pytest.raises(NotADirectoryError):
        saves.wait()
    assert saves.wait() == 0.0  # raised once; nothing in flight after it
