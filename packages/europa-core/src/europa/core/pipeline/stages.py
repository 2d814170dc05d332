"""Which layers each pipeline stage holds and which stages each pipeline rank runs: read
by the trainer and by the planner alike, from parameter shapes (no torch), so a plan's
stages are the run's.

Looped schedules (1F1B, interleaved 1F1B) put stage ``s`` on rank ``s mod P``; the V
schedules (ZBV zero-bubble, DualPipeV) hold two stages a rank, ``r`` and ``2P - 1 - r``, so
the first and the last stage share rank 0 (as torchtitan places them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from europa.core.pipeline.cut import model_cut, stage_module_names, stated_cut
from europa.core.pipeline.kinds import stages_per_rank
from europa.plan.schedules import stages_of_rank  # europa-plan's placement, the planner's too


def stage_count(parallel) -> int:
    return parallel.pp * stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)


def stage_names(
    config, parameters: Mapping[str, Sequence[int]], layer_keys: Sequence[str]
) -> list[list[str]]:
    """Every stage's module names: the configured cut (``parallel.pp_layers``), else the
    one balanced by compute. ``parameters``: the whole model's shapes by name."""
    from europa.core.plan.timing import attention_flops_per_token

    p, m = config.parallel, config.model
    if p.pp_layers:
        cut = stated_cut(p.pp_layers, len(layer_keys))
    else:
        attention = attention_flops_per_token(m, config.training.seq_len) // m.n_layers
        rank_of = stage_ranks(p)
        cut = model_cut(parameters, layer_keys, rank_of, attention, m.top_k, m.num_experts)
    return stage_module_names(cut, layer_keys)


def rank_stages(parallel, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs under ``parallel``'s schedule."""
    per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    return stages_of_rank(parallel.pp_schedule, pp_rank, parallel.pp, per_rank)


def stage_ranks(parallel) -> list[int]:
    """The pipeline rank that runs each stage, in stage order."""
    rank_of = {s: r for r in range(parallel.pp) for s in rank_stages(parallel, r)}
    return [rank_of[s] for s in range(stage_count(parallel))]


def rank_module_names(names: Sequence[Sequence[str]], stages: Sequence[int]) -> list[str]:
    """The modules of all this rank's stages."""
    return [name for i in stages for name in names[i]]
