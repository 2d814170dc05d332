"""europa-overlap inside torchtitan's own ``Trainer`` (torchtitan 0.3.0).

``with_overlap(model_spec)`` returns the ``ModelSpec`` with its ``parallelize_fn``
wrapped: torchtitan's own runs first (FSDP2 on every transformer block and on the root),
then

* each block's forward issues the all-gathers of the next ``depth`` blocks, and its
  backward those of the ``depth`` blocks before it (FSDP2's explicit prefetch), with an
  optional reshard-after-forward policy (None keeps torchtitan's);
* with ``expert_chunks`` > 1, every MoE layer whose routed experts offer the chunked
  exchange (europa-flexshard's dispatcher) sends its tokens in chunks while the shared
  expert and the previous chunk's experts compute. torchtitan's own expert-parallel
  all-to-all has no chunked protocol: asking for chunks there is refused in one line.

Only when gathers are issued changes, so the losses are bit-identical to torchtitan's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from europa.overlap.errors import OverlapError
from europa.overlap.experts import overlap_expert_all_to_all
from europa.overlap.prefetch import RESHARD_POLICIES, prefetch_fsdp


def with_overlap(
    model_spec: Any, *, depth: int = 1, reshard: str | None = None, expert_chunks: int = 1
) -> Any:
    """``model_spec`` (a torchtitan ``ModelSpec``) whose FSDP2 gathers are prefetched
    ``depth`` blocks ahead, and whose expert exchange (europa-flexshard's) goes in
    ``expert_chunks`` chunks."""
    if depth < 0:
        raise OverlapError(f"depth = {depth}: expected 0 or more blocks to prefetch")
    if reshard is not None and reshard not in RESHARD_POLICIES:
        raise OverlapError(f"reshard = {reshard!r}: expected None or one of {RESHARD_POLICIES}")
    if expert_chunks < 1:
        raise OverlapError(f"expert_chunks = {expert_chunks}: expected 1 or more")
    parallelize = model_spec.parallelize_fn

    def parallelize_then_overlap(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = parallelize(model, **kwargs)
        blocks = [block for block in _blocks(model) if isinstance(block, FSDPModule)]
        if not blocks:
            shard = getattr(kwargs.get("parallelism"), "data_parallel_shard_degree", None)
            raise OverlapError(
                f"parallelism.data_parallel_shard_degree = {shard}: no transformer block is "
                "sharded by FSDP2, so there is no gather to prefetch; expected FSDP2 on "
                "model.layers"
            )
        prefetch_fsdp(blocks, depth, reshard, root=model if isinstance(model, FSDPModule) else None)
        if expert_chunks > 1 and not overlap_expert_all_to_all(model, expert_chunks):
            ep = getattr(kwargs.get("parallelism"), "expert_parallel_degree", None)
            raise OverlapError(
                f"expert_chunks = {expert_chunks}: no MoE layer offers the chunked exchange "
                f"(parallelism.expert_parallel_degree = {ep}, torchtitan's own all-to-all); "
                "expected europa-flexshard's expert parallelism, or expert_chunks = 1"
            )
        return model

    return dataclasses.replace(model_spec, parallelize_fn=parallelize_then_overlap)


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    raise OverlapError(
        f"model {type(model).__name__}: expected its transformer blocks in model.layers, "
        "whose gathers europa-overlap prefetches; found none"
    )
