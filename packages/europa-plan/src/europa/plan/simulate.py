"""A pipeline step played out from the schedule's own order: when each rank computes, when it
waits, and how many micro-batches' activations it holds.

Design note. Each rank runs its list of actions in order, as torch's schedule does: a
forward (``F``) of stage s for micro-batch m, its whole backward (``B``), or a backward
split in two, the input's gradient (``I``) and then the weights' (``W``). The lists are
torch's own, written out without torch in ``europa.plan.schedules`` (a test holds them to
torch's); europa-core's planner plays its pipelines out here too. An action starts when
its rank is free and what it needs has arrived: the previous stage's forward of the
micro-batch (one transfer later when that stage is on another rank), the next stage's
backward of it, and for ``W`` its own ``I``. Its duration is the stage's planned compute
for one micro-batch: a forward a third of it, a whole backward two thirds, each half of a
split backward a third. The first stage's input is tokens, which take no gradient: its
``I`` computes nothing and its ``W`` the whole backward (torch runs the backward there
when asked for the weights').

A micro-batch's activations are held from a stage's forward to the end of its backward
(``B``, or ``W``: the weights' gradient reads most of what the forward saved). A split
backward of recomputed blocks (europa's ``recompute_once``) also holds, from its ``I`` to
its ``W``, what it recomputed there, except on the first stage, whose recomputation runs
inside its ``W``.

Paired chunks (DualPipeV's ``OVERLAP_F_B``: a forward and another stage's backward) are
one action to torch: their outputs leave when both parts are done. They run in turn, as
torch runs them (the backward when the forward is done and its input has arrived), unless
``exchange_s`` says how much of a stage's time is its exposed expert exchange: then they
run side by side (as europa-core's trainer runs them: ``europa.core.pipeline.paired``),
both starting once both inputs have arrived. Each part is its compute ``c`` and its
exchange ``x`` in the same shares; one part's exchange travels while the other computes,
so the pair takes the longest of: both computes (one device), both exchanges (one link),
and each part alone, ``max(cF + cB, xF + xB, cF + xF, cB + xB)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from europa.plan.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action


@dataclass(frozen=True)
class Simulation:
    step_s: float  # from the first action to the last, over every rank
    busy_s: dict[int, float]  # per rank: its actions' time
    peak_held: dict[int, float]  # per rank: the most activation bytes it held at once
    finished_s: dict[int, float]  # per rank: when its last action ended

    def bubble(self, rank: int) -> float:
        """The share of the step ``rank`` waits."""
        return max(0.0, 1 - self.busy_s[rank] / self.step_s) if self.step_s else 0.0

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble(r) for r in self.busy_s) / len(self.busy_s)


def simulate(
    orders: Mapping[int, Sequence[Action]],
    compute_s: Callable[[int], float],
    transfer_s: Callable[[int, int], float],
    held_bytes: Callable[[int], float] = lambda stage: 0.0,
    exchange_s: Callable[[int], float] | None = None,
    recomputed_bytes: Callable[[int], float] = lambda stage: 0.0,
) -> Simulation:
    """Play the ranks' ``orders`` out. ``compute_s(stage)``: one micro-batch's forward and
    backward on that stage; ``transfer_s(from_stage, to_stage)``: a hidden state or its
    gradient between those stages (0 on one rank); ``held_bytes(stage)``: one
    micro-batch's saved activations there; ``exchange_s(stage)``: the exposed expert
    exchange within ``compute_s(stage)`` (None: paired chunks run in turn);
    ``recomputed_bytes(stage)``: what one micro-batch's ``I`` recomputes there and its
    ``W`` releases."""
    rank_of = {a.stage: r for r, order in orders.items() for a in order}
    last = max(rank_of)
    done: dict[tuple[int, str, int], float] = {}
    clock = {r: 0.0 for r in orders}
    busy = {r: 0.0 for r in orders}
    held = {r: 0.0 for r in orders}
    peak = {r: 0.0 for r in orders}
    position = {r: 0 for r in orders}
    remaining = sum(len(order) for order in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            while position[r] < len(order):
                action = order[position[r]]
                together = order[position[r] : position[r] + (2 if action.paired else 1)]
                readies = [_ready(a, done, last, transfer_s) for a in together]
                if None in readies:
                    break
                lengths = [compute_s(a.stage) * a.share for a in together]
                start = max(clock[r], readies[0])
                if len(together) == 1:
                    work, clock[r] = lengths[0], start + lengths[0]
                elif exchange_s is None:  # in turn: the backward once its input is there too
                    work = sum(lengths)  # a wait inside the pair is no work
                    clock[r] = max(start + lengths[0], readies[1]) + lengths[1]
                else:
                    work = _side_by_side(together, lengths, exchange_s)
                    clock[r] = max(start, readies[1]) + work
                busy[r] += work
                for a in together:
                    done[a.stage, a.kind, a.micro] = clock[r]
                    recomputed = recomputed_bytes(a.stage) if a.stage else 0.0
                    if a.kind == FORWARD:
                        held[r] += held_bytes(a.stage)
                        peak[r] = max(peak[r], held[r])
                    elif a.kind == INPUT_GRAD:
                        held[r] += recomputed
                        peak[r] = max(peak[r], held[r])
                    elif a.kind == BACKWARD:
                        held[r] -= held_bytes(a.stage)
                    elif a.kind == WEIGHT_GRAD:
                        held[r] -= held_bytes(a.stage) + recomputed
                position[r] += len(together)
                remaining -= len(together)
                progressed = True
        if not progressed:
            stuck = {r: str(o[position[r]]) for r, o in orders.items() if position[r] < len(o)}
            raise ValueError(f"pipeline order cannot proceed: ranks wait at {stuck}")
    return Simulation(max(clock.values()), busy, peak, dict(clock))


def _side_by_side(pair: Sequence[Action], lengths: Sequence[float], exchange_s) -> float:
    """A paired forward and backward run side by side (see the module's note)."""
    (first, second), (one, two) = pair, lengths
    x1 = min(exchange_s(first.stage) * first.share, one)
    x2 = min(exchange_s(second.stage) * second.share, two)
    c1, c2 = one - x1, two - x2
    return max(c1 + c2, x1 + x2, one, two)


def _ready(action: Action, done, last: int, transfer_s) -> float | None:
    """When what ``action`` needs has arrived (None: not yet computed)."""
    s, m = action.stage, action.micro
    needs: list[tuple[tuple[int, str, int], float]] = []
    if action.kind == FORWARD:
        if s > 0:
            needs.append(((s - 1, FORWARD, m), transfer_s(s - 1, s)))
    elif action.kind == WEIGHT_GRAD:
        needs.append(((s, INPUT_GRAD, m), 0.0))
    else:
        needs.append(((s, FORWARD, m), 0.0))
        if s < last:
            later = (s + 1, BACKWARD, m) if (s + 1, BACKWARD, m) in done else (s + 1, INPUT_GRAD, m)
            needs.append((later, transfer_s(s + 1, s)))
    times = []
    for key, delay in needs:
        if key not in done:
            return None
        times.append(done[key] + delay)
    return max(times, default=0.0)
