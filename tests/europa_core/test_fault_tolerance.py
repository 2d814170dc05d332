"""Replica-level fault tolerance (``[fault_tolerance]``, torchft): replica groups on gloo
over loopback, one killed mid-run and restarted, healed from a peer without the disk."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import EuropaProcess, _context, _free_port, run_ranks

STEPS = 40
KILL_AT = 10


def _group_rank(index: int, count: int, rank: int, ranks: int, port: int, run_dir: str,
                overrides: list[str], plugins: list[str]) -> None:  # fmt: skip
    """One rank of replica group ``index``: what ``europa train --replica-group`` runs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(ranks))  # fmt: skip
    import torch

    torch.set_num_threads(1)
    from europa.core.fault.state import ReplicaPlace, group_config
    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    config, manager = open_session("tiny", overrides, plugins)
    group = group_config(config)
    if rank == 0:
        prepare_run_dir(group, Path(run_dir), resume=False)
    device, mesh = init_distributed(group.parallel, ProcessPlace(rank, ranks, rank, "torchrun"))
    torch.distributed.barrier()
    job = Job(config=group, run_dir=Path(run_dir), rank=rank, world_size=ranks,
              local_rank=rank, device=device, mesh=mesh)  # fmt: skip
    Trainer(job, manager, replica=ReplicaPlace(index, count)).run()
    torch.distributed.destroy_process_group()


def _digest_of_save(rank: int, world: int, run_dir: str, step: int, groups: int,
                    extra: list[str]) -> list[str]:  # fmt: skip
    """Resume a run of ``world`` rank(s) (a group's layout: ``extra``) from the
    fault-tolerant run's save of ``step`` (the same global batch: each group's sequences
    as micro-batches) and digest this rank's state."""
    from europa.core.session import open_session
    from tests.trainer_runs import rank_trainer

    micro = groups * _micro_batches(extra)
    overrides = ["training.batch_size=2", "training.seq_len=32", *_without_accum(extra),
                 f"training.grad_accum_steps={micro}", "metrics.progress=false"]  # fmt: skip
    config, plugins = open_session("tiny", overrides, [])
    save = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    trainer = rank_trainer(rank, world, config, plugins, Path(run_dir), save)
    assert trainer.restore() == step
    from europa.core.fault.state import state_digest

    return [state_digest(trainer.model, trainer.optimizer)]


def _micro_batches(extra: list[str]) -> int:
    found = [int(o.split("=")[1]) for o in extra if o.startswith("training.grad_accum_steps=")]
    return found[0] if found else 1


def _without_accum(extra: list[str]) -> list[str]:
    return [o for o in extra if not o.startswith("training.grad_accum_steps=")]


class Group:
    """The ranks of one replica group, each a process forked from the test's fork server."""

    def __init__(self, index, count, ranks, run_dir: Path, overrides, plugins=()) -> None:
        self.run_dir = run_dir
        port = _free_port()
        self.procs = [
            _context().Process(target=_group_rank, args=(index, count, r, ranks, port,
                                                         str(run_dir), overrides, list(plugins)))
            for r in range(ranks)
        ]  # fmt: skip
        for proc in self.procs:
            proc.start()

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def kill_one(self) -> None:
        os.kill(self.procs[-1].pid, signal.SIGKILL)

    def join(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        codes = [proc.exitcode for proc in self.procs]
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        return codes


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=20_000,
                              quorum_tick_ms=20, heartbeat_timeout_ms=1_000)  # fmt: skip
    port = server.address().rsplit(":", 1)[1]
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


def _ft_overrides(lighthouse: str, groups: int) -> list[str]:
    return [
        "fault_tolerance.enabled=true",
        f"parallel.dp_replicate={groups}",
        f'fault_tolerance.lighthouse="{lighthouse}"',
        "fault_tolerance.check_every=1",
        "fault_tolerance.process_group_timeout_s=2",  # a dead peer fails a step this soon
        "fault_tolerance.step_timeout_s=5",
        "fault_tolerance.join_timeout_s=20",
        "fault_tolerance.quorum_timeout_s=60",
        f"training.steps={STEPS}",
        "training.batch_size=2",  # small steps: the test is about the groups, not the model
        "training.seq_len=32",
        "metrics.progress=false",
    ]


