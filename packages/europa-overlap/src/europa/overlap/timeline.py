"""Where a step's time goes: compute, communication, and the communication compute waited for.

Design note. On gloo (and NCCL) a collective runs on a communication thread
(stream); the training thread either carries on computing or blocks until the
collective is done. So a rank's step is measured by three kinds of interval:

* **communication**: from the call that issues a collective to its completion
  (the work's future callback, which fires on the communication thread; for a
  synchronous call, when it returns). A work without a future ends at its
  first wait: on gloo (torch 2.13) the reduce-scatter's work has none
  (``getFuture`` is not implemented, ``is_completed()`` stays False), so its
  interval may look longer than the transfer was; the blocked time is exact;
* **blocked**: the training thread waiting for a collective: a synchronous
  call, ``work.wait()``, or ``wait_tensor`` of a functional collective;
* **compute**: the rest of the step on the training thread.

"Exposed communication" is the blocked time: communication no compute ran
beside. Communication covered by compute is the part of the communication
intervals outside the blocked ones.

With pipeline stages (``torch.distributed.pipelining``), each chunk a stage computes
(``PipelineStage.forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``) is a **stage span**: its stage, action (``F``, ``B``, or a
split backward's ``I`` and ``W``) and micro-batch. The step outside every span is the
rank's pipeline bubble; the blocked time inside a stage's spans is that stage's exposed
communication. DualPipeV's paired chunks may run side by side (``europa.core.pipeline.paired``):
a backward in a second thread beside the training thread's forward. A wait of one thread
is then hidden while the other computes, so a step's blocked time is the time the training
thread waits (blocked, or idle in a pair once its forward is done) while no other thread
computes.

How it hooks in: the ``torch.distributed`` entry points the layouts call
(FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``;
europa-flexshard and this package look them up at call time as well, and
europa-flexshard's point-to-point stand-ins for a gather or reduce-scatter on gloo,
``dist.isend`` / ``dist.irecv``, are filed by their buffers' tag) are
replaced by wrappers while a ``Timeline`` is installed; an asynchronous call
returns a ``Work`` subclass whose ``wait()`` is timed (FSDP2 tests
``isinstance(work, Work)``, so a subclass, not a proxy). Functional collectives
(``torch.distributed._functional_collectives``, whose backward kernels live in
C++) are seen by a dispatch mode held around the step that looks only at the
``_c10d_functional*`` namespaces; their completion is known only when
``wait_tensor`` returns, so their communication interval ends there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from europa.spec.tags import traffic_kind

# Collective entry points of torch.distributed -> the planner's kind of traffic (None: only
# a transfer tagged with the collective it stands for is recorded, as that kind).
ENTRY_POINTS = {
    "all_gather_single": "parameter_gather",
    "all_gather_into_tensor": "parameter_gather",
    "reduce_scatter_single": "gradient_reduce_scatter",
    "reduce_scatter_tensor": "gradient_reduce_scatter",
    "all_to_all_single": "expert_all_to_all",
    "all_reduce": "all_reduce",
    "isend": None,
    "irecv": None,
}
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
TIMELINE_DIR = "overlap"  # under a run directory
KINDS = ("parameter_gather", "gradient_reduce_scatter", "expert_all_to_all", "all_reduce")


FUNCTIONAL_KINDS = {
    "all_gather": "parameter_gather",
    "reduce_scatter": "gradient_reduce_scatter",
    "all_to_all": "expert_all_to_all",
}


def functional_kind(op_name: str) -> str:
    return next((k for part, k in FUNCTIONAL_KINDS.items() if part in op_name), "all_reduce")


@dataclass(frozen=True)
class Interval:
    kind: str
    start: float
    end: float


def union_seconds(intervals: list[Interval] | list[tuple[float, float]]) -> float:
    spans = sorted((i.start, i.end) if isinstance(i, Interval) else i for i in intervals)
    total, current_start, current_end = 0.0, None, None
    for start, end in spans:
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def subtract(spans: list[tuple[float, float]], holes: list[tuple[float, float]]):
    """``spans`` minus ``holes``, as sorted disjoint pieces."""
    out = []
    holes = sorted(holes)
    for start, end in sorted(spans):
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


@dataclass(frozen=True)
class StageSpan:
    """A pipeline stage's chunk: ``action`` (F, B, I or W) of micro-batch ``micro``."""

    stage: int
    action: str
    micro: int
    start: float
    end: float


