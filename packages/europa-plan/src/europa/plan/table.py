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
    flops = plan["flops_per_token"]
    counted = f"{flops['planned']:.1f} GFLOP a token ({flops['convention']})"
    if flops["source"] is not None:
        counted += f", source {flops['source']:.1f}: ratio {flops['ratio']:.3f}"
    lines.append(_line("model FLOPs", counted))
    ex = plan["executed_flops_per_token"]
    lines.append(
        _line(
            "executed",
            f"{ex['total']:.1f} GFLOP a token: dense GEMMs {ex['dense_gemm']:.1f}, "
            f"experts {ex['expert_gemm']:.1f}, attention {ex['attention']:.1f}, "
            f"other {ex['other']:.2f} (recompute {ex['recompute']:.1f}); "
            f"{plan['executed_tflop_per_gpu_step']:,.0f} TFLOP a GPU a step",
        )
    )
    mem = plan["memory_gib"]
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(
        _line(
            "memory a GPU",
            f"{mem['planned']:.1f} of {mem['hbm']:.0f} GiB, {verdict} (pipeline rank "
            f"{mem['rank']}): weights {mem['weights']:.1f}, gradients {mem['gradients']:.1f}, "
            f"optimizer {mem['optimizer']:.1f}, activations {mem['activations']:.1f} "
            f"({mem['micro_batches_in_flight']:g} micro-batches in flight), "
            f"buffers {mem['buffers']:.1f}",
        )
    )
    time = plan["time"]
    step = f"{time['predicted_step_s']:.2f} s predicted"
    if "published_step_s" in time:
        step += f", published {time['published_step_s']:.2f} s: ratio {time['ratio']:.2f}"
    elif "published_tflops_per_gpu" in time:
        step += (
            f" ({time['predicted_tflops_per_gpu']:.0f} TFLOP/s a GPU), published "
            f"{time['published_tflops_per_gpu']:.0f} TFLOP/s: ratio {time['ratio']:.2f}"
        )
    lines.append(_line("step", step))
    terms = ", ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f}" for k, v in time["terms"].items() if v
    )
    lines.append(_line("  made of", terms))
    if plan["assumed"]:
        lines.append(_line("assumed", "left out, planner's default: " + ", ".join(plan["assumed"])))
    return "\n".join(lines)


def plans_table(plans: list[dict[str, Any]]) -> str:
    return "\n\n".join(plan_block(p) for p in plans)
