"""europa-offload inside torchtitan's own ``Trainer`` (torchtitan 0.3.0).

``with_offload(model_spec)`` returns the ``ModelSpec`` with two of its callables
wrapped, and nothing else of torchtitan changed:

* ``parallelize_fn``: torchtitan's own (activation checkpointing, FSDP2, expert
  parallelism...) runs first; then every transformer block (``model.layers``) saves its
  activations under europa-offload's hooks. With torchtitan's full activation
  checkpointing a block saves only its input, which is what goes to host memory;
* ``post_optimizer_build_fn``: after torchtitan's own (MoE load balancing), a step
  post-hook on its optimizers container hands any outstanding host buffer back and
  records the step's figures (``offload_record(model).steps``).

What is not offloaded here: the optimizer state. torchtitan's FSDP2 holds it as DTensors,
which ``OffloadedOptimizer`` refuses on an accelerator; torchtitan's own
``training.enable_cpu_offload`` (FSDP2's ``CPUOffloadPolicy``) moves it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from europa.offload.activations import (
    ActivationOffload,
    OffloadPolicy,
    OffloadStats,
    offload_activations,
)
from europa.offload.errors import OffloadError
from europa.offload.pool import HostBufferPool

_RECORD = "_europa_offload"


@dataclass
class OffloadRecord:
    """The running offload of one model part and each finished step's figures."""

    offload: ActivationOffload
    steps: list[OffloadStats] = field(default_factory=list)

    def end_step(self) -> None:
        self.offload.release()
        self.steps.append(self.offload.take_stats())


def with_offload(
    model_spec: Any,
    policy: OffloadPolicy | None = None,
    *,
    host_limit_bytes: int | None = None,
) -> Any:
    """``model_spec`` (a torchtitan ``ModelSpec``) whose blocks' saved activations go to
    host memory (``policy``: which and how large; ``host_limit_bytes``: the pool's budget,
    None for none)."""
    parallelize, after_optimizers = model_spec.parallelize_fn, model_spec.post_optimizer_build_fn

    def parallelize_then_offload(model: nn.Module, **kwargs: Any) -> nn.Module:
        _check_composes(kwargs)
        model = parallelize(model, **kwargs)
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleDict | nn.ModuleList) or len(layers) == 0:
            raise OffloadError(
                f"model {type(model).__name__}: expected its transformer blocks in "
                "model.layers, where europa-offload wraps them; found none"
            )
        pool = HostBufferPool(limit_bytes=host_limit_bytes)
        named = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
        blocks = [(str(name), block) for name, block in named]
        setattr(model, _RECORD, OffloadRecord(offload_activations(blocks, policy, pool)))
        return model

    def after_optimizers_then_end_steps(optimizers: Any, model_parts: list, parallel_dims: Any):
        if after_optimizers is not None:
            after_optimizers(optimizers, model_parts, parallel_dims)
        records = [offload_record(part) for part in model_parts]

        def end_step(*_: Any) -> None:
            for record in records:
                record.end_step()

        optimizers.register_step_post_hook(end_step)

    return dataclasses.replace(
        model_spec,
        parallelize_fn=parallelize_then_offload,
        post_optimizer_build_fn=after_optimizers_then_end_steps,
    )


def offload_record(model: nn.Module) -> OffloadRecord:
    """The offload ``with_offload`` set up on ``model`` (a torchtitan model part)."""
    record = getattr(model, _RECORD, None)
    if record is None:
        raise OffloadError(
            f"model {type(model).__name__}: no europa-offload on it; expected a model built "
            "from a ModelSpec wrapped by europa.offload.torchtitan.with_offload"
        )
    return record


def _check_composes(kwargs: dict[str, Any]) -> None:
    compile_config = kwargs.get("compile_config")
    if compile_config is not None and getattr(compile_config, "enable", False):
        raise OffloadError(
            "compile.enable = true: expected false with europa-offload, whose saved-tensor "
            "hooks torch.compile does not trace through"
        )
