"""Which checkpoint --resume takes when files are missing or truncated (no training:
checkpoint folders made by hand, with the marker a save writes)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from europa.core.checkpoint.store import MARKER, checkpoint_to_resume, damage, step_dir
from europa.core.errors import CheckpointError


def _checkpoint(run_dir, step, files):
    path = step_dir(run_dir, step)
    path.mkdir(parents=True)
    for name, size in files.items():
        (path / name).write_bytes(b"x" * size)
    (path / MARKER).write_text(json.dumps({"step": step, "files": files}))
    return path


FILES = {".metadata": 40, "__0_0.distcp": 300, "__1_0.distcp": 300}


def test_a_missing_metadata_file_is_damage(tmp_path):
    path = _checkpoint(tmp_path, 1, FILES)
    assert damage(path) is None
    (path / ".metadata").unlink()
    assert damage(path) == "its file .metadata is missing"


def test_a_garbled_marker_is_damage(tmp_path):
    path = _checkpoint(tmp_path, 1, FILES)
    (path / MARKER).write_bytes(b"\x00{")
    assert damage(path) == f"its marker file {MARKER} is unreadable"


def test_a_checkpoint_from_before_sizes_were_recorded_needs_its_metadata(tmp_path):
    path = step_dir(tmp_path, 1)
    path.mkdir(parents=True)
    (path / MARKER).write_text(json.dumps({"step": 1}))
    assert damage(path) == "its file .metadata is missing"
    (path / ".metadata").write_bytes(b"m")
    assert damage(path) is None


def test_without_an_intact_checkpoint_resume_is_refused_even_from_older(tmp_path):
    path = _checkpoint(tmp_path, 1, FILES)
    (path / "__1_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no older checkpoint is intact either"):
        checkpoint_to_resume(tmp_path, 10, from_older=True)


@given(
    damaged=st.lists(st.booleans(), min_size=1, max_size=5),
    from_older=st.booleans(),
)
def test_resume_takes_the_newest_checkpoint_or_the_newest_intact_one_when_asked(
    tmp_path_factory, damaged, from_older
):
    """Invariant: the newest intact checkpoint is taken when it is the newest, or when
    --resume-from-older allows; anything else is refused naming the newest."""
    run_dir = tmp_path_factory.mktemp("run")
    for step, broken in enumerate(damaged, start=1):
        path = _checkpoint(run_dir, step, FILES)
        if broken:
            (path / "__0_0.distcp").write_bytes(b"short")
    intact = [step for step, broken in enumerate(damaged, start=1) if not broken]
    if intact and (not damaged[-1] or from_older):
        assert checkpoint_to_resume(run_dir, 10, from_older=from_older)[0] == intact[-1]
    else:
        with pytest.raises(CheckpointError) as refused:
            checkpoint_to_resume(run_dir, 10, from_older=from_older)
        assert f"step-{len(damaged):08d}' is damaged (its file __0_0.distcp has 5 bytes" in str(
            refused.value
        )
