"""Plotly figure specifications (plain dicts, drawn by plotly.js in the page)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from europa.report import series
from europa.report.runs import RunData
from europa.spec import metrics
from europa.spec.units import MIB

DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")

TRAINING = "Training"
VALIDATION = "Validation"
SPEED = "Speed and memory"
EXPERTS = "Expert load"
REPLICAS = "Replica groups"
ATTENTION = "Attention logits (QK-clip)"


@dataclass(frozen=True)
class Chart:
    id: str  # unique on the page; tests and the page's script find charts by it
    section: str
    figure: dict[str, Any]  # {"data": [...traces], "layout": {...}}


Column = Callable[[RunData], list[Any]]
Axis = tuple[str, Column]  # its title, and what it reads from a run


def all_charts(runs: list[RunData]) -> list[Chart]:
    charts = [
        *_training(runs),
        *_validation(runs),
        *_speed_and_memory(runs),
        *_expert_load(runs),
        *_replica_groups(runs),
        *_attention_logits(runs),
        *_plugins(runs),
    ]
    return [chart for chart in charts if chart.figure["data"]]


def _layout(title: str, x_title: str, y_title: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": x_title}},
        "yaxis": {"title": {"text": y_title}},
        "height": 320,
        "margin": {"l": 64, "r": 16, "t": 40, "b": 44},
        "hovermode": "x unified",
        "legend": {"orientation": "h", "y": -0.25},
        **extra,
    }


def _line(name: str, x: list[Any], y: list[float | None], dash: str = "solid") -> dict:
    x, y = series.thin(x, y)
    return {
        "type": "scatter",
        "mode": "lines",
        "name": name,
        "x": x,
        "y": y,
        "line": {"dash": dash},
    }


def _per_run(
    runs: list[RunData],
    chart_id: str,
    section: str,
    title: str,
    x: Axis,
    y: Axis,
    scale: float = 1.0,
) -> Chart:
    """One curve per run, so several runs overlay on the same axes."""
    (x_title, x_of), (y_title, y_of) = x, y
    traces = []
    for run in runs:
        ys = y_of(run)
        if any(v is not None for v in ys):
            traces.append(_line(run.label, x_of(run), [_scaled(v, scale) for v in ys]))
    return Chart(chart_id, section, {"data": traces, "layout": _layout(title, x_title, y_title)})


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value / scale


def _key(y_title: str, key: str) -> Axis:
    return y_title, lambda run: series.column(run, key)


STEP: Axis = ("step", series.steps)
TOKENS: Axis = ("tokens seen", series.tokens_seen)
LOSS = _key("cross-entropy", "loss")
LR = _key("learning rate", "lr")


def _training(runs: list[RunData]) -> list[Chart]:
    return [
        _per_run(runs, "loss", TRAINING, "Loss by step", STEP, LOSS),
        _per_run(runs, "loss_by_tokens", TRAINING, "Loss by tokens seen", TOKENS, LOSS),
        _per_run(runs, "grad_norm", TRAINING, "Gradient norm (before clipping)", STEP,
                 _key("global L2 norm", "grad_norm")),
        _per_run(runs, "lr", TRAINING, "Learning rate by step", STEP, LR),
        _per_run(runs, "lr_by_tokens", TRAINING, "Learning rate by tokens seen", TOKENS, LR),
        _per_run(runs, "skipped_steps", TRAINING, "Steps skipped (non-finite loss or gradient)",
                 STEP, _key("skipped so far", "skipped_steps")),
    ]  # fmt: skip


def _validation(runs: list[RunData]) -> list[Chart]:
    """The held-out sequences' loss and perplexity, a point at each step that evaluated."""
    charts = []
    for key, title, y_title in (
        (metrics.VAL_LOSS, "Validation loss by step", "cross-entropy"),
        (metrics.VAL_PERPLEXITY, "Validation perplexity by step", "perplexity"),
    ):
        traces = []
        for run in runs:
            points = [
                (x, y)
                for x, y in zip(series.steps(run), series.column(run, key), strict=True)
                if y is not None
            ]
            if points:
                trace = _line(run.label, [x for x, _ in points], [y for _, y in points])
                traces.append(trace | {"mode": "lines+markers"})
        figure = {"data": traces, "layout": _layout(title, "step", y_title)}
        charts.append(Chart(key, VALIDATION, figure))
    return charts


def _speed_and_memory(runs: list[RunData]) -> list[Chart]:
    memory = "Peak memory (device on CUDA, process on CPU; largest rank)"
    return [
        _per_run(runs, "tokens_per_s", SPEED, "Throughput", STEP,
                 _key("tokens/s (all ranks)", "tokens_per_s")),
        _per_run(runs, "step_time_s", SPEED, "Step time", STEP, _key("seconds", "step_time_s")),
        _per_run(runs, "memory_peak_bytes", SPEED, memory, STEP,
                 _key("MiB", "memory_peak_bytes"), scale=MIB),
    ]  # fmt: skip


def _replica_groups(runs: list[RunData]) -> list[Chart]:
    """A fault-tolerant run: the groups in each step's quorum, and each heal's seconds."""
    heals = _per_run(runs, "heal_s", REPLICAS, "Heals: seconds receiving a peer's state", STEP,
                     _key("seconds", metrics.HEAL_S))  # fmt: skip
    for trace in heals.figure["data"]:
        trace["mode"] = "markers"  # a heal is one step, not a curve
    return [
        _per_run(runs, "replicas", REPLICAS, "Replica groups taking part", STEP,
                 _key("groups", metrics.REPLICAS)),
        heals,
    ]  # fmt: skip


