"""A fault-tolerant ``europa train`` (two replica groups of one rank, torchft, a Lighthouse
on loopback) stopped as a batch system stops it: a stop signal to the command it
started ends in one checkpoint that every group agreed on and exit 0; a SIGKILL leaves
no process of the run behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import EuropaProcess

STEPS = 40
EVERY_PROCESS = -1
FT = [
    "fault_tolerance.enabled=true",
    "parallel.dp_replicate=2",
    "fault_tolerance.check_every=10",
    "fault_tolerance.process_group_timeout_s=2",
    "fault_tolerance.step_timeout_s=5",
    "fault_tolerance.join_timeout_s=20",
    "fault_tolerance.quorum_timeout_s=60",
    f"training.steps={STEPS}",
    "training.batch_size=2",  # small steps: the test is about the processes, not the model
    "training.seq_len=32",
    "metrics.progress=false",
]


# Every step needs both groups: with min_replicas = 1 the group that starts first steps
# alone while the other imports torch, and at 0.05 s a step it can finish the run alone.
BOTH = ["--set", "fault_tolerance.min_replicas=2"]


def _train(run_dir: Path, err: Path, *extra: str) -> EuropaProcess:
    sets = [arg for key in FT for arg in ("--set", key)]
    return EuropaProcess(["train", "--nproc", "2", "--run-dir", str(run_dir), *sets, *extra],
                         stderr=err)  # fmt: skip


def _records(run_dir: Path, group: int) -> list[dict]:
    path = run_dir / f"replica-{group}" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _committed(run_dir: Path, group: int) -> int:
    return max((r["step"] for r in _records(run_dir, group) if r.get("committed")), default=0)


def _processes_of(run_dir: Path) -> set[int]:
    """Live processes whose command line names the run directory: the groups' launchers
    (``--run-dir RUN``) and their workers (``--run-dir RUN/replica-I``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # ended while we looked
            continue
        if state != "Z" and any(arg.startswith(bytes(run_dir)) for arg in argv):
            found.add(int(entry.name))
    return found


def _wait_for_both(run_dir: Path, launcher: EuropaProcess, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while min(_committed(run_dir, g) for g in (0, 1)) < step:
        assert launcher.poll() is None, launcher.stderr_path.read_text()
        assert time.monotonic() < deadline, f"the groups did not reach step {step}"
        time.sleep(0.05)


def _gone_within(run_dir: Path, seen: set[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (_processes_of(run_dir) | {p for p in seen if _alive(p)}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    left = _processes_of(run_dir) | {p for p in seen if _alive(p)}
    assert not left, f"processes of the run still there after {seconds} s: {sorted(left)}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_launcher(run_dir: Path, index: int) -> int:
    for pid in _processes_of(run_dir):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--replica-group" in argv and argv[argv.index(b"--replica-group") + 1] == b"%d" % index:
            return pid
    raise AssertionError(f"no launcher of group {index}")


def _stop(run_dir: Path, launcher: EuropaProcess, sig: signal.Signals, at: int,
          only_group: int | None = None) -> int:  # fmt: skip
    """Send ``sig`` to ``europa train`` (or to one group's launcher alone) once both groups
    have committed step ``at``; the step every group stopped after."""
    _wait_for_both(run_dir, launcher, at, timeout=120)
    seen = _processes_of(run_dir)
    assert len(seen) in (2, 4), seen  # a group's rank trains in its launcher or a worker
    if only_group == EVERY_PROCESS:  # as Slurm's scancel signals a job step's processes
        targets = [launcher.pid, *_processes_of(run_dir)]
    elif only_group is None:
        targets = [launcher.pid]
    else:
        targets = [_group_launcher(run_dir, only_group)]
    for target in targets:
        os.kill(target, sig)
    assert launcher.wait(60) == 0, launcher.stderr_path.read_text()
    _gone_within(run_dir, seen, 10)  # all of them had ended when the command did
    summaries = [
        json.loads((run_dir / f"replica-{g}" / "summary.json").read_text()) for g in (0, 1)
    ]
    by = [sig.name if only_group in (None, EVERY_PROCESS, g) else "a signal to another rank"
          for g in (0, 1)]  # fmt: skip
    assert [s["stopped_by"] for s in summaries] == by
    (stopped,) = {s["steps"] for s in summaries}  # one last committed step for both
    assert stopped >= at
    from europa.core.checkpoint.store import complete_checkpoints

    assert complete_checkpoints(run_dir)[-1][0] == stopped  # saved, once, by one group
    assert f"stopped by {by[0]} after step {stopped} of {STEPS}" in (
        launcher.stderr_path.read_text()
    )
    return stopped


@pytest.mark.distributed
def test_a_stop_signal_saves_the_step_every_group_agreed_on_and_resume_finishes(tmp_path):
    run_dir = tmp_path / "run"
    first = _train(run_dir, tmp_path / "first.err", *BOTH)
    try:
        stopped = _stop(run_dir, first, signal.SIGTERM, at=6)
        again = _train(run_dir, tmp_path / "again.err", "--resume")  # the run's config: BOTH
        stopped = _stop(run_dir, again, signal.SIGINT, at=stopped + 4)
        # a signal to one group alone (a batch system's to one job step): the other follows
        third = _train(run_dir, tmp_path / "third.err", "--resume")
        stopped = _stop(run_dir, third, signal.SIGUSR1, at=stopped + 4, only_group=1)
        # SIGTERM to every process of the run, workers too (--max-restarts spawns them), so
        # each group's launcher gets two: its own and the one europa train passes on
        fourth = _train(run_dir, tmp_path / "fourth.err", "--resume", "--max-restarts", "1")
        stopped = _stop(run_dir, fourth, signal.SIGTERM, at=stopped + 4, only_group=EVERY_PROCESS)
        last = _train(run_dir, tmp_path / "last.err", "--resume")
        assert last.wait(180) == 0, last.stderr_path.read_text()
    finally:
        for process in (first, *(locals().get(n) for n in ("again", "third", "fourth", "last"))):
            if process is not None and process.poll() is None:
                process.kill()
    ends = [_records(run_dir, g)[-1] for g in (0, 1)]
    assert [r["step"] for r in ends] == [STEPS, STEPS]
    assert ends[0]["state_digest"] == ends[1]["state_digest"]
    for group in (0, 1):  # every step once after the last resume: from the save, or healed
        resumed = [r for r in _records(run_dir, group) if r["committed"] and r["step"] > stopped]
        assert [r["step"] for r in resumed] == list(range(resumed[0]["step"], STEPS + 1))
        assert resumed[0]["step"] == stopped + 1 or "heal_s" in resumed[0], resumed[0]


@pytest.mark.distributed
def test_a_killed_europa_train_leaves_no_process_of_its_run(tmp_path):
    run_dir = tmp_path / "run"
    launcher = _train(run_dir, tmp_path / "err")
    try:
        _wait_for_both(run_dir, launcher, 3, timeout=120)
        seen = _processes_of(run_dir)
        assert len(seen) == 2, seen
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        _gone_within(run_dir, seen, 30)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _kill_group_1s_worker_once_both_reach(run_dir: Path, launcher: EuropaProcess,
                                          step: int) -> None:  # fmt: skip
    """SIGKILL to group 1's worker (spawned by --max-restarts) once both groups committed
    ``step``."""
    _wait_for_both(run_dir, launcher, step, timeout=120)
    (worker,) = [
        pid
        for pid in _processes_of(run_dir)
        if b"replica-1" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"europa.core.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    os.kill(worker, signal.SIGKILL)


@pytest.mark.distributed
def test_a_killed_group_restarts_heals_and_the_run_ends_whole(tmp_path):
    run_dir, steps = tmp_path / "run", 30
    # both groups in every step: alone, the other would finish the run's 30 short steps
    # while the killed group's worker restarts
    launcher = _train(run_dir, tmp_path / "err", "--max-restarts", "2", *BOTH,
                      "--set", f"training.steps={steps}")  # fmt: skip
    try:
        _kill_group_1s_worker_once_both_reach(run_dir, launcher, step=8)
        assert launcher.wait(180) == 0, launcher.stderr_path.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    ends = [_records(run_dir, g)[-1] for g in (0, 1)]
    assert [r["step"] for r in ends] == [steps, steps]
    assert ends[0]["state_digest"] == ends[1]["state_digest"]
    assert any("heal_s" in r for r in _records(run_dir, 1) if r["step"] > 8), "no heal"


@pytest.mark.distributed
def test_a_group_restarted_after_the_others_finished_leaves_their_run_as_it_is(tmp_path):
    """min_replicas = 1: while the killed group's worker restarts, the other trains the
    short run's last steps alone and leaves. The restarted group's first quorum heals it
    from no one; it reads the run's newest checkpoint then (the finished run), not the one
    of its restart, and trains nothing more: no step of it alone, no second final save."""
    run_dir, steps = tmp_path / "run", 30
    shorter = ["--set", f"training.steps={steps}", "--set", "checkpoint.every=5"]
    launcher = _train(run_dir, tmp_path / "err", "--max-restarts", "1", *shorter)
    try:
        _kill_group_1s_worker_once_both_reach(run_dir, launcher, step=8)
        assert launcher.wait(180) == 0, launcher.stderr_path.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    from europa.core.checkpoint.store import complete_checkpoints

    assert complete_checkpoints(run_dir)[-1][0] == steps
    summaries = [
        json.loads((run_dir / f"replica-{g}" / "summary.json").read_text()) for g in (0, 1)
    ]
    assert [s["steps"] for s in summaries] == [steps, steps]
    # the restarted group's records after its restart's checkpoint: healed from group 0,
    # or none (group 0 had finished); never steps trained alone from an older save
    restarted_at = summaries[1]["resumed_from"]
    after = [r for r in _records(run_dir, 1) if r["committed"] and r["step"] > restarted_at]
    assert not after or "heal_s" in after[0], after[0]
    if after:
        assert after[-1]["state_digest"] == _records(run_dir, 0)[-1]["state_digest"]
    else:
        assert "nothing is left to train" in launcher.stderr_path.read_text()


@pytest.mark.distributed
def test_a_worker_that_fails_under_fault_tolerance_ends_with_its_run(tmp_path, fault_plugin_dir):
    """A worker that raises leaves the torchft manager's threads running: unless it leaves
    its replica group, the process never exits, and its launcher neither restarts it nor
    fails. Both groups raise at step 3 in both starts (--max-restarts 1): the run fails."""
    from tests.reliability.conftest import europa_env

    run_dir = tmp_path / "run"
    sets = [arg for key in FT for arg in ("--set", key)]
    launcher = EuropaProcess(
        ["train", "-p", "faults", "--nproc", "2", "--max-restarts", "1", "--run-dir",
         str(run_dir), *sets, "--set", "faults.rank=0", "--set", "faults.raise_at_step=3"],
        europa_env(fault_plugin_dir), stderr=tmp_path / "err",
    )  # fmt: skip
    try:
        assert launcher.wait(90) == 1, launcher.stderr_path.read_text()
        _gone_within(run_dir, set(), 10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    err = launcher.stderr_path.read_text()
    assert err.count("RuntimeError: injected fault at step 3") == 4, err  # 2 groups, 2 starts
    assert "europa: error: replica group" in err.splitlines()[-1]
