"""``flex_shard``: lay any ``nn.Module`` out by whole-matrix ownership.

After ``flex_shard(model)`` every parameter the module registers is this
rank's *local* storage: the matrices it owns, stacked ``[owned, *matrix]`` (a
stacked expert tensor ``[E, rows, cols]`` keeps its owned experts; a 2-D or
1-D tensor is ``[1, *shape]`` on its owner and ``[0, *shape]`` elsewhere).
Forward and backward see whole parameters (``europa.flexshard.gather``); an
optimizer over ``model.parameters()`` touches only what this rank owns.

With ``experts=ExpertParallel(...)`` the routed experts are split over that
group instead and stay resident (``europa.flexshard.experts``); everything else
is laid out as above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from europa.flexshard.direct import runs_direct
from europa.flexshard.errors import PlanError
from europa.flexshard.experts import (
    ExpertParallel,
    check_expert_split,
    check_groups_follow_nodes,
    expert_stack,
    routed_expert_modules,
)
from europa.flexshard.gather import (
    EXPERT_COPIES_KIND,
    AsyncSum,
    GatherUnit,
    Groups,
    Slot,
    all_gather,
    count_backward,
    sum_over,
)
from europa.flexshard.keep import KeptExchanges, keep_exchanges
from europa.flexshard.plan import OwnershipPlan, ParameterSpec, plan_ownership
from europa.flexshard.segments import UnitSegments
from europa.spec.init import InitMatrix
from europa.spec.optim import uses_muon
from europa.spec.plan_layout import ROOT_UNIT
from europa.spec.tags import mark_traffic


def default_units(model: nn.Module) -> list[nn.Module]:
    """Each entry of ``model.layers`` (a ModuleDict or ModuleList), then the root."""
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
    return [*blocks, model]


def _groups(
    group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    direct: bool | None,
) -> Groups:
    if not dist.is_available() or not dist.is_initialized():
        if replicate_group is not None:
            raise PlanError("replicate_group given without torch.distributed initialised")
        return Groups(shard=None, rank=0, size=1)
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    return Groups(
        shard=group,
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        replicate=replicate_group,
        replicas=replicas,
        direct=runs_direct(group) if direct is None else direct,
    )


class FlexShardLayout:
    """A module laid out by ownership: its plans, its slots and its gather units."""

    def __init__(
        self,
        model: nn.Module,
        plan: OwnershipPlan,
        specs: dict[str, ParameterSpec],
        slots: dict[str, Slot],
        units: list[GatherUnit],
        groups: Groups,
        experts: _Experts | None = None,
    ) -> None:
        self.model = model
        self.plan = plan  # everything but routed experts, over groups.shard
        self.specs = specs
        self.slots = slots
        self.units = units
        self.groups = groups
        self.experts = experts
        self._hook_expert_gradients()

    @property
    def rank(self) -> int:
        return self.groups.rank

    def spec(self, name: str) -> ParameterSpec:
        return self.specs[name]

    def is_expert(self, name: str) -> bool:
        return self.experts is not None and name in self.experts.names

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, slot in self.slots.items():
            yield name, slot.local

    def owned_indices(self, name: str) -> range:
        slot = self.slots[name]
        return range(slot.start, slot.stop)

    # -- prefetch ---------------------------------------------------------------------------

    def cancel_prefetch(self) -> None:
        """Wait for and drop every prefetched all-gather not used yet (see
        ``GatherUnit.set_prefetch``); call it before parameters change (the optimizer step)."""
        for unit in self.units:
            unit.cancel_prefetch()

    # -- materialising ----------------------------------------------------------------------

    @torch.no_grad()
    def materialise(self, device: torch.device | str, init_matrix: InitMatrix) -> None:
        """Allocate this rank's storage on ``device`` and fill each owned matrix with
        ``init_matrix(name, index, out)``: no rank allocates more than it owns."""
        for name, slot in self.slots.items():
            old = slot.local
            local = torch.empty(old.shape, dtype=old.dtype, device=device)
            spec = self.specs[name]
            for j, index in enumerate(range(slot.start, slot.stop)):
                init_matrix(name, index, local[j] if spec.stacked else local[0])
            slot.module._parameters[slot.attr] = nn.Parameter(local, old.requires_grad)
        self._hook_expert_gradients()
        for unit in self.units:
            unit.hook_gradients()

    # -- gradients --------------------------------------------------------------------------

    def _hook_expert_gradients(self) -> None:
        if self.experts is None:
            return
        for name in self.experts.names:
            param = self.slots[name].local
            if param.requires_grad and not param.is_meta:
                param.register_hook(self.experts.reduce_gradient)
                param.register_post_accumulate_grad_hook(self.experts.after_accumulate)

    def sum_copies_in_backward(self, backwards_per_step: int) -> None:
        """Issue the once-a-step sums (each unit's over its replicas, each resident
        expert's over its copies) in the ``backwards_per_step``-th backward since the last
        ``finish_gradients``, each as soon as its gradient is complete, so they travel beside
        the rest of that backward (0: after the backward, in ``finish_gradients``). A
        backward beyond that count before ``finish_gradients`` is refused."""
        if backwards_per_step < 0:
            raise PlanError(f"backwards_per_step = {backwards_per_step}: expected 0 or more")
        for unit in self.units:
            unit.sum_replicas_in_backward = backwards_per_step
        if self.experts is not None:
            self.experts.sum_in_backward = backwards_per_step

    def finish_gradients(self) -> None:
        """Sum the owned gradients over the replicas and the resident experts' gradients
        over their copies, once per optimizer step after the last micro-batch's backward
        (``clip_grad_norm_`` and the optimizer's step call it)."""
        for unit in self.units:
            unit.reduce_replicas()
        if self.experts is not None:
            self.experts.reduce_copies([self.slots[n].local for n in self.experts.names])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip to a total 2-norm of ``max_norm`` (0: only measure); return the norm
        before clipping. Each matrix is counted once: on its owner."""
        self.finish_gradients()
        device = next(iter(self.slots.values())).local.device
        squares = torch.zeros(2, dtype=torch.float32, device=device)
        mark_traffic(squares, "gradient_norm")
        dense, routed = squares[0], squares[1]
        grads = []
        for name, slot in self.slots.items():
            grad = slot.local.grad
            if grad is None:
                continue
            grads.append(grad)
            (routed if self.is_expert(name) else dense).add_(grad.float().pow(2).sum())
        self._sum_over_owners(squares)
        norm = (dense + routed).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
            for grad in grads:
                grad.mul_(scale.to(grad.dtype))
        return norm.item()

    def _sum_over_owners(self, squares: torch.Tensor) -> None:
        """Sum ``squares`` (the dense, then the routed sum of squares) over the ranks that own
        each kind of matrix: one all-reduce where both groups are the same ranks."""
        groups = []  # (kind, group): None is the default group
        if self.groups.size > 1:
            groups.append((0, self.groups.shard))
        if self.experts is not None and self.experts.size > 1:
            groups.append((1, self.experts.group))
        if len(groups) == 2 and _same_ranks(groups[0][1], groups[1][1]):
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=groups[0][1])
            return
        for kind, group in groups:
            dist.all_reduce(squares[kind : kind + 1], op=dist.ReduceOp.SUM, group=group)

    # -- summaries --------------------------------------------------------------------------

    def max_local_bytes(self) -> int:
        """At most what one rank stores: its owned share plus its resident experts."""
        routed = max(self.experts.plan.rank_bytes()) if self.experts is not None else 0
        return max(self.plan.rank_bytes(), default=0) + routed

    def describe(self) -> str:
        text = self.plan.describe()
        if self.experts is None:
            return text
        e = self.experts.plan.summary()
        per_layer = sorted({p.matrices for p in self.experts.plan.parameters})
        return (
            f"{text}; routed experts ({'/'.join(map(str, per_layer))} a layer) split over "
            f"{e['ranks']} expert-parallel rank(s), resident bytes per rank max "
            f"{e['bytes_max'] / 2**20:.2f} MiB / mean {e['bytes_mean'] / 2**20:.2f} MiB"
        )

    # -- whole parameters -------------------------------------------------------------------

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full, on every rank (a collective; for tests and export)."""
        fulls: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for slot, full in zip(unit.slots, unit.all_gather(), strict=True):
                fulls[slot.name] = full
        if self.experts is not None:
            for name in self.experts.names:
                fulls[name] = self.experts.gather(name, self.slots[name].local.detach())
        return fulls


def _same_ranks(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    world = dist.group.WORLD
    return dist.get_process_group_ranks(a or world) == dist.get_process_group_ranks(b or world)


@dataclass
class _Experts:
    """The routed experts of a layout: their names, plan and groups."""

    modules: dict[str, str]  # expert parameter -> its routed-expert module
    parallel: ExpertParallel
    rank: int
    size: int
    plan: OwnershipPlan  # one stack per routed-expert module, over the expert group
    kept: list[KeptExchanges] = field(default_factory=list)  # blocks keeping their exchanges

    @property
    def names(self) -> list[str]:
        return list(self.modules)

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.parallel.group

    reduce_dtype: torch.dtype | None = None
    sum_in_backward: int = 0  # see FlexShardLayout.sum_copies_in_backward
    _copies_pending: bool = False
    _backwards: dict[int, int] = field(default_factory=dict)  # per parameter, since the sum
    _early: dict[int, AsyncSum] = field(default_factory=dict)  # sums issued in a backward

    def reduce_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """This backward's share of the mean over data-parallel ranks; the copies of these
        experts sum the accumulated gradients once a step (``reduce_copies``)."""
        copies = self.parallel.copies
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._copies_pending = copies is not None and dist.get_world_size(copies) > 1
        return grad / (self.parallel.data_parallel_size or world)

    def after_accumulate(self, param: torch.Tensor) -> None:
        """In the last backward of a step (``sum_in_backward``), issue this expert
        parameter's sum over its copies as soon as its gradient is accumulated."""
        if self.sum_in_backward <= 0 or not self._copies_pending:
            return
        seen = count_backward(self._backwards, id(param), self.sum_in_backward,
                              "the experts' sum over their copies")  # fmt: skip
        if seen == self.sum_in_backward:
            self._early[id(param)] = AsyncSum(
                [param.grad], self.parallel.copies, self.reduce_dtype, EXPERT_COPIES_KIND
            )

    def reduce_copies(self, params: Sequence[torch.Tensor]) -> None:
        """Sum the experts' gradients over their copies (one all-reduce, in the reduce
        dtype), if a backward left them unsummed, or wait for the sums the last backward
        issued; every copy calls it together."""
        early, self._early, self._backwards = self._early, {}, {}
        for pending in early.values():
            pending.finish()
        if not self._copies_pending:
            return
        self._copies_pending = False
        grads = [p.grad for p in params if p.grad is not None and id(p) not in early]
        if grads:
            sum_over(grads, self.parallel.copies, self.reduce_dtype, EXPERT_COPIES_KIND)

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Expert parameter ``name`` in full, from each rank's run of it (a collective)."""
        if self.size == 1:
            return local.clone()
        counts = self.plan.counts(self.modules[name])  # each layer splits its own way
        widest = max(counts)
        padded = local.new_zeros(widest, *local.shape[1:])
        padded[: local.shape[0]] = local
        rows = local.new_empty(self.size * widest, *local.shape[1:])
        all_gather(rows, padded, group=self.group)
        pieces = [rows[r * widest : r * widest + count] for r, count in enumerate(counts)]
        return torch.cat(pieces)


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
    Parameters on the meta device stay there until ``layout.materialise``; real ones are
    sliced and the rest freed.
    """
    groups = _groups(group, replicate_group, direct)
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
        _plan_experts(model, specs, experts, compute_itemsize, reduce_dtype)
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
) -> _Experts:
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
    return _Experts(owners, parallel, rank, size, plan, reduce_dtype=reduce_dtype)


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
