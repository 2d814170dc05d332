"""A rank's device memory at the moments of a step that can hold its peak.

Design note. A rank's memory is not the sum of each kind's largest amount: the gradients
are whole only at the end of backward, when the saved activations are gone; a block's
unsharded gradients exist only during its own backward. So the planner follows the step
(the order ``europa plan --execute`` measured it in, on the seed scenario's rank 0) and
takes the largest of five moments, each the sum of what is alive then:

* **forward**, the last micro-batch's last block: the saved activations, the root unit
  (gathered when the model's forward starts, kept to backward), the block in use and the
  one prefetched, the blocks kept gathered to backward; earlier micro-batches' gradients;
  the block of scores QK-clip's maxima compute beside a fused attention kernel;
* **block backward**, at either end of the blocks: the same gathered units, every
  gradient, that block's unsharded gradients, the rows its reduce-scatter sends
  (``gathered_unit_wire_elements``: the widest share from every rank, on the collectives'
  path) and the share it receives (by direct transfers, on gloo: a buffer for each other
  rank's contribution to its own pieces); at the first block in backward every saved activation
  and no once-a-step sum yet, at the last one only the block recomputed and the copies
  every other unit's sum sends (issued in the last backward, held until they finish);
  at either, the gradients its attention kernel returns
  (``europa.core.plan.attention_gradients``);
* **end of backward**: the root unit's turn (its gradient completes last: the embedding's):
  the root gathered, its unsharded gradients, rows and share, every other gradient, and
  every other unit's sum copies;
* **optimizer**: the gradients, the sum copies finishing (at clipping), then the optimizer
  state on the device (a chunk of it when europa-offload keeps it on the host) and its
  workspace.

Model buffers (RoPE tables, expert counters: every rank holds them whole) and the
parameters are alive at every moment. Expert exchange buffers belong to forward and block
backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.spec.plan_layout import ROOT_UNIT


@dataclass(frozen=True)
class Moment:
    name: str
    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds for the whole step, in bytes."""

    parameters: int
    gradients: int
    optimizer_state: int  # on the device between steps (0 when offloaded)
    optimizer_step_state: int  # on the device during the optimizer step
    root_gradients: int  # this rank's share of the root unit's gradients
    model_buffers: int
    index: int = 0  # its position in the gather group


def _unit(units: dict[str, int], wire: dict[str, int], unit: str, ranks: int):
    elements = units.get(unit, 0)
    rows = wire.get(unit, elements)
    return elements, rows, -(-rows // ranks) if ranks else 0  # full, rows, share


def device_moments(
    layout: dict,
    rank: RankMemory,
    *,
    compute_bytes: int,
    reduce_bytes: int,
    activations: int,
    recomputed: int,
    expert_buffers: int,
    kept_blocks: list[str],
    micro_batches: int,
    attention_gradients: int = 0,
    attention_scores: int = 0,
) -> list[Moment]:
    """The moments of the design note, for ``rank`` of ``layout``."""
    units = layout["gathered_unit_elements"]
    wire = layout.get("gathered_unit_wire_elements") or units
    ranks = layout["gather_group_size"]
    blocks = {u: n for u, n in units.items() if u != ROOT_UNIT}
    largest = max(blocks, key=blocks.get, default=None)
    root, root_rows, root_share = _unit(units, wire, ROOT_UNIT, ranks)
    block, block_rows, block_share = _unit(units, wire, largest, ranks) if largest else (0, 0, 0)
    kept = sum(blocks[u] for u in kept_blocks if u != largest)
    gathered = (root + 2 * block + kept) * compute_bytes
    sums = _sum_copies(layout) * reduce_bytes
    root_sums = _root_sum_copies(layout, rank, reduce_bytes)
    earlier = rank.gradients if micro_batches > 1 else 0
    always = {"parameters": rank.parameters, "model_buffers": rank.model_buffers}

    direct = layout.get("direct_transfers") and layout.get("unit_rank_elements") is not None

    def buffers(full: int, rows: int, share: int, unit: str | None) -> int:
        """A unit's unsharded gradients and what its reduce-scatter sends and receives: the
        padded rows and this rank's share, or, by direct transfers, a buffer for each other
        rank's contribution to this rank's pieces."""
        if ranks == 1:
            return 0
        if direct:
            own = layout["unit_rank_elements"].get(unit, [0] * ranks)[rank.index]
            rows, share = (ranks - 1) * own, 0
        return full * compute_bytes + (rows + share) * reduce_bytes

    before_step = always | {"optimizer_state": rank.optimizer_state}
    forward = {
        "gradients": earlier,
        "activations": activations,
        "gathered_parameters": gathered,
        "expert_buffers": expert_buffers,
        "attention_scores": attention_scores,
    }
    block_backward = {
        "gradients": rank.gradients,
        "gathered_parameters": gathered,
        "gradient_buffers": buffers(block, block_rows, block_share, largest),
        "expert_buffers": expert_buffers,
        "activation_gradients": attention_gradients,
    }
    first_block = {"activations": activations, "sum_buffers": 0}
    last_block = {"activations": recomputed, "sum_buffers": sums - root_sums}
    end_of_backward = {
        "gradients": rank.gradients - (rank.root_gradients if micro_batches == 1 else 0),
        "gathered_parameters": root * compute_bytes,
        "gradient_buffers": buffers(root, root_rows, root_share, ROOT_UNIT),
        "sum_buffers": sums - root_sums,
    }
    optimizer = {
        "gradients": rank.gradients,
        "optimizer_state": rank.optimizer_step_state,
        "sum_buffers": sums,
        "optimizer_workspace": 3 * 4 * layout.get("largest_step_gather_elements", 0),
    }
    return [
        Moment("forward", before_step | forward),
        Moment("first block backward", before_step | block_backward | first_block),
        Moment("last block backward", before_step | block_backward | last_block),
        Moment("end of backward", before_step | end_of_backward),
        Moment("optimizer", always | optimizer),
    ]


def _sum_copies(layout: dict) -> int:
    """Elements the once-a-step sums copy into their reduce dtype (held until they finish):
    the non-expert ones over the replicas, the experts' over their copies."""
    elements = 0
    replica = layout.get("replica_group")
    if replica and not replica.get("per_micro_batch", True) and replica["size"] > 1:
        stored = max(layout["stored_elements"], default=0)
        elements += layout.get("replicated_elements", stored)
    copies = layout.get("expert_copies")
    if copies and not copies.get("per_micro_batch", True) and copies.get("group_size", 1) > 1:
        elements += copies["elements"]
    return elements


def _root_sum_copies(layout: dict, rank: RankMemory, reduce_bytes: int) -> int:
    """Of the sum copies, the root unit's: issued only once its gradient is complete."""
    replica = layout.get("replica_group")
    if not replica or replica.get("per_micro_batch", True) or replica["size"] <= 1:
        return 0
    return rank.root_gradients // 4 * reduce_bytes


def peak(moments: list[Moment]) -> Moment:
    return max(moments, key=lambda m: m.total)
