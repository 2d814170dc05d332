"""Where a process stands: torchrun, SLURM or alone; and the mesh it builds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from europa.core.config import load_config
from europa.core.errors import LaunchError
from europa.core.launch.distributed import ProcessPlace, detect_launcher, mesh_shape


def test_a_lone_process_has_no_launcher():
    assert detect_launcher({}) is None
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert detect_launcher(env) == ProcessPlace(3, 4, 1, "torchrun")


def test_slurm_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
    }
    assert detect_launcher(env) == ProcessPlace(5, 8, 1, "slurm")


def test_slurm_without_a_rendezvous_address_is_refused():
    with pytest.raises(LaunchError) as err:
        detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "MASTER_PORT": "1"})
    assert str(err.value).startswith("MASTER_ADDR is not set under slurm: expected")


@pytest.mark.parametrize(
    ("overrides", "world", "shape"),
    [
        ([], 2, (1, 1, 2, 1)),
        (["parallel.dp_replicate=2"], 4, (1, 2, 2, 1)),
        (["parallel.ep=2"], 4, (1, 1, 2, 2)),
        (["parallel.dp_shard=3"], 3, (1, 1, 3, 1)),
        (["parallel.pp=2", "training.grad_accum_steps=2"], 2, (2, 1, 1, 1)),
    ],
)
def test_mesh_shape(overrides, world, shape):
    assert mesh_shape(load_config("tiny", overrides).parallel, world) == shape


def test_a_mesh_that_does_not_cover_the_ranks_is_refused():
    parallel = load_config("tiny", ["parallel.dp_shard=2", "parallel.dp_replicate=2"]).parallel
    with pytest.raises(LaunchError) as err:
        mesh_shape(parallel, 2)
    assert str(err.value) == (
        "parallel.dp_replicate × parallel.dp_shard × parallel.ep = 4: expected the 2 ranks"
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_under_torchrun_each_rank_trains_as_the_rank_it_was_given(tmp_path):
    run_dir = tmp_path / "torchrun"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "europa.cli", "train", "--run-dir", str(run_dir),
        "--set", "training.steps=3", "--set", "metrics.progress=false",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert "2 rank(s), mesh pp=1 × dp_replicate=1 × dp_shard=2 × ep=1" in done.stderr


SLURM_TASK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODEID": "1"}


def test_under_slurm_launch_options_make_this_process_the_nodes_launcher():
    from europa.core.launch.launcher import launcher_place
    from europa.core.launch.nodes import Nodes

    two_nodes = Nodes(2, 1, "node0:29500")
    assert launcher_place(None, two_nodes, SLURM_TASK) is None  # no MASTER_ADDR needed
    assert launcher_place(4, Nodes(), SLURM_TASK) is None
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set under slurm"):
        launcher_place(None, Nodes(), SLURM_TASK)  # srun europa train: one task per rank
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launcher_place(4, Nodes(), torchrun) == ProcessPlace(0, 2, 0, "torchrun")


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        (dict(count=2), "--nnodes = 2: expected --rdzv-endpoint HOST:PORT"),
        (dict(count=2, rank=2, endpoint="h:1"), "--node-rank = 2: expected 0 <= node rank"),
        (dict(count=2, endpoint="h"), "--rdzv-endpoint = 'h': expected HOST:PORT"),
        (dict(count=2, endpoint="h:70000"), "--rdzv-endpoint = 'h:70000': expected HOST:PORT"),
    ],
)
def test_inconsistent_node_options_are_one_line(nodes, message):
    from europa.core.launch.nodes import Nodes

    with pytest.raises(LaunchError) as err:
        Nodes(**nodes).check()
    assert str(err.value).startswith(message)


def _resume_from_the_older(rank: int, world: int, root: str) -> dict:
    from pathlib import Path

    from europa.core.checkpoint.store import step_dir
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session
    from europa.core.train.loop import run_training

    run_dir, place = Path(root), ProcessPlace(0, 1, 0, "torchrun")
    steps = ["training.steps=4", "checkpoint.every=2", "metrics.progress=false"]
    config, plugins = open_session("tiny", steps)
    prepare_run_dir(config, run_dir, resume=False)
    run_training(config, run_dir, place, plugins)  # saves steps 2 and 4
    config, plugins = open_session("tiny", steps)
    return run_training(config, run_dir, place, plugins, resume_from=step_dir(run_dir, 2))


@pytest.mark.distributed
def test_a_worker_loads_the_launchers_choice_even_when_a_newer_checkpoint_exists(tmp_path):
    from tests.conftest import run_ranks

    summary = run_ranks(_resume_from_the_older, 1, str(tmp_path))[0]
    assert (summary["resumed_from"], summary["steps"]) == (2, 4)


def test_each_start_of_the_workers_gets_the_launchers_choice_for_it(tmp_path, monkeypatch):
    """The first start takes the command's choice; each restart, the one decided then."""
    from pathlib import Path

    from europa.core.launch.resume import RESUME_FROM, ResumeChoice, resume_from_environment

    monkeypatch.delenv(RESUME_FROM, raising=False)
    later = iter([tmp_path / "step-00000004", None])
    choice = ResumeChoice(tmp_path / "step-00000002", lambda: next(later))
    seen = []
    for _ in range(3):
        choice.publish()
        seen.append(resume_from_environment())
    assert seen == [tmp_path / "step-00000002", tmp_path / "step-00000004", None]
    assert resume_from_environment({RESUME_FROM: ""}) is None
    assert isinstance(seen[0], Path)


def test_a_restart_continues_from_the_newest_checkpoint_or_starts_over(tmp_path):
    from europa.core.checkpoint.store import step_dir
    from europa.core.launch.resume import checkpoint_at_restart

    new_run = checkpoint_at_restart(tmp_path, 10, requested=False, from_older=False)
    assert new_run is None  # restarted before its first checkpoint: starts over
    for step in (2, 4):
        step_dir(tmp_path, step).mkdir(parents=True)
        (step_dir(tmp_path, step) / "europa-checkpoint.json").write_text("{}")
        (step_dir(tmp_path, step) / ".metadata").write_bytes(b"")  # unchecked: no record
    (tmp_path / "checkpoints" / ".step-00000006.partial").mkdir()  # the failed group's save
    chosen = checkpoint_at_restart(tmp_path, 10, requested=False, from_older=False)
    assert chosen == step_dir(tmp_path, 4)
    assert not (tmp_path / "checkpoints" / ".step-00000006.partial").exists()
