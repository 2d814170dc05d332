"""Checkpoint state of a FlexShard layout for torch.distributed.checkpoint (DCP).

Each parameter (and each optimizer tensor shaped like it) is saved under its
own name with its *full* shape; each rank writes the chunk it owns (its
contiguous run of experts, or the whole tensor on its owner) and nothing else.
DCP writes every matrix once and, on load, reads whatever overlaps the loading
rank's own matrices, so a checkpoint saved on one world size resumes on any
other, and its keys and shapes are those of an unsharded model
(``model.<name>``), which lets a launcher check a checkpoint against a model on
the meta device.

The chunk is an ``OwnedChunk`` (``europa.spec.dcp``): a full-shaped tensor of
which this rank holds one region, described through DCP's own chunk protocol. Without
torch.distributed (one process) the tensors are plain and full.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from europa.flexshard.optimizer import FlexShardOptimizer
from europa.flexshard.whole_matrix_layout import FlexShardLayout
from europa.spec.dcp import OwnedChunk

HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "ns_steps", "betas", "eps")


class FlexShardState:
    """``state_dict()`` -> ``{"model": ..., "optim": ...}``; ``load_state_dict`` after
    DCP has filled it in place (tensors are views of the live storage). Each part alone:
    ``model_state()`` (``optimizer`` may be None for it) and ``optimizer_state()``."""

    def __init__(self, layout: FlexShardLayout, optimizer: FlexShardOptimizer | None) -> None:
        self.layout = layout
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model_state(), "optim": self.optimizer_state()}

    def model_state(self) -> dict[str, Any]:
        """{name: parameter (an ``OwnedChunk``) or persistent buffer}."""
        model = dict(_persistent_buffers(self.layout.model))  # replicated: equal on every rank
        for name, param in self.layout.named_local_parameters():
            model[name] = self._global(name, param)
        return model

    def optimizer_state(self) -> dict[str, Any]:
        """{"state": {name: {key: tensor}}, "param_groups": {name: hyperparameters}}."""
        state, groups = {}, {}
        for group in self.optimizer.param_groups:  # by parameter: any cut of stages loads it
            hyperparameters = {k: group[k] for k in HYPERPARAMETERS}
            for name in group["names"]:
                groups[name] = hyperparameters | {"use_muon": group["use_muon"]}
        for name, param, _ in self.optimizer.named_parameters():
            state[name] = {
                key: value if value.ndim == 0 else self._global(name, value)
                for key, value in self.optimizer.state[param].items()
            }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Tensors were filled in place by DCP; only the hyperparameters are new objects.
        saved_groups = state["optim"]["param_groups"]
        for group in self.optimizer.param_groups:
            saved = [saved_groups[name] for name in group["names"]]
            if any(s["use_muon"] != group["use_muon"] for s in saved):
                raise ValueError("checkpoint optimizer groups do not match this model's parameters")
            for key in HYPERPARAMETERS:
                group[key] = tuple(saved[0][key]) if key == "betas" else saved[0][key]

    def _global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's ``[owned, *matrix]``) as the full-shaped tensor it is part of."""
        spec = self.layout.spec(name)
        slot = self.layout.slots[name]
        mine = local.detach() if spec.stacked else local.detach().reshape(-1, *spec.shape)
        if self.layout.groups.shard is None and not dist.is_initialized():
            return mine if spec.stacked else mine[0]  # one process: the tensor itself
        if slot.start == slot.stop:
            return OwnedChunk(torch.Size(spec.shape), mine, None)
        if spec.stacked:
            return OwnedChunk(torch.Size(spec.shape), mine, (slot.start, 0, 0))
        return OwnedChunk(torch.Size(spec.shape), mine[0], (0,) * len(spec.shape))


def _persistent_buffers(model: torch.nn.Module):
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer
