"""Declaring config settings with the standard library alone.

A table is a plain ``@dataclass``. A field may carry, as a plain dict in
``dataclasses.field(metadata=...)``, any of the keys ``doc``, ``ge``, ``gt``,
``le`` and ``choices``; the validator reads the annotations for types and these
keys for bounds, so one declaration drives parsing, checking and docs. A plugin
writes that dict itself and needs no europa import; ``setting`` is core's
shorthand for the same field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

BOUND_KEYS = ("doc", "ge", "gt", "le", "choices")


@dataclass(frozen=True)
class Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[Any, ...] | None = None
    doc: str = ""


def setting(
    default: Any = MISSING,
    *,
    doc: str = "",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: tuple[Any, ...] | None = None,
) -> Any:
    """A config field. Without a default the key must come from the preset or the file."""
    given = {"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices}
    metadata = {key: value for key, value in given.items() if value not in (None, "")}
    if isinstance(default, list):
        frozen = tuple(default)
        return dataclasses.field(default_factory=lambda: list(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bounds_of(field: dataclasses.Field) -> Bounds:
    found = {key: field.metadata[key] for key in BOUND_KEYS if key in field.metadata}
    if found.get("choices") is not None:
        found["choices"] = tuple(found["choices"])
    return Bounds(**found)


@dataclass(frozen=True)
class ConfigSection:
    """One TOML table: its name, the dataclass that types it, and who declared it."""

    name: str
    schema: type
    owner: str = "europa-core"
