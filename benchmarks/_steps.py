"""A trainer's steps timed from outside: iteration wall times, a forward / backward /
optimizer split, and, from a torch.profiler window after the timed steps, the share of
each phase spent waiting on a collective (exposed communication).

The trainer is left as it is; the clock wraps three of its callables (the model's
forward through module hooks, the forward-backward method, the optimizer's ``step``)
and is told where each iteration starts. On CPU, gloo runs collectives on its own
threads: a collective is exposed while one is in flight and the trainer's thread runs
no operator.

On a GPU (``device="cuda"``) the clock waits for the device at each mark, so a phase is
the time its kernels took, not the time it took to queue them; the profiler records the
kernels too, and the operator table is sorted by their time. Where forward and backward
replay as a CUDA graph (torchtitan's default on a GPU), the model's hooks do not run: the
forward is counted in the backward, and the step time is unaffected."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PHASES = ("forward", "backward", "optimizer", "other")
Intervals = list[tuple[float, float]]


class StepClock:
    def __init__(self, warmup: int, timed: int, profiled: int, device: str = "cpu") -> None:
        self.warmup, self.timed, self.profiled = warmup, timed, profiled
        self.on_gpu = device == "cuda"
        self.starts: list[float] = []
        self.phase_s: list[dict[str, float]] = []
        self.profiler: torch.profiler.profile | None = None
        self.profile: Any = None
        self._forward_started = 0.0
        self._forward_mark: Any = None

    # -- what the trainer calls ---------------------------------------------------------

    def boundary(self) -> None:
        """An iteration starts here (or the last one has ended)."""
        index = len(self.starts)
        self.starts.append(self._now())
        self.phase_s.append(dict.fromkeys(PHASES[:3], 0.0))
        profile_from = self.warmup + self.timed
        if self.profiled and index == profile_from:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.on_gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif self.profiler is not None and index == profile_from + self.profiled:
            self.profiler.__exit__(None, None, None)
            self.profile, self.profiler = self.profiler, None

    def watch(self, model: torch.nn.Module, forward_backward: Callable, step: Callable):
        """Hooks on ``model``; returns ``forward_backward`` and ``step`` wrapped."""
        model.register_forward_pre_hook(self._forward_begins)
        model.register_forward_hook(self._forward_ends)
        return self._phase("fwd_bwd", forward_backward), self._phase("optimizer", step)

    def _forward_begins(self, *_: Any) -> None:
        self._forward_mark = torch.profiler.record_function("e2e.forward")
        self._forward_mark.__enter__()
        self._forward_started = self._now()

    def _forward_ends(self, *_: Any) -> None:
        if self.phase_s:  # a forward before the first step (none today) is not timed
            self.phase_s[-1]["forward"] += self._now() - self._forward_started
        self._forward_mark.__exit__(None, None, None)

    def _phase(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started = self._now()
            with torch.profiler.record_function(f"e2e.{name}"):
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self.phase_s:
                        key = "backward" if name == "fwd_bwd" else name  # less forward, later
                        self.phase_s[-1][key] += self._now() - started

        return wrapper

    def _now(self) -> float:
        # not while a CUDA graph is being captured (torchtitan's forward and backward can
        # be): a sync is refused there, and the hooks inside do not run when it replays
        if self.on_gpu and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return time.perf_counter()

    # -- what the benchmark reads -------------------------------------------------------

    def timed_steps(self) -> list[dict[str, float]]:
        """Per timed iteration: its wall time and its phases (summing to it)."""
        first = self.warmup
        steps = []
        for i in range(first, first + self.timed):
            wall = self.starts[i + 1] - self.starts[i]
            phases = dict(self.phase_s[i])
            phases["backward"] -= phases["forward"]  # fwd_bwd holds the forward
            phases["other"] = wall - sum(phases.values())
            steps.append({"step_s": wall, **phases})
        return steps

    def exposed_fractions(self) -> dict[str, float]:
        """Per phase, the fraction of its profiled time a collective was exposed."""
        if self.profile is None:
            return dict.fromkeys(PHASES, 0.0)
        events = self.profile.events()
        marks = {e.name: [] for e in events if e.name.startswith("e2e.")}
        for e in events:
            if e.name in marks:
                marks[e.name].append((e.time_range.start, e.time_range.end))
        main = {e.thread for e in events if e.name.startswith("e2e.")}
        busy = union([_span(e) for e in events if e.thread in main and _is_compute(e.name)])
        in_flight = union([_span(e) for e in events if e.name.startswith("gloo:")])
        exposed = difference(in_flight, busy)
        window = (min(s for s, _ in busy), max(e for _, e in busy)) if busy else (0.0, 0.0)
        forward = union(marks.get("e2e.forward", []))
        fwd_bwd = union(marks.get("e2e.fwd_bwd", []))
        optimizer = union(marks.get("e2e.optimizer", []))
        regions = {
            "forward": forward,
            "backward": difference(fwd_bwd, forward),
            "optimizer": optimizer,
            "other": difference([window], union(fwd_bwd + optimizer)),
        }
        return {
            name: (length(intersect(exposed, spans)) / length(spans) if length(spans) else 0.0)
            for name, spans in regions.items()
        }

    def operator_table(self, rows: int = 25) -> str:
        if self.profile is None:
            return ""
        key = "self_device_time_total" if self.on_gpu else "self_cpu_time_total"
        return self.profile.key_averages().table(sort_by=key, row_limit=rows)


def _span(event: Any) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def _is_compute(name: str) -> bool:
    return name.startswith("aten::") or name.startswith("fsdp::")


def summarise(clock: StepClock, tokens_per_step: int) -> dict[str, Any]:
    """tokens/s from the median timed step (robust to a neighbour's burst on a shared
    machine; the mean over the timed steps beside it), the median phase split, and the
    exposed communication of each phase (its profiled fraction times its median)."""
    steps = clock.timed_steps()
    total = sum(s["step_s"] for s in steps)
    median = statistics.median(s["step_s"] for s in steps)
    phases = {name: statistics.median(s[name] for s in steps) for name in PHASES}
    fractions = clock.exposed_fractions()
    exposed = {name: phases[name] * fractions[name] for name in PHASES}
    memory = {"peak_gpu_memory_bytes": torch.cuda.max_memory_allocated()} if clock.on_gpu else {}
    return {
        "tokens_per_s": tokens_per_step / median,
        "tokens_per_s_mean": tokens_per_step * len(steps) / total,
        "step_s": median,
        "step_s_all": [round(s["step_s"], 4) for s in steps],
        "phases_s": phases,
        "exposed_communication_s": sum(exposed.values()),
        "exposed_communication_by_phase_s": exposed,
        **memory,
    }


# -- interval arithmetic on sorted, disjoint (start, end) lists ------------------------------


def union(spans: Intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: Intervals, b: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: Intervals, b: Intervals) -> Intervals:
    out: Intervals = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def length(spans: Intervals) -> float:
    return sum(end - start for start, end in spans)
