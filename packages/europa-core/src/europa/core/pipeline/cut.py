"""The model's layers cut into consecutive stages, balanced by compute.

Each layer's cost is its matrix-multiply FLOPs per token (``6 ×`` the matrix parameters a
token touches: every dense one, ``top_k`` of the routed experts) plus causal attention;
the embedding is a lookup and the output head a product over the vocabulary, and each
counts to the stage that holds it (the first and the last). The cut minimises the largest
stage's cost over every split into non-empty runs of consecutive layers (exact, by
dynamic programming: at most a few hundred layers).

Where a rank runs several stages (interleaved 1F1B, the V schedules), what sets the step
is the busiest rank, the sum of its stages: six equal layers in four stages cut 2, 1, 2, 1
are as balanced as stages can be, yet interleaving puts 4 layers on rank 0 and 2 on
rank 1. So the stage-balanced cut is then moved, one boundary one layer at a time, while
that lowers the busiest rank's cost (then the largest stage's): a local search, never
worse than where it starts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

EMBEDDING, LAYERS, HEAD = "tok_embeddings", "layers", ("norm", "lm_head")


def matrix_flops_per_token(shapes: Iterable[Sequence[int]], top_k: int, num_experts: int) -> int:
    """``6 ×`` the matrix parameters a token touches among parameters of ``shapes`` (2-D
    weights in full, 3-D stacks of routed experts ``top_k / num_experts`` of them)."""
    total = 0
    for shape in shapes:
        if len(shape) == 2 and min(shape) > 1:
            total += math.prod(shape)
        elif len(shape) == 3:
            total += math.prod(shape) * top_k // num_experts
    return 6 * total


def layer_costs(
    parameters: Mapping[str, Sequence[int]],
    layer_keys: Sequence[str],
    attention_per_layer: int,
    top_k: int,
    num_experts: int,
):
    """(each layer's FLOPs per token, in order; the head's), from the model's parameter
    shapes by name. The embedding is a lookup: no matrix product."""

    def of(prefix: str) -> int:
        shapes = [shape for name, shape in parameters.items() if name.startswith(prefix + ".")]
        return matrix_flops_per_token(shapes, top_k, num_experts)

    layers = [of(f"{LAYERS}.{key}") + attention_per_layer for key in layer_keys]
    return layers, sum(of(name) for name in HEAD)


def balanced_cut(costs: Sequence[float], stages: int) -> list[range]:
    """``stages`` consecutive, non-empty runs of the items (their indices), covering each
    once, whose largest sum is the least any such cut has. ``stages`` must be between 1
    and ``len(costs)``."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} items into {stages} non-empty stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[s][i]: the least largest stage cost of the first i items in s stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], choice[s][i] = worst, j
    bounds, i = [n], n
    for s in range(stages, 0, -1):
        i = choice[s][i]
        bounds.append(i)
    bounds.reverse()
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def rank_balanced_cut(costs: Sequence[float], rank_of: Sequence[int]) -> list[range]:
    """A cut of the items into ``len(rank_of)`` stages, stage ``s`` run by rank
    ``rank_of[s]``: the stage-balanced cut, then improved for the busiest rank (see the
    module's note)."""
    stages = len(rank_of)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def badness(bounds: list[int]) -> tuple[float, float]:
        stage = [prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]
        rank: dict[int, float] = {}
        for s, cost in enumerate(stage):
            rank[rank_of[s]] = rank.get(rank_of[s], 0.0) + cost
        return max(rank.values()), max(stage)

    cut = balanced_cut(costs, stages)
    bounds = [r.start for r in cut] + [len(costs)]
    current = badness(bounds)
    improved = True
    while improved:
        improved = False
        for i in range(1, stages):
            for step in (-1, 1):
                moved = bounds[i] + step
                if not bounds[i - 1] < moved < bounds[i + 1]:
                    continue  # a stage would be left empty
                trial = [*bounds[:i], moved, *bounds[i + 1 :]]
                score = badness(trial)
                if score < current:
                    bounds, current, improved = trial, score, True
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def model_cut(
    parameters: Mapping[str, Sequence[int]],
    layer_keys: Sequence[str],
    rank_of: Sequence[int],
    attention_per_layer: int,
    top_k: int,
    num_experts: int,
) -> list[range]:
    """The balanced cut of the model's layers into ``len(rank_of)`` stages (stage ``s`` on
    rank ``rank_of[s]``), the head counted to the last layer's stage."""
    layers, head = layer_costs(parameters, layer_keys, attention_per_layer, top_k, num_experts)
    layers[-1] += head
    return rank_balanced_cut(layers, rank_of)


def stated_cut(layers_per_stage: Sequence[int], n_layers: int) -> list[range]:
    """The cut a config states (``parallel.pp_layers``): each stage's layer count."""
    if any(count < 1 for count in layers_per_stage) or sum(layers_per_stage) != n_layers:
        raise ValueError(
            f"{list(layers_per_stage)}; expected a positive layer count per stage, "
            f"summing to the model's {n_layers} layers"
        )
    out, start = [], 0
    for count in layers_per_stage:
        out.append(range(start, start + count))
        start += count
    return out


def stage_module_names(cut: Sequence[range], layer_keys: Sequence[str]) -> list[list[str]]:
    """Each stage's module names: its layers (``layers.<key>``), the embedding with the
    first stage, the final norm and the output head with the last."""
    names = [[f"{LAYERS}.{layer_keys[i]}" for i in stage] for stage in cut]
    names[0].insert(0, EMBEDDING)
    names[-1].extend(HEAD)
    return names
