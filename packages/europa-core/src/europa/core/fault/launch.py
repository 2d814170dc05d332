"""``europa train`` with ``fault_tolerance.enabled``: the run's replica groups, each a job of
its own, and the Lighthouse that forms their quorums.

Design note. The run directory is one run's. It holds the resolved config, the data
cache and the checkpoints, and one folder per group (``replica-I``), which is that
group's run directory for everything a group writes alone: its config (without the
replicate axis), its metrics, its progress and its errors. The group's ``checkpoints``
and ``cache`` are links to the run's, so one group of each step's quorum writes each
checkpoint where every group resumes from after a full stop, and the text is prepared
once.

* ``europa train`` alone on one machine starts a Lighthouse on 127.0.0.1 (unless
  ``fault_tolerance.lighthouse`` names one) and the ``parallel.dp_replicate`` groups, each
  ``europa train --replica-group I`` with its share of ``--nproc`` and the same
  ``--max-restarts``, and holds the run directory's lock for all of them.
* ``europa train --replica-group I`` (one job step per group under Slurm, or one
  ``torchrun`` per group) trains group ``I`` in ``RUN_DIR/replica-I``; its workers learn
  their group from the environment (``REPLICA_GROUP_ENV``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from europa.core.errors import LaunchError, WorkerFailed
from europa.core.fault.state import ReplicaPlace, group_config
from europa.core.launch.orphan import LAUNCHER_PID, announce_launcher, exit_with_launcher
from europa.core.launch.signals import SignalScope
from europa.core.run_dir import CACHE, CONFIG_FILE

REPLICA_GROUP_ENV = "EUROPA_REPLICA_GROUP"  # "I/R": this process's group, of R
GROUP_DIR = "replica-{}"
CHECKPOINTS = "checkpoints"


def replica_from_environment(environ=None) -> ReplicaPlace | None:
    value = (os.environ if environ is None else environ).get(REPLICA_GROUP_ENV)
    if not value:
        return None
    index, count = value.split("/")
    return ReplicaPlace(int(index), int(count))


def check_replicated(config) -> int:
    """The number of replica groups, or a one-line error. Not a config rule: each group's
    own config has no replicate axis (``group_config``)."""
    replicas, least = config.parallel.dp_replicate, config.fault_tolerance.min_replicas
    if replicas < 2:
        raise LaunchError(
            f"parallel.dp_replicate = {replicas}: expected 2 or more replica groups with "
            "fault_tolerance.enabled"
        )
    if least > replicas:
        raise LaunchError(
            f"fault_tolerance.min_replicas = {least}: expected at most "
            f"parallel.dp_replicate ({replicas})"
        )
    return replicas


def group_run_dir(run_dir: Path, index: int) -> Path:
    """``RUN_DIR/replica-I``, its checkpoints and data cache linked to the run's."""
    group = run_dir / GROUP_DIR.format(index)
    group.mkdir(parents=True, exist_ok=True)
    for shared in (CHECKPOINTS, CACHE):
        (run_dir / shared).mkdir(exist_ok=True)
        link = group / shared
        if not link.is_symlink():
            with contextlib.suppress(FileExistsError):  # another node of the group made it
                link.symlink_to(Path("..") / shared, target_is_directory=True)
    return group