def _wait_for_step(group: Group, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step and r.get("committed") for r in group.records()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{group.run_dir.name} did not reach step {step} within {timeout} s")


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("groups", "ranks", "plugins", "extra"),
    [
        (3, 1, [], []),
        # each group's 2 ranks cut its 4 sequences (cp): 2 × 32 tokens a rank, as the others
        (2, 2, ["flexshard"], ["parallel.ep=2", "parallel.cp=2", "training.batch_size=4"]),
        (2, 2, [], ["parallel.pp=2", "training.grad_accum_steps=2"]),
    ],
    ids=["core-3x1", "flexshard-ep2-cp2-2x2", "core-pp2-2x2"],
)
def test_a_killed_group_heals_from_a_peer_and_every_group_ends_with_the_same_state(
    tmp_path, lighthouse, groups, ranks, plugins, extra
):
    saves = ["checkpoint.every=5", "checkpoint.keep=0"]
    overrides = [*_ft_overrides(lighthouse, groups), *saves, *extra]
    started = [Group(i, groups, ranks, tmp_path / f"group{i}", overrides, plugins)
               for i in range(groups)]  # fmt: skip
    victim, others = started[1], [g for i, g in enumerate(started) if i != 1]
    _wait_for_step(victim, KILL_AT, timeout=120)
    victim.kill_one()  # its other ranks fail at their next collective inside the group
    assert victim.join(60)[-1] == -signal.SIGKILL
    _wait_for_step(others[0], KILL_AT + 5, timeout=120)  # the others step on without it
    again = Group(1, groups, ranks, tmp_path / "group1-restarted", overrides, plugins)
    for group in (*others, again):
        assert group.join(180) == [0] * ranks, group.run_dir.name

    survivors = [g.records() for g in others]
    healed = again.records()
    for records in survivors:
        committed = [r["step"] for r in records if r["committed"]]
        # every step once, in order; a group that started after the first quorum healed
        assert committed == list(range(committed[0], STEPS + 1))
        assert committed[0] == 1 or "heal_s" in records[0], records[0]
        retried = {r["step"] for r in records if not r["committed"]}
        assert len(retried) <= 1, retried  # at most the step in flight when the group died
    first = healed[0]
    assert "heal_s" in first and first["step"] > KILL_AT + 5, first  # healed, not from step 0
    assert [r["step"] for r in healed if r["committed"]] == list(range(first["step"], STEPS + 1))
    # from the first step after healing, every rank's state equals its peers' bit for bit
    digests = [{r["step"]: r["state_digest"] for r in rs if r["committed"]}
               for rs in (*survivors, healed)]  # fmt: skip
    for step in range(first["step"], STEPS + 1):
        assert all(d[step] == digests[0][step] for d in digests), step
        assert len(digests[0][step]) == ranks
    if plugins == []:  # a save written while the group was away holds the committed state
        away_steps = [r["step"] for r in survivors[0] if r["committed"] and r["replicas"] < groups]
        saved = next(step for step in away_steps if step % 5 == 0)
        writer = next(
            g for g in others if (g.run_dir / "checkpoints" / f"step-{saved:08d}").is_dir()
        )
        by_rank = run_ranks(_digest_of_save, ranks, str(writer.run_dir), saved, groups, extra)
        assert [d for rank in by_rank for d in rank] == digests[0][saved], saved
    # each step trained the sequences of the groups that took part (2 × 32 tokens a rank)
    for records in survivors:
        done = [r for r in records if r["committed"]]
        for before, after in itertools.pairwise(done):
            assert after["tokens_seen"] - before["tokens_seen"] == 64 * ranks * after["replicas"]
    assert healed[-1]["tokens_seen"] == survivors[0][-1]["tokens_seen"]
    # the others stepped on without it, and ended with every group again
    away = {r["replicas"] for r in survivors[0] if r["committed"] and r["step"] > KILL_AT + 1}
    assert groups - 1 in away and survivors[0][-1]["replicas"] == groups


