"""torchtitan 0.3.0's own ``Trainer`` (``torchtitan.trainer.Trainer``), set up to train
what a europa run trains, on whatever device torchtitan finds (on CPU ranks, import
``_torchtitan_cpu`` instead: it patches torchtitan first).

The model is torchtitan's ``deepseek_v3`` ``debugmodel`` flavour with SDPA causal
attention (FlexAttention has no CPU backward) and the router settings of europa's
``debug`` preset, or with ``europa_shape`` europa's own ``[model]``; ``fp32_experts`` swaps
its routed experts (which cast to bf16 for ``torch._grouped_mm``,
``torchtitan/models/common/moe.py`` ``GroupedExperts.forward``) for europa's
``NativeDtypeGroupedExperts``: the same parameters and grouped matmul, no cast.
``dtype = "bfloat16"`` is torchtitan's mixed precision (fp32 parameters, bf16 compute:
FSDP2's policy when it shards, autocast on one device). Data come from europa's batches
for the same preset, so both systems see the same token ids on each rank at each step.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw
from torchtitan.config.configs import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import model_registry
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.trainer import Trainer


class EuropaBatches(BaseDataLoader):
    """europa's per-rank batches for a preset, as torchtitan's (inputs, labels) pairs."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        preset: str = "debug"
        overrides: list[str] = field(default_factory=list)
        cache_dir: str = ""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, **_: Any) -> None:
        from europa.core.config import load_config
        from europa.core.train.batches import open_rank_batches

        europa_config = load_config(config.preset, config.overrides)
        is_main = torch.distributed.get_rank() == 0
        self.source = open_rank_batches(
            europa_config, dp_rank, dp_world_size, Path(config.cache_dir), is_main
        ).source
        self.step = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            inputs, labels = self.source.batch(self.step, 0)
            self.step += 1
            yield {"input": inputs}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def model_spec(europa_model: Any, *, fp32_experts: bool, europa_shape: bool = False) -> Any:
    """torchtitan's debugmodel with SDPA attention and europa's routing choices; with
    ``europa_shape``, its model config is europa's own ``[model]`` (the same torchtitan
    module tree europa trains, with SDPA attention), for a shape the preset overrides."""
    spec = model_registry("debugmodel")
    if europa_shape:
        from europa.core.model import model_spec as europa_model_spec

        spec.model = europa_model_spec(europa_model, native_dtype_experts=fp32_experts)
        return spec
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is None:
            continue
        router = layer.moe.router
        router.score_func = europa_model.score_func
        router.route_norm = europa_model.route_norm
        router.route_scale = europa_model.route_scale
        layer.moe.load_balance_coeff = europa_model.load_balance_coeff or None
        if fp32_experts:
            import dataclasses

            from europa.core.model.experts import NativeDtypeGroupedExperts

            inner = layer.moe.routed_experts.inner_experts
            layer.moe.routed_experts.inner_experts = NativeDtypeGroupedExperts.Config(
                **{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)}
            )
    return spec


def routing_of(spec: Any) -> dict[str, Any]:
    moe = next(layer.moe for layer in spec.model.layers if layer.moe is not None)
    return {
        "top_k": moe.router.top_k,
        "num_experts": moe.num_experts,
        "shared_experts_hidden_dim": (
            moe.shared_experts.w1.out_features if moe.shared_experts is not None else 0
        ),
        "score_func": moe.router.score_func,
        "route_norm": moe.router.route_norm,
        "experts_class": type(moe.routed_experts.inner_experts).__qualname__,
    }


def adapted(spec: Any, adapter: str) -> Any:
    """``spec`` with a europa technique's torchtitan adapter: "offload" (every saved
    activation of at least 64 KiB) or "overlap" (FSDP2 gathers prefetched 2 blocks ahead)."""
    if adapter == "offload":
        from europa.offload import OffloadPolicy
        from europa.offload.torchtitan import with_offload

        return with_offload(spec, OffloadPolicy(min_bytes=64 << 10))
    if adapter == "overlap":
        from europa.overlap.torchtitan import with_overlap

        return with_overlap(spec, depth=2)
    raise ValueError(f"adapter = {adapter!r}: expected 'offload' or 'overlap' here")


