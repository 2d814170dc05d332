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
* ``FlexShardState(layout, optimizer)``: checkpoint state for torch.distributed.checkpoint.

``europa.flexshard.plugin`` adapts these to europa's hooks (``europa train -p flexshard``).
"""

from europa.flexshard.errors import FlexShardError, PlanError
from europa.flexshard.layout import FlexShardLayout, default_units, flex_shard
from europa.flexshard.optimizer import FlexShardOptimizer, orthogonalise
from europa.flexshard.plan import OwnershipPlan, ParameterSpec, plan_ownership
from europa.flexshard.state import FlexShardState

__all__ = [
    "FlexShardError",
    "FlexShardLayout",
    "FlexShardOptimizer",
    "FlexShardState",
    "OwnershipPlan",
    "ParameterSpec",
    "PlanError",
    "default_units",
    "flex_shard",
    "orthogonalise",
    "plan_ownership",
]