def train_group(config, plugins, index: int, run_dir: Path | None, train_one_job, **launch):
    """``europa train --replica-group I``: group ``index`` as a job of its own."""
    replicas = check_replicated(config)
    if not 0 <= index < replicas:
        raise LaunchError(
            f"--replica-group = {index}: expected 0 to {replicas - 1} "
            f"(parallel.dp_replicate = {replicas})"
        )
    if run_dir is None:
        raise LaunchError(
            f"--replica-group = {index}: expected --run-dir, the directory every group shares"
        )
    if not config.fault_tolerance.lighthouse:
        raise LaunchError(
            f"--replica-group = {index}: expected fault_tolerance.lighthouse, the address of "
            "the Lighthouse every group joins (europa lighthouse)"
        )
    check_reachable(config.fault_tolerance.lighthouse)
    if os.environ.get(LAUNCHER_PID):  # started by europa train for every group (here)
        exit_with_launcher()
    os.environ[REPLICA_GROUP_ENV] = f"{index}/{replicas}"  # for this group's workers
    return train_one_job(
        group_config(config), plugins, run_dir=group_run_dir(run_dir, index),
        replicas=replicas, **launch,
    )  # fmt: skip


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A one-line error, before anything is written, when no Lighthouse answers at
    ``address`` (``http://host:port``)."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(address)  # its form: the config's rules
    try:
        with socket.create_connection((where.hostname, where.port), timeout=timeout_s):
            pass
    except OSError as err:
        raise LaunchError(
            f"fault_tolerance.lighthouse = {address!r}: nothing answers there "
            f"({err.strerror or err}); expected a running Lighthouse (europa lighthouse)"
        ) from None


@contextmanager
def lighthouse(bind: str, min_replicas: int, ft) -> Iterator[str]:
    """A torchft Lighthouse listening on ``bind`` (host:port), timed by ``ft`` (the
    ``[fault_tolerance]`` table, or anything with its ``join_timeout_s``,
    ``heartbeat_timeout_s`` and ``quorum_tick_s``); yields its address."""
    from europa.core.fault import quiet_torchft

    quiet_torchft()
    from torchft._torchft import LighthouseServer

    host = bind.rsplit(":", 1)[0]
    server = LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=_ms(ft.join_timeout_s),
        quorum_tick_ms=_ms(ft.quorum_tick_s),
        heartbeat_timeout_ms=_ms(ft.heartbeat_timeout_s),
    )
    try:
        yield f"http://{host}:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def check_local_ranks(config, nproc: int) -> None:
    """The groups on this machine share its ``nproc`` ranks evenly."""
    replicas = config.parallel.dp_replicate
    if nproc % replicas:
        raise LaunchError(
            f"--nproc = {nproc}: expected a multiple of parallel.dp_replicate ({replicas}), "
            "the replica groups sharing this machine's ranks"
        )


def train_groups_here(config, run_dir: Path, *, resume: bool, nproc: int, max_restarts: int):
    """Every replica group on this machine, each ``europa train --replica-group I`` in a
    process of its own, beside a Lighthouse on loopback unless the config names one. The
    caller holds the run directory and has prepared it."""
    replicas = config.parallel.dp_replicate
    ft = config.fault_tolerance
    with _lighthouse_for(ft) as address:
        per_group = nproc // replicas
        commands = [
            _group_command(run_dir, i, per_group, max_restarts, address, resume)
            for i in range(replicas)
        ]
        # the groups share this machine's cores, as one job's local workers do
        threads = str(max(1, (os.cpu_count() or 1) // nproc))
        announce_launcher()  # each group's launcher ends with this one (orphan)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
        procs: list[subprocess.Popen] = []
        try:
            with GroupStops(procs):
                for command in commands:
                    # a session of its own: a terminal's Ctrl-C reaches it once, through here
                    procs.append(subprocess.Popen(command, env=env, start_new_session=True))
                failed = _wait_all(procs)
        finally:
            for proc in procs:  # none outlives this command, whatever ended it
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    if failed is not None:
        index, code = failed
        raise WorkerFailed(
            f"replica group {index} failed (exit code {code}); its messages are above and "
            f"in {run_dir / GROUP_DIR.format(index)}",
            code,
        )


@contextmanager
def _lighthouse_for(ft) -> Iterator[str]:
    if ft.lighthouse:
        yield ft.lighthouse
        return
    from europa.core.launch.distributed import free_port

    with lighthouse(f"127.0.0.1:{free_port()}", 1, ft) as address:
        yield address


def _group_command(run_dir: Path, index: int, nproc: int, max_restarts: int, address: str,
                   resume: bool) -> list[str]:  # fmt: skip
    command = [sys.executable, "-m", "europa.cli", "train", str(run_dir / CONFIG_FILE),
               "--run-dir", str(run_dir), "--replica-group", str(index), "--nproc", str(nproc),
               "--max-restarts", str(max_restarts),
               "--set", f'fault_tolerance.lighthouse="{address}"']  # fmt: skip
    return [*command, "--resume"] if resume else command


class GroupStops(SignalScope):
    """A stop signal to ``europa train`` goes to every replica group it started, as each
    group's launcher passes it to its workers: they agree on one last committed step
    (``train.stop``), one of them saves it, and every group exits 0."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)


def _wait_all(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait for every group; the first that failed (its index and exit code), if any.
    A group that fails leaves the others training: they need no one to finish."""
    failed = None
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for index, proc in enumerate(procs):
        if proc.returncode != 0 and failed is None:
            failed = (index, proc.returncode)
    return failed