@dataclass
class StepTimeline:
    """One rank's step: times in seconds from the step's start."""

    step: int
    rank: int
    duration: float
    comm: list[Interval] = field(default_factory=list)
    blocked: list[Interval] = field(default_factory=list)
    stages: list[StageSpan] = field(default_factory=list)

    def compute(self) -> list[Interval]:
        holes = [(b.start, b.end) for b in self.blocked]
        return [Interval("compute", s, e) for s, e in subtract([(0.0, self.duration)], holes)]

    def summary(self) -> dict[str, float]:
        exposed = union_seconds(self.blocked)
        comm = union_seconds(self.comm)
        out = {
            "step_s": self.duration,
            "compute_s": self.duration - exposed,
            "comm_s": comm,
            "exposed_comm_s": exposed,
            "hidden_comm_s": max(0.0, comm - exposed),
        }
        for kind in KINDS:
            mine = [i for i in self.comm if i.kind == kind]
            if mine:
                out[f"{kind}_s"] = union_seconds(mine)
                out[f"{kind}_exposed_s"] = union_seconds(
                    [i for i in self.blocked if i.kind == kind]
                )
        if self.stages:
            out.update(self._stage_summary())
        return out

    def _stage_summary(self) -> dict[str, float]:
        """The pipeline bubble (the step outside every stage span), and per stage its
        spans' time and the blocked time inside them."""
        spans = [(s.start, s.end) for s in self.stages]
        out = {"pipeline_bubble_s": self.duration - union_seconds(spans)}
        blocked = [(b.start, b.end) for b in self.blocked]
        for stage in sorted({s.stage for s in self.stages}):
            mine = [(s.start, s.end) for s in self.stages if s.stage == stage]
            inside = union_seconds(mine) - union_seconds(subtract(mine, blocked))
            out[f"stage{stage}_s"] = union_seconds(mine)
            out[f"stage{stage}_exposed_comm_s"] = inside
        return out

    def as_dict(self) -> dict[str, Any]:
        def rows(items):
            return [[i.kind, round(i.start, 6), round(i.end, 6)] for i in items]

        return {
            "step": self.step,
            "rank": self.rank,
            "duration": round(self.duration, 6),
            "compute": rows(self.compute()),
            "comm": rows(self.comm),
            "blocked": rows(self.blocked),
            "stages": [
                [s.stage, s.action, s.micro, round(s.start, 6), round(s.end, 6)]
                for s in self.stages
            ],
        }


class _TimedWork(dist.distributed_c10d.Work):
    """An asynchronous collective's work, its completion and waits recorded."""

    def __init__(self, inner: Any, record: _Record) -> None:
        super().__init__()
        self.inner, self.record = inner, record
        # A backend without futures: the first wait tells when it was done.
        with contextlib.suppress(RuntimeError, AttributeError):
            inner.get_future().then(lambda _: record.complete(time.perf_counter()))

    def wait(self, timeout: Any = None) -> bool:
        started = time.perf_counter()
        done = self.inner.wait() if timeout is None else self.inner.wait(timeout)
        self.record.waited(started, time.perf_counter())
        return done

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_success(self) -> bool:
        return self.inner.is_success()

    def get_future(self) -> Any:
        return self.inner.get_future()

    def exception(self) -> Any:
        return self.inner.exception()

    def source_rank(self) -> int:
        return self.inner.source_rank()

    def result(self) -> Any:
        return self.inner.result()


