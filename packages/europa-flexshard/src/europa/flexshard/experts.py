"""Expert parallelism: routed experts stay whole and resident on their owners;
tokens travel to them and back.

Design note. The ``ep`` ranks of a group split each MoE layer's routed experts
by whole experts, following an ownership plan over that group (each layer's
experts as one stack, so an expert's three matrices stay together; uneven
counts are fine: 6 experts over 4 ranks is 2, 2, 1, 1). A rank keeps its
experts' weights for forward and backward; it never gathers another rank's.

Tokens travel through a dispatcher (``europa.flexshard.exchange.dispatcher``): the flat one
sends a row per (token, expert); the two-level one a row per (token, destination
node), then fans out inside the node (``ExpertParallel.nodes``). Either can send
the tokens in bf16 or FP8 (``dispatch_dtype``) and keep what it received for a
recomputation (``keep_exchanges``, ``europa.flexshard.exchange.kept``).

Gradients. Every rank is a data-parallel rank (it reads its own sequences).
After backward, an expert's gradient on its owner already holds the
contributions of every token routed to it from its ep group (the backward
exchange brought them); the ranks holding the *same* experts in other
data-parallel positions (``copies``) sum theirs, and the mean over all
data-parallel ranks is taken, as for every other parameter. The mean runs as a
hook on each expert gradient, once per backward, so gradient accumulation
adds averaged micro-batches; the sum over the copies runs once per optimizer step
(``ResidentExperts``, ``europa.flexshard.once_a_step``).

The dispatcher duck-types torchtitan's token dispatcher (``dispatch`` and
``combine`` on a module with ``token_dispatcher`` and ``inner_experts``), so
no torchtitan import is needed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from europa.flexshard.errors import PlanError
from europa.flexshard.exchange.dispatcher import ExpertDispatcher
from europa.flexshard.exchange.flat import FlatDispatcher
from europa.flexshard.exchange.kept import Keeper, KeptExchanges
from europa.flexshard.exchange.nodes import ExpertNodes
from europa.flexshard.exchange.two_level import TwoLevelDispatcher
from europa.flexshard.exchange.wire import DISPATCHES, WIRE_DTYPES, Wire
from europa.flexshard.gather import all_gather
from europa.flexshard.once_a_step import EXPERT_COPIES_KIND, OnceAStepSum
from europa.flexshard.ownership import OwnershipPlan, ParameterSpec
from europa.spec.execution import RoutingModel


@dataclass(frozen=True)
class ExpertParallel:
    """Where routed experts live and how tokens reach them.

    ``group``: the ranks that split them. ``copies``: the ranks holding the same
    experts at other data-parallel positions (None: no copies). ``data_parallel_size``:
    the ranks whose mean gradient is taken (default: the whole world). ``dispatch``:
    "flat" or "two_level" (which needs ``nodes``, from ``expert_node_groups``).
    ``dispatch_dtype``: "compute", "bfloat16" or "float8_e4m3fn", the wire dtype of
    the tokens sent towards the experts. ``keep_exchanges``: keep what each MoE layer
    received for the recomputation of activation checkpointing. ``routing``: the routing
    model that sizes the exchanges in an execution on fake tensors (None: the routing
    tensors; ``europa.flexshard.exchange.routing``), with tokens limited to ``max_nodes`` nodes."""

    group: dist.ProcessGroup | None = None
    copies: dist.ProcessGroup | None = None
    data_parallel_size: int | None = None
    dispatch: str = "flat"
    nodes: ExpertNodes | None = None
    dispatch_dtype: str = "compute"
    keep_exchanges: bool = False
    routing: RoutingModel | None = None
    max_nodes: int = 0

    def check(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise PlanError(
                f"dispatch = {self.dispatch!r}: expected one of {', '.join(DISPATCHES)}"
            )
        if self.dispatch_dtype not in WIRE_DTYPES:
            expected = ", ".join(WIRE_DTYPES)
            raise PlanError(f"dispatch_dtype = {self.dispatch_dtype!r}: expected one of {expected}")
        if self.dispatch == "two_level" and (self.nodes is None or self.nodes.rail_group is None):
            raise PlanError(
                'dispatch = "two_level": expected nodes with node and rail groups '
                "(europa.flexshard.exchange.nodes.expert_node_groups)"
            )

    def dispatcher(
        self, rank: int, ranges: Sequence[tuple[int, int]], top_k: int, compute_itemsize: int
    ) -> ExpertDispatcher:
        options = dict(
            wire=Wire(self.dispatch_dtype, compute_itemsize),
            keeper=Keeper() if self.keep_exchanges else None,
            routing=self.routing,
            max_nodes=self.max_nodes,
        )
        if self.dispatch == "two_level":
            return TwoLevelDispatcher(self.group, rank, ranges, top_k, nodes=self.nodes, **options)
        return FlatDispatcher(self.group, rank, ranges, top_k, **options)


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


def check_groups_follow_nodes(
    name: str, groups: int, ranges: Sequence[tuple[int, int]], local: int
) -> None:
    """A router's ``groups`` expert groups (node-limited routing) must each lie on one node."""
    experts = ranges[-1][1]
    nodes = [(ranges[i][0], ranges[i + local - 1][1]) for i in range(0, len(ranges), local)]
    for g in range(groups):
        lo, hi = g * experts // groups, (g + 1) * experts // groups
        if not any(a <= lo and hi <= b for a, b in nodes):
            raise PlanError(
                f"{name}: routing group {g} (experts {lo}..{hi - 1}) straddles nodes "
                f"{[(a, b - 1) for a, b in nodes]}; expected each group on one node"
            )


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


