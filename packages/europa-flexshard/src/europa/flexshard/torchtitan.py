"""europa-flexshard inside torchtitan's own ``Trainer`` (torchtitan 0.3.0): the
whole-matrix layout in place of FSDP2.

``flexshard_config(config, ranks_per_node=..., max_nodes_per_token=...)`` turns a
torchtitan ``Trainer.Config`` into one whose ``build()`` trains the same job with every
matrix owned whole by one rank. It rewires four of torchtitan's extension points:

* the ``ModelSpec``: its ``parallelize_fn`` applies torchtitan's activation checkpointing,
  then lays the model out with ``flex_shard`` instead of torchtitan's expert-parallel
  DTensors and FSDP2 (a recomputed block finds its weights gathered). The non-expert
  matrices are split over the data-parallel ranks; the routed experts stay resident over
  torchtitan's ``ep`` ranks, and tokens reach them by flexshard's exchange (two-level:
  between nodes once, then inside the node, where an ep group spans nodes). Gathered
  weights compute in ``training.mixed_precision_param`` and gradients reduce in
  ``mixed_precision_reduce``, as FSDP2's would. The model's ``init_weights`` draws only
  the matrices this rank owns (each from its own seed: the same weights on any layout).
  torchtitan divides each rank's loss by the global token count, so gradients are summed
  over ranks, not averaged. With ``max_nodes_per_token`` each router's expert groups are
  the nodes of an ep group and a token reaches at most that many
  (``node_limited_routing``);
* the optimizers (``FlexShardOptimizers``): flexshard's AdamW or Muon on the owned
  matrices, with no collective in ``step()``. torchtitan's MoE load-balancing hook,
  which all-reduces the experts' token counts, runs right after clipping instead of
  inside ``step()``, in the same order relative to the step;
* the trainer (``FlexShardTrainer``): the layout's ``clip_grad_norm_`` in place of
  ``torchtitan.distributed.utils.clip_grad_norm_``, which no config reaches;
* the checkpointer (``FlexShardCheckpointManager``): torchtitan's DCP checkpointer saves
  each rank's owned matrices as regions of full-shaped tensors under torchtitan's own
  keys (``europa.spec.dcp.OwnedChunk``), so a checkpoint loads on any layout.

What the layout does not compose with here (pipeline, tensor and context parallelism,
HSDP replicas, torch.compile, a chunked loss, multi-token prediction, the ``spmd_types``
and ``full_dtensor`` backends, CPU offload, CUDA graphs, asynchronous or Hugging Face
saves, optimizer groups other than one AdamW group) is refused in one line
(``FlexShardError``) by ``flexshard_config``, before any rank builds a model.

Imports torch, torchtitan, europa-spec and europa-flexshard only; never europa-core.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import utils as titan_distributed
from torchtitan.models.common.moe import RoutedExperts, TokenChoiceTopKRouter
from torchtitan.protocols.module import Module as TitanModule
from torchtitan.trainer import Trainer

from europa.flexshard.builder import flex_shard
from europa.flexshard.errors import FlexShardError
from europa.flexshard.exchange.nodes import (
    ExpertNodes,
    expert_node_groups,
    launcher_ranks_per_node,
    split_into_nodes,
)
from europa.flexshard.experts import ExpertParallel
from europa.flexshard.optimizer import FlexShardOptimizer
from europa.flexshard.process_groups import dispatch_of
from europa.flexshard.state import HYPERPARAMETERS, FlexShardState
from europa.flexshard.whole_matrix_layout import FlexShardLayout
from europa.spec.qk_clip_step import install_qk_clip

_RECORD = "_europa_flexshard"


@dataclass(frozen=True)
class FlexShardOptions:
    """How the layout is made. ``ranks_per_node``: ranks sharing a node's fast link
    (numbered node by node). ``max_nodes_per_token``: node-limited routing (0: off).
    ``dispatch``: "auto" (two-level where an ep group spans nodes), "flat" or "two_level".
    ``dispatch_dtype``: the tokens' wire dtype towards the experts. ``seed``: the initial
    weights' seed."""

    ranks_per_node: int
    max_nodes_per_token: int = 0
    dispatch: str = "auto"
    dispatch_dtype: str = "compute"
    seed: int = 0
    qk_clip_tau: float = 0.0


@dataclass
class FlexShardRecord:
    """What the adapter keeps on a laid-out model: its layout and the optimizers' step
    pre-hooks that run after clipping instead (torchtitan's load balancing all-reduces)."""

    layout: FlexShardLayout
    options: FlexShardOptions
    after_clipping: list[Callable[[], None]] = field(default_factory=list)


