"""Every checkpoint byte is checksummed as it is written and checked as it is read: a
single flipped bit anywhere in a shard file or in ``.metadata`` is refused naming the
file, and ``europa checkpoint verify`` finds it too (one process, no training)."""

from __future__ import annotations

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from europa.cli.app import run
from europa.core.checkpoint import store as checkpoint
from europa.core.checkpoint.checksums import ChecksummingWriter
from europa.core.checkpoint.marker import read_marker
from europa.core.checkpoint.verify import verify_checkpoint
from europa.core.errors import CheckpointError, DamagedCheckpoint


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def _saved(run_dir, step: int = 1):
    model, optimizer = _model_and_optimizer()
    state = checkpoint.TorchDistributedState(model, optimizer)
    return checkpoint.save_checkpoint(run_dir, step, state, {"step": step, "note": "x" * 40})


def _load(path):
    model, optimizer = _model_and_optimizer(seed=1)
    state = checkpoint.TorchDistributedState(model, optimizer)
    return checkpoint.load_checkpoint(path, state, {"step": 0, "note": ""}), model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return _saved(run_dir)


def test_the_marker_records_each_file_and_piece_as_written(saved):
    marker = read_marker(saved)
    on_disk = {p.name for p in saved.iterdir()} - {checkpoint.MARKER}
    assert set(marker.files) == on_disk
    for name, record in marker.files.items():
        content = (saved / name).read_bytes()
        assert record.bytes == len(content)
        assert record.crc32c == crc32c.crc32c(content)
        if name == ".metadata":
            continue
        pieces = sorted(marker.pieces[name], key=lambda p: p.offset)
        # the pieces tile the file: every byte in exactly one, each with its own checksum
        assert [p.offset for p in pieces] == [0, *(p.offset + p.length for p in pieces[:-1])]
        assert pieces[-1].offset + pieces[-1].length == len(content)
        for p in pieces:
            assert p.crc32c == crc32c.crc32c(content[p.offset : p.offset + p.length])


def test_an_intact_checkpoint_loads_and_verifies(saved):
    trainer, _ = _load(saved)
    assert trainer == {"step": 1, "note": "x" * 40}
    found = verify_checkpoint(saved.parent.parent, progress=False)
    assert found.problem is None and found.checksummed
    assert found.bytes == sum(r.bytes for r in read_marker(saved).files.values())


def _flip(file, bit: int) -> None:
    content = bytearray(file.read_bytes())
    content[bit // 8] ^= 1 << (bit % 8)
    file.write_bytes(bytes(content))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_one_flipped_bit_anywhere_is_refused_naming_its_file(tmp_path_factory, data):
    path = _saved(tmp_path_factory.mktemp("run"))
    names = sorted(p.name for p in path.iterdir() if p.name != checkpoint.MARKER)
    name = data.draw(st.sampled_from(names), label="file")
    # .metadata's size varies by a few bytes (it holds the save's id): draw a position
    where = data.draw(st.integers(0, 2**32 - 1), label="where")
    bit = where % ((path / name).stat().st_size * 8)
    _flip(path / name, bit)

    with pytest.raises(CheckpointError) as refused:
        _load(path)
    assert str(path / name) in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
    if name != ".metadata":  # .metadata is checked whole before DCP sees it
        assert isinstance(refused.value, DamagedCheckpoint)
    found = verify_checkpoint(path.parent.parent, progress=False)
    assert found.problem is not None and f"its file {name} " in found.problem


def test_verify_names_the_damaged_file_and_exits_1(tmp_path, capsys):
    path = _saved(tmp_path / "run", step=3)
    assert run(["checkpoint", "verify", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "checkpoint step 3 of" in capsys.readouterr().err
    _flip(path / "__0_0.distcp", 8 * 700 + 3)
    assert run(["checkpoint", "verify", str(tmp_path / "run"), "--step", "3"]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("europa:")]
    assert line.startswith(f"europa: checkpoint {str(path)!r} is damaged (its file __0_0.distcp")
    assert run(["checkpoint", "verify", str(tmp_path / "run"), "--step", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "europa: error: --step = 2: expected one of the saved steps (3)"
    )


def test_a_damaged_newest_checkpoint_is_skipped_when_asked(tmp_path):
    """What Trainer.restore does on a flipped bit found while loading: the newest is refused
    naming the file, or with --resume-from-older the next older intact one is taken."""
    older, newest = _saved(tmp_path, 2), _saved(tmp_path, 4)
    _flip(newest / "__0_0.distcp", 8 * 900)
    with pytest.raises(DamagedCheckpoint) as found:
        _load(newest)
    damaged = {newest: f"its file __0_0.distcp: {found.value.problem}"}
    with pytest.raises(CheckpointError, match="add --resume-from-older to continue from step-00"):
        checkpoint.checkpoint_to_resume(tmp_path, 10, damaged=damaged)
    assert checkpoint.checkpoint_to_resume(tmp_path, 10, from_older=True, damaged=damaged) == (
        2,
        older,
    )


def test_a_write_cap_holds_the_writer_to_its_rate(tmp_path):
    """max_bytes_per_s paces what the writer streams (the benchmark's slow file system)."""
    import time

    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(250_000)}  # 1 MB
    started = time.perf_counter()
    dcp.save(state, storage_writer=ChecksummingWriter(tmp_path, max_bytes_per_s=4e6), no_dist=True)
    assert time.perf_counter() - started >= 0.2  # 1 MB at 4 MB/s: a lower bound, not a timing
    loaded = {"w": torch.ones(250_000)}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(loaded["w"], state["w"])


def test_a_torch_reader_still_reads_a_checksummed_checkpoint(saved):
    """The checksums live in europa's marker: DCP's own reader reads the files as they are."""
    import torch.distributed.checkpoint as dcp

    model, _optimizer = _model_and_optimizer(seed=2)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(saved), no_dist=True)
    original, _ = _model_and_optimizer()
    for name, value in original.state_dict().items():
        assert torch.equal(state["model"][name], value)


@pytest.mark.distributed
def test_resume_refuses_a_flipped_bit_in_one_line_and_continues_from_older_when_asked(
    tmp_path, capfd
):
    """What a user sees: europa train --resume names the damaged file (exit 2, nothing
    trained); --resume-from-older continues from the checkpoint before it."""
    run_dir = tmp_path / "run"
    quiet = ["--set", "metrics.progress=false"]
    steps = ["--set", "training.steps=2", "--set", "checkpoint.every=1"]
    assert run(["train", "--nproc", "1", "--run-dir", str(run_dir), *quiet, *steps]) == 0
    newest = checkpoint.step_dir(run_dir, 2)
    shard = sorted(newest.glob("*.distcp"))[0]
    _flip(shard, 8 * (shard.stat().st_size // 2) + 5)
    capfd.readouterr()
    more = ["--nproc", "1", "--set", "training.steps=3"]
    assert run(["train", "--resume", "--run-dir", str(run_dir), *quiet, *more]) == 2
    (line,) = [x for x in capfd.readouterr().err.splitlines() if x.startswith("europa: error")]
    assert line.startswith(
        f"europa: error: --resume: checkpoint {str(newest)!r} is damaged (its file {shard.name}: "
    )
    assert line.endswith(
        "add --resume-from-older to continue from step-00000001, the newest intact one"
    )
    args = ["train", "--resume", "--resume-from-older", "--run-dir", str(run_dir), *quiet, *more]
    assert run(args) == 0
    assert "step-00000002 is damaged" in capfd.readouterr().err
    assert [s for s, _ in checkpoint.complete_checkpoints(run_dir)][-1] == 3
