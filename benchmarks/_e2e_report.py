"""The ratios, the targets they are held to and the markdown table of an e2e run."""

from __future__ import annotations

from typing import Any

TARGETS = {
    "vs_torchtitan_shipped": 2.5,
    "vs_torchtitan_fp32_experts": 1.5,
    "mfu_1_rank": 0.75,
    "scaling_2_over_1_rank": 0.95,
}


def _best_europa(configs: list[dict], world: int) -> dict | None:
    ours = [c for c in configs if c["system"] == "europa" and c["ranks"] == world]
    return max(ours, key=lambda c: c["tokens_per_s"], default=None)


def _find(configs: list[dict], name: str, world: int) -> dict | None:
    return next((c for c in configs if c["config"] == name and c["ranks"] == world), None)


def _best_torchtitan(configs: list[dict], family: str, world: int) -> dict | None:
    """torchtitan's fastest layout of one expert dtype (``family`` and ``family-<layout>``)."""
    theirs = [
        c
        for c in configs
        if c["system"] == "torchtitan"
        and c["ranks"] == world
        and (c["config"] == family or c["config"].startswith(f"{family}-"))
    ]
    return max(theirs, key=lambda c: c["tokens_per_s"], default=None)


def ratios_and_targets(configs: list[dict]) -> dict[str, Any]:
    """europa's fastest layout at each rank count against torchtitan's fastest layout of
    each expert dtype (as shipped, fp32 experts),
    every configuration's 2-rank / 1-rank throughput, and the targets as booleans (None
    where this run lacks what a target needs: 1 and 2 ranks, both systems)."""
    worlds = sorted({c["ranks"] for c in configs})
    vs: dict[str, dict[str, Any]] = {}
    for world in worlds:
        best = _best_europa(configs, world)
        if best is None:
            continue
        row: dict[str, Any] = {"europa_config": best["config"]}
        for titan in ("torchtitan-shipped", "torchtitan-fp32-experts"):
            other = _best_torchtitan(configs, titan, world)
            ratio = best["tokens_per_s"] / other["tokens_per_s"] if other else None
            row[f"over_{titan}"] = ratio
            row[f"{titan}_config"] = other["config"] if other else None
        vs[f"{world}_rank"] = row
    scaling = {}
    for one in (c for c in configs if c["ranks"] == 1):
        two = _find(configs, one["config"], 2)
        if two:
            scaling[one["config"]] = two["tokens_per_s"] / one["tokens_per_s"]
    best_one, best_two = _best_europa(configs, 1), _best_europa(configs, 2)
    if best_one and best_two:
        scaling["europa_best"] = best_two["tokens_per_s"] / best_one["tokens_per_s"]
    both = "1_rank" in vs and "2_rank" in vs
    return {
        "europa_vs_torchtitan": vs,
        "scaling_2_over_1_rank": scaling,
        "targets": {
            "thresholds": TARGETS,
            "vs_torchtitan_shipped": _all_at_least(
                [row["over_torchtitan-shipped"] for row in vs.values()] if both else [],
                TARGETS["vs_torchtitan_shipped"],
            ),
            "vs_torchtitan_fp32_experts": _all_at_least(
                [row["over_torchtitan-fp32-experts"] for row in vs.values()] if both else [],
                TARGETS["vs_torchtitan_fp32_experts"],
            ),
            "mfu_1_rank": _all_at_least(
                [best_one["mfu"]] if best_one else [], TARGETS["mfu_1_rank"]
            ),
            "scaling_2_over_1_rank": _all_at_least(
                [scaling.get("europa_best")] if best_one and best_two else [],
                TARGETS["scaling_2_over_1_rank"],
            ),
        },
    }


def _all_at_least(values: list[float | None], threshold: float) -> bool | None:
    if not values or None in values:
        return None
    return all(v >= threshold for v in values)


def markdown_table(configs: list[dict]) -> str:
    head = (
        "| system | configuration | ranks | tokens/s | step s | forward | backward | optimizer "
        "| other | exposed comm. | GFLOP/s | MFU |"
    )
    lines = [head, "|" + "---|" * 12]
    for c in configs:
        p = c["phases_s"]
        lines.append(
            f"| {c['system']} | {c['config']} | {c['ranks']} | {c['tokens_per_s']:.0f} "
            f"| {c['step_s']:.3f} | {p['forward']:.3f} | {p['backward']:.3f} "
            f"| {p['optimizer']:.3f} | {p['other']:.3f} | {c['exposed_communication_s']:.3f} "
            f"| {c['achieved_flops_per_s'] / 1e9:.1f} | {c['mfu']:.2f} |"
        )
    return "\n".join(lines)
