"""What ``europa plan`` asks of FlexShard: the layout's memory and traffic, as arithmetic.

``plan_layout`` fills ``plan["layout"]`` (``europa.spec.plan_layout.Layout``'s fields) with
the whole-matrix ownership of the planned parameters (``europa.flexshard.ownership``, the
same plan every rank computes at run time) and, with ``ep``, the expert exchange that
uniform routing predicts (``europa.flexshard.exchange.wire``); ``search_alternatives``
offers FlexShard's settings to ``europa plan --search``. No process group, and torch
only where a planned expert stack is shaped (``europa.flexshard.experts``).
"""

from __future__ import annotations

import functools
import itertools
import math
import pickle

from europa.flexshard.config import NAME
from europa.flexshard.errors import FlexShardError
from europa.flexshard.process_groups import check_dense_group, dispatch_of, ranks_per_node
from europa.spec.job import PlanningJob, RunningJob
from europa.spec.optim import STATE_TENSORS
from europa.spec.plan_layout import ROOT_UNIT, unit_of
from europa.spec.plan_mapping import PlanMapping, SearchInputs
from europa.spec.units import GIB


def plan_layout(job: PlanningJob, plan: PlanMapping) -> None:
    """Replace ``plan["layout"]`` with FlexShard's whole-matrix ownership, from
    ``plan["parameter_shapes"]`` ({name: shape}) and ``plan["world_size"]``.
    With ``parallel.ep > 1`` the 3-D parameters (the routed experts) are split
    over ``ep`` and stay resident, and tokens travel by all-to-all."""
    cfg = job.config
    parallel = cfg.parallel
    ep = parallel.ep
    shard_ranks = plan["world_size"] // parallel.dp_replicate  # dp_shard × ep
    check_dense_group(job, shard_ranks)
    if cfg.section(NAME).dense_group == "node":
        shard_ranks = min(shard_ranks, ranks_per_node(job))
    elif cfg.section(NAME).dense_group == "rank":
        shard_ranks = 1
    shapes = tuple((name, tuple(shape)) for name, shape in plan["parameter_shapes"].items())
    layout, summary, moe_layers = owned_layout(
        shapes, shard_ranks, ep, cfg.optimizer.name == "muon", plan.get("parameter_itemsize", 4)
    )
    if moe_layers:
        exchange = planned_exchange(job, moe_layers)
        a2a = exchange["bytes_per_step_by_link"]
        layout["expert_all_to_all_bytes_per_step"] = sum(a2a.values())
        layout["expert_all_to_all_bytes_by_link"] = a2a
        layout["expert_kept_bytes_per_moe_block"] = exchange["kept_bytes_per_moe_block"]
        if ep > 1:  # the exchange's weighted sums keep the outputs as they are (summing.py)
            layout["expert_output_bytes"] = 2 if cfg.training.dtype == "bfloat16" else 4
        summary["expert_all_to_all_bytes_per_rank_per_step"] = sum(a2a.values())
        summary["expert_exchange"] = exchange
    # The copies of each share (replicas, other nodes) and of each expert (ranks with the
    # same ep index: dp_replicate × dp_shard) sum their gradients once a step, in the last
    # micro-batch's backward (``sum_copies_in_backward``): beside that backward only, and
    # the root's sum (its gradient completes last) after it.
    once_a_step = {"per_micro_batch": False, "overlappable": True, "window": "last_backward"}
    layout["expert_copies"] |= {"group_size": plan["world_size"] // ep} | once_a_step
    layout["replica_group"] = {
        "size": plan["world_size"] // shard_ranks,
        "stride": shard_ranks,
        "tail_elements": layout.pop("root_elements"),
    } | once_a_step
    bf16 = cfg.training.dtype == "bfloat16"
    layout["reduce_itemsize"] = 2 if bf16 and cfg.section(NAME).reduce_dtype == "bfloat16" else 4
    layout["direct_transfers"] = _transfers_directly(job, plan)
    if shard_ranks == 1 and not bf16:  # whole on each rank, used in place: nothing gathered
        layout["gathered_unit_elements"] = layout["gathered_unit_wire_elements"] = {}
        layout["unit_rank_elements"] = {}
    plan["layout"] = layout
    plan[NAME] = summary


def _transfers_directly(job: PlanningJob, plan: PlanMapping) -> bool:
    """Whether the planned run's gathers are direct transfers (``europa.flexshard.direct``):
    on gloo, the backend CPU ranks use (or the one an execution names)."""
    execution = getattr(job, "execution", None)
    backend = execution.backend if execution is not None else job.config.parallel.backend
    if backend == "auto":
        device = plan.get("hardware", {}).get("device", "cuda")
        backend = "gloo" if device == "cpu" else "nccl"
    return backend == "gloo"


def owned_layout(shapes, shard_ranks: int, ep: int, muon: bool, itemsize: int):
    """(``plan["layout"]`` without the exchange terms, the ownership summary, the number of
    MoE layers) for parameters ``shapes`` ((name, shape) pairs in model order). Pure, and
    the costly part of a plan (a loop over every rank for every matrix), so ``europa plan
    --search`` reuses it across the layouts that share it; callers get their own copy."""
    layout, summary, moe_layers = _owned_layout(shapes, shard_ranks, ep, muon, itemsize)
    return _copied(layout), _copied(summary), moe_layers


def _copied(value):
    """A deep copy of plain data (dicts, lists, numbers): through pickle, several times
    faster than ``copy.deepcopy``, which a search of ~2,000 plans spends a third of its
    time in."""
    return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


@functools.lru_cache(maxsize=32)
def _owned_layout(shapes, shard_ranks: int, ep: int, muon: bool, itemsize: int):
    from europa.flexshard.experts import expert_stack
    from europa.flexshard.ownership import ParameterSpec, plan_ownership
    from europa.spec.optim import uses_muon

    routed = {name for name, shape in shapes if ep > 1 and len(shape) == 3}
    specs = [
        ParameterSpec(name, shape, itemsize, unit_of(name), uses_muon(name, shape))
        for name, shape in shapes
        if name not in routed
    ]
    ownership = plan_ownership(specs, shard_ranks)
    layout = _OwnedElements(shard_ranks, uses_muon if muon else None)
    for spec in specs:
        layout.add(spec, ownership.counts(spec.name), lambda r: r)
    units: dict[str, int] = {}
    for spec in specs:
        units[spec.unit] = units.get(spec.unit, 0) + spec.matrices * spec.matrix_numel
    summary = ownership.summary()
    summary = {k: v for k, v in summary.items() if not isinstance(v, list)}
    summary["optimizer_step_bytes_communicated"] = 0
    stacks: dict[str, list[tuple[int, ...]]] = {}  # in model order, as at run time
    for name, shape in shapes:
        if name in routed:
            # torchtitan's stacks live in <module>.inner_experts; plan per <module>
            module = name.rpartition(".")[0].removesuffix(".inner_experts")
            stacks.setdefault(module, []).append(shape)
    if stacks:
        expert_specs = [expert_stack(module, s, itemsize) for module, s in stacks.items()]
        experts = plan_ownership(expert_specs, ep)
        # The shard group is [dp_shard, ep] flattened: rank r holds ep rank r % ep's experts.
        for spec, module in zip(expert_specs, stacks, strict=True):
            tensors = len(stacks[module])  # w1, w2, w3: each its own optimizer state
            layout.add(spec, experts.counts(spec.name), lambda r: r % ep, tensors, expert=True)
        summary["routed_expert_bytes_per_rank_max"] = max(experts.rank_bytes())
    return layout.as_plan(units, ep), summary, len(stacks)


def search_alternatives(
    config, world_size: int, ranks_per_node: int, plan: SearchInputs
) -> list[dict]:
    """The alternatives of FlexShard's one lever: core's own layout (no ``ep``), or
    FlexShard with each ``ep`` whose resident experts can fit, each dense group, each
    gradient-reduction dtype (bf16 runs), and with ``ep`` each payload dtype and kept
    exchanges or not (the config rules refuse kept exchanges without recomputation).
    Node-limited routing changes the model, so it stays as the config has it."""
    per_replica = world_size // config.parallel.dp_replicate
    per_node = min(ranks_per_node or world_size, world_size)
    dense_groups = ["all", "rank"] if per_replica > 1 else ["all"]
    if per_replica > per_node:
        dense_groups.insert(1, "node")
    payloads = ["compute", "float8_e4m3fn"]
    reductions = ["float32"]
    if config.training.dtype == "bfloat16":
        reductions.append("bfloat16")
    else:
        payloads.insert(1, "bfloat16")
    alternatives: list[dict] = [{"plugins": [], "set": {"parallel.ep": 1}}]
    for ep in range(1, min(per_replica, config.model.num_experts) + 1):
        if per_replica % ep or not _experts_can_fit(plan, ep):
            continue
        for dense, reduce in itertools.product(dense_groups, reductions):
            base = {"parallel.ep": ep, f"{NAME}.dense_group": dense, f"{NAME}.reduce_dtype": reduce}
            if ep == 1:
                alternatives.append({"plugins": [NAME], "set": base})
                continue
            for payload, keep in itertools.product(payloads, (False, True)):
                levers = {"parallel.ep_dispatch_dtype": payload, "parallel.ep_keep_exchanges": keep}
                alternatives.append({"plugins": [NAME], "set": base | levers})
    return alternatives


def _experts_can_fit(plan, ep: int) -> bool:
    """Whether the mean rank's routed experts, parameters and gradients (which stay on the
    device whatever is offloaded), fit its device memory: a bound (the most loaded rank
    holds at least the mean), so a layout it leaves out could never fit."""
    shapes = [shape for shape in plan["parameter_shapes"].values() if len(shape) == 3]
    if not shapes or ep == 1:
        return True
    experts = shapes[0][0]
    per_expert = sum(math.prod(shape[1:]) for shape in shapes)
    resident = experts * per_expert * 2 * plan["parameter_itemsize"] / ep
    return resident <= plan["device_bytes_per_rank"]


def planned_exchange(job: PlanningJob, moe_layers: int) -> dict:
    """The expert exchange of one rank per optimizer step, as uniform routing predicts it
    (``europa.flexshard.exchange.wire``): bytes by link, and what is kept for a recomputation."""
    from europa.flexshard.exchange.wire import (
        ExpertGroup,
        RowBytes,
        Wire,
        expected_bytes_per_token,
        expected_count_bytes,
        kept_bytes_per_token,
    )

    cfg = job.config
    parallel, model, training = cfg.parallel, cfg.model, cfg.training
    per_node = ranks_per_node(job)
    dispatch = dispatch_of(parallel, per_node)
    group = ExpertGroup(
        model.num_experts,
        parallel.ep,
        min(per_node, parallel.ep),
        model.top_k,
        parallel.ep_max_nodes_per_token,
    )
    wire = Wire(parallel.ep_dispatch_dtype, 2 if training.dtype == "bfloat16" else 4)
    rows = RowBytes.of(dispatch, wire, model.dim, model.top_k)
    recompute = cfg.section("activation_checkpointing").mode == "full"
    passes = 2 if recompute and not parallel.ep_keep_exchanges else 1
    tokens = training.batch_size * training.seq_len // parallel.cp  # this rank's rows
    payload = expected_bytes_per_token(group, dispatch, rows, forward_passes=passes)
    counts = expected_count_bytes(group, dispatch, calls=passes)
    micro_batches = moe_layers * training.grad_accum_steps
    by_link = {
        link: round((payload[link] * tokens + counts[link]) * micro_batches) for link in payload
    }
    kept = kept_bytes_per_token(group, dispatch, rows) * tokens if passes == 1 and recompute else 0
    return {
        "dispatch": dispatch,
        "dispatch_dtype": wire.dispatch,
        "combine_dtype": wire.combine,
        "nodes_per_ep_group": group.nodes,
        "other_nodes_per_token": group.other_nodes_per_token(),
        "forward_passes_exchanging": passes,
        "bytes_per_step_by_link": by_link,
        "kept_bytes_per_moe_block": round(kept),
    }


def check_budget(job: RunningJob, layout) -> None:
    """Refuse a layout whose most loaded rank holds more than ``flexshard.max_rank_gib``."""
    limit = job.config.section(NAME).max_rank_gib
    if not limit:
        return
    # fp32 tensors a rank keeps per owned parameter element: the parameter and its
    # gradient, plus the optimizer's state (Muon: momentum; AdamW: two moments).
    need = layout.max_local_bytes() * (2 + STATE_TENSORS[job.config.optimizer.name])
    if need > limit * GIB:
        raise FlexShardError(
            f"flexshard.max_rank_gib = {limit}: the most loaded of {job.world_size} rank(s) "
            f"would hold {need / GIB:.2f} GiB of parameters, gradients and optimizer state; "
            "expected more ranks or a larger limit"
        )


class _OwnedElements:
    """Per-rank element counts in the shape ``plan["layout"]`` asks for. Every
    rank keeps a (possibly empty) local tensor of every parameter, and
    ``FlexShardOptimizer`` gives each AdamW one a step counter, owned or not."""

    def __init__(self, ranks: int, orthogonalised) -> None:
        """``orthogonalised(name, shape)``: which parameters Muon steps (None: AdamW only)."""
        self.ranks, self.orthogonalised = ranks, orthogonalised
        self.stored = [0] * ranks
        self.experts = [0] * ranks
        self.root = [0] * ranks  # the root unit's: its gradient completes last in backward
        self.by_unit: dict[str, list[int]] = {}  # of the gathered (non-resident) matrices
        self.by_rule = {True: [0] * ranks, False: [0] * ranks}
        self.adamw_tensors = 0

    def add(self, spec, counts, source_rank, tensors: int = 1, expert: bool = False) -> None:
        """``counts[source_rank(r)]`` matrices of ``spec`` on shard rank ``r``."""
        use_muon = bool(self.orthogonalised and self.orthogonalised(spec.name, spec.shape))
        numel, by_rule = spec.matrix_numel, self.by_rule[use_muon]
        in_root = spec.unit == ROOT_UNIT
        by_unit = None if expert else self.by_unit.setdefault(spec.unit, [0] * self.ranks)
        for r in range(self.ranks):
            owned = counts[source_rank(r)] * numel
            self.stored[r] += owned
            by_rule[r] += owned
            if expert:
                self.experts[r] += owned
            if in_root:
                self.root[r] += owned
            if by_unit is not None:
                by_unit[r] += owned
        if not use_muon:
            self.adamw_tensors += tensors

    def as_plan(self, units: dict[str, int], ep: int) -> dict:
        """The layout keys of the ownership alone: no exchange yet (``europa_plan`` adds
        it, and the number of each expert's copies, which depend on more than this)."""
        shared = [
            stored - experts for stored, experts in zip(self.stored, self.experts, strict=True)
        ]
        return {
            "owner": NAME,
            "group_size": self.ranks,
            "stored_elements": self.stored,
            "muon_elements": self.by_rule[True],
            "adamw_elements": self.by_rule[False],
            "adamw_tensors": self.adamw_tensors,
            "gathered_unit_elements": units,
            # a unit's gather sends the widest rank's share from every rank
            "gathered_unit_wire_elements": {
                unit: self.ranks * max(shares) for unit, shares in self.by_unit.items()
            },
            "unit_rank_elements": {unit: list(shares) for unit, shares in self.by_unit.items()},
            "gather_group_size": self.ranks,
            "optimizer_step_gather_elements": 0,
            "largest_step_gather_elements": 0,
            "expert_all_to_all_bytes_per_step": 0,
            "expert_all_to_all_bytes_by_link": {},
            "expert_group_size": ep,
            # Replicas all-reduce what is not an expert; the copies of an expert
            # (every rank with the same ep index) all-reduce its gradients.
            "replicated_elements": max(shared),
            "root_elements": max(self.root),
            "root_stored_elements": list(self.root),
            "expert_stored_elements": list(self.experts),
            "expert_copies": {"elements": max(self.experts), "stride": ep},
        }