class _Record:
    """One collective's interval; closed at its completion or first wait, whichever is known."""

    def __init__(self, timeline: Timeline, kind: str, issued: float) -> None:
        self.timeline, self.kind, self.issued = timeline, kind, issued
        self.done: float | None = None
        self._lock = threading.Lock()

    def complete(self, at: float) -> None:
        with self._lock:
            if self.done is None:
                self.done = at
                self.timeline._add_comm(self.kind, self.issued, at)

    def waited(self, started: float, ended: float) -> None:
        self.timeline._add_blocked(self.kind, started, ended)
        self.complete(ended)


class _FunctionalCollectives(TorchDispatchMode):
    """Sees only functional collectives and their ``wait_tensor``; passes the rest on."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline
        self.pending: dict[int, tuple[str, float]] = {}
        self.last = "all_reduce"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in FUNCTIONAL_NAMESPACES:
            return func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        ended = time.perf_counter()
        if name == "wait_tensor":
            kind, issued = self.pending.pop(id(args[0]), (self.last, started))
            self.timeline._add_blocked(kind, started, ended)
            self.timeline._add_comm(kind, issued, ended)
        else:
            self.last = functional_kind(name)
            self.pending[id(out)] = (self.last, started)
        return out


# -- the patched entry points ------------------------------------------------------------

_ORIGINALS: dict[str, Callable] = {}
_ACTIVE: list[Timeline] = []  # the timeline with an open step in this process, if any
_NESTED = threading.local()  # an entry point calling another (a deprecated alias) counts once


def _wrap(name: str, original: Callable) -> Callable:
    kind = ENTRY_POINTS[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        timeline = _ACTIVE[-1] if _ACTIVE else None
        if timeline is None or getattr(_NESTED, "depth", 0) or not timeline._recording():
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        filed_as = _kind_of(kind, bound)
        if filed_as is None:
            return original(*args, **kwargs)
        asynchronous = bound.get("async_op", kind is None)  # isend and irecv always are
        _NESTED.depth = 1
        started = time.perf_counter()
        try:
            work = original(*args, **kwargs)
        finally:
            _NESTED.depth = 0
        record = _Record(timeline, filed_as, started)
        if asynchronous and work is not None:
            return _TimedWork(work, record)
        record.waited(started, time.perf_counter())
        return work

    return timed


def _kind_of(kind: str | None, bound: dict[str, Any]) -> str | None:
    """A transfer or an all-reduce of a buffer tagged with the collective it stands for
    (europa-flexshard's, on gloo) is filed as that collective; an untagged transfer
    (``kind`` None) is not filed."""
    if kind in (None, "all_reduce"):
        return traffic_kind(bound.get("tensor")) or kind
    return kind


def _install() -> None:
    if _ORIGINALS:
        return
    _install_stage_spans()
    for name in ENTRY_POINTS:
        original = getattr(dist.distributed_c10d, name, None)
        if original is None:
            continue
        _ORIGINALS[name] = original
        wrapped = _wrap(name, original)
        setattr(dist.distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)


# PipelineStage's compute methods -> the action their span records.
# (backward_one_chunk: "B" for a whole backward, "I" for a split one's input half)
STAGE_METHODS = {
    "forward_one_chunk": "F",
    "backward_one_chunk": "B",
    "backward_weight_one_chunk": "W",
}
_STAGE_ORIGINALS: dict[str, Callable] = {}


def _install_stage_spans() -> None:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    for name in STAGE_METHODS:
        original = getattr(_PipelineStageBase, name)
        _STAGE_ORIGINALS[name] = original
        setattr(_PipelineStageBase, name, _spanned(name, original))


def _spanned(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def spanned(stage, micro: int, *args, **kwargs):
        if not _ACTIVE:
            return original(stage, micro, *args, **kwargs)
        started = time.perf_counter()
        try:
            return original(stage, micro, *args, **kwargs)
        finally:
            ended = time.perf_counter()
            action = STAGE_METHODS[name]
            if action == "B" and not kwargs.get("full_backward", True):
                action = "I"
            for timeline in _ACTIVE:
                timeline._add_stage(StageSpan(stage.stage_index, action, micro, started, ended))

    return spanned


def _uninstall_stage_spans() -> None:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    for name, original in _STAGE_ORIGINALS.items():
        setattr(_PipelineStageBase, name, original)
    _STAGE_ORIGINALS.clear()


def _uninstall() -> None:
    _uninstall_stage_spans()
    for name, original in _ORIGINALS.items():
        setattr(dist.distributed_c10d, name, original)
        setattr(dist, name, original)
    _ORIGINALS.clear()


class Timeline:
    """Records each step's compute and communication on this rank.

    ``with timeline.step(i): ...`` around one training step; ``timeline.last``
    is then that step's ``StepTimeline``. Install it once (``install()``), before
    the model's first collective, and ``uninstall()`` when done."""

    def __init__(self, rank: int | None = None) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.last: StepTimeline | None = None
        self._lock = threading.Lock()
        self._open: tuple[int, float] | None = None
        self._comm: list[Interval] = []
        self._blocked: list[tuple[int, Interval]] = []  # (thread, interval)
        self._stages: list[tuple[int, StageSpan]] = []

    def install(self) -> Timeline:
        _install()
        return self

    def uninstall(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not _ACTIVE:
            _uninstall()

    def _recording(self) -> bool:
        return self._open is not None

    def _add_comm(self, kind: str, start: float, end: float) -> None:
        with self._lock:
            self._comm.append(Interval(kind, start, end))

    def _add_blocked(self, kind: str, start: float, end: float) -> None:
        with self._lock:
            self._blocked.append((threading.get_ident(), Interval(kind, start, end)))

    def _add_stage(self, span: StageSpan) -> None:
        with self._lock:
            self._stages.append((threading.get_ident(), span))

    def write(self, run_dir: Path | str) -> Path:
        """Append the last step's intervals to ``run_dir/overlap/timeline-rank<r>.jsonl``,
        which ``europa trace`` (``europa.overlap.trace``) draws."""
        folder = Path(run_dir) / TIMELINE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"timeline-rank{self.rank}.jsonl"
        with open(path, "a") as out:
            out.write(json.dumps(self.last.as_dict()) + "\n")
        return path

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        _install()
        self._comm, self._blocked, self._stages = [], [], []
        training = threading.get_ident()
        started = time.perf_counter()
        self._open = (index, started)
        _ACTIVE.append(self)
        try:
            with _FunctionalCollectives(self):
                yield
        finally:
            ended = time.perf_counter()
            _ACTIVE.remove(self)
            self._open = None
            with self._lock:  # a completion callback may still be arriving: clip it
                comm = [_relative(i, started, ended) for i in self._comm]
                blocked = [(t, _relative(i, started, ended)) for t, i in self._blocked]
                stages = [
                    (t, dataclasses.replace(s, start=s.start - started, end=s.end - started))
                    for t, s in self._stages
                ]
            blocked = _exposed(training, blocked, stages)
            stages = [span for _, span in stages]
            self.last = StepTimeline(index, self.rank, ended - started, comm, blocked, stages)


def _exposed(training: int, blocked, stages) -> list[Interval]:
    """The blocked intervals no thread computed beside (``(thread, interval)`` pairs in,
    see the design note): the training thread's waits outside the other threads'
    computing, and the other threads' waits where the training thread idles in their span."""
    side = [(s.start, s.end) for t, s in stages if t != training]
    if not side:
        return [i for _, i in blocked]
    mine = [(s.start, s.end) for t, s in stages if t == training]
    side_waits = [(i.start, i.end) for t, i in blocked if t != training]
    side_busy = subtract(side, side_waits)
    training_idle = subtract(side, mine)  # its forward done, joining the backward
    out = []
    for thread, interval in blocked:
        span = [(interval.start, interval.end)]
        if thread == training:
            pieces = subtract(span, side_busy)
        else:
            pieces = subtract(span, subtract(span, training_idle))  # span ∩ training_idle
        out += [Interval(interval.kind, start, end) for start, end in pieces]
    return out


def _relative(interval: Interval, origin: float, end: float) -> Interval:
    return Interval(
        interval.kind, max(0.0, interval.start - origin), min(end, interval.end) - origin
    )