def flexshard_record(model: nn.Module) -> FlexShardRecord:
    """The adapter's record on a model part a ``FlexShardTrainer`` built."""
    record = getattr(model, _RECORD, None)
    if record is None:
        raise FlexShardError(
            f"model {type(model).__name__}: not laid out by europa-flexshard; expected a "
            "Trainer.Config made by europa.flexshard.torchtitan.flexshard_config"
        )
    return record


def flexshard_layout(model: nn.Module) -> FlexShardLayout:
    """The ``FlexShardLayout`` of a model part a ``FlexShardTrainer`` built."""
    return flexshard_record(model).layout


# -- the one call -------------------------------------------------------------------------


def flexshard_config(
    config: Trainer.Config,
    *,
    ranks_per_node: int | None = None,
    max_nodes_per_token: int = 0,
    algorithm: str = "adamw",
    momentum: float = 0.95,
    ns_steps: int = 5,
    dispatch: str = "auto",
    dispatch_dtype: str = "compute",
    qk_clip_tau: float = 0.0,
) -> FlexShardTrainer.Config:
    """``config`` laid out by europa-flexshard instead of FSDP2: its ``build()`` makes a
    ``FlexShardTrainer``. ``ranks_per_node``: default the launcher's ``LOCAL_WORLD_SIZE``.
    ``algorithm``: "adamw" (the hyperparameters of ``config.optimizer``'s one group) or
    "muon" (AdamW's for embeddings, norms, router and head; ``momentum``, ``ns_steps``).
    ``qk_clip_tau`` > 0: Kimi-K2's QK-clip at that tau (``europa.spec.qk_clip_step``): the
    maxima agreed after clipping, outside ``step()``, and the owners' rows scaled after it,
    which sends nothing."""
    refuse_misfits(config)
    if qk_clip_tau < 0 or qk_clip_tau != qk_clip_tau:
        raise FlexShardError(f"qk_clip_tau = {qk_clip_tau!r}: expected 0 (off) or a number > 0")
    _refuse_choice("algorithm", algorithm, ("adamw", "muon"))
    _refuse_choice("dispatch", dispatch, ("auto", "flat", "two_level"))
    per_node = ranks_per_node or launcher_ranks_per_node(_world_size())
    options = FlexShardOptions(
        ranks_per_node=per_node,
        max_nodes_per_token=max_nodes_per_token,
        dispatch=dispatch,
        dispatch_dtype=dispatch_dtype,
        seed=config.debug.seed or 0,
        qk_clip_tau=qk_clip_tau,
    )
    spec = config.model_spec
    model = spec.model
    ep = config.parallelism.expert_parallel_degree
    if max_nodes_per_token:
        model = node_limited_routing(model, _nodes_of_ep(ep, per_node), max_nodes_per_token)
    spec = dataclasses.replace(
        spec,
        model=model,
        parallelize_fn=_parallelizer(options),
        pipelining_fn=None,
        post_optimizer_build_fn=_after_optimizers(spec.post_optimizer_build_fn),
    )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return FlexShardTrainer.Config(
        **fields
        | {
            "model_spec": spec,
            "optimizer": _optimizer_config(config.optimizer, algorithm, momentum, ns_steps),
            "checkpoint": FlexShardCheckpointManager.Config(**_fields_of(config.checkpoint)),
        }
    )


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _fields_of(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


# -- refusals -----------------------------------------------------------------------------

# (setting, its value on the config, what the layout needs, why)
_MUST_BE = (
    ("parallelism.pipeline_parallel_degree", lambda c: c.parallelism.pipeline_parallel_degree, 1,
     "pipeline stages are not laid out here"),
    ("parallelism.tensor_parallel_degree", lambda c: c.parallelism.tensor_parallel_degree, 1,
     "flexshard keeps every matrix whole"),
    ("parallelism.context_parallel_degree", lambda c: c.parallelism.context_parallel_degree, 1,
     "flexshard's data-parallel ranks each read their own sequences"),
    ("parallelism.data_parallel_replicate_degree",
     lambda c: c.parallelism.data_parallel_replicate_degree, 1,
     "HSDP replicas are not laid out here"),
    ("parallelism.spmd_backend", lambda c: c.parallelism.spmd_backend, "partial_dtensor",
     "flexshard's parameters are plain tensors, not DTensors"),
    ("compile.enable", lambda c: c.compile.enable, False,
     "flexshard's gather hooks are not traced by torch.compile here"),
    ("training.enable_cpu_offload", lambda c: c.training.enable_cpu_offload, False,
     "FSDP2's CPU offload does not apply"),
    ("training.disable_cuda_graphs", lambda c: c.training.disable_cuda_graphs, True,
     "flexshard's exchange sizes its buffers on the host"),
    ("checkpoint.async_mode", lambda c: getattr(c.checkpoint, "async_mode", "disabled"),
     "disabled", "asynchronous saves of owned chunks are not wired yet"),
    ("checkpoint.last_save_in_hf", lambda c: c.checkpoint.last_save_in_hf, False,
     "Hugging Face export reads full tensors"),
)  # fmt: skip


def refuse_misfits(config: Trainer.Config) -> None:
    """Raise ``FlexShardError`` in one line for the first setting of ``config`` that the
    layout does not compose with."""
    if config.model_spec is None:
        raise FlexShardError("model_spec = None: expected a torchtitan ModelSpec")
    for setting, value_of, expected, why in _MUST_BE:
        value = value_of(config)
        if value != expected:
            raise FlexShardError(
                f"{setting} = {_shown(value)}: expected {_shown(expected)} with "
                f"europa-flexshard ({why})"
            )
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        raise FlexShardError(
            "loss = ChunkedLossWrapper: expected a plain loss with europa-flexshard (the "
            "chunked loss calls lm_head outside the model's forward, where it is not gathered)"
        )
    _refuse_export_cast(config)
    _refuse_no_experts(config)
    _refuse_multi_token_prediction(config)
    _one_optimizer_group(config.optimizer)


def _refuse_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        expected = ", ".join(f'"{c}"' for c in choices)
        raise FlexShardError(f'{name} = "{value}": expected one of {expected}')


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, str):
        return f'"{value}"'
    if dataclasses.is_dataclass(value):
        return type(value).__qualname__.removesuffix(".Config")
    return str(value)


