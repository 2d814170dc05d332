"""The GPU generations, GPUs and models every runs file may name without defining them
(``builtin.toml`` beside this module, read with the same checks as a user's file)."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Any


@cache
def builtin_tables() -> MappingProxyType[str, tuple[dict[str, Any], ...]]:
    """The raw ``[[generation]]``, ``[[gpu]]`` and ``[[model]]`` tables, by kind."""
    text = resources.files("europa.plan").joinpath("builtin.toml").read_text()
    return MappingProxyType({kind: tuple(t) for kind, t in tomllib.loads(text).items()})
