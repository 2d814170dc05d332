"""Type checking of single TOML values against a dataclass field, with the
one-line wording every config error shares: ``key = value: expected ...``."""

from __future__ import annotations

import datetime
import json
import math
import re
import typing
from dataclasses import Field
from typing import Any

from europa.core.config.fields import Bounds, bounds_of
from europa.core.config.toml import INT64_MAX, INT64_MIN
from europa.core.errors import ConfigError


def show(value: Any) -> str:
    """A value as it would be written in TOML (any value ``tomllib`` can return)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(show(item) for item in value) + "]"
    if isinstance(value, dict):
        items = (f"{_show_key(k)} = {show(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return repr(value)


def _show_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key} = {show(value)}: expected {expected}")


def _type_word(annotation: Any) -> str:
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a finite number"
    if annotation is str:
        return "a string"
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return f"a list of {_type_word(item).removeprefix('a ').removeprefix('an ')}s"
    raise TypeError(f"unsupported config annotation {annotation!r}")


def _bounds_words(bounds: Bounds) -> str:
    parts = []
    if bounds.ge is not None and bounds.le is not None:
        return f" between {show(bounds.ge)} and {show(bounds.le)}"
    if bounds.ge is not None:
        parts.append(f">= {show(bounds.ge)}")
    if bounds.gt is not None:
        parts.append(f"> {show(bounds.gt)}")
    if bounds.le is not None:
        parts.append(f"<= {show(bounds.le)}")
    return (" " + " and ".join(parts)) if parts else ""


def describe(annotation: Any, field: Field) -> str:
    """What a field accepts, in words: 'an integer > 0', 'one of "adamw", "muon"'."""
    bounds = bounds_of(field)
    if bounds.choices is not None:
        return "one of " + ", ".join(show(choice) for choice in bounds.choices)
    return _type_word(annotation) + _bounds_words(bounds)


def _matches_type(annotation: Any, value: Any) -> bool:
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches_type(item, v) for v in value)
    raise TypeError(f"unsupported config annotation {annotation!r}")


def _within_bounds(bounds: Bounds, value: Any) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False  # nan passes every comparison-based bound; inf is no usable setting
    if bounds.choices is not None and value not in bounds.choices:
        return False
    if bounds.ge is not None and value < bounds.ge:
        return False
    if bounds.gt is not None and value <= bounds.gt:
        return False
    return not (bounds.le is not None and value > bounds.le)


def _is_utf8(value: Any) -> bool:
    """False for text with lone surrogates: what non-UTF-8 argv bytes (a Latin-1 file
    name, say) decode to, and what the resolved config.toml cannot hold."""
    if isinstance(value, list):
        return all(_is_utf8(item) for item in value)
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fits_64_bits(value: Any) -> bool:
    """What TOML, torch and numpy hold. A file or ``--set`` is refused past it when read
    (``europa.core.config.toml``); this catches a config built in Python."""
    if isinstance(value, list):
        return all(_fits_64_bits(item) for item in value)
    return not isinstance(value, int) or INT64_MIN <= value <= INT64_MAX


def coerce(key: str, annotation: Any, field: Field, value: Any) -> Any:
    """Check one value; return it in the field's Python type or raise ConfigError."""
    if not _matches_type(annotation, value) or not _within_bounds(bounds_of(field), value):
        raise fail(key, value, describe(annotation, field))
    if not _fits_64_bits(value):
        expected = f"{describe(annotation, field)} within 64 bits ({INT64_MIN} to {INT64_MAX})"
        raise fail(key, value, expected)
    if not _is_utf8(value):
        raise fail(key, value, "UTF-8 text (config.toml stores it)")
    if annotation is float:
        return float(value)
    if typing.get_origin(annotation) is list:
        return list(value)
    return value
