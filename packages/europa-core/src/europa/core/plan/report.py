"""A plan as JSON (for machines) and as a plain-text table (for people)."""

from __future__ import annotations

import math
from typing import Any

from europa.core.plan.record import PipelinePlan, Plan
from europa.plan.exposure import StepTime
from europa.spec.lanes import PAIRED_SCHEDULES
from europa.spec.units import human


def _step(t: StepTime, tokens_per_step: int) -> dict[str, Any]:
    return {
        "compute_s": t.compute_s,
        "exposed_communication_s": t.exposed_s,
        "optimizer_s": t.optimizer_s,
        "step_s": t.step_s,
        "mfu": t.mfu,
        "tokens_per_second": tokens_per_step / t.step_s,
    }


def _layout_name(layout: dict) -> str:
    form = layout.get("form")
    return f"{layout['owner']} ({form})" if form else layout["owner"]


def plan_json(plan: Plan) -> dict[str, Any]:
    counts = plan.shapes.counts
    state = plan.state.totals()
    replicate, shard, ep = plan.mesh
    return {
        "config": plan.config.run.name,
        "hardware": plan.hardware.name,
        "world_size": plan.world_size,
        "mesh": {"dp_replicate": replicate, "dp_shard": shard, "ep": ep},
        "layout": plan.layout["owner"],
        "layout_form": plan.layout.get("form"),
        "parameters": {
            **counts.as_dict(),
            "per_tensor": {p.name: p.numel for p in plan.shapes.parameters},
        },
        "memory_per_rank": {
            "device": {
                **plan.device_terms,
                "total": plan.device_total,
                "capacity": plan.device_capacity,
                "fits": plan.fits_device,
            },
            "host": {
                **plan.host_terms,
                "total": plan.host_total,
                "capacity": plan.host_capacity,
                "fits": plan.fits_host,
            },
            "device_moments": {m.name: m.terms | {"total": m.total} for m in plan.moments},
            "device_peak_moment": plan.peak_moment,
            "state_bytes": {"max": max(state), "min": min(state), "mean": sum(state) / len(state)},
            "saved_activations_per_block": plan.activations.per_block,
            "activations_by_checkpointing_mode": plan.activations_by_mode,
        },
        "communication_per_step": [
            {
                "kind": t.kind,
                "link": t.link,
                "bytes_per_rank": t.bytes_per_step,
                "seconds": plan.without_overlap.link_s[t.kind, t.link],
            }
            for t in plan.traffic
        ],
        "model_flops_per_token": plan.model_flops_per_token,
        "tokens_per_step": plan.tokens_per_step,
        "step": {
            "without_overlap": _step(plan.without_overlap, plan.tokens_per_step),
            "with_overlap": _step(plan.with_overlap, plan.tokens_per_step),
            "overlap_enabled": plan.overlap_enabled,
            "compute_priced_by": plan.step.compute_priced_by,
        },
        "checkpoint": {
            "bytes": plan.checkpoint_bytes,
            "bytes_per_rank": plan.checkpoint_bytes / plan.world_size,
            "write_s": plan.checkpoint_write_s,
            "mode": plan.config.checkpoint.mode,
            "every": plan.config.checkpoint.every,
            "staging_bytes_per_rank": plan.checkpoint_staging_bytes,
            "async_staging": {
                "bytes_per_rank": plan.checkpoint_stage_bytes,
                "seconds": plan.checkpoint_stage_s,
            },
            "lost_s": plan.checkpoint_lost_s,
            "read_s": plan.checkpoint_read_s,
        },
        "goodput": plan.goodput.as_dict(),
        "fits": plan.fits,
        "refusal": plan.refusal(),
        "plugins": plan.plugins,
        "pipeline": _pipeline_json(plan.pipeline),
    }


def _pipeline_json(pipeline: PipelinePlan | None) -> dict[str, Any] | None:
    if pipeline is None:
        return None
    return {
        "schedule": pipeline.schedule,
        "pp": pipeline.pp,
        "stages": pipeline.stages,
        "micro_batches": pipeline.micro_batches,
        "stage_modules": [list(m) for m in pipeline.stage_modules],
        "hidden_bytes": pipeline.hidden_bytes,
        "link": pipeline.link,
        "step_s": pipeline.step_s,
        "paired_hidden_s": pipeline.paired_hidden_s,
        "bubble": pipeline.bubble,
        "ranks": [
            {
                "rank": r.rank,
                "stages": list(r.stages),
                "modules": list(r.modules),
                "device_bytes": r.device_bytes,
                "held_micro_batches": r.held_micro_batches,
                "send_bytes": r.send_bytes,
                "busy_s": r.busy_s,
                "bubble": r.bubble,
            }
            for r in pipeline.ranks
        ],
    }


