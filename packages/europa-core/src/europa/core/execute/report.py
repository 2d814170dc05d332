"""Executed ranks beside the plan, as text (for people); ``--json`` prints the comparison."""

from __future__ import annotations

from typing import Any

from europa.core.execute.compare import MEMORY_TOLERANCE, NEGLIGIBLE_BYTES, TRAFFIC_TOLERANCE
from europa.spec.units import human

LARGEST = 5  # storages alive at the device peak, largest first, that the table names


def _ratio(ratio: float | None) -> str:
    return f"{ratio:.3f}" if ratio is not None else "-"


def _memory_rows(title: str, memory: dict[str, Any]) -> list[str]:
    lines = [f"  {title:<24}{'planned':>14}{'executed':>14}{'ratio':>8}"]
    for term, row in memory["terms"].items():
        if row["planned"] or row["executed"]:
            ratio = row["executed"] / row["planned"] if row["planned"] else None
            lines.append(
                f"    {term:<22}{human(row['planned']):>14}{human(row['executed']):>14}"
                f"{_ratio(ratio):>8}"
            )
    mark = "" if memory["agrees"] else f"   beyond ±{MEMORY_TOLERANCE:.0%}"
    lines.append(
        f"    {'peak':<22}{human(memory['planned']):>14}{human(memory['executed_peak']):>14}"
        f"{_ratio(memory['ratio']):>8}{mark}"
    )
    return lines


def execution_table(comparisons: list[dict[str, Any]]) -> str:
    lines = []
    for c in comparisons:
        seconds = c["seconds"]["total"]
        lines.append(
            f"executed rank {c['rank']} (one step on fake tensors, {c['backend']}'s path, "
            f"routing {c['routing']}; {seconds:.0f} s, {human(c['max_rss_bytes'])} resident)"
        )
        lines += _memory_rows("device memory", c["memory"]["device"])
        for nbytes, term, op in c["memory"]["device"]["largest_at_peak"][:LARGEST]:
            lines.append(f"      at the peak: {human(nbytes)} {term} ({op})")
        moments = ", ".join(f"{k} {human(v)}" for k, v in c["memory"]["planned_moments"].items())
        phases = ", ".join(
            f"{k} {human(v)}" for k, v in c["memory"]["executed_phase_peaks"].items()
        )
        lines.append(f"    planned moments: {moments}")
        lines.append(f"    executed peaks by phase: {phases}")
        reserved = c["memory"]["planned_not_executed"]
        if reserved:
            kept = ", ".join(f"{k} {human(v)}" for k, v in reserved.items())
            lines.append(f"    (planned, not executed: {kept})")
        lines += _memory_rows("host memory", c["memory"]["host"])
        header = f"{'bytes sent per step':<24}{'link':>12}{'planned':>12}{'executed':>12}"
        lines.append(f"  {header}{'ratio':>8}")
        for row in c["traffic"]:
            mark = "" if row["agrees"] else f"   beyond ±{TRAFFIC_TOLERANCE:.0%}"
            if not row["planned"] and row["agrees"]:
                mark = f"   unplanned, under {human(NEGLIGIBLE_BYTES)}"
            lines.append(
                f"    {row['kind']:<22}{row['link']:>12}{human(row['planned']):>12}"
                f"{human(row['executed']):>12}{_ratio(row['ratio']):>8}{mark}"
            )
        checkpoint = c["checkpoint"]
        lines.append(
            f"  checkpoint save plan: {checkpoint['items']} items, "
            f"{human(checkpoint['tensor_bytes'])} of tensors this rank holds for DCP"
        )
        if c["stand_in"]:
            lines.append(f"  stand-in: {c['stand_in']}")
        if c["stand_in_reads"]:
            reads = sum(c["stand_in_reads"].values())
            sites = ", ".join(c["stand_in_reads"])
            lines.append(f"  {reads} float read(s) to the host answered by a stand-in: {sites}")
        lines.append(f"  agrees with the plan: {'yes' if c['agrees'] else 'no'}")
    return "\n".join(lines)
