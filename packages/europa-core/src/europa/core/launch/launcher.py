"""``europa train`` without the CLI: check everything that can be checked in one
process, prepare the run directory, then run here (one process, or one rank of
torchrun/SLURM) or start N local workers through torch's own launcher."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from europa.core.checkpoint.global_batch import check_global_batch
from europa.core.checkpoint.store import (
    check_compatible,
    checkpoint_to_resume,
    latest_checkpoint,
)
from europa.core.config import EuropaConfig
from europa.core.errors import (
    LaunchedRunError,
    LaunchError,
    RendezvousTimedOut,
    WorkerFailed,
    is_user_error,
)
from europa.core.job import Job
from europa.core.launch.casualty import WORKER_MODULE, describe_failure, next_step
from europa.core.launch.distributed import (
    ProcessPlace,
    check_node_layout,
    check_node_numbering,
    detect_launcher,
    free_port,
    mesh_shape,
    ranks_per_node,
)
from europa.core.launch.interrupt import ForwardedInterrupts
from europa.core.launch.lock import RunDirLock
from europa.core.launch.nodes import Nodes
from europa.core.launch.orphan import announce_launcher
from europa.core.launch.prepare import check_run_dir, prepare_run_dir
from europa.core.launch.resume import (
    RENDEZVOUS_BACKEND,
    RESUME_FROM,
    ResumeChoice,
    checkpoint_at_restart,
    is_restart,
    resumes,
)
from europa.core.launch.stores import address_toward, endpoint_address, is_loopback_endpoint
from europa.core.plan.context import sequence_groups
from europa.core.plugins.manager import EuropaPluginManager
from europa.core.run_dir import (
    CACHE,
    CONFIG_FILE,
    PROGRESS,
    SUMMARY_FILE,
    WORKER_ERRORS,
    default_run_dir,
    worker_error_file,
)
from europa.core.train.batches import build_batches
from europa.core.train.resources import check_fits

# How long a stop signal leaves workers to finish a step and checkpoint
# before the launcher kills them.
STOP_GRACE_SECONDS = 600


def preflight(
    config: EuropaConfig,
    plugins: EuropaPluginManager,
    world_size: int,
    resume_point: tuple[int, Path] | None = None,
    run_dir: Path | None = None,
    local_ranks: int | None = None,
    replicas: int = 1,
) -> None:
    """Fail in the launching process, with one line, on anything a worker would hit later.
    ``resume_point``: the checkpoint (step, path) a resumed run continues from.

    With ``run_dir``, also open the data as the workers will, preparing text into the run
    directory's cache (a directory holding only that cache still counts as new).
    ``local_ranks`` (default: all of them) is how many of the ranks share this machine.
    ``replicas``: the replica groups of a fault-tolerant run, each ``world_size`` ranks
    (``config`` is a group's)."""
    import torch

    _, replicas_here, shards, ep = mesh_shape(config.parallel, world_size)  # or one line
    if config.parallel.pp > 1:
        from europa.core.pipeline.runner import check_pipeline_plugins

        check_pipeline_plugins(config, plugins, data_ranks=replicas_here * shards * ep)
    per_node = local_ranks if local_ranks is not None else world_size
    job = Job(config=config, run_dir=Path("."), world_size=world_size, ranks_per_node=per_node)
    check_node_layout(config.parallel, world_size, job.node_size)
    model = plugins.hook.europa_build_model(job=job)
    on_cpu = config.parallel.device == "cpu" or (
        config.parallel.device == "auto" and not torch.cuda.is_available()
    )
    if on_cpu:  # local workers share this machine's memory; GPU ranks check their own
        check_fits(config, plugins, torch.device("cpu"), world_size, per_node, model=model,
                   ranks_per_node=job.node_size)  # fmt: skip
    if resume_point is not None:
        _, path = resume_point
        newest = latest_checkpoint(path.parents[1])  # RUN_DIR/checkpoints/step-N
        if newest is not None and newest[1] != path:
            print(
                f"europa: {newest[1].name} is damaged; resuming from {path.name}",
                file=sys.stderr,
            )
        check_compatible(path, model)
        groups = sequence_groups(config.parallel, world_size)
        check_global_batch(path, config.training, replicas * groups)
    elif config.model.init_from:
        from europa.core.hf.load import open_initialiser
        from europa.core.model import model_spec

        open_initialiser(model, model_spec(config.model), config.model)  # checks, reads headers
    # Last, because it writes: text is prepared here, once, into the run directory's cache.
    if run_dir is not None:
        build_batches(config, dp_rank=0, dp_world=world_size, run_dir=run_dir)


def train(
    config: EuropaConfig,
    plugins: EuropaPluginManager,
    *,
    run_dir: Path | None = None,
    resume: bool = False,
    nproc: int | None = None,
    from_older: bool = False,
    nodes: Nodes | None = None,
    replica_group: int | None = None,
) -> Path:
    """Run ``europa train``; returns the run directory. ``from_older``: on resume, fall
    back to the newest intact checkpoint when newer ones are damaged; ``replica_group``:
    with ``fault_tolerance.enabled``, train that group only (``europa.core.fault.launch``)."""
    launch = dict(run_dir=run_dir, resume=resume, nproc=nproc, from_older=from_older,
                  nodes=nodes)  # fmt: skip
    if config.fault_tolerance.enabled:
        return _train_fault_tolerant(config, plugins, replica_group, **launch)
    if replica_group is not None:
        raise LaunchError(
            f"--replica-group = {replica_group}: expected fault_tolerance.enabled = true"
        )
    return _train_one_job(config, plugins, **launch)


def _train_fault_tolerant(config, plugins, replica_group, *, run_dir, resume, nproc,
                          from_older, nodes) -> Path:  # fmt: skip
    """One replica group (``--replica-group``), or every group on this machine."""
    from europa.core.fault import launch as ft
    from europa.core.fault.state import group_config

    if replica_group is not None:
        return ft.train_group(config, plugins, replica_group, run_dir, _train_one_job,
                              resume=resume, nproc=nproc, from_older=from_older,
                              nodes=nodes)  # fmt: skip
    nodes = nodes or Nodes()
    place = launcher_place(nproc, nodes)
    if place is not None or nodes.several:
        raise LaunchError(
            "fault_tolerance.enabled: expected --replica-group I with each group's launch "
            "(torchrun, srun or --nnodes), or europa train alone on one machine"
        )
    replicas = ft.check_replicated(config)
    per_node = nproc if nproc is not None else config.parallel.nproc
    ft.check_local_ranks(config, per_node)  # before the run directory is made
    run_dir = run_dir or default_run_dir(config)
    with RunDirLock.hold(run_dir) as lock:  # for every group: the run directory is one run's
        with _undone_on_bad_input(run_dir, lock):
            point = check_run_dir(config, run_dir, resume=resume, from_older=from_older)
            preflight(group_config(config), plugins, max(1, per_node // replicas), point,
                      run_dir, replicas=replicas)  # fmt: skip
        prepare_run_dir(config, run_dir, resume=resume, checked=True)
        ft.train_groups_here(config, run_dir, resume=resume, nproc=per_node,
                             max_restarts=nodes.max_restarts)  # fmt: skip
    return run_dir


def _train_one_job(config, plugins, *, run_dir, resume, nproc, from_older, nodes,
                   replicas: int = 1) -> Path:  # fmt: skip
    """One job: this process, or this node's workers. ``replicas``: the groups of a
    fault-tolerant run, of which this job is one."""
    nodes = nodes or Nodes()
    nodes.check()
    place = launcher_place(nproc, nodes)
    if place is not None:
        _refuse_launch_options_under(place, nproc, nodes)
        return _run_as_rank(config, plugins, place, run_dir, resume, from_older)
    per_node = nproc if nproc is not None else config.parallel.nproc
    if per_node < 1:
        raise LaunchError(f"--nproc = {per_node}: expected an integer >= 1")
    if nodes.several and run_dir is None:
        raise LaunchError(
            f"--nnodes = {nodes.count}: expected --run-dir, a directory every node shares"
        )
    world = per_node * nodes.count
    run_dir = run_dir or default_run_dir(config)
    if not nodes.prepares_run_dir:  # node 0 holds the run directory; its workers wait for ours
        point = None
        if resume:
            point = checkpoint_to_resume(run_dir, config.training.steps, from_older=from_older)
        preflight(config, plugins, world, point, None, local_ranks=per_node, replicas=replicas)
        _train_here(config, plugins, run_dir, resume, point, from_older, per_node, world, nodes,
                    replicas)  # fmt: skip
        return run_dir
    # First, before anything is read or written there: no other training uses it.
    with RunDirLock.hold(run_dir) as lock:
        with _undone_on_bad_input(run_dir, lock):
            # before preflight writes its data cache there; the one choice of the checkpoint
            point = check_run_dir(config, run_dir, resume=resume, from_older=from_older)
            preflight(config, plugins, world, point, run_dir, local_ranks=per_node,
                      replicas=replicas)  # fmt: skip
        # a replica group's checkpoints are the run's, where the other groups may be saving
        prepare_run_dir(config, run_dir, resume=resume, checked=True, keep_partials=replicas > 1)
        _train_here(config, plugins, run_dir, resume, point, from_older, per_node, world, nodes,
                    replicas)  # fmt: skip
    return run_dir


def _train_here(config, plugins, run_dir, resume, point, from_older, per_node, world, nodes,
                replicas):  # fmt: skip
    """This process trains (one rank, no restarts), or starts this node's workers;
    ``point``: the checkpoint (step, path) this command chose to continue from; ``replicas``:
    the replica groups of a fault-tolerant run, of which this job is one."""
    chosen = None if point is None else point[1]
    if world == 1 and nodes.max_restarts == 0:
        from europa.core.train.loop import run_training

        place = ProcessPlace(0, 1, 0, "single")
        run_training(config, run_dir, place, plugins, resume_from=chosen, from_older=from_older)
    else:

        def at_restart() -> Path | None:
            steps = config.training.steps
            return checkpoint_at_restart(run_dir, steps, requested=resume, from_older=from_older,
                                         keep_partials=replicas > 1)  # fmt: skip

        choice = ResumeChoice(chosen, at_restart)
        try:
            launch_local_workers(per_node, run_dir, choice, nodes, from_older=from_older)
        except RendezvousTimedOut:
            if nodes.prepares_run_dir and not resume:  # nothing ran: the same command may retry
                (run_dir / CONFIG_FILE).unlink(missing_ok=True)
            raise


def launcher_place(
    nproc: int | None, nodes: Nodes, environ: dict[str, str] | None = None
) -> ProcessPlace | None:
    """The rank torchrun or SLURM gave this process, or None when this process launches
    workers itself: started alone, or under SLURM with launch options (one ``europa train``
    per node, through ``srun``, each starting its node's ``--nproc`` workers)."""
    env = dict(os.environ if environ is None else environ)
    asks_to_launch = nproc is not None or nodes != Nodes(rdzv_timeout=nodes.rdzv_timeout)
    if asks_to_launch and "RANK" not in env:
        return None
    return detect_launcher(env)


def _refuse_launch_options_under(place: ProcessPlace, nproc: int | None, nodes: Nodes) -> None:
    given = [f"--nproc = {nproc}"] if nproc is not None else []
    given += [f"--nnodes = {nodes.count}"] if nodes.count != 1 else []
    given += [f"--rdzv-endpoint = {nodes.endpoint!r}"] if nodes.endpoint else []
    given += [f"--max-restarts = {nodes.max_restarts}"] if nodes.max_restarts else []
    if given:
        raise LaunchError(
            f"{given[0]}: expected no launch options under {place.source}, which already "
            f"started {place.world_size} processes"
        )


@contextmanager
def _undone_on_bad_input(run_dir: Path, lock: RunDirLock) -> Iterator[None]:
    """Bad input leaves the run directory as it found it. The lock and preflight write only
    the lock file and the data cache: on a user error, remove the folders this command
    created (the run directory itself if it was new), else the lock file if it was new and
    the cache files it added. Anything else (an interrupt, a bug) keeps what was prepared,
    for the next attempt."""
    created = lock.created
    cache = run_dir / CACHE
    had_cache = cache.is_dir()
    before = set(cache.iterdir()) if had_cache else set()
    try:
        yield
    except Exception as err:
        if is_user_error(err):
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            else:
                if lock.new_file:
                    lock.path.unlink(missing_ok=True)  # still held until this command exits
                if cache.is_dir():
                    for path in set(cache.iterdir()) - before:
                        _remove(path)
                    if not had_cache:
                        cache.rmdir()
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _run_as_rank(config, plugins, place, run_dir, resume, from_older) -> Path:
    from europa.core.train.loop import run_training

    mesh_shape(config.parallel, place.world_size)
    per_node = ranks_per_node(config.parallel, place.world_size, place.local_world_size)
    check_node_layout(config.parallel, place.world_size, per_node)
    check_node_numbering(place, per_node)
    if run_dir is None:
        run_dir = default_run_dir(config)
    lock = RunDirLock.hold(run_dir) if place.rank == 0 else None  # rank 0 speaks for the job
    try:
        chosen = None  # rank 0 decides for its group; run_training shares its choice
        if place.rank == 0:
            restarted = is_restart()
            resume = resumes(run_dir, resume, restarted)
            if resume or not restarted:  # a fresh restart reuses its files
                point = check_run_dir(config, run_dir, resume=resume, from_older=from_older)
                prepare_run_dir(config, run_dir, resume=resume, checked=True)
                chosen = None if point is None else point[1]
        run_training(config, run_dir, place, plugins, resume_from=chosen, from_older=from_older)
    finally:
        if lock is not None:
            lock.release()
    return run_dir


def _threads_per_worker(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def launch_local_workers(
    nproc: int,
    run_dir: Path,
    choice: ResumeChoice,
    nodes: Nodes | None = None,
    *,
    from_older: bool = False,
) -> None:
    """N worker processes on this machine via torch.distributed's elastic launcher,
    joined with the other nodes' workers when ``nodes`` has several. ``choice``: the
    checkpoint each start of the workers continues from.

    A stop signal to this process (SIGTERM, SIGUSR1, Ctrl-C, ...) is passed on to the
    workers, which finish their step and checkpoint (see ``train.stop``); a second Ctrl-C
    kills them at once (see ``train.interrupt``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(_threads_per_worker(nproc)))
    # The elastic agent logs every worker exit at ERROR with a traceback; the
    # worker has already printed its one-line error, and we raise WorkerFailed.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    nodes = nodes or Nodes()
    endpoint = nodes.endpoint or f"127.0.0.1:{free_port()}"
    launch = LaunchConfig(
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        nproc_per_node=nproc,
        run_id=nodes.run_id(run_dir),
        rdzv_backend=RENDEZVOUS_BACKEND,
        rdzv_endpoint=endpoint,
        # the workers' store and MASTER_ADDR: loopback when the rendezvous is, else this
        # node's address toward it (torch's default is the host's name, which may not
        # resolve to an address the other nodes reach)
        local_addr=(
            "127.0.0.1"
            if is_loopback_endpoint(endpoint)
            else address_toward(*endpoint_address(endpoint))
        ),
        rdzv_configs=choice.rendezvous_configs(nodes.rdzv_configs()),
        max_restarts=nodes.max_restarts,
        monitor_interval=0.1,
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGINT, SIGTERM, SIGUSR1: ForwardedInterrupts
        shutdown_timeout=STOP_GRACE_SECONDS,
    )
    args = ["-m", WORKER_MODULE, "--run-dir", str(run_dir)]
    args += ["--resume-from-older"] if from_older else []
    # Reports from an earlier attempt in this run directory must not be taken for this one's.
    shutil.rmtree(run_dir / WORKER_ERRORS, ignore_errors=True)
    shutil.rmtree(run_dir / PROGRESS, ignore_errors=True)
    interrupts = ForwardedInterrupts(run_dir)
    announce_launcher()
    try:
        with interrupts:
            elastic_launch(launch, sys.executable)(*args)
    except KeyboardInterrupt:
        if not interrupts.forwarded:
            raise
        raise WorkerFailed(
            f"stopped at once by a second Ctrl-C (SIGINT); {next_step(run_dir)}", 130
        ) from None
    except RendezvousTimeoutError:
        raise RendezvousTimedOut(
            f"--rdzv-endpoint = {launch.rdzv_endpoint!r}: not every one of the {nodes.count} "
            f"nodes joined within {nodes.rdzv_timeout} s; expected `europa train` on each node "
            "with the same --nnodes, --rdzv-endpoint and --run-dir"
        ) from None
    except ChildFailedError as err:
        rank, _ = err.get_first_failure()
        report = worker_error_file(run_dir, rank)
        if report.is_file():  # a user-facing error, the same on every rank that hit it
            raise LaunchedRunError(report.read_text().strip()) from None
        exit_codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
        raise WorkerFailed(*describe_failure(run_dir, exit_codes)) from None
    except SignalException as err:
        if not _stopped_cleanly(run_dir):
            raise WorkerFailed(
                f"stopped by {err.sigval.name} before the workers saved a checkpoint "
                f"(run directory {str(run_dir)!r})",
                128 + int(err.sigval),
            ) from None
    finally:
        os.environ.pop(RESUME_FROM, None)  # the choice was for these workers only


def _stopped_cleanly(run_dir: Path) -> bool:
    summary = run_dir / SUMMARY_FILE
    return summary.is_file() and bool(json.loads(summary.read_text()).get("stopped_by"))
