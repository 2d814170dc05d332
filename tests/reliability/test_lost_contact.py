"""Under torchrun or SLURM there is no europa launcher watching the ranks: a rank whose
peer hangs (or dies on another node) learns of it only when a collective times out after
``parallel.collective_timeout_s``; it then exits in one line instead of waiting forever."""

from __future__ import annotations

import os
import socket
import time

import pytest

from tests.conftest import EuropaProcess

from .conftest import QUIET, europa_env, last_line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_whose_peer_hangs_exits_after_the_collective_timeout(tmp_path, fault_plugin_dir):
    run_dir, port = tmp_path / "run", _free_port()
    command = ["train", "-p", "faults", "--run-dir", str(run_dir), "--set", "faults.hang_at_step=2",
               "--set", "parallel.collective_timeout_s=8", *QUIET]  # fmt: skip
    ranks = []
    for rank in range(2):
        env = europa_env(fault_plugin_dir) | {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        # python -m europa.cli, forked from the fork server that has imported what it needs
        ranks.append(EuropaProcess(command, env, stderr=tmp_path / f"rank-{rank}.err"))
    survivor, hung = ranks
    try:
        _, err = survivor.communicate(timeout=120)
        waited = time.time() - (run_dir / "progress" / "rank-1.json").stat().st_mtime
        assert survivor.returncode == 1, err
        assert last_line(err).startswith(
            "europa: error: rank 0 lost contact with the other ranks at step 2 (Timed out "
            "waiting 8000ms"
        )
        assert last_line(err).endswith(
            f"another rank died or hung, see its output; continue with: europa train "
            f"--resume --run-dir {run_dir}"
        )
        assert "Traceback" not in err
        assert 8 <= waited < 60  # the timeout, and not much more
        assert hung.poll() is None  # stopped, not dead: only the timeout could tell
    finally:
        os.kill(hung.pid, 9)
        hung.communicate()