def _refuse_export_cast(config: Trainer.Config) -> None:
    checkpoint = config.checkpoint
    if checkpoint.last_save_model_only and checkpoint.export_dtype != config.training.dtype:
        raise FlexShardError(
            f'checkpoint.export_dtype = "{checkpoint.export_dtype}": expected '
            f'"{config.training.dtype}" (training.dtype) with europa-flexshard, whose owned '
            "chunks are saved as they are stored"
        )


def _refuse_no_experts(config: Trainer.Config) -> None:
    ep = config.parallelism.expert_parallel_degree
    if ep > 1 and not any(config.model_spec.model.traverse(RoutedExperts.Config, recurse=True)):
        raise FlexShardError(
            f"parallelism.expert_parallel_degree = {ep}: the model has no routed experts "
            "(RoutedExperts) to split; expected 1"
        )


def _refuse_multi_token_prediction(config: Trainer.Config) -> None:
    layers = getattr(config.model_spec.model, "mtp_layers", None) or []
    if layers:
        raise FlexShardError(
            f"model.mtp_layers = {len(layers)} layer(s): expected none with europa-flexshard "
            "(multi-token prediction is not laid out here)"
        )


def _one_optimizer_group(optimizer: OptimizersContainer.Config) -> dict[str, Any]:
    """The keyword arguments of the one catch-all optimizer group (``default_adamw``)."""
    if isinstance(optimizer, FlexShardOptimizers.Config):
        return {}
    groups = optimizer.param_groups
    if len(groups) != 1 or groups[0].optimizer_name != "AdamW":
        names = [g.optimizer_name for g in groups]
        raise FlexShardError(
            f"optimizer.param_groups = {names}: expected one AdamW group (default_adamw) "
            "with europa-flexshard, whose optimizer steps every owned matrix"
        )
    if optimizer.implementation == "fused_opt_states_bf16":
        raise FlexShardError(
            'optimizer.implementation = "fused_opt_states_bf16": expected "fused", '
            '"foreach" or "for-loop" with europa-flexshard (its state is stored as the parameters)'
        )
    return groups[0].optimizer_kwargs


# -- node-limited routing -----------------------------------------------------------------


