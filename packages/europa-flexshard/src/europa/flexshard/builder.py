"""``flex_shard``: lay any ``nn.Module`` out by whole-matrix ownership.

It plans who owns each whole matrix (``europa.flexshard.ownership``), keeps this rank's
matrices as the module's parameters, and puts a gather unit on each block
(``europa.flexshard.gather``); the result is a ``FlexShardLayout``
(``europa.flexshard.whole_matrix_layout``, which says what the local parameters hold).

With ``experts=ExpertParallel(...)`` the routed experts are split over that
group instead and stay resident (``europa.flexshard.experts``); everything else
is laid out as above.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from europa.flexshard.direct import runs_direct
from europa.flexshard.errors import PlanError
from europa.flexshard.exchange.kept import KeptExchanges, keep_exchanges
from europa.flexshard.experts import (
    ExpertParallel,
    ResidentExperts,
    check_expert_split,
    check_groups_follow_nodes,
    expert_stack,
    routed_expert_modules,
)
from europa.flexshard.gather import GatherUnit
from europa.flexshard.ownership import ParameterSpec, plan_ownership
from europa.flexshard.segments import UnitSegments
from europa.flexshard.slots import Groups, Slot
from europa.flexshard.whole_matrix_layout import FlexShardLayout
from europa.spec.optim import uses_muon
from europa.spec.plan_layout import ROOT_UNIT


def default_units(model: nn.Module) -> list[nn.Module]:
    """Each entry of ``model.layers`` (a ModuleDict or ModuleList), then the root."""
    return [*_blocks(model), model]


def stage_units(model: nn.Module) -> list[nn.Module]:
    """A pipeline stage's units: each block, then each other child of the root holding
    parameters (the embedding, the norm, the head). A stage runs the root's forward once
    per micro-batch in flight, so the root's parts are gathered and freed like a block's."""
    blocks = _blocks(model)
    layers = getattr(model, "layers", None)
    others = [
        child
        for child in model.children()
        if child is not layers and any(True for _ in child.parameters())
    ]
    return [*blocks, *others]


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])


def _groups(
    group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    direct: bool | None,
    mean: bool = True,
) -> Groups:
    if not dist.is_available() or not dist.is_initialized():
        if replicate_group is not None:
            raise PlanError("replicate_group given without torch.distributed initialised")
        return Groups(shard=None, rank=0, size=1, mean=mean)
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    return Groups(
        shard=group,
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        replicate=replicate_group,
        replicas=replicas,
        direct=runs_direct(group) if direct is None else direct,
        mean=mean,
    )


def flex_shard(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    units: Sequence[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    orthogonalised: Callable[[str, Sequence[int]], bool] = uses_muon,
    experts: ExpertParallel | None = None,
    direct: bool | None = None,
    mean_over_ranks: bool = True,
) -> FlexShardLayout:
    """Lay ``model`` out by whole-matrix ownership over ``group`` (default: the world).

    ``units`` are the modules whose parameters are gathered together (default:
    each of ``model.layers``, then the root for the rest). ``replicate_group``
    joins ranks holding the same share in other copies (HSDP-style data
    parallelism). ``param_dtype`` is the gathered, compute dtype (e.g. bf16,
    with fp32 local storage); ``reduce_dtype`` the gradient reduction dtype.
    ``orthogonalised(name, shape)`` says which parameters count Newton–Schulz
    work in the balance. ``experts`` splits the routed experts of every module
    with a ``token_dispatcher`` and ``inner_experts`` over its group instead
    (expert parallelism). ``direct``: gather and reduce-scatter by direct transfers
    between ranks (default: where the backend is gloo, ``europa.flexshard.direct``).
    ``mean_over_ranks``: each gradient is the mean over the data-parallel ranks; False:
    their sum, for a loss that each rank already divides by the global token count
    (torchtitan's).
    Parameters on the meta device stay there until ``layout.materialise``; real ones are
    sliced and the rest freed.
    """
    groups = _groups(group, replicate_group, direct, mean_over_ranks)
    unit_modules = list(units) if units is not None else default_units(model)
    if not any(m is model for m in unit_modules):
        unit_modules.append(model)  # the root gathers whatever no other unit claims
    owners = _unit_of_each_parameter(model, unit_modules)
    specs = {
        name: ParameterSpec(
            name=name,
            shape=tuple(param.shape),
            itemsize=param.element_size(),
            unit=owners[name],
            orthogonalised=orthogonalised(name, tuple(param.shape)),
        )
        for name, param in model.named_parameters()
    }
    compute_itemsize = (param_dtype or next(model.parameters()).dtype).itemsize
    routed = (
        _plan_experts(model, specs, experts, compute_itemsize, reduce_dtype, mean_over_ranks)
        if experts is not None
        else None
    )
    expert_names = set(routed.names) if routed is not None else set()
    dense = [spec for name, spec in specs.items() if name not in expert_names]
    plan = plan_ownership(dense, groups.size)
    ranges = {spec.name: plan.ranges[spec.name][groups.rank] for spec in dense}
    if routed is not None:
        for name, module_name in routed.modules.items():
            ranges[name] = routed.plan.ranges[module_name][routed.rank]
    slots = _localise(model, specs, ranges)
    unit_names = {id(m): n for n, m in model.named_modules()}
    gather_units = []
    for module in unit_modules:
        unit_name = unit_names[id(module)] or ROOT_UNIT
        names = [s.name for s in dense if s.unit == unit_name]
        if not names:
            continue
        unit_slots = [slots[n] for n in names]
        for index, slot in enumerate(unit_slots):
            slot.index = index
        unit = GatherUnit(
            module,
            unit_slots,
            UnitSegments(plan, names),
            groups,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )
        # The root is gathered when the model's forward starts and its last forward use (the
        # output head) is backward's first: freeing it in between only gathers it again.
        unit.reshard_after_forward = module is not model
        gather_units.append(unit)
    if routed is not None and experts.keep_exchanges:
        routed.kept = _keep_in_blocks(model, unit_modules)
    return FlexShardLayout(model, plan, specs, slots, gather_units, groups, routed)


def _keep_in_blocks(model: nn.Module, unit_modules: Sequence[nn.Module]) -> list[KeptExchanges]:
    """Each block (a unit other than the root) keeps its MoE layers' exchanges."""
    kept = []
    for block in unit_modules:
        if block is model:
            continue
        keepers = [m.token_dispatcher.keeper for _, m in routed_expert_modules(block)]
        if keepers:
            kept.append(keep_exchanges(block, keepers))
    return kept


def _stacked_experts(module: nn.Module, module_name: str) -> list[str]:
    return [
        f"{module_name}.inner_experts.{n}"
        for n, p in module.inner_experts.named_parameters()
        if p.ndim == 3
    ]


def _plan_experts(
    model: nn.Module,
    specs: dict[str, ParameterSpec],
    parallel: ExpertParallel,
    compute_itemsize: int,
    reduce_dtype: torch.dtype | None = None,
    mean_over_ranks: bool = True,
) -> ResidentExperts:
    """Whole experts over the expert-parallel group: one stack per routed-expert
    module (its matrices together), and each module's dispatcher swapped for ours."""
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(parallel.group) if initialised else 0
    size = dist.get_world_size(parallel.group) if initialised else 1
    modules = routed_expert_modules(model)
    if not modules:
        raise PlanError(
            "expert parallelism asked for, but the model has no module with a "
            "token_dispatcher and inner_experts; expected torchtitan-style routed experts"
        )
    stacks, owners = [], {}
    for module_name, module in modules:
        members = [specs[n] for n in _stacked_experts(module, module_name)]
        stack = expert_stack(module_name, [m.shape for m in members], members[0].itemsize)
        check_expert_split(module_name, stack.matrices, size)
        stacks.append(stack)
        owners |= {spec.name: module_name for spec in members}
    plan = plan_ownership(stacks, size)
    parallel.check()
    for module_name, module in modules:
        ranges = plan.ranges[module_name]
        groups = _router_groups(model, module_name)
        if groups and parallel.nodes is not None:
            check_groups_follow_nodes(module_name, groups, ranges, parallel.nodes.local)
        module.token_dispatcher = parallel.dispatcher(
            rank, ranges, _top_k(module), compute_itemsize
        )
    return ResidentExperts(
        owners, parallel, rank, size, plan, reduce_dtype, mean_over_ranks=mean_over_ranks
    )


def _router_groups(model: nn.Module, module_name: str) -> int:
    """The routing groups of the router beside a routed-expert module (0: none)."""
    parent = model.get_submodule(module_name.rpartition(".")[0])
    return getattr(getattr(parent, "router", None), "num_expert_groups", None) or 0


def _top_k(module: nn.Module) -> int:
    top_k = getattr(module.token_dispatcher, "top_k", None)
    if not isinstance(top_k, int):
        raise PlanError(f"{type(module).__name__}'s token_dispatcher has no integer top_k")
    return top_k


def _unit_of_each_parameter(model: nn.Module, unit_modules: Sequence[nn.Module]) -> dict[str, str]:
    names = {id(m): n for n, m in model.named_modules()}
    unit_names = []
    for module in unit_modules:
        if id(module) not in names:
            raise PlanError(f"unit {type(module).__name__} is not a submodule of the model")
        unit_names.append(names[id(module)])
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            raise PlanError(
                f"parameters {seen[id(param)]!r} and {name!r} are the same tensor: tied "
                "parameters are not supported; expected untied weights"
            )
        seen[id(param)] = name
    owners = {}
    for name, _ in model.named_parameters():
        candidates = [u for u in unit_names if u == "" or name.startswith(u + ".")]
        owners[name] = max(candidates, key=len) or ROOT_UNIT
    return owners


@torch.no_grad()
def _localise(
    model: nn.Module, specs: dict[str, ParameterSpec], ranges: dict[str, tuple[int, int]]
) -> dict[str, Slot]:
    slots = {}
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        spec = specs[name]
        start, stop = ranges[name]
        full = param.detach()
        if not full.is_meta:
            stacked = full if spec.stacked else full.unsqueeze(0)
            local = stacked[start:stop].clone()
        else:
            local = torch.empty((stop - start, *spec.matrix_shape), dtype=full.dtype, device="meta")
        module._parameters[attr] = nn.Parameter(local, requires_grad=param.requires_grad)
        slots[name] = Slot(name, module, attr, index=0, start=start, stop=stop)
    return slots
