"""An executed rank beside its plan: memory by the plan's terms, bytes by kind and link.

The plan states one rank's device memory (its state, the transient terms of the most
loaded rank, and ``reserved``, the profile's allowance for the CUDA context, which no
execution sees) and host memory, and the bytes each rank sends per step by kind and link.
With pipeline stages a rank is held against its own pipeline rank's plan (its layers over
its stage's ranks, with the micro-batches it holds at once) and the plan's stage-to-stage
sends of that pipeline rank. An execution measures the same, so each figure gets a ratio,
executed / planned. The
agreement the project holds itself to: device and host peaks within ``MEMORY_TOLERANCE``,
each (kind, link) of traffic within ``TRAFFIC_TOLERANCE``.
"""

from __future__ import annotations

from typing import Any

from europa.core.plan.pipeline_plan import STAGE_KIND

MEMORY_TOLERANCE = 0.10
TRAFFIC_TOLERANCE = 0.05
# Traffic the plan does not model because it is this small (the expert-load counts and the
# gradient norm's sums: a few bytes per expert and layer): shown, never a disagreement.
NEGLIGIBLE_BYTES = 1 << 20
UNPLANNED_DEVICE = ("reserved",)  # planned, never executed: the CUDA context and NCCL


def _ratio(executed: float, planned: float) -> float | None:
    return executed / planned if planned else None


def _within(ratio: float | None, tolerance: float, executed: float) -> bool:
    if ratio is None:
        return executed == 0
    return abs(ratio - 1.0) <= tolerance


def _memory(planned: dict[str, int], executed: dict[str, Any]) -> dict[str, Any]:
    terms = list(planned) + [t for t in executed["by_term"] if t not in planned]
    rows = {
        term: {"planned": planned.get(term, 0), "executed": executed["by_term"].get(term, 0)}
        for term in terms
    }
    total = sum(planned.values())
    ratio = _ratio(executed["total"], total)
    return {
        "terms": rows,
        "planned": total,
        "executed_peak": executed["total"],
        "ratio": ratio,
        "agrees": _within(ratio, MEMORY_TOLERANCE, executed["total"]),
        "largest_at_peak": executed.get("largest", []),
    }


def compare_rank(plan, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` (``europa.core.execute.program.execute``'s) beside ``plan``."""
    own, rank = plan.rank_view(result["rank"])
    device, host = own.terms_of(rank)
    not_executed = {term: device.pop(term) for term in UNPLANNED_DEVICE if term in device}
    planned_traffic = {(t.kind, t.link): t.bytes_per_step for t in own.traffic_of(rank)}
    if plan.pipeline is not None:
        pipeline_rank = plan.pipeline.ranks[result["rank"] // (plan.world_size // plan.pipeline.pp)]
        planned_traffic[STAGE_KIND, plan.pipeline.link] = pipeline_rank.send_bytes
    executed_traffic = {
        (kind, link): nbytes
        for kind, links in result["traffic"].items()
        for link, nbytes in links.items()
    }
    traffic = []
    for key in [*planned_traffic, *(k for k in executed_traffic if k not in planned_traffic)]:
        planned, executed = planned_traffic.get(key, 0), executed_traffic.get(key, 0)
        ratio = _ratio(executed, planned)
        negligible = not planned and executed < NEGLIGIBLE_BYTES
        agrees = negligible or _within(ratio, TRAFFIC_TOLERANCE, executed)
        row = {"kind": key[0], "link": key[1], "planned": planned, "executed": executed}
        traffic.append(row | {"ratio": ratio, "agrees": agrees})
    r = rank % own.layout["group_size"]
    memory = {
        "device": _memory(device, result["memory"]["device"]),
        "host": _memory(host, result["memory"]["host"]),
        "planned_not_executed": not_executed,
        "planned_moments": {m.name: m.total for m in own.memory.moments(r)},
        "executed_phase_peaks": result["memory"]["device"].get("by_phase", {}),
    }
    agrees = all(m["agrees"] for m in (memory["device"], memory["host"]))
    agrees = agrees and all(t["agrees"] for t in traffic)
    return {
        "rank": result["rank"],
        "memory": memory,
        "traffic": traffic,
        "agrees": agrees,
        "checkpoint": result["checkpoint"],
        "stand_in": result["stand_in"],
        "stand_in_reads": result["stand_in_reads"],
        "routing": result["routing"],
        "backend": result["backend"],
        "seconds": result["seconds"],
        "max_rss_bytes": result["max_rss_bytes"],
    }
