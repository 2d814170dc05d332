"""TOML read with the standard library, nesting capped.

``tomllib`` parses arrays and inline tables nested thousands deep, and every later walk of
such a value (a message that shows it, a deep copy) would overflow Python's stack; a
config never needs more than a few levels. Past ``MAX_NESTING`` this raises
``RecursionError``, as the parser itself does when the stack runs out, so a caller
handles both in one place."""

from __future__ import annotations

import tomllib
from typing import Any

MAX_NESTING = 100
TOMLDecodeError = tomllib.TOMLDecodeError


def loads(text: str) -> dict[str, Any]:
    table = tomllib.loads(text)
    _check_nesting(table)
    return table


def _check_nesting(table: dict[str, Any]) -> None:
    stack = [(table, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:
            raise RecursionError(
                f"TOML inline arrays/tables are nested more than the allowed {MAX_NESTING} levels"
            )
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
