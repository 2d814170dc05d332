"""Default ``europa_build_model``: the EUROPA MoE from ``[model]``."""

from __future__ import annotations

from europa.core.hookspecs import hookimpl
from europa.core.model import build_moe_model


@hookimpl(trylast=True)
def europa_build_model(job):
    fp32 = job.config.training.dtype == "float32"
    return build_moe_model(job.config.model, native_dtype_experts=fp32)
