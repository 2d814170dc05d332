"""The ``[flexshard]`` table of a europa config (``europa train -p flexshard``)."""

from __future__ import annotations

from dataclasses import dataclass, field

NAME = "flexshard"


@dataclass(kw_only=True)
class FlexShardConfig:
    reduce_dtype: str = field(
        default="float32",
        metadata={
            "choices": ("float32", "bfloat16"),
            "doc": "dtype of every gradient reduction in bfloat16 runs: the reduce-scatter, "
            "and the once-a-step sums over replicas and over expert copies",
        },
    )
    log_plan: bool = field(
        default=True, metadata={"doc": "print the ownership summary (bytes per rank) at start"}
    )
    dense_group: str = field(
        default="all",
        metadata={
            "choices": ("all", "node", "rank"),
            "doc": "ranks that split the non-expert matrices: all of dp_shard × ep, one "
            "node's (copies on the other nodes, gradients all-reduced across nodes once per "
            'optimizer step; gathers stay on the node\'s link), or none: "rank" keeps them '
            "whole on every rank, as DDP does (nothing gathered; gradients all-reduced once "
            "per optimizer step)",
        },
    )
    max_rank_gib: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "doc": "refuse a layout whose most loaded rank holds more parameter, gradient and "
            "optimizer-state GiB than this; 0: no limit",
        },
    )
