"""Declaring config settings: a dataclass field plus the bounds the validator enforces.

Every table (core or plugin) is a plain dataclass whose fields are declared with
``setting``. The validator reads the annotations for types and the metadata for
bounds and choices, so one declaration drives parsing, checking and docs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any


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
    metadata = {"europa": Bounds(ge=ge, gt=gt, le=le, choices=choices, doc=doc)}
    if isinstance(default, list):
        frozen = tuple(default)
        return dataclasses.field(default_factory=lambda: list(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bounds_of(field: dataclasses.Field) -> Bounds:
    return field.metadata.get("europa", Bounds())


@dataclass(frozen=True)
class ConfigSection:
    """One TOML table: its name, the dataclass that types it, and who declared it."""

    name: str
    schema: type
    owner: str = "europa-core"
