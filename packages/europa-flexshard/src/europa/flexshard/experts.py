"""Expert parallelism: routed experts stay whole and resident on their owners;
tokens travel to them and back.

Design note. The ``ep`` ranks of a group split each MoE layer's routed experts
by whole experts, following an ownership plan over that group (each layer's
experts as one stack, so an expert's three matrices stay together; uneven
counts are fine: 6 experts over 4 ranks is 2, 2, 1, 1). A rank keeps its
experts' weights for forward and backward; it never gathers another rank's.

Tokens move in two all-to-alls per layer. ``dispatch``: sort this rank's
(token, expert) pairs by expert; since each rank owns a contiguous run of
experts, that order is also by destination rank. The per-expert counts go
first (an all-to-all of integers), so every buffer is sized exactly; then the
tokens (an autograd all-to-all: its backward is the reverse exchange); the
received tokens, grouped by source, are regrouped by local expert for the
grouped GEMM. ``combine`` undoes both steps and sums each token's top-k
outputs, weighted by their routing scores, as torchtitan's local dispatcher
does. An expert that receives no token simply computes nothing.

Gradients. Every rank is a data-parallel rank (it reads its own sequences).
After backward, an expert's gradient on its owner already holds the
contributions of every token routed to it from its ep group (the backward
all-to-all brought them); the ranks holding the *same* experts in other
data-parallel positions (``copies``) sum theirs, and the mean over all
data-parallel ranks is taken, as for every other parameter. This runs as a
hook on each expert gradient, once per backward, so gradient accumulation
adds averaged micro-batches.

The dispatcher duck-types torchtitan's token dispatcher (``dispatch`` and
``combine`` on a module with ``token_dispatcher`` and ``inner_experts``), so
no torchtitan import is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

from europa.flexshard.errors import PlanError
from europa.flexshard.plan import ParameterSpec


@dataclass(frozen=True)
class ExpertParallel:
    """Where routed experts live. ``group``: the ranks that split them. ``copies``:
    the ranks holding the same experts at other data-parallel positions (None:
    no copies). ``data_parallel_size``: the ranks whose mean gradient is taken
    (default: the whole world)."""

    group: dist.ProcessGroup | None = None
    copies: dist.ProcessGroup | None = None
    data_parallel_size: int | None = None


def routed_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules routing tokens to stacked experts: a ``token_dispatcher`` with
    ``dispatch``/``combine`` and ``inner_experts`` whose 3-D parameters are the experts."""
    found = []
    for name, module in model.named_modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if hasattr(dispatcher, "dispatch") and isinstance(
            getattr(module, "inner_experts", None), nn.Module
        ):
            found.append((name, module))
    return found


@dataclass(frozen=True)
class _Exchange:
    """What ``combine`` needs from ``dispatch``."""

    token_indices: torch.Tensor  # (N,) source token of each expert-sorted pair
    scores: torch.Tensor  # (N,) its routing score
    sent: list[int]  # pairs sent to each rank
    received: list[int]  # pairs received from each rank
    regroup: torch.Tensor  # received (by source) -> by local expert


class AllToAllDispatcher:
    """torchtitan's dispatcher interface, over an expert-parallel group.

    ``ranges[r]`` is the (start, stop) of the experts rank r owns (contiguous
    runs in rank order)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        ranges: Sequence[tuple[int, int]],
        top_k: int,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = rank
        self.ranges = list(ranges)
        self.top_k = top_k
        self.experts_per_rank = [stop - start for start, stop in self.ranges]

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, _Exchange]:
        order = torch.argsort(topk_expert_ids_TK.reshape(-1), stable=True)
        scores = topk_scores_TK.reshape(-1)[order]
        token_indices = order // self.top_k
        pairs = x_TD[token_indices]

        counts = num_local_tokens_per_expert_E.to(torch.int64)
        mine = self.experts_per_rank[self.rank]
        received_counts = all_to_all_single(
            counts, [mine] * len(self.ranges), self.experts_per_rank, self.group
        )
        received_counts = received_counts.view(len(self.ranges), mine)
        # Split sizes are host integers: read each count tensor once (one sync on a GPU).
        per_expert = counts.tolist()
        by_source = received_counts.tolist()
        sent = [sum(per_expert[start:stop]) for start, stop in self.ranges]
        received = [sum(row) for row in by_source]
        arrived = all_to_all_single_autograd(pairs, received, sent, self.group)
        regroup = _by_local_expert(by_source, x_TD.device)
        exchange = _Exchange(token_indices, scores, sent, received, regroup)
        return arrived[regroup], received_counts.sum(dim=0), exchange

    def combine(
        self, routed_output_RD: torch.Tensor, metadata: _Exchange, x_TD: torch.Tensor
    ) -> torch.Tensor:
        by_source = routed_output_RD[torch.argsort(metadata.regroup)]
        back = all_to_all_single_autograd(by_source, metadata.sent, metadata.received, self.group)
        weighted = (back.float() * metadata.scores.reshape(-1, 1)).to(back.dtype)
        return torch.zeros_like(x_TD).index_add(0, metadata.token_indices, weighted)

    def wire_meshes(self, **_: Any) -> None:  # torchtitan's interface; the group is ours
        return None


def _by_local_expert(counts: list[list[int]], device: torch.device) -> torch.Tensor:
    """Indices that reorder pairs received source by source (``counts[source][expert]``,
    each source's pairs sorted by expert) into local-expert order, sources in order
    within an expert."""
    starts, offset = [], 0
    for row in counts:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    experts = len(counts[0]) if counts else 0
    pieces = [
        torch.arange(starts[source][expert], starts[source][expert] + counts[source][expert])
        for expert in range(experts)
        for source in range(len(counts))
    ]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return order.to(device)


def expert_stack(module_name: str, shapes: Sequence[Sequence[int]], itemsize: int) -> ParameterSpec:
    """A routed-expert module's ``[E, rows, cols]`` parameters as one stack to plan:
    E matrices, each holding one expert's matrices together, so they share an owner."""
    counts = {shape[0] for shape in shapes}
    if len(counts) != 1:
        raise PlanError(f"{module_name}: its expert stacks disagree on the expert count")
    (experts,) = counts
    per_expert = sum(math.prod(shape[1:]) for shape in shapes)
    return ParameterSpec(
        module_name, (experts, 1, per_expert), itemsize, module_name, orthogonalised=False
    )


def check_expert_split(name: str, num_experts: int, ranks: int) -> None:
    if ranks > num_experts:
        raise PlanError(
            f"expert-parallel group of {ranks} ranks for {name} with {num_experts} experts: "
            "expected at most one rank per expert"
        )


def all_to_all_bytes_per_rank(
    *,
    tokens: int,
    top_k: int,
    dim: int,
    itemsize: int,
    num_experts: int,
    moe_layers: int,
    forward_passes: int = 1,
) -> int:
    """Mean payload one rank hands to the expert all-to-alls per micro-batch.

    Per MoE layer and forward: the per-expert counts (int64), the dispatch of
    ``tokens × top_k`` rows of ``dim``, and the combine of as many rows on average;
    the backward repeats the two row exchanges. ``forward_passes`` is 2 when
    activation checkpointing recomputes the forward."""
    rows = tokens * top_k * dim * itemsize
    per_forward = 8 * num_experts + 2 * rows
    return moe_layers * (forward_passes * per_forward + 2 * rows)
