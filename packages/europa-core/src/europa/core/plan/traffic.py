"""Bytes each rank sends per optimizer step, by kind, and the link they cross.

Ring collectives: an all-gather or reduce-scatter over ``n`` ranks of a
``b``-byte tensor sends ``b·(n-1)/n`` from each rank; an all-reduce twice that.
A group whose ranks all sit on one node uses the intra-node link, any other the
inter-node one (ranks are numbered node by node; the mesh is
``[dp_replicate, dp_shard, ep]``, ``ep`` innermost). Host copies are two records, one a
direction (``device_to_host`` out, ``host_to_device`` back), each timed at its own rate.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from europa.core.plan.hardware import DEVICE_TO_HOST, HOST_TO_DEVICE
from europa.plan.links import ring_network_share
from europa.spec.plan_layout import (
    CONTEXT_GATHER,
    CONTEXT_REDUCE_SCATTER,
    QUERIES_BACKWARD,
    QUERIES_FORWARD,
    ROOT_UNIT,
    STEP,
)
from europa.spec.qk_clip import MAXIMA_TRAFFIC

INTRA, INTER, HOST = "intra_node", "inter_node", "host_device"


def contiguous_link(size: int, gpus_per_node: int) -> str:
    return INTRA if size <= gpus_per_node else INTER


def strided_link(size: int, stride: int, gpus_per_node: int) -> str:
    return INTRA if stride * (size - 1) < gpus_per_node else INTER


def ring_links(size: int, stride: int, gpus_per_node: int, rails: bool) -> dict[str, float]:
    """Of the bytes a rank of a ring collective sends, the share on each link: all on the
    intra-node link within one node; across nodes, with a network link a GPU (``rails``:
    NCCL's ring per rail), ``europa.plan.links.ring_network_share`` of them on the
    inter-node link, else (gloo's one ring) all of them, as the rank at the crossing
    sends them."""
    if strided_link(size, stride, gpus_per_node) == INTRA:
        return {INTRA: 1.0}
    members = min(size, max(1, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return ring_split(members, size, rails)


def ring_split(members: int, size: int, rails: bool) -> dict[str, float]:
    """The shares by link of a ring over ``size`` ranks, ``members`` of them on a rank's
    node (``ring_links``; the execution's count takes the same)."""
    if members >= size:
        return {INTRA: 1.0}
    across = ring_network_share(members) if rails else 1.0
    return {INTRA: 1.0 - across, INTER: across} if across < 1 else {INTER: 1.0}


def ring_share(size: int) -> float:
    return (size - 1) / size if size > 1 else 0.0


EXCHANGE_KIND = "expert_all_to_all"  # tokens to their experts and back

# The collective each kind of traffic is (a hardware profile may rate each on its own).
COLLECTIVE = {
    "parameter_gather": "all_gather",
    "optimizer_step": "all_gather",
    "gradient_reduce_scatter": "reduce_scatter",
    "gradient_replica_all_reduce": "all_reduce",
    "expert_gradient_all_reduce": "all_reduce",
    EXCHANGE_KIND: "all_to_all",
    CONTEXT_GATHER: "all_gather",
    CONTEXT_REDUCE_SCATTER: "reduce_scatter",
    MAXIMA_TRAFFIC: "all_reduce",
}


@dataclass(frozen=True)
class Traffic:
    kind: str
    link: str
    bytes_per_step: int
    overlappable: bool  # can run beside computation at all
    # When it can: beside the whole step, or only beside the last micro-batch's backward
    # (once-a-step sums, issued as each gradient completes); ``tail_bytes`` of it only
    # start when that backward ends (the gradient that completes last). Context
    # parallelism's exchange: beside the query projection's forward or backward only.
    window: str = STEP
    tail_bytes: int = 0
    direct: bool = False  # sent as direct transfers, not as the kind's collective

    @property
    def collective(self) -> str | None:
        return "point_to_point" if self.direct else COLLECTIVE.get(self.kind)


def _direct_transfers(
    layout: dict, once: set[str], rank: int | None, gpus_per_node: int
) -> dict[str, tuple[int, int]]:
    """Elements one rank sends per micro-batch when each row travels once, straight into
    place (europa-flexshard on gloo), per link: in a gather its own pieces to every other
    rank, in a reduce-scatter every other rank's pieces of its gradients to their owners.
    Each piece crosses the link to its peer's node (the group's ranks are consecutive)."""
    shares = layout["unit_rank_elements"]
    group = layout["gather_group_size"]
    node = [r // gpus_per_node for r in range(group)]

    def sent(r: int) -> dict[str, tuple[int, int]]:
        out = {}
        for link, same in ((INTRA, True), (INTER, False)):
            peers = [p for p in range(group) if p != r and (node[p] == node[r]) == same]
            passes = {unit: len(peers) * (1 if unit in once else 2) for unit in shares}
            gathered = sum(own[r] * passes[unit] for unit, own in shares.items())
            reduced = sum(own[p] for own in shares.values() for p in peers)
            if gathered or reduced:
                out[link] = (gathered, reduced)
        return out

    if rank is not None:
        return sent(rank)
    return max((sent(r) for r in range(group)), key=lambda links: sum(map(sum, links.values())))


def step_traffic(
    *,
    layout: dict,
    world_size: int,
    replicas: int,
    gpus_per_node: int,
    compute_bytes: int,
    reduce_bytes: int,
    micro_batches: int,
    host_bytes_per_micro_batch: int,
    host_optimizer_bytes: int,
    kept_blocks: Collection[str] = (),
    root_kept: bool = True,
    rails: bool = False,
    rank: int | None = None,
    clip_maxima: tuple[int, int] = (0, 1),
    context_exchange: tuple[int, int, bool] = (0, 1, False),
) -> list[Traffic]:
    """``kept_blocks``: the blocks that keep their gathered parameters from forward to
    backward (``europa.core.plan.memory.kept_blocks``), gathered once a micro-batch.
    ``root_kept``: the root (embedding, final norm, head) stays gathered from forward to
    backward, as it does around a whole model; a pipeline stage gathers each of them as a
    block of its own, again for backward.
    ``rails``: a network link a GPU, each ring collective across nodes split over it and
    NVLink (``ring_links``).
    ``rank``: the rank of the gather group whose bytes to count where they differ by rank
    (direct transfers); default: the one that sends most.
    ``clip_maxima``: QK-clip's maxima (bytes, and the ranks of the run that reduce them
    with one MAX, every stage's included), after the backward and before the optimizer
    step.
    ``context_exchange``: context parallelism's bytes a pass (``europa.core.plan.context``),
    its group's size (cp consecutive ranks) and whether blocks are recomputed (a second
    gather); the attention waits for them."""
    group = layout["gather_group_size"]
    shard_links = ring_links(group, 1, gpus_per_node, rails)
    # Blocks are gathered for forward and again for backward, unless kept between the
    # two; the root of a whole model stays gathered between the two.
    once = {*kept_blocks, *([ROOT_UNIT] if root_kept else [])}
    direct = bool(layout.get("direct_transfers")) and group > 1
    if direct:
        by_link = _direct_transfers(layout, once, rank, gpus_per_node)
    else:
        # What each gather and reduce-scatter moves: the unit, or its padded rows where the
        # ranks' shares differ (FlexShard's whole matrices).
        units = layout.get("gathered_unit_wire_elements") or layout["gathered_unit_elements"]
        passes = sum(n * (1 if unit in once else 2) for unit, n in units.items())
        by_link = {
            link: (passes * ring_share(group) * f, sum(units.values()) * ring_share(group) * f)
            for link, f in shard_links.items()
        }
    stored = layout.get("replicated_elements", max(layout["stored_elements"], default=0))
    replica = layout.get("replica_group") or {
        "size": replicas,
        "stride": world_size // replicas,
        "per_micro_batch": True,
        "overlappable": True,
    }
    replicas, replica_stride = replica["size"], replica["stride"]
    reductions = micro_batches if replica["per_micro_batch"] else 1
    replica_share = 2 * reduce_bytes * ring_share(replicas)
    replicated = stored * replica_share * reductions
    copies = layout.get("expert_copies") or {"elements": 0, "group_size": 1, "stride": 1}
    copy_share = ring_share(copies["group_size"])
    copy_reductions = micro_batches if copies.get("per_micro_batch", True) else 1
    expert_copies = 2 * copies["elements"] * reduce_bytes * copy_share * copy_reductions
    step_gather = layout["optimizer_step_gather_elements"] * 4 * ring_share(group)
    experts = layout.get("expert_all_to_all_bytes_by_link") or {
        contiguous_link(layout["expert_group_size"], gpus_per_node): layout[
            "expert_all_to_all_bytes_per_step"
        ]
    }

    cp_pass, cp, recomputed = context_exchange
    cp_gathers = 2 if recomputed else 1  # a recomputed forward gathers again

    def ring(kind, nbytes, size_stride, overlappable, window=STEP, tail_bytes=0.0):
        """A ring collective's bytes (and tail) split over the links it crosses."""
        shares = ring_links(*size_stride, gpus_per_node, rails)
        for link, f in shares.items():
            yield Traffic(kind, link, int(nbytes * f), overlappable, window, int(tail_bytes * f))

    # A gather sends parameters in the compute dtype, a reduce-scatter gradients in theirs.
    unit_passes = (
        ("parameter_gather", 0, compute_bytes),
        ("gradient_reduce_scatter", 1, reduce_bytes),
    )
    out = [
        *(
            Traffic(kind, link, int(elements[i] * nbytes * micro_batches), True, direct=direct)
            for kind, i, nbytes in unit_passes
            for link, elements in by_link.items()
        ),
        *ring(
            "gradient_replica_all_reduce",
            replicated,
            (replicas, replica_stride),
            replica.get("overlappable", True),
            replica.get("window", STEP),
            replica.get("tail_elements", 0) * replica_share,
        ),
        *ring(
            "expert_gradient_all_reduce",
            expert_copies,
            (copies["group_size"], copies["stride"]),
            copies.get("overlappable", True),
            copies.get("window", STEP),
        ),
        *(Traffic(EXCHANGE_KIND, link, int(n), True) for link, n in experts.items()),
        *ring("optimizer_step", step_gather, (group, 1), overlappable=False),
        *ring(CONTEXT_GATHER, cp_pass * cp_gathers, (cp, 1), True, QUERIES_FORWARD),
        *ring(CONTEXT_REDUCE_SCATTER, cp_pass, (cp, 1), True, QUERIES_BACKWARD),
        *ring(
            MAXIMA_TRAFFIC,
            2 * clip_maxima[0] * ring_share(clip_maxima[1]),
            (clip_maxima[1], 1),
            overlappable=False,
        ),
        # Offloaded activations go out once and come back once a micro-batch; offloaded
        # optimizer state once each way a step. The same bytes each way, at each way's rate.
        *(
            Traffic(
                "host_copies",
                direction,
                host_bytes_per_micro_batch * micro_batches + host_optimizer_bytes,
                True,
            )
            for direction in (DEVICE_TO_HOST, HOST_TO_DEVICE)
        ),
    ]
    return [t for t in out if t.bytes_per_step]