@dataclass
class ResidentExperts:
    """The routed experts of a layout: their names, plan and groups, and their gradients'
    once-a-step sum over their copies (see the design note)."""

    modules: dict[str, str]  # expert parameter -> its routed-expert module
    parallel: ExpertParallel
    rank: int
    size: int
    plan: OwnershipPlan  # one stack per routed-expert module, over the expert group
    reduce_dtype: torch.dtype | None = None
    mean_over_ranks: bool = True  # False: the gradients' sum over the data-parallel ranks
    kept: list[KeptExchanges] = field(default_factory=list)  # blocks keeping their exchanges
    copies_sum: OnceAStepSum = field(init=False)  # backwards counted per parameter

    def __post_init__(self) -> None:
        self.copies_sum = OnceAStepSum(
            self.parallel.copies,
            self.reduce_dtype,
            EXPERT_COPIES_KIND,
            "the experts' sum over their copies",
        )

    @property
    def names(self) -> list[str]:
        return list(self.modules)

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.parallel.group

    def reduce_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """This backward's share of the mean over data-parallel ranks; the copies of these
        experts sum the accumulated gradients once a step (``reduce_copies``)."""
        copies = self.parallel.copies
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.copies_sum.pending = copies is not None and dist.get_world_size(copies) > 1
        if not self.mean_over_ranks:
            return grad
        return grad / (self.parallel.data_parallel_size or world)

    def after_accumulate(self, param: torch.Tensor) -> None:
        """In the last backward of a step, issue this expert parameter's sum over its
        copies as soon as its gradient is accumulated."""
        copies_sum = self.copies_sum
        if not copies_sum.early or not copies_sum.pending:
            return
        if copies_sum.in_last_backward(id(param)):
            copies_sum.issue(id(param), [param.grad])

    def reduce_copies(self, params: Sequence[torch.Tensor]) -> None:
        """Sum the experts' gradients over their copies (one all-reduce, in the reduce
        dtype), if a backward left them unsummed, or wait for the sums the last backward
        issued; every copy calls it together."""

        def unsummed(issued: Collection[int]) -> list[torch.Tensor]:
            return [p.grad for p in params if p.grad is not None and id(p) not in issued]

        self.copies_sum.finish(unsummed)

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Expert parameter ``name`` in full, from each rank's run of it (a collective)."""
        if self.size == 1:
            return local.clone()
        counts = self.plan.counts(self.modules[name])  # each layer splits its own way
        widest = max(counts)
        padded = local.new_zeros(widest, *local.shape[1:])
        padded[: local.shape[0]] = local
        rows = local.new_empty(self.size * widest, *local.shape[1:])
        all_gather(rows, padded, group=self.group)
        pieces = [rows[r * widest : r * widest + count] for r, count in enumerate(counts)]
        return torch.cat(pieces)
