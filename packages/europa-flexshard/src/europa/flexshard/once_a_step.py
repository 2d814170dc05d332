"""Gradients summed over their copies once per optimizer step, early in the step's last backward.

Two kinds of copy hold gradients that must be summed once a step, not once a backward: a
gather unit's replicas (the same owned share held by other ranks, ``GatherUnit``) and a
resident expert's copies (the ranks with the same ep index, ``ResidentExperts``). Both
do it the same way, with one ``OnceAStepSum`` each: told how many backwards make a step
(``sum_copies_in_backward``), the owner counts the backwards each gradient sees and, in
the last one, issues the sum as soon as that gradient is complete, so it travels beside
the rest of that backward; ``finish`` (once a step, after the last backward) waits for
those sums and sums whatever no backward issued.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist

from europa.flexshard.errors import PlanError
from europa.spec.lanes import lane_group
from europa.spec.tags import mark_memory, mark_traffic

REPLICA_SUM_KIND = "gradient_replica_all_reduce"
EXPERT_COPIES_KIND = "expert_gradient_all_reduce"


class AsyncSum:
    """One all-reduce (a sum) of several tensors flattened together, in ``dtype``
    (default: their own), issued on construction; ``finish`` waits for it and writes
    each sum back into its tensor. ``kind``: the planner's kind of this traffic."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group,
        dtype: torch.dtype | None,
        kind: str = REPLICA_SUM_KIND,
    ):
        self.tensors = list(tensors)
        self.flat = torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in self.tensors])
        mark_traffic(self.flat, kind)
        mark_memory(self.flat, "sum_buffers")
        self.work = dist.all_reduce(
            self.flat, op=dist.ReduceOp.SUM, group=lane_group(group), async_op=True
        )

    def finish(self) -> None:
        self.work.wait()
        pieces = self.flat.split([t.numel() for t in self.tensors])
        for tensor, piece in zip(self.tensors, pieces, strict=True):
            tensor.copy_(piece.view_as(tensor))


class OnceAStepSum:
    """The once-a-step sum of some gradients over ``group`` (in ``dtype``; ``kind``: the
    planner's kind of this traffic). ``what`` names it in errors.

    ``sum_copies_in_backward``: the backward, counted since the last ``finish``, that is
    the step's last (0: none is known; everything is summed in ``finish``). ``pending``:
    gradients have accumulated that no sum has taken yet; the owner sets it."""

    def __init__(self, group, dtype: torch.dtype | None, kind: str, what: str) -> None:
        self.group, self.dtype, self.kind, self.what = group, dtype, kind, what
        self.sum_copies_in_backward = 0
        self.pending = False
        self._backwards: dict[int, int] = {}  # per key (a unit, a parameter): since the sum
        self._issued: dict[int, AsyncSum] = {}  # per key: the sums issued in a backward

    @property
    def early(self) -> bool:
        """Whether the sum goes in the step's last backward (the number of backwards that
        make a step is known)."""
        return self.sum_copies_in_backward > 0

    def in_last_backward(self, key: int) -> bool:
        """Count one more backward for ``key`` and say whether it is the step's last; one
        beyond it before ``finish`` is refused."""
        limit = self.sum_copies_in_backward
        seen = self._backwards.get(key, 0) + 1
        if seen > limit:
            raise PlanError(
                f"sum_copies_in_backward = {limit}: a backward beyond it before {self.what} "
                "was finished (finish_gradients)"
            )
        self._backwards[key] = seen
        return seen == limit

    def backwards(self, key: int) -> int:
        """Backwards counted for ``key`` since the last ``finish``."""
        return self._backwards.get(key, 0)

    def issue(self, key: int, grads: Sequence[torch.Tensor]) -> None:
        """Issue the sum of ``grads`` (``key``'s) now; ``finish`` waits for it."""
        self._issued[key] = AsyncSum(grads, self.group, self.dtype, self.kind)

    def finish(self, unsummed: Callable[[Collection[int]], list[torch.Tensor]]) -> None:
        """Wait for the sums issued in the last backward, then, if gradients are pending,
        sum ``unsummed(issued keys)`` (one all-reduce); every copy calls it together."""
        issued, self._issued, self._backwards = self._issued, {}, {}
        for pending in issued.values():
            pending.finish()
        if not self.pending:
            return
        self.pending = False
        grads = unsummed(issued.keys())
        if grads:
            AsyncSum(grads, self.group, self.dtype, self.kind).finish()
