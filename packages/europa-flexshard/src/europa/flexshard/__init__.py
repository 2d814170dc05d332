"""europa-flexshard: whole-matrix ownership for mixture-of-experts training.

Each matrix (an expert's slice of a stacked ``[E, rows, cols]`` tensor, a dense
weight, a norm) lives on exactly one rank of the data-parallel group. Forward
and backward gather a block's matrices and reduce gradients back to their
owners; the optimizer then steps whole matrices where they live, so Muon's
Newton–Schulz needs no communication at all.

Plain API (needs only torch):

* ``plan_ownership`` / ``OwnershipPlan`` / ``ParameterSpec``: the plan, pure Python;
* ``flex_shard(model, group=...)`` -> ``FlexShardLayout``: the layout at run time;
* ``FlexShardOptimizer(layout, lr=...)``: Muon/AdamW with no collective in ``step()``;
* ``FlexShardState(layout, optimizer)``: checkpoint state for torch.distributed.checkpoint;
* ``ExpertParallel`` / ``expert_node_groups``: routed experts split over an ep group, tokens
  sent flat or in two levels (between nodes once, then inside the node).

``europa.flexshard.plugin`` adapts these to europa's hooks (``europa train -p flexshard``).
"""

from europa.spec.lazy import lazy_exports

# The names load on first use (PEP 562), so that importing the plugin module,
# which every ``europa`` command does, does not import torch.
_WHERE = {
    "ExpertNodes": "europa.flexshard.exchange.nodes",
    "ExpertParallel": "europa.flexshard.experts",
    "FlexShardError": "europa.flexshard.errors",
    "FlexShardLayout": "europa.flexshard.whole_matrix_layout",
    "FlexShardOptimizer": "europa.flexshard.optimizer",
    "FlexShardState": "europa.flexshard.state",
    "OwnershipPlan": "europa.flexshard.ownership",
    "ParameterSpec": "europa.flexshard.ownership",
    "PlanError": "europa.flexshard.errors",
    "default_units": "europa.flexshard.builder",
    "expert_node_groups": "europa.flexshard.exchange.nodes",
    "flex_shard": "europa.flexshard.builder",
    "orthogonalise": "europa.flexshard.optimizer",
    "plan_ownership": "europa.flexshard.ownership",
}

__all__ = [
    "ExpertNodes",
    "ExpertParallel",
    "FlexShardError",
    "FlexShardLayout",
    "FlexShardOptimizer",
    "FlexShardState",
    "OwnershipPlan",
    "ParameterSpec",
    "PlanError",
    "default_units",
    "expert_node_groups",
    "flex_shard",
    "orthogonalise",
    "plan_ownership",
]


__getattr__ = lazy_exports(__name__, _WHERE)
