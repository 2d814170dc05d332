"""Initialisation of the EUROPA MoE (DeepSeek-V3's scheme): truncated normal
with std 0.02, output projections scaled down with depth, unit norms.

These are the values of torchtitan's own DeepSeek-V3 initialisers, which
torchtitan 0.3.0 keeps private (``_LINEAR_INIT``, ``_depth_init``, ... in
``torchtitan.models.deepseek_v3``); its public ``depth_scaled_std`` is used
for the depth scaling. ``europa.core.model.materialise`` calls them one matrix
at a time with a seeded generator.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.nn as nn
from torchtitan.models.common.param_init import depth_scaled_std

BASE_STD = 0.02

LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.trunc_normal_, std=BASE_STD),
    "bias": nn.init.zeros_,
}
NORM_INIT: dict[str, Callable] = {"weight": nn.init.ones_}
EMBEDDING_INIT: dict[str, Callable] = {"weight": partial(nn.init.normal_, std=1.0)}


def output_linear_init(dim: int) -> dict[str, Callable]:
    std = dim**-0.5
    return {
        "weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std),
        "bias": nn.init.zeros_,
    }


def depth_init(layer_id: int) -> dict[str, Callable]:
    std = depth_scaled_std(BASE_STD, layer_id)
    return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}


def depth_experts_init(layer_id: int) -> dict[str, Callable]:
    std = depth_scaled_std(BASE_STD, layer_id)
    return {
        "w1_EFD": partial(nn.init.trunc_normal_, std=BASE_STD),
        "w2_EDF": partial(nn.init.trunc_normal_, std=std),
        "w3_EFD": partial(nn.init.trunc_normal_, std=std),
    }
