"""Where parameters live, as the planner sees it: core's FSDP2 layout.

A layout is a plain mapping (``plan["layout"]``) so that a sharding plugin, which
imports nothing of europa-core, can replace it from its ``europa_plan`` hook; its keys
are the fields of ``europa.spec.plan_layout.Layout``, which the planner checks.

FSDP2 (``fully_shard`` with ``Shard(0)``): a rank holds rows
``[r·c, min((r+1)·c, d0))`` with ``c = ceil(d0 / ranks)``, in storage padded to
``c`` rows on every rank.
"""

from __future__ import annotations

import math
from itertools import accumulate

from europa.core.plan.shapes import ModelShapes
from europa.spec.optim import uses_muon

FSDP2 = "core.fsdp2"


def _ranges_to_list(diff: list[int]) -> list[int]:
    return list(accumulate(diff[:-1]))


def data_parallel_form(dp_replicate: int, dp_shard: int, dtype: str) -> str:
    """How core holds the model: "fsdp2" or "hsdp" where it shards or casts, else
    (fp32, ``dp_shard = 1``) "plain" on one rank or "ddp" over replicas."""
    if dp_shard > 1 or dtype != "float32":
        return "hsdp" if dp_replicate > 1 else "fsdp2"
    return "ddp" if dp_replicate > 1 else "plain"


def fsdp2_layout(shapes: ModelShapes, ranks: int, optimizer: str, *, form: str = "fsdp2") -> dict:
    """``form``: "fsdp2" (or "hsdp"), or "plain" / "ddp" where core leaves FSDP2 out (fp32,
    ``dp_shard = 1``): nothing is gathered then. Computed once per arguments for a model's
    shapes; each caller gets its own copy to change (a plugin's ``europa_plan`` may)."""
    layout = shapes.remembered(
        ("fsdp2_layout", ranks, optimizer, form),
        lambda: _fsdp2_layout(shapes, ranks, optimizer, form),
    )
    # its values are numbers, strings, lists of numbers and a dict of numbers
    return {k: v.copy() if isinstance(v, list | dict) else v for k, v in layout.items()}


def _fsdp2_layout(shapes: ModelShapes, ranks: int, optimizer: str, form: str) -> dict:
    plain = form in ("plain", "ddp")
    stored = [0] * (ranks + 1)  # difference arrays: O(parameters + ranks)
    local = {"muon": [0] * (ranks + 1), "adamw": [0] * (ranks + 1)}
    adamw_tensors = 0
    step_gather = largest_step_gather = 0
    units: dict[str, int] = {}
    for p in shapes.parameters:
        rows, rest = (p.shape[0], math.prod(p.shape[1:])) if p.shape else (1, 1)
        chunk = math.ceil(rows / ranks)
        stored[0] += chunk * rest
        stored[ranks] -= chunk * rest
        muon = optimizer == "muon" and uses_muon(p.name, p.shape)
        diff = local["muon" if muon else "adamw"]
        full_ranks, remainder = divmod(rows, chunk) if chunk else (0, 0)
        diff[0] += chunk * rest
        diff[full_ranks] -= chunk * rest
        if remainder:
            diff[full_ranks] += remainder * rest
            diff[full_ranks + 1] -= remainder * rest
        adamw_tensors += not muon
        # Muon needs whole matrices: a 2-D one sharded by rows is gathered in the
        # step; stacked experts sharded along the expert dimension are whole.
        if muon and len(p.shape) == 2 and ranks > 1:
            step_gather += p.numel
            largest_step_gather = max(largest_step_gather, p.numel)
        units[p.unit] = units.get(p.unit, 0) + chunk * ranks * rest
    return {
        "owner": FSDP2,
        "form": form,
        "group_size": ranks,
        "stored_elements": _ranges_to_list(stored),
        "muon_elements": _ranges_to_list(local["muon"]),
        "adamw_elements": _ranges_to_list(local["adamw"]),
        "adamw_tensors": adamw_tensors,
        "gathered_unit_elements": {} if plain else units,
        "gather_group_size": ranks,
        "optimizer_step_gather_elements": step_gather,
        "largest_step_gather_elements": largest_step_gather,
        "expert_all_to_all_bytes_per_step": 0,
        "expert_group_size": 1,
    }
