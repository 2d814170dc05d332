"""Byte sizes: the binary units every package counts in, and sizes as people read them."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30
_UNITS = (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10))


def human(n: float, digits: int = 1) -> str:
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"


__all__ = ["GIB", "MIB", "human"]
