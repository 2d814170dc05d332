"""Each pipeline rank's order of computations under the schedules europa runs ("1f1b",
"interleaved-1f1b", "zbv", "dualpipev"), and the stages each rank holds.

The trainer runs torch's schedules (``torch.distributed.pipelining``), which compute their
orders when constructed; the planner must not import torch, so the same orders are written
out here: forwards (``F``), whole backwards (``B``), and split backwards, the input's
gradient (``I``) then the weights' (``W``). Only computations are listed: torch's idle
slots and the communication it adds are not, and DualPipeV's paired chunk
(``OVERLAP_F_B``, a forward and another stage's backward) is its two parts in turn, each
marked ``paired``. tests/europa_plan/test_schedules.py holds them to torch's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
SHARE = {FORWARD: 1 / 3, BACKWARD: 2 / 3, INPUT_GRAD: 1 / 3, WEIGHT_GRAD: 1 / 3}
# The first stage's input is tokens, which take no gradient: its I computes nothing and its
# W the whole backward (torch runs the backward there when asked for the weights').
FIRST_STAGE_SHARE = {**SHARE, INPUT_GRAD: 0.0, WEIGHT_GRAD: SHARE[BACKWARD]}

SCHEDULE_NAMES = ("1f1b", "interleaved-1f1b", "zbv", "dualpipev")
# A run's pipeline_schedule (``europa.plan.record.SCHEDULES``) -> the order it runs.
# DeepSeek's bidirectional DualPipe has DualPipeV's bubble and placement (DualPipeV is its
# V-shaped half): its order stands in.
ORDER_OF = {
    "1f1b": "1f1b",
    "interleaved": "interleaved-1f1b",
    "zbv": "zbv",
    "dualpipev": "dualpipev",
    "dualpipe": "dualpipev",
}
V_SHAPED = ("zbv", "dualpipev")  # two stages a rank, r and 2P - 1 - r


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # FORWARD, BACKWARD, INPUT_GRAD or WEIGHT_GRAD
    micro: int
    paired: bool = False  # one of an OVERLAP_F_B's two parts (a forward, then a backward)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"

    @property
    def share(self) -> float:
        """This action's part of its stage's forward and backward of one micro-batch."""
        return (FIRST_STAGE_SHARE if self.stage == 0 else SHARE)[self.kind]


def stages_of_rank(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds, in the order it runs them: stage
    ``s`` on rank ``s mod P`` for the looped schedules, ``r`` and ``2P - 1 - r`` for the V
    schedules (the first and the last stage on rank 0)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def rank_orders(schedule: str, pp: int, per_rank: int, micro: int) -> dict[int, list[Action]]:
    """Each pipeline rank's actions in the order ``schedule`` runs them, over ``pp`` ranks
    of ``per_rank`` stages each and ``micro`` micro-batches. Raises ValueError where torch's
    schedule refuses the shape."""
    if schedule == "1f1b":
        return {r: one_f_one_b(r, pp, micro) for r in range(pp)}
    if schedule == "interleaved-1f1b":
        return {r: interleaved_1f1b(r, pp, per_rank, micro) for r in range(pp)}
    if schedule in V_SHAPED and per_rank != 2:
        raise ValueError(f"{schedule} runs 2 stages a rank, not {per_rank}")
    if schedule == "zbv":
        return {r: zbv(r, pp, micro) for r in range(pp)}
    if schedule == "dualpipev":
        if micro < 2 * pp:
            raise ValueError(f"dualpipev needs a micro-batch a stage ({2 * pp}), not {micro}")
        return {r: dualpipev(r, pp, micro) for r in range(pp)}
    raise ValueError(f"unknown pipeline schedule {schedule!r}: one of {SCHEDULE_NAMES}")


def one_f_one_b(stage: int, stages: int, micro: int) -> list[Action]:
    """Schedule1F1B's order on ``stage``: ``min(micro, stages - stage)`` forwards, then a
    backward and a forward in turn, then the backwards left."""
    warmup = min(micro, stages - stage)
    order = [Action(stage, FORWARD, m) for m in range(warmup)]
    forwards = warmup
    for m in range(micro):
        order.append(Action(stage, BACKWARD, m))
        if forwards < micro:
            order.append(Action(stage, FORWARD, forwards))
            forwards += 1
    return order


def interleaved_1f1b(rank: int, pp: int, per_rank: int, micro: int) -> list[Action]:
    """ScheduleInterleaved1F1B's order on ``rank`` (Megatron's interleaving, depth first).

    Micro-batches go in rounds of ``micro // max(1, micro // pp)``: a rank runs a round's
    forwards on its first stage, then on its next, and so on round after round; its
    backwards likewise from its last stage down. It starts with the forwards that fill the
    pipeline (all stages but its last for one round, plus two for each rank after it), then
    runs a forward and a backward in turn, then the backwards left."""
    rounds = max(1, micro // pp)
    if micro % rounds:
        raise ValueError(
            f"interleaved-1f1b needs micro-batches in whole rounds of {micro // rounds}"
            f" ({rounds} rounds), not {micro}"
        )
    per_round = micro // rounds
    total = per_rank * micro  # forwards on this rank, and backwards
    warmup = min((per_rank - 1) * per_round + 2 * (pp - 1 - rank), total)

    def forward_stage(k: int) -> int:  # of this rank's k-th forward
        return (k // per_round) % per_rank * pp + rank

    def backward_stage(k: int) -> int:
        return (per_rank - 1 - (k // per_round) % per_rank) * pp + rank

    counts: dict[tuple[int, str], int] = defaultdict(int)

    def next_action(stage: int, kind: str) -> Action:
        counts[stage, kind] += 1
        return Action(stage, kind, counts[stage, kind] - 1)

    order = [next_action(forward_stage(k), FORWARD) for k in range(warmup)]
    for k in range(warmup, total):
        order.append(next_action(forward_stage(k), FORWARD))
        order.append(next_action(backward_stage(k - warmup), BACKWARD))
    order.extend(next_action(backward_stage(k), BACKWARD) for k in range(total - warmup, total))
    return order


def zbv(rank: int, pp: int, micro: int) -> list[Action]:
    """ScheduleZBVZeroBubble's order on ``rank`` (zero bubble, V shape: Qi et al. 2024, s6).

    Rank r holds stage ``r`` (chunk 0) and ``2P - 1 - r`` (chunk 1). The order is built for
    at least ``2P - 1`` micro-batches, those past ``micro`` then dropped."""
    planned = max(2 * pp - 1, micro)
    first, second = rank, 2 * pp - 1 - rank
    order: list[Action] = []
    counts: dict[tuple[int, str], int] = defaultdict(int)

    def add(stage: int, *kinds: str) -> None:
        for kind in kinds:
            order.append(Action(stage, kind, counts[stage, kind]))
            counts[stage, kind] += 1

    # warm-up: chunk 0's forwards, then both chunks', then chunk 1's with its backwards
    for _ in range(2 * (pp - rank) - 1):
        add(first, FORWARD)
    for _ in range(rank):
        add(second, FORWARD)
        add(first, FORWARD)
    for _ in range(pp - rank):
        add(second, FORWARD, INPUT_GRAD, WEIGHT_GRAD)
    # steady: a forward and a whole split backward on each chunk in turn
    while counts[second, FORWARD] < counts[first, FORWARD] or counts[first, FORWARD] < planned:
        if counts[first, FORWARD] < planned:
            add(first, FORWARD)
        add(first, INPUT_GRAD, WEIGHT_GRAD)
        add(second, FORWARD, INPUT_GRAD, WEIGHT_GRAD)
    # cool-down: the input gradients left first, their weights' gradients after
    for _ in range(rank):
        add(first, INPUT_GRAD)
        add(second, INPUT_GRAD)
    for _ in range(pp - rank):
        add(first, INPUT_GRAD, WEIGHT_GRAD)
    while counts[second, WEIGHT_GRAD] < counts[second, INPUT_GRAD]:
        add(second, WEIGHT_GRAD)
    while counts[first, WEIGHT_GRAD] < counts[first, INPUT_GRAD]:
        add(first, WEIGHT_GRAD)
    return [a for a in order if a.micro < micro]


def dualpipev(rank: int, pp: int, micro: int) -> list[Action]:
    """ScheduleDualPipeV's order on ``rank`` (DeepSeek's DualPipe folded into a V).

    Rank r holds stage ``r`` (chunk 0) and ``2P - 1 - r`` (chunk 1). In the main phase a
    forward of one chunk is paired with a whole backward of the other. A weight gradient
    (``W``) always takes the oldest input gradient (``I``) still without one."""
    first, second = rank, 2 * pp - 1 - rank
    order: list[Action] = []
    forwards: dict[int, int] = defaultdict(int)
    backwards: dict[int, int] = defaultdict(int)  # B or I
    weights_due: list[tuple[int, int]] = []  # (stage, micro) of I without its W yet

    def forward(stage: int, paired: bool = False) -> None:
        order.append(Action(stage, FORWARD, forwards[stage], paired))
        forwards[stage] += 1

    def backward(stage: int, kind: str = BACKWARD, paired: bool = False) -> None:
        order.append(Action(stage, kind, backwards[stage], paired))
        if kind == INPUT_GRAD:
            weights_due.append((stage, backwards[stage]))
        backwards[stage] += 1

    def pair(forward_stage: int, backward_stage: int) -> None:
        forward(forward_stage, paired=True)
        backward(backward_stage, paired=True)

    def weight() -> None:
        if weights_due:
            stage, m = weights_due.pop(0)
            order.append(Action(stage, WEIGHT_GRAD, m))

    for _ in range(2 * (pp - rank - 1)):  # 1: chunk 0's forwards
        forward(first)
    for _ in range(rank + 1):  # 2: both chunks' forwards
        forward(first)
        forward(second)
    for _ in range(pp - rank - 1):  # 3: zero bubble on chunk 1
        backward(second, INPUT_GRAD)
        weight()
        forward(second)
    for i in range(micro - 2 * pp + rank + 1):  # 4: the main phase, paired chunks
        if i == 0 and rank == pp - 1:  # not paired, to shrink the bubble
            forward(first)
            backward(second)
        else:
            pair(first, second)
        pair(second, first)
    for _ in range(pp - rank - 1):  # 5: chunk 1's backward, then a pair
        backward(second)
        pair(second, first)
    # 6: the backwards left, the second half split (on odd ranks from chunk 1's, on even
    # ranks from chunk 0's) so that their weights' gradients fill the cool-down
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(second, INPUT_GRAD if split else BACKWARD)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(first, INPUT_GRAD if split else BACKWARD)
    for _ in range(pp - rank - 1):  # 7: chunk 0's last backwards
        weight()
        backward(first, INPUT_GRAD if split else BACKWARD)
    for _ in range(rank + 1):  # 8: the weights' gradients left
        weight()
    return order
