"""What an expert exchange puts on the wire, in bytes, and what uniform routing makes of it.

Pure Python (no torch): the planner (``europa_plan``) and the byte checks use it.

Rows. Every exchange sends rows of one packed layout (``europa.flexshard.exchange.all_to_all``):

* towards the experts (forward dispatch, and the backward of combine) the token
  itself in the *dispatch* wire dtype: the compute dtype, bf16, or FP8 (e4m3) with
  one fp32 scale per 128 values;
* back from the experts (forward combine, and the backward of dispatch) in the
  *combine* wire dtype: the compute dtype, or bf16 when the dispatch dtype is
  lower than the compute dtype (combine outputs and their gradients stay at least
  bf16);
* the two-level dispatcher adds, to each row towards the experts, the token's
  ``top_k`` routing slots (int32 local expert ids, -1 off the destination; fp32
  scores), and to each row of the backward of dispatch the scores' gradients.

Counts (int64) go first, so every buffer is sized exactly: the flat dispatcher
sends one per expert (to its owner), the two-level one one per destination node
(between nodes), then one per destination rank (inside the node).

Links. Ranks are numbered node by node; a row to another node crosses the
inter-node link, a row to another rank of the node the intra-node one, a row to
oneself no link at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WIRE_DTYPES = ("compute", "bfloat16", "float8_e4m3fn")
FP8_BLOCK = 128  # values sharing one fp32 scale
SCALE_BYTES = ID_BYTES = SCORE_BYTES = 4
COUNT_BYTES = 8
VALUE_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1}  # per value, before FP8's scales
INTER, INTRA = "inter_node", "intra_node"
DISPATCHES = ("flat", "two_level")


def row_bytes(wire: str, cols: int, compute_itemsize: int) -> int:
    """Bytes of one row of ``cols`` values in wire dtype ``wire``."""
    if wire == "compute":
        return cols * compute_itemsize
    if wire == "bfloat16":
        return cols * 2
    if wire == "float8_e4m3fn":
        return cols + SCALE_BYTES * math.ceil(cols / FP8_BLOCK)
    raise ValueError(f"wire dtype {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")


@dataclass(frozen=True)
class Wire:
    """The wire dtypes of a run: ``dispatch`` as configured; combine follows it."""

    dispatch: str = "compute"
    compute_itemsize: int = 4

    @property
    def combine(self) -> str:
        lower = self.dispatch != "compute" and VALUE_BYTES[self.dispatch] < self.compute_itemsize
        return "bfloat16" if lower else "compute"

    def dispatch_row(self, dim: int) -> int:
        return row_bytes(self.dispatch, dim, self.compute_itemsize)

    def combine_row(self, dim: int) -> int:
        return row_bytes(self.combine, dim, self.compute_itemsize)


@dataclass(frozen=True)
class RowBytes:
    """Bytes per row of each exchange of one dispatcher."""

    dispatch: int  # forward, towards the experts
    dispatch_grad: int  # backward of dispatch, back from the experts
    combine: int  # forward, back from the experts
    combine_grad: int  # backward of combine, towards the experts

    @classmethod
    def of(cls, dispatch: str, wire: Wire, dim: int, top_k: int) -> RowBytes:
        routing = top_k * (ID_BYTES + SCORE_BYTES) if dispatch == "two_level" else 0
        score_grads = top_k * SCORE_BYTES if dispatch == "two_level" else 0
        return cls(
            dispatch=wire.dispatch_row(dim) + routing,
            dispatch_grad=wire.combine_row(dim) + score_grads,
            combine=wire.combine_row(dim),
            combine_grad=wire.dispatch_row(dim),
        )

    def forward(self) -> int:
        return self.dispatch + self.combine

    def backward(self) -> int:
        return self.dispatch_grad + self.combine_grad


def _miss(experts: float, avoided: float, top_k: int) -> float:
    """P(none of ``top_k`` distinct uniform picks out of ``experts`` lands in ``avoided``)."""
    kept = experts - avoided
    if kept < top_k:
        return 0.0
    return math.comb(round(kept), top_k) / math.comb(round(experts), top_k)


@dataclass(frozen=True)
class ExpertGroup:
    """An ep group as the byte model sees it: ``nodes × per_node`` ranks splitting
    ``num_experts`` evenly, each token picking ``top_k`` distinct experts uniformly among
    those of ``max_nodes`` nodes chosen uniformly (``max_nodes = 0``: all of them)."""

    num_experts: int
    ep: int
    per_node: int
    top_k: int
    max_nodes: int = 0

    @property
    def nodes(self) -> int:
        return max(1, self.ep // self.per_node)

    @property
    def local(self) -> int:
        return min(self.ep, self.per_node)

    @property
    def _reachable_nodes(self) -> int:
        return self.max_nodes or self.nodes

    def _hit(self, avoided: float) -> float:
        """P(a token reaches a given set of ``avoided`` experts of one reachable node)."""
        reachable = self._reachable_nodes * self.num_experts / self.nodes
        return 1.0 - _miss(reachable, avoided, self.top_k)

    @property
    def _node_reached(self) -> float:
        return self._reachable_nodes / self.nodes  # P(a given node is among the chosen)

    def other_nodes_per_token(self) -> float:
        """Expected distinct other nodes a token's experts sit on."""
        per_node = self.num_experts / self.nodes
        return (self.nodes - 1) * self._node_reached * self._hit(per_node)

    def other_local_ranks_per_token(self) -> float:
        """Expected ranks, other than the forwarding one, a token reaches inside the nodes
        it goes to (the fan-out of the two-level dispatch)."""
        per_rank = self.num_experts / self.ep
        return (self.ep - self.nodes) * self._node_reached * self._hit(per_rank)

    def pair_fractions(self) -> tuple[float, float]:
        """(off the node, on the node but another rank) share of (token, expert) pairs."""
        node = 1.0 / self.nodes
        return 1.0 - node, node - 1.0 / self.ep