def trainer_config(args: dict[str, Any], world: int, dump_folder: str) -> Trainer.Config:
    """torchtitan's own debugmodel job, made to match the europa run it is compared with."""
    from europa.core.config import load_config
    from europa.core.data.assets import __file__ as assets_init

    europa = load_config(args["preset"], args["overrides"])
    opt = europa.optimizer
    config = deepseek_v3_debugmodel()
    config.model_spec = model_spec(
        europa.model,
        fp32_experts=args["fp32_experts"],
        europa_shape=args.get("europa_shape", False),
    )
    if args.get("adapter") in ("offload", "overlap"):
        config.model_spec = adapted(config.model_spec, args["adapter"])
    config.hf_assets_path = str(Path(assets_init).parent)  # europa's tokenizer.json
    config.dump_folder = dump_folder
    config.metrics = MetricsProcessor.Config(log_freq=args["log_every"])
    config.dataloader = EuropaBatches.Config(
        preset=args["preset"], overrides=args["overrides"], cache_dir=args["data_dir"]
    )
    config.optimizer = default_adamw(
        lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay
    )
    # europa's micro-batches: as many accumulated per step on every rank; with ``pp``
    # stages, the pipeline's micro-batches of one local batch, as europa's stages run them
    pp = args.get("pp", 1)
    micro, accum = europa.training.batch_size, europa.training.grad_accum_steps
    local = micro * accum if pp > 1 else micro
    config.training = TrainingConfig(
        local_batch_size=local,
        global_batch_size=micro * (world // pp) * accum,
        seq_len=europa.training.seq_len,
        steps=args["steps"],
        max_norm=europa.training.max_grad_norm,
        dtype="float32",  # the parameters': bf16 compute is mixed precision, as in europa
        mixed_precision_param=europa.training.dtype,
        # its default on a GPU is to capture forward and backward as a CUDA graph
        disable_cuda_graphs=not args.get("cuda_graphs", False),
    )
    # Its default "spmd_types" backend refuses FSDP on these CPU ranks (a norm weight stays
    # a plain tensor: "all parameters must be DTensors on the full SPMD mesh");
    # "partial_dtensor" is plain FSDP2 over the data-parallel ranks, as europa's core layout,
    # or with ``replicate`` HSDP over ``world`` replicas of one shard each.
    # ``ep`` splits the routed experts over that many ranks (torchtitan's own all-to-all
    # dispatcher); ``full_ac`` recomputes every block, as europa's
    # activation_checkpointing.mode = "full".
    replicas = world if args.get("replicate") else 1
    config.parallelism = ParallelismConfig(
        data_parallel_shard_degree=world // replicas // pp,
        data_parallel_replicate_degree=replicas,
        expert_parallel_degree=args.get("ep", 1),
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=args.get("pp_schedule", "1F1B"),
        pipeline_parallel_microbatch_size=micro,
        spmd_backend="partial_dtensor",
    )
    config.checkpoint = CheckpointManager.Config(enable=False)
    # europa's e2e runs recompute nothing either
    config.activation_checkpoint = FullAC.Config() if args.get("full_ac") else None
    if args.get("plain_loss"):  # the chunked loss calls lm_head outside the model's forward
        config.loss = config.loss.loss_fn
    if args.get("nodes"):  # node-limited routing over the nodes an ep group spans
        from europa.flexshard.torchtitan import node_limited_routing

        config.model_spec.model = node_limited_routing(config.model_spec.model, args["nodes"], 1)
    if args.get("adapter") == "flexshard":
        from europa.flexshard.torchtitan import flexshard_config

        per_node = args["ep"] // args["nodes"]
        config = flexshard_config(config, ranks_per_node=per_node, max_nodes_per_token=1)
    return config


def run_trainer(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One torchtitan Trainer run on this rank, timed by a StepClock (``_steps``)."""
    import warnings

    from _steps import StepClock, summarise

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="e2e-torchtitan-") as dump_folder:
        config = trainer_config(args, world, dump_folder)
        trainer = config.build()
        try:
            model = trainer.model_parts[0]
            clock = StepClock(
                args["warmup"], args["timed"], args["profiled"], args.get("device", "cpu")
            )
            step = trainer.optimizers.step
            traffic = CountedTraffic() if args.get("count_step_traffic") else None
            if traffic is not None:
                step = _inside(traffic, step)
            trainer.forward_backward_step, trainer.optimizers.step = clock.watch(
                model, trainer.forward_backward_step, step
            )
            keep_going = trainer.should_continue_training
            link = LinkBytes(args["link_device"]) if args.get("link_device") else None

            def should_continue_training() -> bool:
                clock.boundary()
                if link is not None:
                    link.boundary()
                return keep_going()

            trainer.should_continue_training = should_continue_training
            trainer.train()
        finally:
            trainer.close()
        parameters = sum(p.numel() for p in model.parameters())
        tokens = config.training.global_batch_size * config.training.seq_len
        result = summarise(clock, tokens)
        if traffic is not None:
            result["optimizer_step_calls"] = traffic.calls
            result["optimizer_step_bytes"] = traffic.bytes
        if link is not None:
            timed = link.per_step()[clock.warmup : clock.warmup + clock.timed]
            result["link_sent_bytes_per_step"] = sorted(timed)[len(timed) // 2]
        if args.get("adapter") == "offload":
            from europa.offload.torchtitan import offload_record

            steps = offload_record(model).steps
            result["offloaded_bytes_per_step"] = max(s.bytes_offloaded for s in steps)
        result.update(
            parameters=parameters,
            routing=routing_of(config.model_spec),
            torchtitan_flops_per_token=trainer.metrics_processor.num_flops_per_token,
        )
        return result


class LinkBytes:
    """What this node sends over its emulated link (``_netns``) in each iteration: the
    veth end's transmit counter, read in this rank's network namespace at every step
    boundary. Every rank of the node reads the same counter: its ranks' traffic together."""

    def __init__(self, device: str) -> None:
        self.counter = Path(f"/sys/class/net/{device}/statistics/tx_bytes")
        self.readings: list[int] = []

    def boundary(self) -> None:
        self.readings.append(int(self.counter.read_text()))

    def per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.readings, self.readings[1:], strict=False)]


