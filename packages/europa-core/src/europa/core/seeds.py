"""Seeds: their range, and the per-matrix seeds that make initialisation
independent of the layout and the world size."""

from __future__ import annotations

import hashlib

# torch's CPU generator keeps 32 bits of a seed: 2**32 behaves like 0. Data
# shuffles epoch e with seed + e, so seeds stay below 2**31 and never wrap onto
# another run's order.
MAX_SEED = 2**31 - 1


def matrix_seed(seed: int, parameter: str, index: int) -> int:
    """The seed of matrix ``index`` of ``parameter`` (an expert slice of a stacked
    tensor, or 0 for any other tensor): a 63-bit hash of all three, so no two
    matrices of a run share a stream and no rank needs another's numbers."""
    digest = hashlib.blake2b(f"{seed}/{parameter}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
