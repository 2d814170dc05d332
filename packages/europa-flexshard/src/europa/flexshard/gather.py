"""One gather unit at run time: its parameters whole around forward and backward.

Design note. Each rank stores only the matrices it owns (a local parameter of
shape ``[owned, *matrix]``). A unit (a transformer block, or the root's
embedding, norm and head) is gathered the way FSDP2 gathers one:

* forward pre-hook: one all-gather of every rank's segment; the full tensors
  come out of an autograd function whose inputs are the local parameters, and
  they *shadow* the module's parameters (they are put in the module's instance
  ``__dict__``, which attribute lookup reads before ``_parameters``), so the
  module's own code runs unchanged on whole weights;
* forward post-hook: the shadows go and the full tensors' storage is freed
  (``resize_(0)``); autograd keeps only the tensor objects it saved. On gloo a
  parameter this rank owns whole is gathered as a view of its local parameter (its
  pieces are sent from there, nothing packed), and that storage stays;
* pre-backward hook (on the unit's outputs): the storage is gathered again in
  place, so what autograd saved is valid, and the shadows return, so a
  recomputed forward (activation checkpointing) sees whole weights too;
* backward of the autograd function: the full gradients are reduce-scattered
  to their owners (averaged over the data-parallel ranks; on gloo both collectives
  are direct transfers between ranks, ``europa.flexshard.direct``), the shadows go and
  the storage is freed. With replicas (the same share held elsewhere: HSDP-style
  copies, or the other nodes' copies of a node-wide layout) the owners' gradients
  are all-reduced over them once per optimizer step, not once per backward: in
  the last micro-batch's backward as soon as the unit's share lands, when the
  layout knows how many backwards make a step (``sum_copies_in_backward``), so
  the sum travels beside the rest of that backward; else after it
  (``reduce_replicas``). ``europa.flexshard.once_a_step`` keeps that count.

Each forward holds its own full tensors until its backward (``_Gathered``): a pipeline
runs several micro-batches' forwards of a unit before their backwards, in any order.

A group of one (this rank owns every matrix of the unit) computing in its storage's
dtype: there is nothing to gather or scatter, so the shadows are views of the local
storage itself, autograd puts the gradients straight into ``.grad``, and no hook runs in
backward (a unit computing in another dtype is gathered as usual, so its cast copy is
freed after forward and made again for backward): alone, the unit costs what the plain
module costs. With replicas (every rank holding the whole unit, as DDP does) the local
gradients are averaged over them once a step: in the last backward as soon as every one
of the unit's gradients has accumulated (a post-accumulate-grad hook per parameter), else
in ``reduce_replicas``.

Overlap (off by default; europa-overlap switches it on): ``set_prefetch``
names units whose all-gather this unit issues asynchronously right after its
own, in forward (the next blocks) and in backward (the previous ones, if they
resharded), so it travels while this unit computes; ``reshard_after_forward =
False`` keeps a unit's full storage from forward to backward (no second
gather); ``reduce_scatter_async = True`` issues the gradient reduce-scatter
asynchronously, returns no gradient to autograd, and adds this rank's share to
``.grad`` (set, or added in place, as autograd does) in a callback at the end
of the backward, so the earlier blocks' backward runs beside it.

Why our own collective rather than FSDP2's: FSDP2 stores ``Shard(dim)`` pieces
with every rank holding part of every tensor; it can express whole matrices on
one rank only for stacked experts whose count divides the group, and never for
a dense matrix. Mixing the two would cost two collectives per block; one flat
all-gather and one reduce-scatter per unit is what FSDP2 itself does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from europa.flexshard.direct import gather_pieces, reduce_scatter_pieces
from europa.flexshard.once_a_step import REPLICA_SUM_KIND, OnceAStepSum
from europa.flexshard.segments import UnitSegments
from europa.flexshard.slots import Groups, Slot
from europa.spec.autograd import in_backward
from europa.spec.lanes import lane_group
from europa.spec.tags import mark_gathered, mark_memory


# Looked up at each call, so a tool that wraps torch.distributed (europa-overlap's
# timeline) sees these collectives too; over the calling thread's lane
# (europa.spec.lanes: a backward beside a forward has twin groups).
def all_gather(*args, group=None, **kwargs):
    return dist.all_gather_single(*args, group=lane_group(group), **kwargs)


def reduce_scatter(*args, group=None, **kwargs):
    return dist.reduce_scatter_single(*args, group=lane_group(group), **kwargs)


class GatherUnit:
    def __init__(
        self,
        module: nn.Module,
        slots: Sequence[Slot],
        segments: UnitSegments,
        groups: Groups,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.slots = list(slots)
        self.segments = segments
        self.groups = groups
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self._forward: _Gathered | None = None  # the forward running now
        self._awaiting_refill = 0  # forwards whose storage was freed, before their backward
        # False: the full storage stays from forward to backward (no second gather).
        self.reshard_after_forward = True
        # True: the gradient reduce-scatter is issued asynchronously and waited for at the
        # end of the backward (the rest of the backward runs beside it).
        self.reduce_scatter_async = False
        # Prefetch (see ``set_prefetch``): the units whose all-gather this one issues.
        self.forward_prefetch: list[GatherUnit] = []
        self.backward_prefetch: list[GatherUnit] = []
        # An all-gather in flight: (rows, this rank's pieces for unpack or None, its work).
        self._pending: tuple[torch.Tensor, tuple | None, dist.Work] | None = None
        # The owned gradients' sum over the replicas; its backwards are counted per unit
        # (gathered), or per parameter (whole here: each one's gradient accumulates alone).
        self.replica_sum = OnceAStepSum(
            groups.replicate, reduce_dtype, REPLICA_SUM_KIND, "the replicas' sum"
        )
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True),
            module.register_forward_hook(self._post_forward),
        ]
        self._grad_handles: list = []
        self.hook_gradients()

    def remove_hooks(self) -> None:
        for handle in [*self._handles, *self._grad_handles]:
            handle.remove()

    # -- collectives ----------------------------------------------------------------------

    def _compute_dtype(self) -> torch.dtype:
        return self.param_dtype or self.slots[0].local.dtype

    def all_gather(self) -> list[torch.Tensor]:
        """Every parameter of the unit in full, as new tensors in the compute dtype
        (from the prefetched all-gather when one is in flight)."""
        if self._pending is not None:
            rows, own, work = self._pending
            self._pending = None
            work.wait()
        else:
            rows, own, _ = self._issue_gather(async_op=False)
        return self.segments.unpack(rows, own)

    def _issue_gather(self, async_op: bool):
        """Gather every rank's segment into ``[ranks, width]`` rows; returns (rows, this
        rank's pieces for ``UnitSegments.unpack`` (None: they are in its row), the work:
        None once done). On gloo the pieces go straight from the local parameters (cast to
        the compute dtype where it differs) and this rank's row stays empty
        (``europa.flexshard.direct``); elsewhere the segment is packed for the collective
        (into this rank's own row where nothing else gathers: one rank)."""
        g, segments = self.groups, self.segments
        locals_ = [slot.local.detach() for slot in self.slots]
        dtype, device = self._compute_dtype(), locals_[0].device
        rows = torch.empty(g.size, segments.width, dtype=dtype, device=device)
        mark_memory(rows, "gathered_parameters")
        if g.size > 1 and g.direct:
            pieces = [local.to(dtype) for local in locals_]
            sent = [pieces[slot] for slot in segments.owned_slots(g.rank)]
            spans = [segments.owned_spans(peer) for peer in range(g.size)]
            work = gather_pieces(sent, rows, spans, g.rank, g.shard, async_op=async_op)
            return rows, (g.rank, pieces), work
        send = segments.pack(g.rank, locals_, dtype, out=rows[g.rank] if g.size == 1 else None)
        work = None
        if g.size > 1:
            work = all_gather(rows.view(-1), send, group=g.shard, async_op=async_op)
        return rows, None, work

    # -- prefetch ---------------------------------------------------------------------------

    def set_prefetch(
        self, forward: Sequence[GatherUnit] = (), backward: Sequence[GatherUnit] = ()
    ) -> None:
        """When this unit gathers for its forward, also issue ``forward``'s all-gathers;
        when it gathers for its backward, ``backward``'s (those that resharded after
        forward). They run asynchronously; each unit waits for its own when it needs it.
        Every rank must set the same schedule (the all-gathers are collectives)."""
        self.forward_prefetch = list(forward)
        self.backward_prefetch = list(backward)

    def prefetch(self) -> None:
        """Issue this unit's all-gather now, asynchronously (no-op if one is in flight).
        It packs the local parameters as they are now: call it only when they will not
        change before the unit runs (not across an optimizer step)."""
        g = self.groups
        if self._pending is not None or g.size == 1:
            return
        self._pending = self._issue_gather(async_op=True)

    def cancel_prefetch(self) -> None:
        """Wait for and drop an all-gather issued but never used (e.g. at the end of a step)."""
        if self._pending is not None:
            self._pending[2].wait()
            self._pending = None

    def reduce_scatter(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """This rank's averaged share of the full gradients, one per local parameter."""
        return self._finish_reduce_scatter(self._issue_reduce_scatter(grads, async_op=False))

    def _issue_reduce_scatter(
        self, grads: Sequence[torch.Tensor | None], async_op: bool
    ) -> Callable[[], list[torch.Tensor]]:
        """Issue the reduce-scatter of ``grads``; returns what waits for it and gives this
        rank's summed shares, one per local parameter (not yet averaged)."""
        g, segments = self.groups, self.segments
        dtype = self.reduce_dtype or self.slots[0].local.dtype
        device = self.slots[0].local.device
        if g.size > 1 and g.direct:
            fulls = [
                torch.zeros(spec.shape, dtype=dtype, device=device) if x is None else x.to(dtype)
                for x, spec in zip(grads, segments.specs, strict=True)
            ]
            outgoing = [
                [] if peer == g.rank else segments.owned_pieces(peer, fulls)
                for peer in range(g.size)
            ]
            sums, work = reduce_scatter_pieces(
                segments.owned_pieces(g.rank, fulls), outgoing, g.rank, g.shard, async_op
            )

            def pieces() -> list[torch.Tensor]:
                if work is not None:
                    work.wait()
                return self._per_slot(sums, dtype, device)

            return pieces
        rows = torch.empty(g.size, segments.width, dtype=dtype, device=device)
        mark_memory(rows, "gradient_buffers")
        segments.scatter_rows([None if x is None else x.to(dtype) for x in grads], rows)
        if g.size == 1:
            mine, work = rows[0], None
        else:
            mine = rows.new_empty(segments.width)
            mark_memory(mine, "gradient_buffers")
            work = reduce_scatter(
                mine, rows.view(-1), op=dist.ReduceOp.SUM, group=g.shard, async_op=async_op
            )

        def split() -> list[torch.Tensor]:
            if work is not None:
                work.wait()
            # Views of this rank's row where the row is exactly its shares (no padding kept
            # alive as gradient), else compact copies.
            views = self.segments.fills_row(g.rank)
            return [p if views else p.clone() for p in self.segments.split(g.rank, mine)]

        return split

    def _per_slot(self, sums: Sequence[torch.Tensor], dtype, device) -> list[torch.Tensor]:
        """The owned pieces' sums placed by slot; an empty share where this rank owns none."""
        rank, segments = self.groups.rank, self.segments
        by_slot = dict(zip(segments.owned_slots(rank), sums, strict=True))
        return [
            by_slot[slot]
            if slot in by_slot
            else torch.empty(segments.local_shape(rank, slot), dtype=dtype, device=device)
            for slot in range(len(segments.specs))
        ]

    def _finish_reduce_scatter(self, pending: Callable[[], list[torch.Tensor]]):
        """This rank's averaged shares, once ``pending`` (``_issue_reduce_scatter``) is done."""
        g = self.groups
        shares = pending()
        self.replica_sum.pending = g.replicas > 1
        if g.mean:  # gloo has no AVG; the mean over data-parallel ranks
            for share in shares:
                share.div_(g.size * g.replicas)
        return [share.to(slot.local.dtype) for share, slot in zip(shares, self.slots, strict=True)]

    def reduce_replicas(self) -> None:
        """Sum the local gradients over the replicas (one all-reduce of the unit's owned
        gradients), if a backward left them unsummed, or wait for the sum the last backward
        issued; every replica calls it together."""
        self.replica_sum.finish(lambda issued: self._unsummed())

    def _unsummed(self) -> list[torch.Tensor]:
        locals_ = [slot.local for slot in self.slots]
        if self.whole_here:  # autograd's own gradients: not yet divided
            return self._averaged(locals_)
        return [p.grad for p in locals_ if p.grad is not None]

    def _accumulate(self, pending: Callable[[], list[torch.Tensor]]) -> None:
        """End of backward: this unit's asynchronous reduce-scatter is waited for and its
        share added to ``.grad``."""
        self._add_to_grads(self._finish_reduce_scatter(pending))

    def _add_to_grads(self, shares: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Add this backward's shares to the local parameters' ``.grad`` as autograd would
        (set, or added in place); the gradients of those that take one."""
        grads = []
        for slot, share in zip(self.slots, shares, strict=True):
            local = slot.local
            if not local.requires_grad:
                continue
            if local.grad is None:
                local.grad = share
            else:
                local.grad += share
            grads.append(local.grad)
        return grads

    # -- shadows and storage ----------------------------------------------------------------

    def _shadow(self, fulls: Sequence[torch.Tensor]) -> None:
        for slot, full in zip(self.slots, fulls, strict=True):
            slot.module.__dict__[slot.attr] = full

    def _unshadow(self) -> None:
        for slot in self.slots:
            slot.module.__dict__.pop(slot.attr, None)

    def _free(self, gathered: _Gathered) -> None:
        for full in gathered.freed:
            full.untyped_storage().resize_(0)

    def _refill(self, gathered: _Gathered) -> None:
        fresh = dict(zip(map(id, gathered.fulls), self.all_gather(), strict=True))
        for full in gathered.freed:
            full.untyped_storage().resize_(fresh[id(full)].untyped_storage().nbytes())
            with torch.autograd._unsafe_preserve_version_counter(full):
                full.copy_(fresh[id(full)])

    # -- hooks ------------------------------------------------------------------------------

    @property
    def whole_here(self) -> bool:
        """This rank owns every matrix of the unit (other ranks may hold copies) and
        computes with them as they are stored: the module can use them in place."""
        cast = self.param_dtype is not None and self.param_dtype != self.slots[0].local.dtype
        return self.groups.size == 1 and not cast

    @property
    def alone(self) -> bool:
        """This rank holds the whole unit and no other rank holds a copy."""
        return self.whole_here and self.groups.replicas == 1

    def hook_gradients(self) -> None:
        """With replicas of a whole unit, each local parameter tells the unit when its
        gradient has accumulated (``_after_accumulate``); call it again whenever the local
        parameters are replaced (``FlexShardLayout.materialise``)."""
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []
        if not self.whole_here or self.groups.replicas == 1:
            return
        self._grad_handles = [
            slot.local.register_post_accumulate_grad_hook(self._after_accumulate)
            for slot in self.slots
            if slot.local.requires_grad and not slot.local.is_meta
        ]

    def _after_accumulate(self, param: torch.Tensor) -> None:
        """A whole unit's parameter has its gradient: in the step's last backward, once
        every one has, their sum over the replicas is issued."""
        replica_sum = self.replica_sum
        replica_sum.pending = True
        if not replica_sum.early:
            return
        replica_sum.in_last_backward(id(param))
        wanted = [slot.local for slot in self.slots if slot.local.requires_grad]
        last = replica_sum.sum_copies_in_backward
        if all(replica_sum.backwards(id(p)) == last for p in wanted):
            replica_sum.pending = False
            replica_sum.issue(id(self), self._averaged(wanted))

    def _averaged(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of ``params``, divided by the replicas: their sum is the mean
        (undivided where the layout sums over ranks, ``Groups.mean``)."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.groups.mean:
            for grad in grads:
                grad.div_(self.groups.replicas)
        return grads

    def _whole_views(self) -> list[torch.Tensor]:
        return [
            slot.local.view(spec.shape)
            for slot, spec in zip(self.slots, self.segments.specs, strict=True)
        ]

    def _pre_forward(self, module: nn.Module, args) -> None:
        if self.whole_here:
            if self.groups.replicas > 1 and torch.is_grad_enabled():
                # Its backward leaves gradients to sum over the replicas. Said here too, as
                # a pipeline's split backward accumulates them by hand: no hook sees them.
                self.replica_sum.pending = True
            views = self._whole_views()
            for view in views:
                mark_gathered(view)
            self._shadow(views)
            return
        locals_ = [slot.local for slot in self.slots]
        if torch.is_grad_enabled() and any(p.requires_grad for p in locals_):
            gathered = _Gathered()  # the function's backward needs it: filled after
            gathered.hold(self, _GatherFunction.apply(self, gathered, *locals_))
        else:
            gathered = _Gathered().hold(self, self.all_gather())
        self._forward = gathered
        for full in gathered.fulls:  # tells activation offload (europa-offload) to leave them be
            mark_gathered(full)
            if full._base is not None:  # the gathered rows: the base of what views them
                mark_gathered(full._base)
        self._shadow(gathered.fulls)
        if not in_backward():  # not a forward recomputed in backward
            for unit in self.forward_prefetch:
                unit.prefetch()

    def _post_forward(self, module: nn.Module, args, output) -> None:
        self._unshadow()
        gathered, self._forward = self._forward, None
        if self.whole_here or gathered is None:
            return
        needs_grad = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if not needs_grad or not any(f.requires_grad for f in gathered.fulls):
            return
        if self.reshard_after_forward:
            self._free(gathered)
            gathered.resharded = True
            self._awaiting_refill += 1
        torch.autograd.graph.register_multi_grad_hook(
            needs_grad, functools.partial(self._pre_backward, gathered), mode="any"
        )

    def _pre_backward(self, gathered: _Gathered, grad: torch.Tensor) -> None:
        if gathered.done:  # a second backward through the same graph
            return
        if gathered.resharded:
            self._refill(gathered)
            gathered.resharded = False
            self._awaiting_refill -= 1
        self._shadow(gathered.fulls)
        for unit in self.backward_prefetch:
            if unit._awaiting_refill:
                unit.prefetch()

    def _in_last_backward(self) -> bool:
        """Count this backward of a gathered unit with replicas; whether it is the step's
        last (its shares are summed over the replicas at once)."""
        if self.groups.replicas == 1 or not self.replica_sum.early:
            return False
        return self.replica_sum.in_last_backward(id(self))

    def _add_and_sum_over_replicas(self, shares: Sequence[torch.Tensor]) -> None:
        """Add this backward's shares to ``.grad`` and issue their sum over the replicas;
        ``reduce_replicas`` waits for it."""
        grads = self._add_to_grads(shares)
        self.replica_sum.pending = False
        if grads:
            self.replica_sum.issue(id(self), grads)

    def _post_backward(
        self, gathered: _Gathered, grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        for grad in grads:  # the unsharded gradients, until reduce-scattered
            if grad is not None:
                mark_memory(grad, "gradient_buffers")
        if self._in_last_backward():
            self._add_and_sum_over_replicas(self.reduce_scatter(grads))
            local_grads = self._nothing_more()  # already in .grad
        elif self.reduce_scatter_async and self.groups.size > 1:
            pending = self._issue_reduce_scatter(grads, async_op=True)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._accumulate(pending)
            )
            local_grads = self._nothing_more()  # added to .grad when the backward ends
        else:
            local_grads = self.reduce_scatter(grads)
        self._unshadow()
        self._free(gathered)
        gathered.done = True
        return local_grads

    def _nothing_more(self) -> list[torch.Tensor]:
        """What autograd adds to ``.grad`` where the unit puts its share there itself:
        zeros, not None. A pipeline's split backward (torch's ``stage_backward_weight``)
        adds what ``autograd.grad`` returns to ``.grad`` by hand and cannot add None."""
        return [torch.zeros_like(slot.local) for slot in self.slots]


class _Gathered:
    """One forward's whole parameters, kept for its backward. Several forwards of a unit
    can wait for their backwards at once (a pipeline's micro-batches in flight), each
    with its own: its ``fulls``, those of them whose storage is freed between uses
    (``freed``), whether that storage is freed now (``resharded``), and whether its
    backward has run (``done``)."""

    __slots__ = ("done", "freed", "fulls", "resharded")

    def __init__(self) -> None:
        self.fulls: list[torch.Tensor] = []
        self.freed: list[torch.Tensor] = []
        self.resharded = False
        self.done = False

    def hold(self, unit: GatherUnit, fulls: Sequence[torch.Tensor]) -> _Gathered:
        """Hold ``fulls``; those with storage of their own are freed between uses, not
        those that view a local parameter (one this rank owns whole, gathered on gloo)."""
        local = {_storage_of(slot.local) for slot in unit.slots}
        self.fulls = list(fulls)
        self.freed = [
            full
            for full in self.fulls
            if full.untyped_storage().nbytes() == 0 or _storage_of(full) not in local
        ]
        return self


def _storage_of(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (its address is no identity: on fake tensors,
    which hold no memory, every address is 0)."""
    return tensor.untyped_storage()._cdata


class _GatherFunction(torch.autograd.Function):
    """local parameters -> full parameters; backward: full gradients -> owners, and
    ``gathered`` (this forward's full parameters) freed."""

    @staticmethod
    def forward(ctx, unit: GatherUnit, gathered: _Gathered, *locals_: torch.Tensor):
        ctx.unit, ctx.gathered = unit, gathered
        return tuple(unit.all_gather())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        return (None, None, *ctx.unit._post_backward(ctx.gathered, grads))