def _inside(context: Any, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with context:
            return fn(*args, **kwargs)

    return wrapper


# torch.distributed's point-to-point and collective calls, each counted by CountedTraffic
TRAFFIC = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "gather", "irecv", "isend", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "send",
)  # fmt: skip


class CountedTraffic:
    """While active, every call this process makes to one of ``TRAFFIC`` (looked up on
    ``torch.distributed`` at call time, as europa's layouts do) is counted with the bytes of
    its tensors, and with ``functional`` DTensor's functional collectives too, through
    torch's ``CommDebugMode`` (which sees every operator: slow around a whole step)."""

    def __init__(self, functional: bool = True) -> None:
        self.calls = 0
        self.bytes = 0
        self.functional = functional

    def __enter__(self) -> CountedTraffic:
        import torch.distributed as dist
        from torch.distributed.tensor.debug import CommDebugMode

        self._originals = {n: getattr(dist, n) for n in TRAFFIC if hasattr(dist, n)}
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(original))
        self._functional = CommDebugMode() if self.functional else None
        if self._functional is not None:
            self._functional.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        if self._functional is not None:
            self._functional.__exit__(*exc)
            self.calls += self._functional.get_total_counts()
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _counted(self, original: Callable) -> Callable:
        import torch

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            for value in (*args, *kwargs.values()):
                items = value if isinstance(value, list | tuple) else [value]
                for item in items:
                    if isinstance(item, torch.Tensor):
                        self.bytes += item.numel() * item.element_size()
            return original(*args, **kwargs)

        return counted
