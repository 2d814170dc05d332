"""``europa plan --search``: the fastest layouts that fit an allocation, for the same
global batch.

The levers are core's own (activation checkpointing; micro-batch and gradient
accumulation at the same tokens per step) and every installed plugin's
(``europa_search_levers``: europa-flexshard's ``ep``, dense group and exchange
levers, europa-offload's, europa-overlap's). The search plans their product. Each
combination is resolved exactly as the command line it prints would be (the
user's config and ``--set``, then the combination's ``-p`` and ``--set``), so a
proposal is reproduced by its arguments; a combination the config rules or a
plugin refuse is not a layout and is skipped. Ranking is by planned step time (a
prediction, with overlap where the layout enables it), then device memory.

When no layout fits, the search says so and looks for the smallest replica
(whole nodes) that fits the config as given.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from europa.core.config.schema import EuropaConfig
from europa.core.errors import is_user_error
from europa.core.plan.record import Plan
from europa.core.plan.search_stages import stage_levers
from europa.core.session import open_session
from europa.spec.plan_mapping import SearchInputs

MAX_DOUBLINGS = 24
SHOWN = 5


@dataclass(frozen=True)
class Proposal:
    """One searched layout: the arguments that give it and its plan."""

    plugins: tuple[str, ...]
    sets: tuple[tuple[str, Any], ...]  # (dotted key, value) the search chose
    plan: Plan

    @property
    def step(self):
        return self.plan.step

    def overrides(self) -> list[str]:
        return [f"{key}={toml_value(value)}" for key, value in self.sets]

    def arguments(self, base: EuropaConfig, defaults: dict[str, Any]) -> str:
        """``-p`` for every plugin it enables, ``--set`` for what differs from ``base`` (or,
        for a table ``base`` does not enable, from the table's ``defaults``)."""
        words = [f"-p {name}" for name in self.plugins]
        if not set(base.plugins.enabled) <= set(self.plugins):  # a plugin the config enables
            words.append(f"--set {shlex.quote(f'plugins.enabled={json.dumps([])}')}")
        for key, value in self.sets:
            if _value_in(base, key, defaults) != value:
                words.append(f"--set {shlex.quote(f'{key}={toml_value(value)}')}")
        return " ".join(words)


@dataclass(frozen=True)
class SearchResult:
    proposals: list[Proposal]  # the ones that fit, fastest first
    planned: int  # layouts planned (fitting or not)
    skipped: int  # combinations the rules or a plugin refused
    seconds: float
    base: EuropaConfig
    defaults: dict[str, Any]  # every installed table's, by "table.key"
    # With pipeline stages, around the best layout without (``search_stages``); fastest first
    staged: list[Proposal] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> Proposal | None:
        """The fastest that fits, with or without stages."""
        return min(self.proposals[:1] + self.staged[:1], key=lambda p: p.step.step_s, default=None)

    def arguments(self, proposal: Proposal) -> str:
        return proposal.arguments(self.base, self.defaults)

    def _staged_note(self) -> str:
        return f" without stages and {len(self.staged)} with" if self.staged else ""

    def note(self, world_size: int, hardware: str) -> str:
        return (
            f"search: {self.planned} layout(s) planned for {world_size} rank(s) on {hardware} "
            f"in {self.seconds:.1f} s, {len(self.proposals)} fit{self._staged_note()} "
            f"({self.skipped} combination(s) refused by the config rules were skipped)"
        )


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _value_in(config: EuropaConfig, key: str, defaults: dict[str, Any]) -> Any:
    table, _, name = key.rpartition(".")
    if table in config.extensions or table in {f.name for f in dataclasses.fields(config)}:
        return getattr(config.section(table), name)
    return defaults.get(key)  # a table of a plugin the config does not enable


def table_defaults(manager) -> dict[str, Any]:
    """``{"table.key": default}`` for every installed table."""
    out = {}
    for section in manager.config_sections():
        for f in dataclasses.fields(section.schema):
            if f.default is not dataclasses.MISSING:
                out[f"{section.name}.{f.name}"] = f.default
    return out


CONTEXT_PARALLEL = (2, 4, 8, 16)  # the cp the search tries when no layout fits without


def _batches(sequences: int, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Every micro-batch × accumulation of ``sequences`` a step, with ``extra`` settings."""
    splits = [(b, sequences // b) for b in range(sequences, 0, -1) if sequences % b == 0]
    return [
        {"plugins": [], "set": {**extra, "training.batch_size": b, "training.grad_accum_steps": n}}
        for b, n in splits
    ]


def core_levers(config: EuropaConfig) -> list[list[dict[str, Any]]]:
    """Activation checkpointing, and every micro-batch × accumulation with the config's
    sequences per rank and step."""
    training = config.training
    sequences = training.batch_size * training.grad_accum_steps
    return [
        [{"plugins": [], "set": {"activation_checkpointing.mode": m}} for m in ("none", "full")],
        _batches(sequences, {}),
    ]


def context_levers(config: EuropaConfig, world_size: int) -> list[list[dict[str, Any]]]:
    """``core_levers`` with each sequence cut over cp ranks (the latent exchange): a group
    of cp ranks reads cp times a rank's sequences, so the global batch stays. Empty where
    no cp divides the data-parallel ranks and the sequence (2·cp chunks)."""
    training, p = config.training, config.parallel
    data_ranks = world_size // p.pp
    cuts = [
        cp for cp in CONTEXT_PARALLEL if data_ranks % cp == 0 and training.seq_len % (2 * cp) == 0
    ]
    if not cuts:
        return []
    sequences = training.batch_size * training.grad_accum_steps
    cut = {"parallel.cp_exchange": "latent"}
    return [
        core_levers(config)[0],
        [alt for cp in cuts for alt in _batches(sequences * cp, {**cut, "parallel.cp": cp})],
    ]


def _combine(alternatives: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, Any]] | None:
    """The plugins and settings of one combination; None when two levers disagree."""
    plugins: list[str] = []
    sets: dict[str, Any] = {}
    for alternative in alternatives:
        plugins += [p for p in alternative["plugins"] if p not in plugins]
        for key, value in alternative["set"].items():
            if sets.get(key, value) != value:
                return None
            sets[key] = value
    return plugins, sets


def plan_inputs(shapes, hardware, world_size: int, ranks_per_node: int) -> SearchInputs:
    """What ``europa_search_levers`` is given to leave out layouts that cannot fit;
    ``shapes``: the model's ``ModelShapes``, the ones every layout is planned with."""
    return {
        "parameter_shapes": shapes.as_dict(),
        "parameter_itemsize": 4,
        "hardware": hardware.as_dict(),
        "device_bytes_per_rank": hardware.device_bytes_per_rank(min(world_size, ranks_per_node)),
    }


def search_layouts(
    *,
    source,
    overrides: Sequence[str],
    plugins: Sequence[str],
    manager,
    plan_for: Callable[[EuropaConfig, Any], Plan],
    world_size: int,
    ranks_per_node: int,
    plan_inputs: SearchInputs,
) -> SearchResult:
    """Every combination of the levers, planned; ``plan_for(config, manager)`` plans a
    resolved config with the plugins it enables."""
    started = time.perf_counter()
    base, _ = open_session(source, overrides, plugins, manager, cross_field_rules=False)
    levers = core_levers(base)
    for plugin_levers in manager.all_hooks.europa_search_levers(
        config=base, world_size=world_size, ranks_per_node=ranks_per_node, plan=plan_inputs
    ):
        levers += plugin_levers or []
    searched = {p for lever in levers for alternative in lever for p in alternative["plugins"]}
    kept = [p for p in base.plugins.enabled if p not in searched]  # the file's and -p's
    defaults = table_defaults(manager)

    def plan_all(levers) -> tuple[list[Proposal], int, int]:
        """Every combination of ``levers`` planned: (those that fit, fastest first; planned;
        refused)."""
        fitting: list[Proposal] = []
        planned = skipped = 0
        for combination in itertools.product(*levers):
            combined = _combine(combination)
            if combined is None:
                continue
            enabled, sets = combined
            chosen = tuple(kept + sorted(enabled))
            settings = [
                *overrides,
                *(f"{k}={toml_value(v)}" for k, v in sets.items()),
                f"plugins.enabled={json.dumps(list(chosen))}",
            ]
            try:
                config, _ = open_session(source, settings, (), manager)
                plan = plan_for(config, manager)
            except Exception as err:
                if not is_user_error(err):
                    raise
                skipped += 1
                continue
            planned += 1
            if plan.fits:
                fitting.append(Proposal(chosen, tuple(sets.items()), plan))
        # Fastest first; then the least memory; then the fewest changes to the command.
        fitting.sort(
            key=lambda p: (
                round(p.step.step_s, 9),
                p.plan.device_total,
                len(p.arguments(base, defaults)),
            )
        )
        return fitting, planned, skipped

    proposals, planned, skipped = plan_all(levers)
    if not proposals and base.parallel.cp == 1:  # the sequence needs cutting, if anything
        cut = context_levers(base, world_size)
        if cut:
            proposals, more, refused = plan_all([*cut, *levers[2:]])
            planned, skipped = planned + more, skipped + refused
    staged: list[Proposal] = []
    if base.parallel.pp == 1 and proposals:
        best = proposals[0]
        around = stage_levers(base, world_size, ranks_per_node, best.plugins, dict(best.sets))
        staged, more, refused = plan_all(around) if around else ([], 0, 0)
        planned, skipped = planned + more, skipped + refused
    manager.enable(base.plugins.enabled)  # as the user's own config left it
    return SearchResult(
        proposals, planned, skipped, time.perf_counter() - started, base, defaults, staged
    )


def proposals_json(result: SearchResult, shown: int = SHOWN) -> list[dict[str, Any]]:
    return [
        {
            "arguments": result.arguments(p),
            "plugins": list(p.plugins),
            "set": p.overrides(),
            "step_s": p.step.step_s,
            "exposed_communication_s": p.step.exposed_s,
            "mfu": p.step.mfu,
            "device_bytes": p.plan.device_total,
            "device_capacity": p.plan.device_capacity,
            "host_bytes": p.plan.host_total,
            "host_capacity": p.plan.host_capacity,
        }
        for p in result.proposals[:shown]
    ]


def staged_json(result: SearchResult) -> dict[str, Any] | None:
    """The best layout without and with pipeline stages (None: no stages searched)."""
    if not result.staged:
        return None
    return {
        "without_stages": proposals_json(result, 1)[0] if result.proposals else None,
        "with_stages": proposals_json(dataclasses.replace(result, proposals=result.staged), 1)[0],
    }


def _proposal_row(label: str, p: Proposal) -> str:
    from europa.spec.units import human

    plan = p.plan
    return (
        f"  {label:>2}  {p.step.step_s:>6.3g} s  {p.step.mfu * 100:>5.1f}%  "
        f"{p.step.exposed_s:>6.3g} s  "
        f"{human(plan.device_total) + ' / ' + human(plan.device_capacity):>21}  "
        f"{human(plan.host_total) + ' / ' + human(plan.host_capacity):>21}"
    )


HEADER = f"  {'#':>2}  {'step':>8}  {'MFU':>6}  {'exposed':>8}  {'device':>21}  {'host':>21}"


def proposals_table(result: SearchResult, shown: int = SHOWN) -> str:
    lines = [
        f"the fastest {min(shown, len(result.proposals))} that fit (planned, not measured); "
        "each line's -p replaces the command's, its --set adds to the command's:",
        HEADER,
    ]
    for i, p in enumerate(result.proposals[:shown], 1):
        lines.append(_proposal_row(str(i), p))
        lines.append(f"      {result.arguments(p) or '(the command as it is)'}")
    if result.staged:
        lines += [
            "the best without and with pipeline stages (planned; stages searched around the "
            "best without them):",
            HEADER,
        ]
        for label, p in (("-", result.proposals[0]), ("pp", result.staged[0])):
            lines.append(_proposal_row(label, p))
            lines.append(f"      {result.arguments(p) or '(the command as it is)'}")
    return "\n".join(lines)


# -- no layout fits: the smallest replica that fits the config as given -------------------


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


def _smallest(fits: Callable[[int], bool], start: int) -> int | None:
    """The smallest n >= start with fits(n), or None within the search limit."""
    if fits(start):
        return start
    return _first_failing(lambda n: not fits(n), start)


def smallest_replica(
    config: EuropaConfig, plan_for: Callable[[EuropaConfig, int], Plan], gpus_per_node: int
) -> tuple[Plan | None, str]:
    """The plan on the smallest replica (whole nodes) that fits ``config``, and one line."""
    replicas = config.parallel.dp_replicate
    node_step = math.lcm(gpus_per_node, config.parallel.ep)

    def fits(units: int) -> bool:
        return plan_for(config, replicas * units * node_step).fits

    units = _smallest(fits, 1)
    if units is None:
        return None, "search: no replica size up to the search limit fits this config"
    per_replica = units * node_step
    return plan_for(config, replicas * per_replica), (
        f"search: the smallest replica that fits the config as given is {per_replica} GPU(s) "
        f"({per_replica / gpus_per_node:g} node(s)), {replicas} replica(s): "
        f"{replicas * per_replica} GPU(s) in all"
    )