def expected_bytes_per_token(
    group: ExpertGroup, dispatch: str, rows: RowBytes, *, forward_passes: int = 1
) -> dict[str, float]:
    """Mean bytes one rank sends per token of its micro-batch through one MoE layer, in
    ``forward_passes`` forwards (2 when a recomputation exchanges again) and one backward,
    by link; counts are per layer call, not per token (see ``expected_count_bytes``)."""
    if dispatch == "flat":
        inter_rows, intra_rows = (group.top_k * f for f in group.pair_fractions())
        per_row = forward_passes * rows.forward() + rows.backward()
        return {INTER: inter_rows * per_row, INTRA: intra_rows * per_row}
    if dispatch == "two_level":
        per_row = forward_passes * rows.forward() + rows.backward()
        return {
            INTER: group.other_nodes_per_token() * per_row,
            INTRA: group.other_local_ranks_per_token() * per_row,
        }
    raise ValueError(f"dispatch {dispatch!r}: expected one of {', '.join(DISPATCHES)}")


def expected_count_bytes(group: ExpertGroup, dispatch: str, *, calls: int = 1) -> dict[str, int]:
    """Bytes of the counts one rank sends in ``calls`` dispatches (forwards) of one layer."""
    if dispatch == "flat":
        per_node = group.num_experts // group.nodes
        per_rank = group.num_experts // group.ep
        inter = (group.num_experts - per_node) * COUNT_BYTES
        intra = (per_node - per_rank) * COUNT_BYTES
    else:
        inter = (group.nodes - 1) * COUNT_BYTES
        intra = (group.local - 1) * COUNT_BYTES
    return {INTER: calls * inter, INTRA: calls * intra}


def kept_bytes_per_token(group: ExpertGroup, dispatch: str, rows: RowBytes) -> float:
    """Mean bytes one rank keeps per token of one MoE layer when the exchanges' results are
    kept for the recomputation: every buffer it received (its own rows included)."""
    if dispatch == "flat":
        return group.top_k * (rows.dispatch + rows.combine)
    # Rows received per token, by symmetry: every node (stage 1) and every rank (stage 2)
    # of the group the token reaches, one's own included.
    nodes = group.nodes * group._node_reached * group._hit(group.num_experts / group.nodes)
    ranks = group.ep * group._node_reached * group._hit(group.num_experts / group.ep)
    return (nodes + ranks) * (rows.dispatch + rows.combine)
