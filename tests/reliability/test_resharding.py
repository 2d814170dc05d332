"""A checkpoint written by 2 ranks resumes on 1 and on 4 (DCP reshards it), under
FSDP2, FlexShard and DDP (fp32 replicas), with the weights it saved and the global batch
it trained with."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from europa.cli.app import run
from europa.core.checkpoint.global_batch import global_batch, suggested_settings
from europa.core.checkpoint.reader import (
    RestrictedFileSystemReader,
    WeightsOnlyLoadPlanner,
    read_metadata,
)
from europa.core.checkpoint.store import step_dir
from europa.core.config import load_config
from europa.core.launch.distributed import free_port
from tests.conftest import run_ranks
from tests.reliability.resume_runs import Resume, resume_runs
from tests.trainer_runs import Run, train_runs

SHAPE = ["training.seq_len=32", "training.steps=4", "checkpoint.every=2"]
# 8 sequences per step everywhere: 4 × 2 ranks when saved, then 4 × 2 micro-batches
# on 1 rank and 2 × 4 ranks.
SAVED = [
    Run("fsdp", [*SHAPE, "training.batch_size=4"]),
    Run("flexshard", [*SHAPE, "training.batch_size=4"], plugins=["flexshard"]),
    # DDP when saved; HSDP (2 replicas × 2 shards) on 4 ranks, plain on 1
    Run("ddp", [*SHAPE, "training.batch_size=4", "parallel.dp_replicate=2"]),
]
LAYOUTS = [run.name for run in SAVED]
ON_ONE = ["training.grad_accum_steps=2"]  # 4 × 2 micro-batches on 1 rank
ON_FOUR = ["training.batch_size=2"]  # 2 × 4 ranks


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("resharding")
    saved = run_ranks(train_runs, 2, str(root), SAVED, timeout=300)[0]
    on_four = [Resume(f"{run.name}-on-4", run.name, ON_FOUR) for run in SAVED]
    resumed = run_ranks(resume_runs, 4, str(root), on_four, timeout=300)[0]
    on_one = [
        Resume(f"{run.name}-on-1", run.name, [*ON_ONE, "parallel.dp_replicate=1"]) for run in SAVED
    ]
    resumed.update(_in_this_process(resume_runs, str(root), on_one))
    return root, saved, resumed


def _in_this_process(fn, *args):
    """``fn`` as the one rank of a gloo group in the test process (no process start)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        return fn(0, 1, *args)
    finally:
        dist.destroy_process_group()


def _saved_weights(checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors in full, read in one process."""
    entries = read_metadata(checkpoint).state_dict_metadata
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(
        state,
        storage_reader=RestrictedFileSystemReader(str(checkpoint)),
        planner=WeightsOnlyLoadPlanner(),
        no_dist=True,
    )
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 4])
def test_weights_after_resharding_equal_the_saved_ones(resharded, layout, world):
    root, _, resumed = resharded
    saved = _saved_weights(step_dir(root / layout, 2))
    restored = resumed[f"{layout}-on-{world}"]["weights"]
    assert restored.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 4])
def test_the_loss_curve_continues_on_another_world_size(resharded, layout, world):
    _, saved, resumed = resharded
    records = resumed[f"{layout}-on-{world}"]["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["tokens_seen"] for r in records] == [r["tokens_seen"] for r in saved[layout]]
    after = [r["loss"] for r in records[2:]]
    assert after == pytest.approx([r["loss"] for r in saved[layout][2:]], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_another_global_batch_is_refused_in_one_line(resharded, tmp_path, capsys):
    root, _, _ = resharded
    run_dir = tmp_path / "fsdp"
    shutil.copytree(root / "fsdp", run_dir)
    before = (run_dir / "config.toml").read_bytes()
    code = run(["train", "--resume", "--run-dir", str(run_dir), "--nproc", "1"])
    assert code == 2
    checkpoint = step_dir(run_dir, 4)
    assert capsys.readouterr().err.strip().splitlines() == [
        "europa: error: training.batch_size = 4: gives 4 sequences per step "
        "(× training.grad_accum_steps = 1 × 1 ranks), but checkpoint "
        f"{str(checkpoint)!r} was trained with 8 (4 × 1 × 2 ranks); expected the same "
        "global batch: --set training.grad_accum_steps=2"
    ]
    assert (run_dir / "config.toml").read_bytes() == before


@given(
    ranks_before=st.integers(1, 64),
    ranks_after=st.integers(1, 64),
    batch=st.integers(1, 16),
    accum=st.integers(1, 8),
    new_batch=st.integers(1, 16),
    new_accum=st.integers(1, 8),
)
def test_the_suggested_settings_keep_the_global_batch(
    ranks_before, ranks_after, batch, accum, new_batch, new_accum
):
    before = load_config(
        "tiny", [f"training.batch_size={batch}", f"training.grad_accum_steps={accum}"]
    )
    want = global_batch(before.training, ranks_before)["sequences"]
    after = load_config(
        "tiny", [f"training.batch_size={new_batch}", f"training.grad_accum_steps={new_accum}"]
    )
    settings = suggested_settings(want, after.training, ranks_after)
    if settings is None:
        assert want % ranks_after
        return
    fixed = load_config(
        "tiny",
        [f"training.batch_size={new_batch}", f"training.grad_accum_steps={new_accum}"]
        + [f"training.{key}={value}" for key, value in settings.items()],
    )
    assert global_batch(fixed.training, ranks_after)["sequences"] == want
