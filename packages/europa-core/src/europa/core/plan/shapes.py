"""What the planner knows about a model: its parameters, read off the module
tree built on the meta device (nothing is allocated)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch.nn as nn

from europa.core.model.counting import ParameterCounts, count_parameters
from europa.spec.plan_layout import ROOT_UNIT, unit_of

ROUTED = ".routed_experts."  # in the name of a routed expert's parameter


@dataclass(frozen=True)
class ParameterShape:
    name: str
    shape: tuple[int, ...]

    # cached: a search reads each of them once per layout it plans
    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def unit(self) -> str:
        return unit_of(self.name)


@dataclass(frozen=True)
class ModelShapes:
    """Trainable parameters in model order, the counts ``europa train`` prints, and the
    bytes of the model's buffers (RoPE tables, expert counters), which every rank holds
    whole whatever the layout."""

    parameters: tuple[ParameterShape, ...]
    counts: ParameterCounts
    buffer_bytes: int = 0
    buffers: tuple[tuple[str, int], ...] = ()  # (name, bytes) of each buffer

    @classmethod
    def of(cls, model: nn.Module) -> ModelShapes:
        params = tuple(
            ParameterShape(name, tuple(p.shape))
            for name, p in model.named_parameters()
            if p.requires_grad
        )
        buffers = tuple((n, b.numel() * b.element_size()) for n, b in model.named_buffers())
        return cls(params, count_parameters(model), sum(b for _, b in buffers), buffers)

    def layer_keys(self) -> list[str]:
        """The keys of ``layers`` (``layers.<key>``), in model order."""
        keys: dict[str, None] = {}
        for p in self.parameters:
            head, _, rest = p.name.partition(".")
            if head == "layers":
                keys[rest.partition(".")[0]] = None
        return list(keys)

    def subset(self, modules: Collection[str]) -> ModelShapes:
        """A pipeline rank's copy of the model (``europa.core.pipeline.split``): the
        parameters of ``modules`` (top-level names and ``layers.<key>``), their buffers and
        the root's own. Its routed experts are inactive in the whole model's proportion."""

        def held(name: str) -> bool:
            return any(name.startswith(module + ".") for module in modules)

        params = tuple(p for p in self.parameters if held(p.name))
        buffers = tuple((n, b) for n, b in self.buffers if held(n) or "." not in n)
        total = sum(p.numel for p in params)
        routed = sum(p.numel for p in params if ROUTED in p.name and len(p.shape) == 3)
        whole = self.counts
        inactive = (whole.total - whole.active_per_token) / whole.routed_experts if routed else 0
        counts = ParameterCounts(total, routed, total - round(routed * inactive))
        return ModelShapes(params, counts, sum(b for _, b in buffers), buffers)

    def units(self) -> dict[str, list[ParameterShape]]:
        """Parameters by gather unit, blocks in model order, the root last."""
        units: dict[str, list[ParameterShape]] = {}
        for p in self.parameters:
            if p.unit != ROOT_UNIT:
                units.setdefault(p.unit, []).append(p)
        units[ROOT_UNIT] = [p for p in self.parameters if p.unit == ROOT_UNIT]
        return units

    def as_dict(self) -> dict[str, tuple[int, ...]]:
        """{name: shape}, a fresh dict each call (a search asks for it once per layout)."""
        return dict(self._by_name)

    @cached_property
    def _by_name(self) -> dict[str, tuple[int, ...]]:
        return {p.name: p.shape for p in self.parameters}

    def remembered(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per ``key`` for these shapes: a search plans hundreds of
        layouts of one model, many alike in what ``key`` names."""
        memo = self._memo
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    @cached_property
    def _memo(self) -> dict[Hashable, Any]:
        return {}
