"""A checkpoint's cost to training: its write time, and the training time each save
loses in either ``checkpoint.mode`` (the planner counts the staging buffers' memory).

"sync": training waits for the write. "async": each rank copies its own state (its
parameters and optimizer state as it holds them, copies included) into host buffers,
then training goes on while a thread writes them; one save is in flight at a time, so
a write longer than the training between two saves makes the next save wait for the
rest. Predictions: the write does not slow the steps it runs beside.
"""

from __future__ import annotations


def write_seconds(
    checkpoint_bytes: int,
    nodes: int,
    ranks_per_node: int,
    filesystem_gbps: float | None,
    max_write_mbps: float,
) -> float | None:
    """Each node writing its even share at the file system's rate, or at its ranks'
    ``checkpoint.max_write_mbps`` cap where that is lower; None without the rate."""
    if filesystem_gbps is None:
        return None
    rate = filesystem_gbps * 1e9
    if max_write_mbps:
        rate = min(rate, max_write_mbps * 1e6 * ranks_per_node)
    return checkpoint_bytes / nodes / rate


def lost_per_save(
    write_s: float | None, staging_s: float, every: int, step_s: float
) -> dict[str, float | None]:
    """Training seconds one save costs in each mode (None where the write time is unknown).
    ``every`` = 0: only the final save, whose whole write training waits for at the end."""
    if write_s is None:
        return {"sync": None, "async": None}
    exposed = write_s if every == 0 else max(0.0, write_s - every * step_s)
    return {"sync": write_s, "async": staging_s + exposed}
