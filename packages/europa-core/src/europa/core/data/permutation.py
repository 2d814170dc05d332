"""A shuffle of [0, n) that costs nothing to set up: position -> index, computed on demand.

Design note. ``torch.randperm(n)`` per epoch needs n int64 (150 MB for the 19 M sequences of a
10 GB corpus) on every rank, and its time grows with n. Here epoch e of a run seeded s is a keyed
bijection of [0, n): a balanced Feistel network on the smallest even number of bits that covers n,
its round keys drawn from (s, e), with cycle walking (apply it again while the value is >= n) to
stay inside [0, n). Any position is mapped in O(1) time and memory, so a rank computes only the
indices of its own batch, and the order stays a pure function of (seed, epoch, position).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_MASK64 = (1 << 64) - 1


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    keys = []
    for round_ in range(ROUNDS):
        base = (seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + round_) & _MASK64
        keys.append(np.uint64(int(_mix(np.array([base], dtype=np.uint64))[0])))
    return keys


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The index at each of ``positions`` (values in [0, n)) of epoch ``epoch``'s order of n."""
    positions = np.asarray(positions, dtype=np.int64)
    if n <= 0:
        raise ValueError(f"n must be >= 1, got {n}")
    if positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must be in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = _round_keys(seed, epoch)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    values = encrypt(positions.astype(np.uint64))
    outside = values >= np.uint64(n)
    while outside.any():  # cycle walking: at most a few rounds, the domain is < 4 n
        values[outside] = encrypt(values[outside])
        outside = values >= np.uint64(n)
    return values.astype(np.int64)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The whole order of epoch ``epoch`` (for tests and small n; training maps positions)."""
    return permute(np.arange(n, dtype=np.int64), n, seed, epoch)
