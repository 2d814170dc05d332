"""A stage's own copy of the model: the modules it holds, every other one removed.

torchtitan's decoder passes its input through a missing embedding, norm or head, and runs
the layers its ``layers`` dict holds, so a stage is the model with the others deleted.
Parameter and buffer names stay those of the whole model (``layers.3.attention.wq``), so
a checkpoint's keys, an initialiser's and an optimizer's do not depend on the cut.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from europa.core.pipeline.cut import LAYERS
from europa.spec.job import STAGE_MODULES


def split_model(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only the modules named in ``keep`` (top-level
    names, and ``layers.<key>`` for layers); build it on the meta device to copy nothing."""
    return keep_only(copy.deepcopy(model), keep)


def keep_only(stage: nn.Module, keep: Sequence[str]) -> nn.Module:
    """``stage`` itself with only the modules named in ``keep`` left (no copy: fake
    tensors, an execution's, cannot be deep-copied)."""
    wanted = set(keep)
    layers = getattr(stage, LAYERS)
    for key in list(layers.keys()):
        if f"{LAYERS}.{key}" not in wanted:
            del layers[key]
    for name, _ in list(stage.named_children()):
        if name != LAYERS and name not in wanted:
            setattr(stage, name, None)
    return stage


def keep_rank_stages(job, model: nn.Module) -> tuple[nn.Module, list[list[str]]]:
    """This rank's part of ``model`` (cut in place) under ``parallel.pp > 1`` and every
    stage's module names; the rank's own stages are stated in ``job.state[STAGE_MODULES]``."""
    from europa.core.pipeline.stages import rank_module_names, rank_stages, stage_names

    config = job.config
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    names = stage_names(config, shapes, list(getattr(model, LAYERS).keys()))
    mine = rank_stages(config.parallel, job.mesh["pp"].get_local_rank())
    job.state[STAGE_MODULES] = [list(names[i]) for i in mine]
    return keep_only(model, rank_module_names(names, mine)), names
