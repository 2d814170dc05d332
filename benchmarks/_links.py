"""Bytes each all-to-all sends, by the link it crosses: counted by wrapping the collective.

While a ``LinkCounter`` is active, every ``torch.distributed.all_to_all_single`` call of
this process is counted (and then made as usual): for each destination rank of the
group other than this one, the bytes of its split, on the inter-node link when the
destination sits on another node (ranks numbered node by node, ``per_node`` a node),
else on the intra-node link. Integer (int64) tensors are counts, the rest rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

INTER, INTRA = "inter_node", "intra_node"


class LinkCounter:
    def __init__(self, per_node: int) -> None:
        self.per_node = per_node
        self.bytes = {link: {"rows": 0, "counts": 0} for link in (INTER, INTRA)}
        self.calls = 0
        self._original = None

    def __enter__(self) -> LinkCounter:
        self._original = dist.all_to_all_single
        dist.all_to_all_single = self._counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._original

    def _counted(self, output, input, output_split_sizes=None, input_split_sizes=None,
                 group=None, async_op=False):  # fmt: skip
        self.calls += 1
        me = dist.get_rank()
        size = dist.get_world_size(group)
        rows = input.shape[0] if input.dim() else 1
        splits = input_split_sizes or [rows // size] * size
        per_row = input.numel() * input.element_size() // rows if rows else 0
        kind = "counts" if input.dtype == torch.int64 else "rows"
        for index, count in enumerate(splits):
            dest = dist.get_global_rank(group, index) if group is not None else index
            if dest == me:
                continue
            link = INTER if dest // self.per_node != me // self.per_node else INTRA
            self.bytes[link][kind] += count * per_row
        return self._original(output, input, output_split_sizes, input_split_sizes,
                              group=group, async_op=async_op)  # fmt: skip

    def totals(self) -> dict[str, int]:
        return {link: sum(kinds.values()) for link, kinds in self.bytes.items()}
