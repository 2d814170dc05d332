"""TOML read with the standard library, nesting capped and integers held to 64 bits.

``tomllib`` parses arrays and inline tables nested thousands deep, and every later walk of
such a value (a message that shows it, a deep copy) would overflow Python's stack; a
config never needs more than a few levels. Past ``MAX_NESTING`` this raises
``RecursionError``, as the parser itself does when the stack runs out, so a caller
handles both in one place.

``tomllib`` also reads integers of any size, where TOML allows 64 bits ("an integer that
cannot be represented losslessly must be an error"), and the code that takes them (torch,
numpy, index arithmetic) holds no more: past that, ``loads`` raises ``IntegerRangeError``
naming where the integer is.

``read_file`` is the one way a file the user names is read (a config, a hardware profile,
a measured one): bytes, then UTF-8, then TOML, each refused in one ``ConfigError`` line that
names the file and where in it the problem is.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from europa.core.errors import ConfigError

MAX_NESTING = 100
TOMLDecodeError = tomllib.TOMLDecodeError
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT64_WORDS = f"an integer from {INT64_MIN} to {INT64_MAX} (64 bits, as TOML allows)"


class IntegerRangeError(ValueError):
    """An integer beyond 64 bits; ``path`` is where it sits (keys, and list indices)."""

    def __init__(self, path: list[str | int], value: int) -> None:
        super().__init__(f"{dotted(path)} = {value}: expected {INT64_WORDS}")
        self.path = path
        self.value = value


def dotted(path: list[str | int]) -> str:
    """``["a", "b", 2]`` -> ``a.b[2]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def loads(text: str) -> dict[str, Any]:
    table = tomllib.loads(text)
    _check_nesting(table)
    _check_integers(table)
    return table


def read_file(path: str | Path, label: str) -> dict[str, Any]:
    """The table of the TOML file at ``path``, or ``ConfigError`` beginning with ``label``
    (``config = "my.toml"``, ``--hardware = 'my.toml'``): unreadable, binary, not UTF-8,
    not TOML, or holding an integer beyond 64 bits."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(
            f"{label}: cannot read ({err.strerror}); expected a readable TOML file"
        ) from None
    return from_bytes(data, label)


def from_bytes(data: bytes, label: str) -> dict[str, Any]:
    """``read_file`` for bytes already read (a packaged preset or profile)."""
    expected = "expected a TOML file (UTF-8 text)"
    nul = data.find(b"\0")
    if nul >= 0:  # UTF-8 allows NUL, TOML does not: a binary file, not a typo
        raise ConfigError(f"{label}: byte 0x00 at offset {nul}, a binary file; {expected}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{label}: byte {err.object[err.start]:#04x} at offset {err.start} is not UTF-8; "
            + expected
        ) from None
    try:
        return loads(text)
    except IntegerRangeError as err:
        raise ConfigError(f"{label}: {err}") from None
    except (TOMLDecodeError, RecursionError) as err:  # nesting past its cap: RecursionError
        raise ConfigError(f"{label}: invalid TOML ({err})") from None


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


def _check_integers(table: dict[str, Any]) -> None:
    """In file order: the first one a reader meets is the one named."""
    stack: list[tuple[list[str | int], Any]] = [([], table)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend(reversed([([*path, key], child) for key, child in items]))
        elif isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise IntegerRangeError(path, value)
