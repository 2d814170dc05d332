"""``europa plan --search``: the largest micro-batch that fits the ranks given,
or, when the config does not fit at all, the smallest replica (whole nodes)
that fits it at the micro-batch given."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from europa.core.config.schema import EuropaConfig
from europa.core.plan.planner import Plan

MAX_DOUBLINGS = 24


def _first_failing(holds: Callable[[int], bool], start: int) -> int | None:
    """The smallest n > start with not holds(n), given holds(start) and holds
    monotone (true, then false); None within 2**MAX_DOUBLINGS · start."""
    low, high = start, start * 2
    for _ in range(MAX_DOUBLINGS):
        if not holds(high):
            break
        low, high = high, high * 2
    else:
        return None
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return high


def _largest(fits: Callable[[int], bool], start: int) -> int:
    """The largest n >= start with fits(n), given fits(start)."""
    failing = _first_failing(fits, start)
    return start * 2**MAX_DOUBLINGS if failing is None else failing - 1


def _smallest(fits: Callable[[int], bool], start: int) -> int | None:
    """The smallest n >= start with fits(n), or None within the search limit."""
    if fits(start):
        return start
    return _first_failing(lambda n: not fits(n), start)


def with_batch(config: EuropaConfig, batch: int) -> EuropaConfig:
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, batch_size=batch)
    )


def search(
    config: EuropaConfig,
    plan_for: Callable[[EuropaConfig, int], Plan],
    world_size: int,
    gpus_per_node: int,
) -> tuple[Plan, str]:
    """The plan found and one line saying what was searched."""
    plan = plan_for(config, world_size)
    if plan.fits:
        batch = _largest(
            lambda b: plan_for(with_batch(config, b), world_size).fits,
            config.training.batch_size,
        )
        found = plan_for(with_batch(config, batch), world_size)
        return found, (
            f"search: the largest micro-batch that fits {world_size} rank(s) is {batch} "
            f"sequence(s) of {config.training.seq_len} tokens per rank"
        )
    replicas = config.parallel.dp_replicate
    node_step = math.lcm(gpus_per_node, config.parallel.ep)

    def fits(units: int) -> bool:
        return plan_for(config, replicas * units * node_step).fits

    units = _smallest(fits, 1)
    if units is None:
        return plan, "search: no replica size up to the search limit fits this config"
    found = plan_for(config, replicas * units * node_step)
    per_replica = units * node_step
    return found, (
        f"search: the smallest replica that fits is {per_replica} GPU(s) "
        f"({per_replica / gpus_per_node:g} node(s)), {replicas} replica(s): "
        f"{replicas * per_replica} GPU(s) in all"
    )
