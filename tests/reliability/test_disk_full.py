"""The disk fills while a checkpoint is written: one line, the previous checkpoint intact,
no partial checkpoint left behind. The run directory is a small tmpfs."""

from __future__ import annotations

import subprocess

import pytest

from europa.core.checkpoint.store import complete_checkpoints, damage

from .conftest import QUIET, last_line, run_here


@pytest.fixture
def small_disk(tmp_path):
    """A 36 MiB tmpfs: room for the data cache and one 24 MB checkpoint of the tiny
    preset on 2 ranks, not for a second."""
    mount = tmp_path / "run"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=36m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {made.stderr}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_full_disk_during_a_save_fails_in_one_line_keeping_the_previous_checkpoint(
    small_disk, capfd
):
    run_dir = small_disk
    code, err = run_here(capfd, "train", "--nproc", "2", "--run-dir", str(run_dir),
                         "--set", "training.steps=3", "--set", "checkpoint.every=1",
                         *QUIET)  # fmt: skip
    assert code == 2, err
    assert last_line(err) == (
        "europa: error: checkpoint of step 2: the disk is full (No space left on device); "
        f"the earlier checkpoints are intact: free space under '{run_dir}/checkpoints', then "
        f"continue with: europa train --resume --run-dir {run_dir}"
    )
    assert "Traceback" not in err
    assert [step for step, _ in complete_checkpoints(run_dir)] == [1]
    assert damage(run_dir / "checkpoints" / "step-00000001") is None
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000001"]
    assert not (run_dir / "summary.json").exists()
