"""Config tables that plugins declare: checked once, when they are collected.

``europa_config_sections()`` returns a mapping of table name to a plain
``@dataclass``. Whatever a plugin gets wrong there is the plugin's bug, not
the user's, so it is reported as a ``PluginError`` naming the plugin, the table
and the field, before any config is read.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

from europa.core.config.fields import BOUND_KEYS, ConfigSection
from europa.core.config.values import describe
from europa.core.errors import PluginError

SUPPORTED_TYPES = "bool, int, float, str or list[...] of one of them"


def _invalid(owner: str, what: str, expected: str) -> PluginError:
    return PluginError(f"plugin {owner!r}: europa_config_sections() {what}; expected {expected}")


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    # resolved once: a search opens a session, and checks every section, per layout
    return typing.get_type_hints(schema)


def _check_table(owner: str, name: Any, schema: Any) -> ConfigSection:
    if not isinstance(name, str) or not name.isidentifier():
        raise _invalid(owner, f"declares a table named {name!r}", "a name like 'my_plugin'")
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise _invalid(owner, f"gives [{name}] as {schema!r}", "a @dataclass class")
    try:
        hints = _type_hints(schema)
    except Exception as err:
        what = f"[{name}] has annotations that do not resolve ({err})"
        raise _invalid(owner, what, "importable types") from None
    for field in dataclasses.fields(schema):
        key = f"[{name}] field {field.name!r}"
        unknown = sorted(set(field.metadata) - set(BOUND_KEYS))
        if unknown:
            raise _invalid(owner, f"{key} has metadata {unknown}", f"only {list(BOUND_KEYS)}")
        try:
            describe(hints[field.name], field)
        except TypeError:
            raise _invalid(
                owner, f"{key} is annotated {hints[field.name]!r}", SUPPORTED_TYPES
            ) from None
    return ConfigSection(name, schema, owner)


def declared_sections(owner: str, declared: Any) -> list[ConfigSection]:
    """One plugin's answer to ``europa_config_sections()`` as checked sections."""
    if declared is None:
        return []
    if not isinstance(declared, Mapping):
        raise _invalid(owner, f"returned {type(declared).__name__}", "a dict of name -> dataclass")
    return [_check_table(owner, name, schema) for name, schema in declared.items()]
