"""``FlexShardLayout``: a module laid out by whole-matrix ownership, at run time.

After ``flex_shard(model)`` (``europa.flexshard.builder``) every parameter the module
registers is this rank's *local* storage: the matrices it owns, stacked ``[owned,
*matrix]`` (a stacked expert tensor ``[E, rows, cols]`` keeps its owned experts; a 2-D or
1-D tensor is ``[1, *shape]`` on its owner and ``[0, *shape]`` elsewhere). Forward and
backward see whole parameters (``europa.flexshard.gather``); an optimizer over
``model.parameters()`` touches only what this rank owns. The layout materialises that
storage, finishes the gradients once a step (the sums over replicas and expert copies),
clips them, and describes itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from europa.flexshard.errors import PlanError
from europa.flexshard.experts import ResidentExperts
from europa.flexshard.gather import GatherUnit
from europa.flexshard.ownership import OwnershipPlan, ParameterSpec
from europa.flexshard.slots import Groups, Slot
from europa.spec.init import InitMatrix
from europa.spec.qk_clip import scale_rows_
from europa.spec.tags import mark_traffic

if TYPE_CHECKING:
    from europa.spec.replicas import ReplicaGroups


class FlexShardLayout:
    """A module laid out by ownership: its plans, its slots and its gather units."""

    def __init__(
        self,
        model: nn.Module,
        plan: OwnershipPlan,
        specs: dict[str, ParameterSpec],
        slots: dict[str, Slot],
        units: list[GatherUnit],
        groups: Groups,
        experts: ResidentExperts | None = None,
    ) -> None:
        self.model = model
        self.plan = plan  # everything but routed experts, over groups.shard
        self.specs = specs
        self.slots = slots
        self.units = units
        self.groups = groups
        self.experts = experts
        self._hook_expert_gradients()

    @property
    def rank(self) -> int:
        return self.groups.rank

    def spec(self, name: str) -> ParameterSpec:
        return self.specs[name]

    def is_expert(self, name: str) -> bool:
        return self.experts is not None and name in self.experts.names

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, slot in self.slots.items():
            yield name, slot.local

    def owned_indices(self, name: str) -> range:
        slot = self.slots[name]
        return range(slot.start, slot.stop)

    # -- prefetch ---------------------------------------------------------------------------

    def cancel_prefetch(self) -> None:
        """Wait for and drop every prefetched all-gather not used yet (see
        ``GatherUnit.set_prefetch``); call it before parameters change (the optimizer step)."""
        for unit in self.units:
            unit.cancel_prefetch()

    # -- materialising ----------------------------------------------------------------------

    @torch.no_grad()
    def materialise(self, device: torch.device | str, init_matrix: InitMatrix) -> None:
        """Allocate this rank's storage on ``device`` and fill each owned matrix with
        ``init_matrix(name, index, out)``: no rank allocates more than it owns."""
        for name, slot in self.slots.items():
            old = slot.local
            local = torch.empty(old.shape, dtype=old.dtype, device=device)
            spec = self.specs[name]
            for j, index in enumerate(range(slot.start, slot.stop)):
                init_matrix(name, index, local[j] if spec.stacked else local[0])
            slot.module._parameters[slot.attr] = nn.Parameter(local, old.requires_grad)
        self._hook_expert_gradients()
        for unit in self.units:
            unit.hook_gradients()

    # -- gradients --------------------------------------------------------------------------

    def _hook_expert_gradients(self) -> None:
        if self.experts is None:
            return
        for name in self.experts.names:
            param = self.slots[name].local
            if param.requires_grad and not param.is_meta:
                param.register_hook(self.experts.reduce_gradient)
                param.register_post_accumulate_grad_hook(self.experts.after_accumulate)

    def sum_copies_in_backward(self, backwards_per_step: int) -> None:
        """Issue the once-a-step sums (each unit's over its replicas, each resident
        expert's over its copies) in the ``backwards_per_step``-th backward since the last
        ``finish_gradients``, each as soon as its gradient is complete, so they travel beside
        the rest of that backward (0: after the backward, in ``finish_gradients``). A
        backward beyond that count before ``finish_gradients`` is refused."""
        if backwards_per_step < 0:
            raise PlanError(f"backwards_per_step = {backwards_per_step}: expected 0 or more")
        for unit in self.units:
            unit.replica_sum.sum_copies_in_backward = backwards_per_step
        if self.experts is not None:
            self.experts.copies_sum.sum_copies_in_backward = backwards_per_step

    def finish_gradients(self) -> None:
        """Sum the owned gradients over the replicas and the resident experts' gradients
        over their copies, once per optimizer step after the last micro-batch's backward
        (``clip_grad_norm_`` and the optimizer's step call it)."""
        for unit in self.units:
            unit.reduce_replicas()
        if self.experts is not None:
            self.experts.reduce_copies([self.slots[n].local for n in self.experts.names])

    @torch.no_grad()
    def scale_rows(self, factors: dict[str, torch.Tensor]) -> int:
        """QK-clip after the optimizer step: each named matrix's owner scales its rows
        (``europa.spec.qk_clip.scale_rows_``); it owns the whole matrix, so nothing is sent.
        The next forward's gathers carry the scaled rows to every rank."""
        scaled = 0
        for name, factor in factors.items():
            if self.spec(name).stacked:
                raise ValueError(f"scale_rows: {name} is a stack of matrices; expected one matrix")
            for matrix in self.slots[name].local:  # [owned, rows, cols]: one matrix or none
                scaled += scale_rows_(matrix, factor, 0)
        return scaled

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, *, pipeline_group=None, across: ReplicaGroups | None = None
    ) -> float:
        """Clip to a total 2-norm of ``max_norm`` (0: only measure); return the norm
        before clipping. Each matrix is counted once: on its owner. ``pipeline_group``:
        the ranks holding the model's other layers (pipeline stages), whose gradients
        count too. ``across``: the replica groups of a fault-tolerant run, over which the
        gradients are averaged first (ownership is positional: this rank's share is the
        same rank's in every group), once a step: the trainer clips once a step."""
        self.finish_gradients()
        if across is not None:
            across.average([s.local.grad for s in self.slots.values() if s.local.grad is not None])
        device = next(iter(self.slots.values())).local.device
        squares = torch.zeros(2, dtype=torch.float32, device=device)
        mark_traffic(squares, "gradient_norm")
        dense, routed = squares[0], squares[1]
        grads = []
        for name, slot in self.slots.items():
            grad = slot.local.grad
            if grad is None:
                continue
            grads.append(grad)
            (routed if self.is_expert(name) else dense).add_(grad.float().pow(2).sum())
        self._sum_over_owners(squares)
        if pipeline_group is not None:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pipeline_group)
        norm = (dense + routed).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
            for grad in grads:
                grad.mul_(scale.to(grad.dtype))
        return norm.item()

    def _sum_over_owners(self, squares: torch.Tensor) -> None:
        """Sum ``squares`` (the dense, then the routed sum of squares) over the ranks that own
        each kind of matrix: one all-reduce where both groups are the same ranks."""
        groups = []  # (kind, group): None is the default group
        if self.groups.size > 1:
            groups.append((0, self.groups.shard))
        if self.experts is not None and self.experts.size > 1:
            groups.append((1, self.experts.group))
        if len(groups) == 2 and _same_ranks(groups[0][1], groups[1][1]):
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=groups[0][1])
            return
        for kind, group in groups:
            dist.all_reduce(squares[kind : kind + 1], op=dist.ReduceOp.SUM, group=group)

    # -- summaries --------------------------------------------------------------------------

    def max_local_bytes(self) -> int:
        """At most what one rank stores: its owned share plus its resident experts."""
        routed = max(self.experts.plan.rank_bytes()) if self.experts is not None else 0
        return max(self.plan.rank_bytes(), default=0) + routed

    def describe(self) -> str:
        text = self.plan.describe()
        if self.experts is None:
            return text
        e = self.experts.plan.summary()
        per_layer = sorted({p.matrices for p in self.experts.plan.parameters})
        return (
            f"{text}; routed experts ({'/'.join(map(str, per_layer))} a layer) split over "
            f"{e['ranks']} expert-parallel rank(s), resident bytes per rank max "
            f"{e['bytes_max'] / 2**20:.2f} MiB / mean {e['bytes_mean'] / 2**20:.2f} MiB"
        )

    # -- whole parameters -------------------------------------------------------------------

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full, on every rank (a collective; for tests and export)."""
        fulls: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for slot, full in zip(unit.slots, unit.all_gather(), strict=True):
                fulls[slot.name] = full
        if self.experts is not None:
            for name in self.experts.names:
                fulls[name] = self.experts.gather(name, self.slots[name].local.detach())
        return fulls


def _same_ranks(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    world = dist.group.WORLD
    return dist.get_process_group_ranks(a or world) == dist.get_process_group_ranks(b or world)
