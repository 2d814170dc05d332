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


def split_model(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only the modules named in ``keep`` (top-level
    names, and ``layers.<key>`` for layers); build it on the meta device to copy nothing."""
    stage = copy.deepcopy(model)
    wanted = set(keep)
    layers = getattr(stage, LAYERS)
    for key in list(layers.keys()):
        if f"{LAYERS}.{key}" not in wanted:
            del layers[key]
    for name, _ in list(stage.named_children()):
        if name != LAYERS and name not in wanted:
            setattr(stage, name, None)
    return stage