@pytest.mark.distributed
@pytest.mark.slow
def test_europa_train_runs_every_group_beside_a_lighthouse_and_resumes_from_the_runs_saves(
    tmp_path,
):
    """The embedded default: ``europa train`` alone starts a Lighthouse on loopback and
    each group (``--replica-group I``); one group of each save's quorum writes it, into
    the run's checkpoints, and every group resumes from there after a full stop."""
    from europa.core.checkpoint.store import complete_checkpoints

    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), "--set", "metrics.progress=false"]
    first = ["train", "--nproc", "2", "--set", "fault_tolerance.enabled=true",
             "--set", "parallel.dp_replicate=2", "--set", "training.steps=4",
             "--set", "checkpoint.every=2", *common]  # fmt: skip
    launcher = EuropaProcess(first, stderr=tmp_path / "first.err")
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err
    assert [step for step, _ in complete_checkpoints(run_dir)] == [2, 4]
    for index in range(2):  # each group's own files, its checkpoints the run's
        group = run_dir / f"replica-{index}"
        records = [json.loads(line) for line in (group / "metrics.jsonl").read_text().splitlines()]
        # a group that starts after the other's first quorum heals from it
        assert [r["step"] for r in records] == list(range(records[0]["step"], 5))
        assert records[0]["step"] == 1 or "heal_s" in records[0]
        assert all(r["committed"] for r in records) and records[-1]["replicas"] == 2
        assert (group / "checkpoints").resolve() == (run_dir / "checkpoints").resolve()

    # europa report RUN_DIR draws every group: the groups in each quorum, and any heal
    from europa.report.charts import all_charts
    from europa.report.runs import load_runs

    charts = {chart.id: chart for chart in all_charts(load_runs([run_dir]))}
    drawn = [trace["name"] for trace in charts["replicas"].figure["data"]]
    assert drawn == ["run/replica-0", "run/replica-1"]

    resumed = EuropaProcess(["train", "--resume", "--set", "training.steps=6", *common],
                            stderr=tmp_path / "resumed.err")  # fmt: skip
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert [step for step, _ in complete_checkpoints(run_dir)] == [4, 6]  # keep = 2
    for index in range(2):
        group = run_dir / f"replica-{index}"
        resumed = [r for r in map(json.loads, (group / "metrics.jsonl").read_text().splitlines())
                   if r["step"] > 4]  # fmt: skip
        assert json.loads((group / "summary.json").read_text())["steps"] == 6
        if not resumed:  # started after the other had trained the 2 steps and saved them
            assert "nothing is left to train" in err
            continue
        # from the save of step 4 on disk, or healed from the group that read it
        assert [r["step"] for r in resumed] == list(range(resumed[0]["step"], 7))
        assert resumed[0]["step"] == 5 or "heal_s" in resumed[0], resumed[0]


def test_a_replica_group_outside_its_range_or_without_a_lighthouse_is_one_line(tmp_path):
    from europa.core.errors import LaunchError
    from europa.core.launch.launcher import train
    from europa.core.session import open_session

    config, plugins = open_session("tiny", ["fault_tolerance.enabled=true",
                                            "parallel.dp_replicate=2"], [])  # fmt: skip
    with pytest.raises(LaunchError, match=r"--replica-group = 2: expected 0 to 1"):
        train(config, plugins, run_dir=tmp_path, replica_group=2)
    with pytest.raises(LaunchError, match=r"expected fault_tolerance.lighthouse"):
        train(config, plugins, run_dir=tmp_path, replica_group=0)
    nowhere = f'fault_tolerance.lighthouse="http://127.0.0.1:{_free_port()}"'
    ft = ["fault_tolerance.enabled=true", "parallel.dp_replicate=2"]
    unreachable, plugins = open_session("tiny", [*ft, nowhere], [])
    with pytest.raises(LaunchError, match=r"nothing answers there .*expected a running Lighthouse"):
        train(unreachable, plugins, run_dir=tmp_path / "run", replica_group=0)
    assert not (tmp_path / "run").exists()  # nothing written
    alone, plugins = open_session("tiny", ["fault_tolerance.enabled=true"], [])
    with pytest.raises(LaunchError, match=r"parallel.dp_replicate = 1: expected 2 or more"):
        train(alone, plugins, run_dir=tmp_path, replica_group=0)
    plain, plugins = open_session("tiny", [], [])
    with pytest.raises(LaunchError, match=r"--replica-group = 0: expected fault_tolerance"):
        train(plain, plugins, run_dir=tmp_path, replica_group=0)


def test_the_timeouts_must_climb_the_ladder():
    from europa.core.errors import ConfigError
    from europa.core.session import open_session

    with pytest.raises(ConfigError, match=r"^fault_tolerance.join_timeout_s = 30.0: expected "
                       r"more than fault_tolerance.step_timeout_s \(60.0\)$"):  # fmt: skip
        open_session("tiny", ["fault_tolerance.enabled=true", "fault_tolerance.join_timeout_s=30"],
                     [])  # fmt: skip
