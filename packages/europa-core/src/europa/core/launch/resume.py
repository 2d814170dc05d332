"""Which checkpoint a started worker group continues from: the launcher decides it once
for each start of the group, and the workers load exactly that one.

The first start takes the choice ``europa train`` made before its pre-flight. A group
that torch's elastic agent restarts (``--max-restarts``) continues from the run's newest
intact checkpoint at the time of the restart, as ``--resume`` would (restarted before
the first checkpoint, the run starts over): the launcher decides it again right after
the group's rendezvous, when no worker of the failed group is running on any node. The
choice reaches the workers in ``EUROPA_RESUME_FROM``, which they inherit (empty: start
afresh). Under torchrun, where each rank is started by torch's launcher, rank 0 decides
for its group (``launcher._run_as_rank``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from europa.core.checkpoint.store import checkpoint_to_resume, clear_partials, latest_checkpoint
from europa.core.launch.distributed import restart_attempt

RESUME_FROM = "EUROPA_RESUME_FROM"
RENDEZVOUS_BACKEND = "europa-c10d"  # c10d's rendezvous, then the launcher's choice
_CHOICE = "europa_resume_choice"  # the rendezvous config key that carries it


def is_restart(environ: dict[str, str] | None = None) -> bool:
    """True in a worker the elastic agent started again after its group failed."""
    return restart_attempt(environ) > 0


def has_checkpoint(run_dir: Path) -> bool:
    return latest_checkpoint(run_dir) is not None


def resumes(run_dir: Path, requested: bool, restarted: bool) -> bool:
    """Resume when asked to, or when restarted with a checkpoint to continue from."""
    return requested or (restarted and has_checkpoint(run_dir))


def checkpoint_at_restart(
    run_dir: Path, total_steps: int, *, requested: bool, from_older: bool,
    keep_partials: bool = False,
) -> Path | None:  # fmt: skip
    """The checkpoint a restarted group continues from, or None to start afresh.
    ``keep_partials``: other jobs may be saving into the run's checkpoints now (the
    other replica groups, whose saves a failed group's leftovers must not cost)."""
    if not resumes(run_dir, requested, restarted=True):
        return None
    _, path = checkpoint_to_resume(run_dir, total_steps, from_older=from_older)
    if not keep_partials:
        clear_partials(run_dir)
    return path


def resume_from_environment(environ: dict[str, str] | None = None) -> Path | None:
    """In a worker: the launcher's choice for this start of its group."""
    value = (os.environ if environ is None else environ).get(RESUME_FROM, "")
    return Path(value) if value else None


class ResumeChoice:
    """The launcher's choice at each start of its worker group: ``first`` for the first
    start, ``at_restart()`` for every later one."""

    def __init__(self, first: Path | None, at_restart: Callable[[], Path | None]) -> None:
        self.first = first
        self.at_restart = at_restart
        self.starts = 0

    def publish(self) -> None:
        """Set the choice for the workers about to start (they inherit this environment)."""
        choice = self.first if self.starts == 0 else self.at_restart()
        self.starts += 1
        os.environ[RESUME_FROM] = "" if choice is None else str(choice)

    def rendezvous_configs(self, configs: dict[str, object]) -> dict[str, object]:
        """``configs`` for ``RENDEZVOUS_BACKEND``, carrying this choice to its handler."""
        return {**configs, _CHOICE: self}


class _ChoosingRendezvous(RendezvousHandler):
    """c10d's rendezvous handler; each completed rendezvous (a start of the worker group)
    publishes the launcher's choice before the agent starts the workers."""

    def __init__(self, inner: RendezvousHandler, choice: ResumeChoice) -> None:
        self._inner = inner
        self._choice = choice

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._choice.publish()
        return info

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _choosing_c10d(params: RendezvousParameters) -> RendezvousHandler:
    configs = dict(params.config)
    choice = configs.pop(_CHOICE)
    inner = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **configs,
    )
    from europa.core.launch.stores import bound_rendezvous

    return _ChoosingRendezvous(bound_rendezvous(inner), choice)


rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _choosing_c10d)
