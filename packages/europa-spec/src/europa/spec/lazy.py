"""A package's names imported on first use (PEP 562): a technique package's ``__init__``
names its plain API without importing torch, so importing its plugin module (which every
``europa`` command does) stays cheap. Pure Python."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: each name of ``where`` is imported from
    the module ``where[name]`` when first asked for, then kept in the package."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__all__ = ["lazy_exports"]
