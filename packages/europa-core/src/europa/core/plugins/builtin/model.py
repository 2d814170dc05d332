"""Default ``europa_build_model``: the EUROPA MoE from ``[model]``."""

from __future__ import annotations

from europa.core.hookspecs import hookimpl


@hookimpl(trylast=True)
def europa_build_model(job):
    from europa.core.model import build_moe_model

    fp32 = job.config.training.dtype == "float32"
    return build_moe_model(job.config.model, native_dtype_experts=fp32)
