"""The EUROPA MoE: a DeepSeek-V3 / Kimi-K2 decoder built from torchtitan's components."""

from europa.core.model.build import build_moe_model, model_spec
from europa.core.model.counting import ParameterCounts, count_parameters
from europa.core.model.load_balance import ExpertLoad, update_expert_bias
from europa.core.model.materialise import (
    MatrixInitialiser,
    init_buffers,
    init_parameters,
    materialise,
)

__all__ = [
    "ExpertLoad",
    "MatrixInitialiser",
    "ParameterCounts",
    "build_moe_model",
    "count_parameters",
    "init_buffers",
    "init_parameters",
    "materialise",
    "model_spec",
    "update_expert_bias",
]
