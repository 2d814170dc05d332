"""Where parameters live, as the planner sees it: core's FSDP2 layout.

A layout is a plain dict (``plan["layout"]``) so that a sharding plugin, which
imports nothing of europa-core, can replace it from its ``europa_plan`` hook.
Its keys (all per rank of the group that splits the parameters):

``owner``, ``group_size``
``form``              (optional) how the owner holds it, e.g. core's "plain", "ddp",
                      "fsdp2" or "hsdp"
``stored_elements``   list: elements of parameter storage each rank allocates;
                      gradients take the same (FSDP2 reduces into padded buffers)
``muon_elements``, ``adamw_elements``
                      lists: local elements under each optimizer rule (state is
                      allocated like the local tensor, without padding)
``adamw_tensors``     tensors that carry an AdamW step counter on every rank
``gathered_unit_elements``
                      {unit: elements} gathered whole before each use of the unit
                      (none in fp32 with dp_shard = 1: plain or DDP, nothing gathered)
``gather_group_size`` ranks in that gather
``optimizer_step_gather_elements``
                      elements gathered inside ``optimizer.step()`` (Muon on
                      row-sharded matrices), and the largest such matrix
``expert_all_to_all_bytes_per_step``, ``expert_group_size``
                      expert-parallel traffic a rank sends per step, and the group
``expert_all_to_all_bytes_by_link`` (optional) {link: bytes}: the same traffic split by
                      the link it crosses (default: all of it on the group's link)
``expert_kept_bytes_per_moe_block`` (optional) exchange results each MoE block keeps
                      for its recomputation (saved, and offloadable, like its input)
``replicated_elements`` (optional; default: the largest ``stored_elements``)
                      elements all-reduced over ``dp_replicate``
``replica_group``     (optional) {size, stride, per_micro_batch, overlappable, window,
                      tail_elements}: the ranks holding the same share, whether they sum
                      every micro-batch or once a step, whether that all-reduce can run
                      beside computation, and beside what: the whole step ("step") or the
                      last micro-batch's backward only ("last_backward"), with
                      ``tail_elements`` of it starting only when that backward ends
                      (default: ``dp_replicate``, every micro-batch, overlapped, "step")
``expert_copies``     (optional) {elements, group_size, stride, per_micro_batch,
                      overlappable, window}: resident expert gradients all-reduced over the
                      ranks holding the same experts (default: every micro-batch,
                      overlapped, "step")
``reduce_itemsize``   (optional; default 4) bytes per element of gradient reductions

FSDP2 (``fully_shard`` with ``Shard(0)``): a rank holds rows
``[r·c, min((r+1)·c, d0))`` with ``c = ceil(d0 / ranks)``, in storage padded to
``c`` rows on every rank.
"""

from __future__ import annotations

import math
from itertools import accumulate

from europa.core.plan.shapes import ModelShapes
from europa.core.plugins.builtin.optimizer import uses_muon

FSDP2 = "core.fsdp2"


def _ranges_to_list(diff: list[int]) -> list[int]:
    return list(accumulate(diff[:-1]))


def fsdp2_layout(shapes: ModelShapes, ranks: int, optimizer: str, *, form: str = "fsdp2") -> dict:
    """``form``: "fsdp2" (or "hsdp"), or "plain" / "ddp" where core leaves FSDP2 out (fp32,
    ``dp_shard = 1``): nothing is gathered then."""
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
        muon = optimizer == "muon" and uses_muon(p.name, len(p.shape))
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
