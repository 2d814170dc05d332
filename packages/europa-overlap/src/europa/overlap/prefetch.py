"""Explicit prefetch of parameter gathers, and which blocks reshard after forward.

FSDP2 (``fully_shard``) gathers a block's parameters when the block starts,
unless another block asked for them earlier; ``set_modules_to_forward_prefetch``
/ ``set_modules_to_backward_prefetch`` name the blocks whose all-gather is
issued as soon as this one's is, so it travels while this block computes.
europa-flexshard's gather units take the same request through their prefetch
API (``GatherUnit.set_prefetch``; duck-typed here, this package does not
import europa-flexshard).

Reshard-after-forward: ``"all"`` frees every block's gathered parameters after
its forward (least memory: each is gathered again for backward); ``"none"``
keeps them all until backward (no second gather, most memory);
``"all_but_last"`` keeps only the last block's, which backward needs first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from europa.overlap.errors import OverlapError
from europa.spec.plan_layout import RESHARD_POLICIES as RESHARD_POLICIES  # this package's API too
from europa.spec.plan_layout import reshards


def _ahead(blocks: Sequence[Any], index: int, depth: int) -> list[Any]:
    return list(blocks[index + 1 : index + 1 + depth])


def _behind(blocks: Sequence[Any], index: int, depth: int) -> list[Any]:
    return list(reversed(blocks[max(0, index - depth) : index]))


def prefetch_fsdp(
    blocks: Sequence[Any], depth: int = 1, reshard: str | None = "all", root: Any = None
) -> None:
    """Prefetch schedule for FSDP2 modules ``blocks`` (in forward order) and their ``root``:
    each block's forward issues the next ``depth`` blocks' all-gathers, each block's
    backward the previous ``depth`` ones'; ``reshard`` is the reshard-after-forward policy
    (None: each block keeps its own)."""
    blocks = list(blocks)
    for index, block in enumerate(blocks):
        if reshard is not None:
            block.set_reshard_after_forward(reshards(reshard, index, len(blocks)))
        if depth:
            block.set_modules_to_forward_prefetch(_ahead(blocks, index, depth))
            block.set_modules_to_backward_prefetch(_behind(blocks, index, depth))
    if depth and root is not None and blocks:
        root.set_modules_to_forward_prefetch(blocks[:depth])
        root.set_modules_to_backward_prefetch(list(reversed(blocks))[:depth])


def prefetch_gather_units(
    units: Sequence[Any],
    depth: int = 1,
    reshard: str = "all",
    root: Any = None,
    async_reduce: bool = True,
) -> None:
    """The same for gather units with a ``set_prefetch(forward=, backward=)`` method and
    ``reshard_after_forward`` / ``reduce_scatter_async`` attributes (europa-flexshard's
    ``GatherUnit``). ``units`` are the blocks in forward order; ``root`` (gathered first,
    freed last) prefetches the first blocks in forward and the last ones in backward.
    ``async_reduce``: gradient reduce-scatters run beside the rest of the backward."""
    units = list(units)
    missing = [u for u in [*units, root] if u is not None and not hasattr(u, "set_prefetch")]
    if missing:
        raise OverlapError(
            f"gather unit {type(missing[0]).__name__} has no set_prefetch(); expected "
            "europa-flexshard with its prefetch API (0.1.0 of this repository or later)"
        )
    for unit in [*units, root]:
        if unit is not None:
            unit.reduce_scatter_async = async_reduce
    for index, unit in enumerate(units):
        unit.reshard_after_forward = reshards(reshard, index, len(units))
        unit.set_prefetch(
            forward=_ahead(units, index, depth) if depth else [],
            backward=_behind(units, index, depth) if depth else [],
        )
    if root is not None:
        root.set_prefetch(
            forward=units[:depth] if depth else [],
            backward=list(reversed(units))[:depth] if depth else [],
        )
