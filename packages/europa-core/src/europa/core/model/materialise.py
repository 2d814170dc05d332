"""Allocate and initialise a (possibly sharded) meta model, one matrix at a time.

Design note. Every parameter is a stack of matrices: a stacked expert tensor
``[E, rows, cols]`` holds E of them, any other tensor is one. Matrix ``i`` of
parameter ``p`` is drawn from its own generator, seeded by (run seed, ``p``,
``i``) (``europa.core.seeds.matrix_seed``). So the initial weights are the same
whatever the layout and the world size, and a rank draws only what it holds: an
FSDP2 rank holding experts 2-3 of a layer draws those two; a row shard of a
dense matrix draws that one matrix whole and keeps its rows. No rank allocates
more than its own parameters plus one matrix.

The work is split in two. ``MatrixInitialiser`` decides the *values*: it is
built from the model before sharding (it records every parameter's full shape
and module) and fills one matrix on request. The layout decides *where* the
matrices live: the ``europa_init_parameters`` hook (``init_parameters`` below
for plain and DTensor parameters; europa-flexshard has its own) allocates this
rank's storage and asks the initialiser for each matrix it holds. Buffers come
last (``init_buffers``).

Values come from torchtitan's per-module ``param_init`` (``trunc_normal_`` and
friends), called on one matrix with a seeded generator. A module without
``param_init`` falls back to its ``reset_parameters()``: it runs once on
full-size copies of the module's own parameters under a seeded global RNG, and
the matrices asked for are copied out (so such a module costs one full copy of
itself while it is initialised).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.protocols.module import Module as TitanModule

from europa.core.seeds import matrix_seed
from europa.spec.init import InitMatrix, RegionInitMatrix


def matrices_in(shape: tuple[int, ...] | torch.Size) -> int:
    """How many matrices a parameter of this shape holds: E for ``[E, rows, cols]``, else 1."""
    return shape[0] if len(shape) == 3 else 1


def matrix_views(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.unbind(0)) if tensor.ndim == 3 else [tensor]


@functools.cache
def _takes_generator(init: Callable) -> bool:
    try:
        return "generator" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def _global_rng_seeded(device: torch.device, seed: int) -> Iterator[None]:
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        yield


def _seeded(init: Callable, out: torch.Tensor, seed: int) -> None:
    if _takes_generator(init):
        init(out, generator=torch.Generator(device=out.device).manual_seed(seed))
        return
    with _global_rng_seeded(out.device, seed):  # ones_, zeros_, custom initialisers
        init(out)


class MatrixInitialiser:
    """``init_matrix(name, index, out)``: fill ``out`` with matrix ``index`` of
    parameter ``name``, from the run seed. Build it before sharding."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self._owner: dict[str, tuple[nn.Module, str, str]] = {}
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        for module_name, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            self._shapes[module_name] = {n: tuple(p.shape) for n, p in own.items()}
            for local in own:
                name = f"{module_name}.{local}" if module_name else local
                self._owner[name] = (module, module_name, local)
        self._reset_cache: tuple[str | None, dict[str, torch.Tensor]] = (None, {})

    def __call__(self, name: str, index: int, out: torch.Tensor) -> None:
        if name not in self._owner:
            raise KeyError(f"{name!r} is not a parameter of the model the initialiser was built on")
        module, module_name, local = self._owner[name]
        init = getattr(module, "_param_init", None)  # torchtitan's per-parameter initialisers
        if init is not None:
            if local not in init:
                raise ValueError(
                    f"{type(module).__name__} ({module_name}) has no initialiser for {local!r}; "
                    f"expected one of {sorted(init)}"
                )
            _seeded(init[local], out, matrix_seed(self.seed, name, index))
            return
        full = self._reset(module, module_name, out.device)[local]
        out.copy_(full[index] if full.ndim == 3 else full)

    def _reset(self, module: nn.Module, module_name: str, device: torch.device):
        cached_for, cached = self._reset_cache
        if cached_for == module_name:
            return cached
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"{type(module).__name__} ({module_name or 'the root module'}) has parameters "
                "but neither param_init nor reset_parameters(); expected one of them"
            )
        originals = dict(module._parameters)
        shapes = self._shapes[module_name]
        try:
            for local, param in originals.items():
                if param is not None:
                    fresh = torch.empty(shapes[local], dtype=param.dtype, device=device)
                    module._parameters[local] = nn.Parameter(fresh, requires_grad=False)
            with _global_rng_seeded(device, matrix_seed(self.seed, module_name, 0)):
                reset()
            fulls = {n: p.detach() for n, p in module._parameters.items() if p is not None}
        finally:
            module._parameters.update(originals)
        self._reset_cache = (module_name, fulls)
        return fulls


def _init_dtensor(name: str, param: DTensor, init_matrix: InitMatrix) -> None:
    local = param.to_local()
    if local.numel() == 0:
        return
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    rows = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    # A checkpoint source reads only this shard's rows (see init_parameters).
    fill_region = init_matrix.fill_region if isinstance(init_matrix, RegionInitMatrix) else None
    if param.ndim == 3:
        whole = tuple(shape[1:]) == tuple(param.shape[1:])
        for j in range(shape[0]):
            if whole:
                init_matrix(name, offset[0] + j, local[j])
            elif fill_region is not None:
                fill_region(name, offset[0] + j, local[j], rows[1:])
            else:
                full = torch.empty(param.shape[1:], dtype=local.dtype, device=local.device)
                init_matrix(name, offset[0] + j, full)
                local[j].copy_(full[rows[1:]])
        return
    if fill_region is not None:
        fill_region(name, 0, local, rows)
        return
    full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
    init_matrix(name, 0, full)
    local.copy_(full[rows])


@torch.no_grad()
def init_parameters(model: nn.Module, device: torch.device, init_matrix: InitMatrix) -> None:
    """Core's layouts: allocate plain and DTensor (FSDP2/HSDP) parameters on
    ``device`` and fill the matrices this rank holds. For a row shard of a
    matrix, ``init_matrix.fill_region(name, index, out, region)`` is used when
    the initialiser has it (a checkpoint reader: only the region is read);
    otherwise the matrix is drawn whole and its rows kept."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            _init_dtensor(name, param, init_matrix)
        else:
            for index, matrix in enumerate(matrix_views(param)):
                init_matrix(name, index, matrix)


@torch.no_grad()
def init_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate buffers still on the meta device (zero-filled), then let each
    torchtitan module fill its own (RoPE tables, MoE counters and biases)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros_like(buffer, device=device)
        if isinstance(module, TitanModule):
            module._init_self_buffers(buffer_device=device)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"parameter {left[0]!r} is still on the meta device after init")


def materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta model (unsharded or DTensor-sharded) on ``device`` and
    initialise it from ``seed``: the same values for any world size."""
    init_parameters(model, device, MatrixInitialiser(model, seed))
    init_buffers(model, device)
