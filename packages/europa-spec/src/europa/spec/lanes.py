"""Two lanes of collectives on one rank, for a pipeline schedule that runs one
micro-batch's backward beside another's forward (DualPipeV's paired chunks) in two threads.

Design note. The ranks of a process group must issue its collectives in one order. Two
threads issuing on the same group race, and the order could differ from rank to rank (a
gather meeting an all-to-all: wrong data or a hang). So the thread running the backward
enters the *backward lane* (``backward_lane()``), where every collective goes over a
*twin* of its group: a second process group over the same ranks. Within each thread the
order is the schedule's, the same on every rank of the group, so every group and every
twin sees one order everywhere.

A technique whose collectives run inside a stage's forward or backward
* passes each group through ``lane_group`` at the call itself (an autograd function's
  backward runs in the backward thread with the group its forward saw), and
* makes its groups' twins once, on every rank together, with ``make_twins``, and says so
  in the run's ``job.state[TWINS_MADE]``.
A runner starts the second thread only where a technique said so; every group used in
the backward lane has a twin then (``lane_group`` refuses a group without one rather than
let the two threads race on it). Twins are kept by their ranks, so several runs in one
process (a benchmark's) share them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a group is made or looked up: a config reads this module
    import torch.distributed as dist

PAIRED_SCHEDULES = ("dualpipev",)  # schedules with paired forward-backward chunks
OVERLAP_F_B_MODES = ("auto", "on", "off")  # parallel.pp_overlap_f_b

_local = threading.local()
TWINS_MADE = "lanes_twins_made"  # job.state key: this run's collectives have twins

_twins: dict[tuple[int, ...], dist.ProcessGroup] = {}  # a group's ranks -> its twin


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def lanes_wanted(parallel) -> bool:
    """Whether ``parallel`` (a config's ``[parallel]``) runs paired chunks in two threads
    where it can; a technique then makes its groups' twins."""
    return (
        parallel.pp > 1
        and parallel.pp_schedule in PAIRED_SCHEDULES
        and parallel.pp_overlap_f_b != "off"
    )


def make_twins(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """A twin of each of ``groups`` (None: the world), made for the backward lane. A
    collective over the world: every rank calls it, each with its own groups."""
    import torch.distributed as dist

    mine = sorted({_ranks(group) for group in groups})
    every: list[list[tuple[int, ...]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    me = dist.get_rank()
    for ranks in sorted({tuple(r) for ranks_of_one in every for r in ranks_of_one or ()}):
        twin = dist.new_group(list(ranks))  # every rank, in one order
        if me in ranks:
            _twins[ranks] = twin


@contextmanager
def backward_lane() -> Iterator[None]:
    """This thread's collectives over the twins, while inside."""
    _local.backward = True
    try:
        yield
    finally:
        _local.backward = False


def in_backward_lane() -> bool:
    return getattr(_local, "backward", False)


def lane_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` in the forward lane; its twin in the backward lane."""
    if not in_backward_lane():
        return group
    ranks = _ranks(group)
    twin = _twins.get(ranks)
    if twin is None:
        raise RuntimeError(
            f"a collective over ranks {list(ranks)} in the backward lane: expected a twin "
            "of its group (europa.spec.lanes.make_twins) before a second thread runs"
        )
    return twin


__all__ = [
    "OVERLAP_F_B_MODES",
    "PAIRED_SCHEDULES",
    "TWINS_MADE",
    "backward_lane",
    "in_backward_lane",
    "lane_group",
    "lanes_wanted",
    "make_twins",
]