def _nodes_of_ep(ep: int, per_node: int) -> int:
    """The nodes an ep group of ``ep`` consecutive ranks spans at ``per_node`` a node."""
    if (ep > per_node and ep % per_node) or (ep < per_node and per_node % ep):
        raise FlexShardError(
            f"parallelism.expert_parallel_degree = {ep}: expected a divisor or a multiple of "
            f"the {per_node} ranks per node, so that each ep group lies inside one node or "
            "holds whole nodes"
        )
    return max(1, ep // per_node)


def node_limited_routing(model_config: Any, nodes: int, max_nodes: int) -> Any:
    """A copy of ``model_config`` whose MoE routers group the experts by the ``nodes``
    an ep group spans (consecutive experts live on consecutive ranks) and route each
    token to at most ``max_nodes`` of them (torchtitan's ``num_expert_groups`` and
    ``num_limited_groups``). Apply the same to a run this one is compared with."""
    if not 0 < max_nodes <= nodes:
        raise FlexShardError(
            f"max_nodes_per_token = {max_nodes}: expected 1 to the {nodes} node(s) an ep "
            "group spans"
        )
    model_config = copy.deepcopy(model_config)
    routers = list(model_config.traverse(TokenChoiceTopKRouter.Config, recurse=True))
    if not routers:
        raise FlexShardError(
            f"max_nodes_per_token = {max_nodes}: the model has no MoE router; expected 0"
        )
    for _, router, _, _ in routers:
        per_group = router.num_experts // nodes
        if router.num_experts % nodes or per_group < 2:
            raise FlexShardError(
                f"max_nodes_per_token = {max_nodes}: {router.num_experts} experts over "
                f"{nodes} nodes; expected a multiple of {nodes} with at least 2 a node "
                "(a router scores a group by its top two)"
            )
        if router.top_k > max_nodes * per_group:
            raise FlexShardError(
                f"max_nodes_per_token = {max_nodes}: top_k = {router.top_k} exceeds the "
                f"{max_nodes * per_group} experts on {max_nodes} node(s); expected more nodes"
            )
        router.num_expert_groups = nodes
        router.num_limited_groups = max_nodes
    return model_config


# -- the model: laid out and initialised ----------------------------------------------------


def _parallelizer(options: FlexShardOptions) -> Callable[..., nn.Module]:
    def lay_out(
        model: nn.Module,
        *,
        parallel_dims: Any,
        training: Any,
        ac_config: Any = None,
        dump_folder: str = "",
        **_: Any,
    ) -> nn.Module:
        """torchtitan's ``parallelize_fn``: its activation checkpointing first, as its own
        parallelize does, then ``flex_shard`` in place of EP and FSDP2."""
        if ac_config is not None:
            ac_config.build(dump_folder=dump_folder).apply(model)
        layout = flex_shard(
            model,
            group=_dense_group(parallel_dims),
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            experts=_expert_parallel(parallel_dims, options),
            mean_over_ranks=False,  # torchtitan's loss is already over the global tokens
        )
        setattr(model, _RECORD, FlexShardRecord(layout, options))
        model.init_weights = _initialiser(model, layout, options.seed)
        return model

    return lay_out


def _dense_group(parallel_dims: Any) -> dist.ProcessGroup | None:
    """The ranks splitting the non-expert matrices: every data-parallel rank (torchtitan's
    ``fsdp`` mesh, which its ``ep`` ranks are part of); None for the world."""
    return parallel_dims.get_mesh("fsdp").get_group() if parallel_dims.fsdp_enabled else None


def _expert_parallel(parallel_dims: Any, options: FlexShardOptions) -> ExpertParallel | None:
    """The routed experts over torchtitan's ``ep`` ranks (consecutive: ``ep`` is the
    innermost axis), their copies over its ``efsdp`` ranks, and the nodes they span."""
    ep, world = parallel_dims.ep, parallel_dims.world_size
    if ep == 1:
        return None
    per_node = options.ranks_per_node
    if world % per_node:
        raise FlexShardError(
            f"ranks_per_node = {per_node}: expected a divisor of the {world} ranks (ranks are "
            "numbered node by node)"
        )
    _nodes_of_ep(ep, per_node)
    ep_groups = [list(range(start, start + ep)) for start in range(0, world, ep)]
    dispatch = dispatch_of(_Parallel(ep_dispatch=options.dispatch, ep=ep), per_node)
    if dispatch == "two_level":
        nodes = expert_node_groups(ep_groups, per_node)  # a collective: every rank builds all
    else:
        for group in ep_groups:
            split_into_nodes(group, per_node)
        nodes = ExpertNodes(min(ep, per_node))
    copies = parallel_dims.get_mesh("efsdp").get_group() if world > ep else None
    return ExpertParallel(
        group=parallel_dims.get_mesh("ep").get_group(),
        copies=copies,
        dispatch=dispatch,
        nodes=nodes,
        dispatch_dtype=options.dispatch_dtype,
        max_nodes=options.max_nodes_per_token,
    )


@dataclass(frozen=True)
class _Parallel:
    """What ``process_groups.dispatch_of`` reads of europa's ``[parallel]`` table."""

    ep_dispatch: str
    ep: int


def _initialiser(model: nn.Module, layout: FlexShardLayout, seed: int) -> Callable[..., None]:
    """The model's ``init_weights``, which torchtitan calls after ``to_empty``: this rank's
    storage allocated, its matrices drawn, then every module's buffers."""

    def init_weights(*, buffer_device: torch.device | None = None, **_: Any) -> None:
        device = buffer_device or next(iter(layout.slots.values())).local.device
        layout.materialise(device, _MatrixInit(layout, seed))
        for module in model.modules():
            if isinstance(module, TitanModule):
                module._init_self_buffers(buffer_device=device)

    return init_weights


class _MatrixInit:
    """``init_matrix(name, index, out)``: matrix ``index`` of parameter ``name`` drawn by
    its module's torchtitan initialiser (``param_init``) from a generator seeded by (seed,
    name, index), so the weights do not depend on the layout or the world size."""

    def __init__(self, layout: FlexShardLayout, seed: int) -> None:
        self.layout = layout
        self.seed = seed

    def __call__(self, name: str, index: int, out: torch.Tensor) -> None:
        slot = self.layout.slots[name]
        init = (getattr(slot.module, "_param_init", None) or {}).get(slot.attr)
        if init is None:
            raise FlexShardError(
                f"parameter {name}: its module {type(slot.module).__name__} has no param_init "
                f"for {slot.attr!r}; expected torchtitan's per-parameter initialisers"
            )
        stacked = len(self.layout.spec(name).shape) == 3
        target = out.unsqueeze(0) if stacked else out  # the fan of a [E, rows, cols] stack
        accelerators = [out.device] if out.device.type != "cpu" else []
        with torch.random.fork_rng(devices=accelerators, device_type=out.device.type):
            torch.manual_seed(_matrix_seed(self.seed, name, index))
            init(target)


def _matrix_seed(seed: int, name: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# -- optimizers -----------------------------------------------------------------------------


def _after_optimizers(original: Callable | None) -> Callable[..., None]:
    def after_optimizers(optimizers: Any, model_parts: list, parallel_dims: Any) -> None:
        """torchtitan's ``post_optimizer_build_fn`` (its MoE load balancing), with the
        step pre-hooks it registers kept to run after clipping, outside ``step()``."""
        if original is None:
            return
        record = flexshard_record(model_parts[0])
        original(_HooksAfterClipping(optimizers, record.after_clipping), model_parts, parallel_dims)

    return after_optimizers


class _HooksAfterClipping:
    """The optimizers as a ``post_optimizer_build_fn`` sees them, except that a step
    pre-hook is kept in ``hooks`` (run after clipping) rather than registered."""

    def __init__(self, optimizers: Any, hooks: list[Callable[[], None]]) -> None:
        self._optimizers = optimizers
        self._hooks = hooks

    def register_step_pre_hook(self, hook: Callable) -> None:
        self._hooks.append(lambda: hook(self._optimizers, (), {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizers, name)


def _optimizer_config(
    optimizer: OptimizersContainer.Config, algorithm: str, momentum: float, ns_steps: int
) -> FlexShardOptimizers.Config:
    if isinstance(optimizer, FlexShardOptimizers.Config):
        return optimizer
    kwargs = _one_optimizer_group(optimizer)
    hyper = {k: kwargs[k] for k in ("lr", "weight_decay", "betas", "eps") if k in kwargs}
    if "betas" in hyper:
        hyper["betas"] = tuple(hyper["betas"])
    return FlexShardOptimizers.Config(
        algorithm=algorithm, momentum=momentum, ns_steps=ns_steps, **hyper
    )


class FlexShardOptimizers(OptimizersContainer):
    """torchtitan's optimizers container holding one ``FlexShardOptimizer`` over the
    layout's owned matrices; its state dict has torchtitan's flat keys
    (``state.{name}.{key}``, ``param_groups.{name}.{key}``), each tensor the rank's owned
    region of the full-shaped state."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        algorithm: str = "adamw"
        lr: float = 8e-4
        weight_decay: float = 0.1
        momentum: float = 0.95
        ns_steps: int = 5
        betas: tuple[float, float] = (0.9, 0.95)
        eps: float = 1e-8

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise FlexShardError(
                f"model parts = {len(model_parts)}: expected 1 with europa-flexshard"
            )
        self.layout = flexshard_layout(model_parts[0])
        self.optimizer = FlexShardOptimizer(
            self.layout,
            algorithm=config.algorithm,
            lr=config.lr,
            weight_decay=config.weight_decay,
            momentum=config.momentum,
            ns_steps=config.ns_steps,
            betas=tuple(config.betas),
            eps=config.eps,
        )
        self.optimizers = [self.optimizer]
        self.model_parts = model_parts
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self._validate_params(params)
        self._post_init(params)
        record = flexshard_record(model_parts[0])
        self.qk_clip = None
        if record.options.qk_clip_tau:
            self.qk_clip = install_qk_clip(
                self,
                model_parts[0],
                n_layers=len(model_parts[0].layers),
                tau=record.options.qk_clip_tau,
                scale=self.layout.scale_rows,
                before_step=record.after_clipping.append,
            )

    def state_dict(self) -> dict[str, Any]:
        optim = FlexShardState(self.layout, self.optimizer).optimizer_state()
        flat = {}
        for name, state in optim["state"].items():
            for key, value in state.items():
                flat[f"state.{canonical_fqn(name)}.{key}"] = value
        for name, hyper in optim["param_groups"].items():
            for key, value in hyper.items():
                flat[f"param_groups.{canonical_fqn(name)}.{key}"] = value
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP filled the state tensors in place; the hyperparameters come back as values.
        groups = {}
        for name, _, group in self.optimizer.named_parameters():
            keys = (*HYPERPARAMETERS, "use_muon")
            prefix = f"param_groups.{canonical_fqn(name)}"
            groups[name] = {k: state_dict.get(f"{prefix}.{k}", group.get(k)) for k in keys}
        FlexShardState(self.layout, self.optimizer).load_state_dict(
            {"optim": {"param_groups": groups}}
        )


# -- checkpoint -----------------------------------------------------------------------------


class FlexShardModelState(Stateful):
    """The model part of a checkpoint: each parameter under its canonical name, full-shaped,
    holding this rank's owned region; persistent buffers as they are. DCP loads in place."""

    def __init__(self, layout: FlexShardLayout) -> None:
        self.layout = layout

    def state_dict(self) -> dict[str, Any]:
        model = FlexShardState(self.layout, None).model_state()
        return {canonical_fqn(name): value for name, value in model.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None  # DCP wrote into the owned regions themselves


class FlexShardCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointer with the model's state as ``FlexShardModelState``."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module], **kwargs: Any) -> None:
        super().__init__(config, model_parts=model_parts, **kwargs)
        if self.enable:
            self.states[MODEL] = FlexShardModelState(flexshard_layout(model_parts[0]))


# -- the trainer ----------------------------------------------------------------------------


class FlexShardTrainer(Trainer):
    """torchtitan's ``Trainer`` whose gradient clipping is the layout's: one all-reduce of
    the owners' squared norms, then the step pre-hooks kept from ``step()``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        refuse_misfits(config)
        super().__init__(config)

    def train_step(self, data_iterator: Iterator) -> None:
        with _clipping_by_layout(flexshard_record(self.model_parts[0])):
            super().train_step(data_iterator)


@contextlib.contextmanager
def _clipping_by_layout(record: FlexShardRecord) -> Iterator[None]:
    """``torchtitan.distributed.utils.clip_grad_norm_`` (which ``Trainer.train_step``
    looks up at each call) as the layout's, for the duration of one step."""
    original = titan_distributed.clip_grad_norm_

    def clip_grad_norm_(parameters: Any, max_norm: float, **_: Any) -> torch.Tensor:
        norm = record.layout.clip_grad_norm_(max_norm)
        for hook in record.after_clipping:
            hook()
        return torch.tensor(norm)

    titan_distributed.clip_grad_norm_ = clip_grad_norm_
    try:
        yield
    finally:
        titan_distributed.clip_grad_norm_ = original


__all__ = [
    "FlexShardCheckpointManager",
    "FlexShardModelState",
    "FlexShardOptimizers",
    "FlexShardOptions",
    "FlexShardRecord",
    "FlexShardTrainer",
    "flexshard_config",
    "flexshard_layout",
    "node_limited_routing",
    "refuse_misfits",
]
