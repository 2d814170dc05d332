"""The bytes a rank's program sends, by the planner's kinds of traffic and by link.

Design note. ``TrafficCount`` replaces the ``torch.distributed`` entry points the layouts
call (they look them up at call time, as europa-overlap's timeline relies on too) with
wrappers that count, then call the real one (the fake backend returns at once). Each call
is counted the way the planner counts it (``europa.core.plan.traffic``), so the two can be
compared kind by kind:

* a ring collective over a group of ``n`` ranks: an all-gather sends its input ``n - 1``
  times, a reduce-scatter ``(n - 1) / n`` of its input, an all-reduce twice that; on the
  intra-node link if every rank of the group shares this rank's node, else inter-node,
  or with NCCL (``rails``: its ring a rail) split between the two as the planner splits it
  (``europa.plan.links.ring_network_share`` of it across, by the group's ranks on this
  rank's node);
* an all-to-all and a point-to-point send: each destination's rows on the link to that
  destination's node (nothing for the rows a rank keeps);
* copies between the device and the host (offload) are seen by the fake mode as ops
  (``op``), by direction.

A call's kind is the tag its tensor carries (``europa.spec.tags.traffic_kind``), else the
entry point's (``ENTRY_KINDS``); an all-reduce nobody tagged is "all_reduce".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from europa.core.plan.traffic import EXCHANGE_KIND, ring_split
from europa.spec.tags import traffic_kind

INTRA, INTER = "intra_node", "inter_node"
DEVICE_TO_HOST, HOST_TO_DEVICE = "device_to_host", "host_to_device"
HOST_COPIES = "host_copies"
ENTRY_KINDS = {
    "all_gather_single": "parameter_gather",
    "all_gather_into_tensor": "parameter_gather",
    "reduce_scatter_single": "gradient_reduce_scatter",
    "reduce_scatter_tensor": "gradient_reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": EXCHANGE_KIND,
    "broadcast": "broadcast",
    "isend": "send",
    "send": "send",
}
_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


@dataclass
class TrafficCount:
    """Bytes this rank (``rank`` of the world, ``per_node`` ranks a node) sends, while
    ``counting``."""

    rank: int
    per_node: int
    rails: bool = False  # NCCL: a ring a rail (see the note)
    counting: bool = False
    sent: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _originals: dict[str, object] = field(default_factory=dict)
    _inside: bool = False
    _group_ranks: dict[int, list[int]] = field(default_factory=dict)

    # -- wiring ------------------------------------------------------------------------------

    def __enter__(self) -> TrafficCount:
        # Both names of each entry point, as europa-overlap's timeline replaces them (it
        # then wraps these wrappers, and puts them back when it is done).
        for name in ENTRY_KINDS:
            original = getattr(dist.distributed_c10d, name)
            self._originals[name] = original
            counted = self._wrap(name, original)
            setattr(dist.distributed_c10d, name, counted)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist.distributed_c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original):
        def counted(*args, **kwargs):
            if not self.counting or self._inside:  # an entry point calling another
                return original(*args, **kwargs)
            self._count(name, *args, **kwargs)
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        counted.__wrapped__ = original
        return counted

    # -- counting ----------------------------------------------------------------------------

    def _add(self, kind: str, link: str, nbytes: float) -> None:
        if nbytes:
            self.sent[kind, link] += round(nbytes)
            self.calls[kind, link] += 1

    def _ranks(self, group) -> list[int]:
        group = group if group is not None else dist.group.WORLD
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = dist.get_process_group_ranks(group)
        return self._group_ranks[key]

    def _link_to(self, peer: int) -> str:
        return INTRA if peer // self.per_node == self.rank // self.per_node else INTER

    def _ring_links(self, ranks: list[int]) -> dict[str, float]:
        members = sum(self._link_to(r) == INTRA for r in ranks)
        return ring_split(members, len(ranks), self.rails)

    def _count(self, name: str, *args, **kwargs) -> None:
        bound = _bind(name, args, kwargs)
        tensor = bound["tensor"]
        kind = traffic_kind(tensor) or ENTRY_KINDS[name]
        group = bound.get("group")
        nbytes = tensor.numel() * tensor.element_size()
        if name in ("isend", "send"):
            peer = bound["peer"]
            if peer is not None and group is not None and bound.get("group_peer", False):
                peer = self._ranks(group)[peer]
            self._add(kind, self._link_to(peer), nbytes)
            return
        ranks = self._ranks(group)
        n = len(ranks)
        if n <= 1:
            return
        if name == "all_to_all_single":
            self._count_all_to_all(kind, ranks, tensor, bound.get("splits"))
            return
        share = {
            "all_gather_single": n - 1,
            "all_gather_into_tensor": n - 1,
            "reduce_scatter_single": (n - 1) / n,
            "reduce_scatter_tensor": (n - 1) / n,
            "all_reduce": 2 * (n - 1) / n,
            "broadcast": 1 if self.rank == bound.get("peer") else 0,
        }[name]
        for link, part in self._ring_links(ranks).items():
            self._add(kind, link, nbytes * share * part)

    def _count_all_to_all(self, kind, ranks, tensor, splits) -> None:
        rows = tensor.shape[0] if tensor.dim() else 0
        row_bytes = tensor.numel() * tensor.element_size() // rows if rows else 0
        if splits is None:
            splits = [rows // len(ranks)] * len(ranks)
        for peer, count in zip(ranks, splits, strict=True):
            if peer != self.rank:
                self._add(kind, self._link_to(peer), count * row_bytes)

    def op(self, func, args, kwargs, out) -> None:
        """A copy between the device and the host (the fake mode's observer)."""
        if not self.counting or func not in _COPIES:
            return
        if func is torch.ops.aten.copy_.default:
            target, source = args[0], args[1]
        else:
            source, target = args[0], out
        kinds = (source.device.type == "cpu", target.device.type == "cpu")
        if kinds == (False, True):
            self._add(HOST_COPIES, DEVICE_TO_HOST, source.numel() * source.element_size())
        elif kinds == (True, False):
            self._add(HOST_COPIES, HOST_TO_DEVICE, source.numel() * source.element_size())

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (kind, link), nbytes in sorted(self.sent.items()):
            out[kind][link] = nbytes
        return dict(out)


def _bind(name: str, args: tuple, kwargs: dict) -> dict:
    """The arguments a count needs, from either calling convention."""

    def arg(position: int, key: str, default=None):
        return args[position] if len(args) > position else kwargs.get(key, default)

    if name in ("isend", "send"):
        group_dst = kwargs.get("group_dst")
        return {
            "tensor": arg(0, "tensor"),
            "peer": group_dst if group_dst is not None else arg(1, "dst"),
            "group": arg(2, "group"),
            "group_peer": group_dst is not None,
        }
    if name == "all_reduce":
        return {"tensor": arg(0, "tensor"), "group": arg(2, "group")}
    if name == "broadcast":
        return {"tensor": arg(0, "tensor"), "peer": arg(1, "src"), "group": arg(2, "group")}
    if name == "all_to_all_single":
        splits = arg(3, "input_split_sizes")
        return {"tensor": arg(1, "input"), "splits": splits, "group": arg(4, "group")}
    if name.startswith("reduce_scatter"):
        return {"tensor": arg(1, "input"), "group": arg(3, "group")}
    return {"tensor": arg(1, "input_tensor"), "group": arg(2, "group")}  # all-gathers
