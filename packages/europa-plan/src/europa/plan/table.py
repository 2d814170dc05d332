"""A plan as text: one block per run, its lines aligned."""

from __future__ import annotations

from typing import Any


def _line(label: str, value: Any) -> str:
    return f"  {label:<16} {value}"


def plan_block(plan: dict[str, Any]) -> str:
    lines = [
        plan["id"],
        _line("model on gpus", f"{plan['model']} on {plan['gpus']} × {plan['gpu']}"),
    ]
    lines.append(_line("layout", plan["layout"]))
    lines.append(_line("batch", f"{plan['tokens_per_step']:,} tokens a step, "
                                f"{plan['micro_batches']} micro-batches a pipeline"))  # fmt: skip
    if plan["assumed"]:
        lines.append(_line("assumed", "left out, planner's default: " + ", ".join(plan["assumed"])))
    return "\n".join(lines)


def plans_table(plans: list[dict[str, Any]]) -> str:
    return "\n\n".join(plan_block(p) for p in plans)
