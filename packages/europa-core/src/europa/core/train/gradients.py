"""Gradient clipping for core's layouts (plain and DTensor parameters)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def clip_gradients(model: torch.nn.Module, max_norm: float, pipeline_group=None) -> float:
    """Clip to a total 2-norm of ``max_norm`` (0: only measure); return the norm
    before clipping. DTensor gradients give a DTensor norm, reduced over its mesh; with a
    ``pipeline_group`` the model is this rank's stages, and the norm is the pipeline's."""
    params = [p for p in model.parameters() if p.grad is not None]
    if pipeline_group is not None:
        local = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=False)
        if hasattr(local, "full_tensor"):  # sharded within the stage
            local = local.full_tensor()
        norm = total_norm_over_pipeline(local, pipeline_group)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
        return norm.item()
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.item()


def total_norm_over_pipeline(local_norm: torch.Tensor, group) -> torch.Tensor:
    """The 2-norm of gradients split over a pipeline's ranks, from each rank's own."""
    squared = local_norm.detach().double() ** 2
    dist.all_reduce(squared, group=group)
    return squared.sqrt().to(local_norm.dtype)