def _paired_note(pipeline: PipelinePlan) -> str:
    if pipeline.schedule not in PAIRED_SCHEDULES:
        return ""
    return (
        f"; paired chunks side by side hide {pipeline.paired_hidden_s:.3g} s of expert "
        "exchange a step"
    )


def _pipeline_table(pipeline: PipelinePlan | None) -> list[str]:
    if pipeline is None:
        return []
    per_rank = pipeline.stages // pipeline.pp
    lines = [
        f"  pipeline (predicted): {pipeline.pp} ranks × {per_rank} stage(s), "
        f"{pipeline.schedule}, {pipeline.micro_batches} micro-batches; a hidden state is "
        f"{human(pipeline.hidden_bytes)} over {pipeline.link}; "
        f"the ranks wait {100 * pipeline.bubble:.1f} % of the step (the bubble)"
        + _paired_note(pipeline),
        _row(
            "pipeline rank (stages)",
            "layers",
            "device peak",
            "held",
            "sent/step",
            "bubble",
            width=26,
        ),
    ]
    for r in pipeline.ranks:
        layers = sum(m.startswith("layers.") for m in r.modules)
        lines.append(
            _row(
                f"{r.rank} ({', '.join(map(str, r.stages))})",
                str(layers),
                human(r.device_bytes),
                f"{r.held_micro_batches:.2g} mb",
                human(r.send_bytes),
                f"{100 * r.bubble:.1f} %",
                width=26,
            )
        )
    return [*lines, ""]


def _row(label: str, *cells: str, width: int = 34) -> str:
    return f"  {label:<{width}}" + "".join(f"{c:>14}" for c in cells)


def plan_table(plan: Plan) -> str:
    counts = plan.shapes.counts
    replicate, shard, ep = plan.mesh
    lines = [
        f"europa plan: {plan.config.run.name} on {plan.hardware.name}, {plan.world_size} "
        f"rank(s) ({_stages(plan)}dp_replicate {replicate} × dp_shard {shard} × ep {ep}), "
        f"layout {_layout_name(plan.layout)}",
        f"  parameters: {_count(counts.total)} total, {_count(counts.active_per_token)} active "
        f"per token, {_count(counts.routed_experts)} in routed experts",
        "",
        _row("memory per rank (most loaded)", "device", "host"),
        f"  (device: at its peak moment, {plan.peak_moment}; "
        + ", ".join(f"{m.name} {human(m.total)}" for m in plan.moments)
        + ", before the reserve)",
    ]
    host = plan.host_terms
    for term, value in plan.device_terms.items():
        lines.append(_row(term, human(value), human(host[term]) if term in host else ""))
    for term, value in host.items():
        if term not in plan.device_terms:
            lines.append(_row(term, "", human(value)))
    lines += [
        _row("total", human(plan.device_total), human(plan.host_total)),
        _row("capacity", human(plan.device_capacity), human(plan.host_capacity)),
        _row("fits", _yes(plan.fits_device), _yes(plan.fits_host)),
        "",
        _row("communication per step, per rank", "link", "bytes", "time"),
    ]
    for t in plan.traffic:
        seconds = plan.without_overlap.link_s[t.kind, t.link]
        lines.append(_row(t.kind, t.link, human(t.bytes_per_step), f"{seconds:.3g} s"))
    if not plan.traffic:
        lines.append("  (none)")
    lines += ["", _row("step time", "without overlap", "with overlap")]
    without, with_ = plan.without_overlap, plan.with_overlap
    tokens = plan.tokens_per_step
    lines += [
        _row("compute", f"{without.compute_s:.3g} s", f"{with_.compute_s:.3g} s"),
        _row("exposed communication", f"{without.exposed_s:.3g} s", f"{with_.exposed_s:.3g} s"),
        _row("optimizer step", f"{without.optimizer_s:.3g} s", f"{with_.optimizer_s:.3g} s"),
        _row("step", f"{without.step_s:.3g} s", f"{with_.step_s:.3g} s"),
        _row("MFU", f"{100 * without.mfu:.1f} %", f"{100 * with_.mfu:.1f} %"),
        _row(
            "tokens/s, all ranks",
            f"{tokens / without.step_s:,.0f}",
            f"{tokens / with_.step_s:,.0f}",
        ),
        f"  (compute: {with_.compute_priced_by})",
        "",
        *_pipeline_table(plan.pipeline),
    ]
    write = plan.checkpoint_write_s
    lines += [
        f"  checkpoint: {human(plan.checkpoint_bytes)} in all, each byte once (about "
        f"{human(plan.checkpoint_bytes / plan.world_size)} a rank); "
        + (
            f"written in {write:.3g} s"
            if write is not None
            else "its write time needs the profile's filesystem_gbps"
        ),
        *_checkpoint_lost(plan),
        "",
        *_goodput(plan),
        "",
    ]
    refusal = plan.refusal()
    lines.append("verdict: fits" if refusal is None else f"verdict: does not fit: {refusal}")
    return "\n".join(lines)


