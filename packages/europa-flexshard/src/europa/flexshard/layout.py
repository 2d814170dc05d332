"""``flex_shard``: lay any ``nn.Module`` out by whole-matrix ownership.

After ``flex_shard(model)`` every parameter the module registers is this
rank's *local* storage: the matrices it owns, stacked ``[owned, *matrix]`` (a
stacked expert tensor ``[E, rows, cols]`` keeps its owned experts; a 2-D or
1-D tensor is ``[1, *shape]`` on its owner and ``[0, *shape]`` elsewhere).
Forward and backward see whole parameters (``europa.flexshard.gather``); an
optimizer over ``model.parameters()`` touches only what this rank owns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from europa.flexshard.errors import PlanError
from europa.flexshard.gather import GatherUnit, Groups, Slot
from europa.flexshard.plan import OwnershipPlan, ParameterSpec, plan_ownership
from europa.flexshard.segments import UnitSegments

InitMatrix = Callable[[str, int, torch.Tensor], None]
ROOT_UNIT = "<root>"

# Names of parameters an optimizer keeps on AdamW however many dimensions they have
# (embeddings, output heads, norms, routers): Muon's authors advise it.
ADAMW_ONLY_PARTS = ("embed", "lm_head", "norm", "router", "expert_bias")


def orthogonalised_by_default(name: str, shape: Sequence[int]) -> bool:
    """Hidden weight matrices and stacked expert matrices go to Muon."""
    return len(shape) >= 2 and not any(part in name for part in ADAMW_ONLY_PARTS)


def default_units(model: nn.Module) -> list[nn.Module]:
    """Each entry of ``model.layers`` (a ModuleDict or ModuleList), then the root."""
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
    return [*blocks, model]


def _groups(group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None) -> Groups:
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
    )


class FlexShardLayout:
    """A module laid out by ownership: its plan, its slots and its gather units."""

    def __init__(
        self,
        model: nn.Module,
        plan: OwnershipPlan,
        slots: dict[str, Slot],
        units: list[GatherUnit],
        groups: Groups,
    ) -> None:
        self.model = model
        self.plan = plan
        self.slots = slots
        self.units = units
        self.groups = groups

    @property
    def rank(self) -> int:
        return self.groups.rank

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, slot in self.slots.items():
            yield name, slot.local

    def owned_indices(self, name: str) -> range:
        slot = self.slots[name]
        return range(slot.start, slot.stop)

    # -- materialising ----------------------------------------------------------------------

    @torch.no_grad()
    def materialise(self, device: torch.device | str, init_matrix: InitMatrix) -> None:
        """Allocate this rank's storage on ``device`` and fill each owned matrix with
        ``init_matrix(name, index, out)``: no rank allocates more than it owns."""
        for name, slot in self.slots.items():
            old = slot.local
            local = torch.empty(old.shape, dtype=old.dtype, device=device)
            spec = self.plan.spec(name)
            for j, index in enumerate(range(slot.start, slot.stop)):
                init_matrix(name, index, local[j] if spec.stacked else local[0])
            slot.module._parameters[slot.attr] = nn.Parameter(local, old.requires_grad)

    # -- gradients --------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip to a total 2-norm of ``max_norm`` (0: only measure); return the norm
        before clipping. Each matrix is counted once: on its owner."""
        grads = [slot.local.grad for slot in self.slots.values() if slot.local.grad is not None]
        device = next(iter(self.slots.values())).local.device
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            squares += grad.float().pow(2).sum()
        if self.groups.size > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.groups.shard)
        norm = squares.sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
            for grad in grads:
                grad.mul_(scale.to(grad.dtype))
        return norm.item()

    # -- whole parameters -------------------------------------------------------------------

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full, on every rank (a collective; for tests and export)."""
        fulls: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for slot, full in zip(unit.slots, unit.all_gather(), strict=True):
                fulls[slot.name] = full
        return fulls


def flex_shard(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    units: Sequence[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    orthogonalised: Callable[[str, Sequence[int]], bool] = orthogonalised_by_default,
) -> FlexShardLayout:
    """Lay ``model`` out by whole-matrix ownership over ``group`` (default: the world).

    ``units`` are the modules whose parameters are gathered together (default:
    each of ``model.layers``, then the root for the rest). ``replicate_group``
    joins ranks holding the same share in other copies (HSDP-style data
    parallelism). ``param_dtype`` is the gathered, compute dtype (e.g. bf16,
    with fp32 local storage); ``reduce_dtype`` the gradient reduction dtype.
    ``orthogonalised(name, shape)`` says which parameters count Newton–Schulz
    work in the balance. Parameters on the meta device stay there until
    ``layout.materialise``; real ones are sliced and the rest freed.
    """
    groups = _groups(group, replicate_group)
    unit_modules = list(units) if units is not None else default_units(model)
    if not any(m is model for m in unit_modules):
        unit_modules.append(model)  # the root gathers whatever no other unit claims
    owners = _unit_of_each_parameter(model, unit_modules)
    specs = [
        ParameterSpec(
            name=name,
            shape=tuple(param.shape),
            itemsize=param.element_size(),
            unit=owners[name],
            orthogonalised=orthogonalised(name, tuple(param.shape)),
        )
        for name, param in model.named_parameters()
    ]
    plan = plan_ownership(specs, groups.size)
    slots = _localise(model, plan, groups.rank)
    unit_names = {id(m): n for n, m in model.named_modules()}
    gather_units = []
    for module in unit_modules:
        unit_name = unit_names[id(module)] or ROOT_UNIT
        names = [s.name for s in specs if s.unit == unit_name]
        if not names:
            continue
        unit_slots = [slots[n] for n in names]
        for index, slot in enumerate(unit_slots):
            slot.index = index
        gather_units.append(
            GatherUnit(
                module,
                unit_slots,
                UnitSegments(plan, names),
                groups,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
            )
        )
    return FlexShardLayout(model, plan, slots, gather_units, groups)


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
def _localise(model: nn.Module, plan: OwnershipPlan, rank: int) -> dict[str, Slot]:
    slots = {}
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        spec = plan.spec(name)
        start, stop = plan.ranges[name][rank]
        full = param.detach()
        if not full.is_meta:
            stacked = full if spec.stacked else full.unsqueeze(0)
            local = stacked[start:stop].clone()
        else:
            local = torch.empty((stop - start, *spec.matrix_shape), dtype=full.dtype, device="meta")
        module._parameters[attr] = nn.Parameter(local, requires_grad=param.requires_grad)
        slots[name] = Slot(name, module, attr, index=0, start=start, stop=stop)
    return slots
