"""The GPUs and models every runs file may name without defining them (``builtin.toml``
beside this module, read with the same checks as a user's file)."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from types import MappingProxyType

from europa.plan.reader import Where, read_gpu, read_model
from europa.plan.record import Gpu, Model


@cache
def _tables() -> dict:
    return tomllib.loads(resources.files("europa.plan").joinpath("builtin.toml").read_text())


def builtin_gpus() -> MappingProxyType[str, Gpu]:
    gpus = {
        t["id"]: read_gpu(Where("builtin.toml", f'gpu "{t["id"]}"'), t) for t in _tables()["gpu"]
    }
    return MappingProxyType(gpus)


def builtin_models() -> MappingProxyType[str, Model]:
    where = lambda t: Where("builtin.toml", f'model "{t["id"]}"')  # noqa: E731
    return MappingProxyType({t["id"]: read_model(where(t), t) for t in _tables()["model"]})