def _attention_logits(runs: list[RunData]) -> list[Chart]:
    """With QK-clip: each layer's largest logit by step against the run's tau (a dashed
    line), and the heads clipped each step."""
    traces = []
    for index, run in enumerate(runs):
        layers = series.layers(run, metrics.QK_LOGIT_MAX)
        for layer in layers:
            name = layer if len(runs) == 1 else f"{run.label} · {layer}"
            y = series.column(run, metrics.QK_LOGIT_MAX, layer)
            traces.append(_line(name, series.steps(run), y, DASHES[index % len(DASHES)]))
        tau = series.number(run.config.get("optimizer", {}).get("qk_clip_tau"))
        steps = series.steps(run)
        if layers and tau is not None and steps:
            name = "tau" if len(runs) == 1 else f"{run.label} · tau"
            line = _line(name, [steps[0], steps[-1]], [tau, tau], "dash")
            traces.append(line | {"line": {"dash": "dash", "color": "black"}})
    logits = Chart(
        "qk_logit_max",
        ATTENTION,
        {
            "data": traces,
            "layout": _layout(
                "Largest attention logit per layer (before the clip) against tau",
                "step",
                "largest pre-softmax logit",
            ),
        },
    )
    clipped = _per_run(runs, "qk_heads_clipped", ATTENTION, "Heads clipped per step", STEP,
                       _key("heads", metrics.QK_HEADS_CLIPPED))  # fmt: skip
    return [logits, clipped]


def _expert_load(runs: list[RunData]) -> list[Chart]:
    traces = []
    for index, run in enumerate(runs):
        for layer in series.layers(run, "expert_imbalance"):
            name = layer if len(runs) == 1 else f"{run.label} · {layer}"
            y = series.column(run, "expert_imbalance", layer)
            traces.append(_line(name, series.steps(run), y, DASHES[index % len(DASHES)]))
    imbalance = Chart(
        "expert_imbalance",
        EXPERTS,
        {
            "data": traces,
            "layout": _layout(
                "Expert imbalance per MoE layer (1 = even)",
                "step",
                "max / mean share of routed tokens",
            ),
        },
    )
    return [
        imbalance,
        *(
            _heatmap(i, run, layer, named=len(runs) > 1)
            for i, run in enumerate(runs)
            for layer in series.layers(run, "expert_load")
        ),
    ]


def _heatmap(index: int, run: RunData, layer: str, *, named: bool) -> Chart:
    x, z = series.expert_load(run, layer)
    experts = len(z)
    trace = {
        "type": "heatmap",
        "x": x,
        "y": list(range(experts)),
        "z": z,
        "zmin": 0,
        "colorscale": "Viridis",
        "colorbar": {"title": {"text": "share"}},
        "hovertemplate": "step %{x}<br>expert %{y}<br>share %{z:.3f}<extra></extra>",
    }
    title = f"Expert load, {layer}: share of routed tokens" + (f" ({run.label})" if named else "")
    layout = _layout(title, "step", "expert", hovermode="closest")
    layout["height"] = min(640, 160 + 14 * experts)
    if experts <= 16:
        layout["yaxis"]["dtick"] = 1
    return Chart(f"expert_load_{index}_{layer}", EXPERTS, {"data": [trace], "layout": layout})


def _plugins(runs: list[RunData]) -> list[Chart]:
    """Every plugin key, by plugin: keys ending in ``_bytes`` (memory held) together
    in one memory chart, each other key in its own chart (in MiB when its name has
    the word ``bytes``); a per-name mapping draws one curve per name."""
    owners: dict[str, dict[str, None]] = {}
    for run in runs:
        for owner, keys in series.plugin_keys(run).items():
            owners.setdefault(owner, {}).update(dict.fromkeys(keys))
    charts = []
    for owner, keys in owners.items():
        section = f"Plugin: {owner}"
        in_bytes = [key for key in keys if key.endswith("_bytes")]
        if in_bytes:
            charts.append(
                _keys_chart(
                    runs,
                    f"{owner}_memory",
                    section,
                    f"{owner}: memory figures",
                    in_bytes,
                    "MiB",
                    MIB,
                )
            )
        for key in keys:
            if key not in in_bytes:
                in_mib = "bytes" in key.split("_")
                y_title, scale = ("MiB", MIB) if in_mib else (key, 1.0)
                charts.append(_keys_chart(runs, key, section, key, [key], y_title, scale))
    return charts


def _keys_chart(
    runs: list[RunData],
    chart_id: str,
    section: str,
    title: str,
    keys: list[str],
    y_title: str,
    scale: float,
) -> Chart:
    traces = []
    for index, run in enumerate(runs):
        for key in keys:
            names = series.layers(run, key) or [None]
            for sub in names:
                y = [_scaled(v, scale) for v in series.column(run, key, sub)]
                if all(v is None for v in y):
                    continue
                parts = [run.label] if len(runs) > 1 else []
                parts += [key] if len(keys) > 1 else []
                parts += [sub] if sub is not None else []
                name = " · ".join(parts) or run.label
                traces.append(_line(name, series.steps(run), y, DASHES[index % len(DASHES)]))
    return Chart(chart_id, section, {"data": traces, "layout": _layout(title, "step", y_title)})