def _stages(plan: Plan) -> str:
    return f"pp {plan.config.parallel.pp} × " if plan.config.parallel.pp > 1 else ""


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.3g} s"


def _checkpoint_lost(plan: Plan) -> list[str]:
    """Both modes' cost per save, the configured one marked, so they can be compared."""
    every, write = plan.config.checkpoint.every, plan.checkpoint_write_s
    lost = plan.checkpoint_lost_s
    unknown = " (needs the profile's filesystem_gbps)" if write is None else ""
    if every:
        between = every * plan.step.step_s
        when = f"checkpoint.every = {every}: {between:.3g} s of training between saves"
        excess = None if write is None else max(0.0, write - between)
        rest = f"{_seconds(excess)} of the write beyond those {between:.3g} s"
    else:
        when = "checkpoint.every = 0: only the final save, whose whole write training waits for"
        rest = f"the whole write, {_seconds(write)}"
    staging = (
        f"{plan.checkpoint_stage_s:.3g} s staging {human(plan.checkpoint_stage_bytes)} "
        "a rank into host memory"
    )
    label = {m: m + (" (configured)" if m == plan.config.checkpoint.mode else "") for m in lost}
    return [
        f"  training time lost per save, predicted ({when}):",
        f"    {label['sync']:<19}{_seconds(lost['sync']):>10}: training waits for the write"
        + unknown,
        f"    {label['async']:<19}{_seconds(lost['async']):>10}: {staging} + {rest}{unknown}",
    ]


def _long_seconds(value: float | None) -> str:
    """Seconds to three figures, whole seconds from 1,000 on (1,006 s, not 1.01e+03 s)."""
    return f"{value:,.0f} s" if value is not None and value >= 1000 else _seconds(value)


def _share(value: float | None) -> str:
    """A percentage with the shortfall from 100 % to two figures (99.9986 %, not 100.00 %)."""
    if value is None:
        return "unknown"
    short = 100 * (1 - value)
    places = 2 if short <= 0 else min(4, max(2, 1 - math.floor(math.log10(short))))
    return f"{100 * value:.{places}f} %"


def _goodput(plan: Plan) -> list[str]:
    """Goodput at checkpoint.every and at the Young–Daly interval, without and (replica
    groups) with fault tolerance, and the figures they come from."""
    g = plan.goodput
    unknown = " (needs the profile's filesystem_gbps)" if g.read_s is None else ""
    steps = "unknown" if g.young_daly_steps is None else f"{g.young_daly_steps:,}"
    between = "whole run" if g.interval_s is None else _long_seconds(g.interval_s)
    lines = [
        _row("goodput (predicted)", "configured", "Young–Daly"),
        _row("checkpoint.every (steps)", f"{g.every:,}" if g.every else "0 (end only)", steps),
        _row("training between saves", between, _long_seconds(g.young_daly_s)),
        _row("without fault tolerance", _share(g.without_ft), _share(g.without_ft_at_young_daly)),
    ]
    if g.replicas > 1:
        lines.append(
            _row("with fault tolerance", _share(g.with_ft), _share(g.with_ft_at_young_daly))
        )
        tolerant = (
            f"; with it one of {g.replicas} replica groups restarts and heals from another in "
            f"{g.heal_s:.3g} s over {g.heal_link} while the others step on"
        )
    else:
        tolerant = "; fault tolerance needs replica groups (parallel.dp_replicate > 1)"
    lines += [
        f"  (a failure every {g.mtbf_s / 3600:,.1f} h: {g.failures_per_gpu_hour:.3g} a GPU-hour "
        f"× {g.gpus:,} GPUs; a restart takes {g.restart_s:.3g} s)",
        f"  (without fault tolerance every rank restarts and reads the checkpoint back, "
        f"{_seconds(g.read_s)}{unknown}, then redoes the work since it{tolerant})",
    ]
    if not g.every:
        lines.append(
            "  (checkpoint.every = 0: without fault tolerance a failure loses the run so far)"
        )
    return lines


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:,}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"
