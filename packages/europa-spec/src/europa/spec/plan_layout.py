"""The plan's layout record: where parameters live, as the planner sees it.

A sharding plugin replaces ``plan["layout"]`` from its ``europa_plan`` hook with a mapping
of these fields (plain values: it needs nothing of europa-core); ``Layout.parse`` checks
it in one place, so a plugin's mistake is one line naming the plugin and the key, not a
``KeyError`` deep in the planner. All counts are per rank of the group that splits the
parameters. (The planner keeps reading the mapping once it has been checked; the
records are the contract.)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from europa.spec.errors import UserError

STEP, LAST_BACKWARD = "step", "last_backward"
# Context parallelism's traffic kinds (europa-core's exchange and plan, europa-overlap), and,
# issued early (europa-overlap), what it runs beside: the query projection's forward (the
# gathers) or its backward (the reduce-scatters) only.
CONTEXT_KINDS = CONTEXT_GATHER, CONTEXT_REDUCE_SCATTER = (
    "context_gather",
    "context_reduce_scatter",
)
QUERIES_FORWARD, QUERIES_BACKWARD = "queries_forward", "queries_backward"
ROOT_UNIT = "<root>"  # the unit of what no block claims: embedding, final norm, output head


# Which gathered blocks free their full parameters after forward (the others keep them
# until their backward): all, all but the last (in forward order), or none. europa-overlap's
# ``overlap.reshard_after_forward``; a plugin that sets it states it in its ``europa_plan``
# as ``plan["reshard_after_forward"]``, and the planner counts what the kept blocks hold.
RESHARD_POLICIES = ("all", "all_but_last", "none")


def reshards(policy: str, index: int, blocks: int) -> bool:
    """Whether block ``index`` of ``blocks`` (in forward order) frees its gathered
    parameters after forward under ``policy`` (one of ``RESHARD_POLICIES``)."""
    if policy not in RESHARD_POLICIES:
        raise UserError(
            f"reshard_after_forward = {policy!r}: expected one of {', '.join(RESHARD_POLICIES)}"
        )
    return policy == "all" or (policy == "all_but_last" and index < blocks - 1)


def unit_of(name: str) -> str:
    """The gather unit of a parameter of a model with ``layers``: its block
    (``layers.<i>``), or the root; every layout groups parameters so."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else ROOT_UNIT


class LayoutError(UserError):
    """A plugin's ``plan["layout"]`` that breaks the contract."""


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks holding the same share (``dp_replicate``, or other nodes' copies)."""

    size: int  # ranks in the group
    stride: int  # rank distance between two of them (it decides which link they share)
    per_micro_batch: bool = True  # they sum every micro-batch (else once a step)
    overlappable: bool = True  # that all-reduce can run beside computation
    window: str = STEP  # beside the whole step, or the last micro-batch's backward only
    tail_elements: int = 0  # of it, what starts only when that backward ends


@dataclass(frozen=True)
class ExpertCopies:
    """Resident expert gradients all-reduced over the ranks holding the same experts."""

    elements: int  # expert gradient elements each rank all-reduces
    stride: int = 1  # rank distance between two copies
    group_size: int = 1  # ranks holding the same experts
    per_micro_batch: bool = True  # they sum every micro-batch (else once a step)
    overlappable: bool = True  # that all-reduce can run beside computation
    window: str = STEP  # beside the whole step, or the last micro-batch's backward only


@dataclass(frozen=True)
class Layout:
    """Where parameters live, per rank of the group that splits them (each field's
    comment says what it counts; the lists hold one entry per rank of that group)."""

    owner: str  # the plugin (or core's "core.fsdp2") that lays the parameters out
    group_size: int  # ranks that split the parameters between them (FSDP2: dp_shard)
    stored_elements: list[int]  # parameter storage each rank allocates; gradients alike
    muon_elements: list[int]  # each rank's parameter elements stepped by Muon
    adamw_elements: list[int]  # each rank's parameter elements stepped by AdamW
    adamw_tensors: int  # tensors that carry an AdamW step counter on every rank
    gathered_unit_elements: dict[str, int]  # {unit: elements} gathered whole before use
    gather_group_size: int  # ranks one unit's all-gather (and reduce-scatter) spans
    optimizer_step_gather_elements: int  # gathered inside optimizer.step() (Muon on shards)
    largest_step_gather_elements: int  # the largest one matrix of those (its buffer's size)
    expert_all_to_all_bytes_per_step: int  # bytes a rank's expert all-to-all moves in a step
    expert_group_size: int  # ranks the experts are split over (ep); 1: no expert exchange
    form: str | None = None  # how the owner holds it: core's "plain", "ddp", "fsdp2", "hsdp"
    # each gather's and reduce-scatter's elements, padding included (the widest share)
    gathered_unit_wire_elements: dict[str, int] | None = None
    expert_all_to_all_bytes_by_link: dict[str, int] | None = None  # {link: bytes}
    expert_kept_bytes_per_moe_block: int = 0  # kept for the recomputation, like its input
    # bytes a routed expert's output value is saved in for its score's gradient (torchtitan's
    # combine keeps an fp32 copy; europa-flexshard's the output as it is)
    expert_output_bytes: int = 4
    replicated_elements: int | None = None  # all-reduced over the replicas (default: max)
    replica_group: ReplicaGroup | None = None  # the share's copies (default: dp_replicate's)
    expert_copies: ExpertCopies | None = None  # resident expert gradients' copies, if any
    reduce_itemsize: int = 4  # bytes per element of gradient reductions
    # per rank of the group, the root unit's stored elements (its gradient completes last;
    # default: an even share of it)
    root_stored_elements: list[int] | None = None
    # per rank of the group, the routed experts' stored elements (resident, never gathered)
    expert_stored_elements: list[int] | None = None
    # gathers and reduce-scatters as direct transfers, each rank's pieces sent once, exactly
    # (europa-flexshard on gloo), with each unit's elements per rank of the gather group
    direct_transfers: bool = False
    unit_rank_elements: dict[str, list[int]] | None = None

    @classmethod
    def parse(cls, mapping: Any) -> Layout:
        """The record of ``mapping``, or a one-line ``LayoutError`` naming the plugin that
        wrote it (its ``owner``) and the key that is missing, unknown or of the wrong type."""
        owner = mapping.get("owner") if isinstance(mapping, Mapping) else None
        return _parse(cls, mapping, owner if isinstance(owner, str) else "?", 'plan["layout"]')


@functools.cache
def _type_hints(record: type) -> dict[str, Any]:
    return typing.get_type_hints(record)  # once per record type: a search parses thousands


def parse_record(record: type, mapping: Any, plugin: str, where: str):
    """A plan record (a dataclass of plain values) from ``mapping``, or a one-line
    ``LayoutError`` naming the ``plugin`` that wrote it and the key at ``where``."""
    return _parse(record, mapping, plugin, where)


def _parse(record: type, mapping: Any, plugin: str, where: str):
    if not isinstance(mapping, Mapping):
        raise LayoutError(f"plugin {plugin}: {where} = {mapping!r}: expected a table")
    fields = {f.name: f for f in dataclasses.fields(record)}
    hints = _type_hints(record)
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise LayoutError(
            f"plugin {plugin}: {where}[{unknown[0]!r}]: unknown key; expected keys among "
            f"{', '.join(fields)}"
        )
    values = {}
    for name, spec in fields.items():
        key = f"{where}[{name!r}]"
        if name not in mapping:
            required = spec.default is dataclasses.MISSING
            if required and spec.default_factory is dataclasses.MISSING:
                raise LayoutError(f"plugin {plugin}: {key} is missing; expected it in the layout")
            continue
        values[name] = _value(hints[name], mapping[name], plugin, key)
    return record(**values)


def _value(hint: Any, value: Any, plugin: str, key: str):
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in (o for o in options if o is not type(None)):
        if dataclasses.is_dataclass(option):
            return _parse(option, value, plugin, key)
        if _fits(option, value):
            return value
    raise LayoutError(f"plugin {plugin}: {key} = {value!r}: expected {_describe(hint)}")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _fits(option: Any, value: Any) -> bool:
    return _checker(option)(value)


@functools.cache
def _checker(option: Any) -> Callable[[Any], bool]:
    """Whether a value is of type ``option``, made once per type: a search checks
    thousands of layouts, each with lists of a value per rank."""
    origin = typing.get_origin(option)
    if origin is list:
        (item,) = typing.get_args(option)
        if item is int:  # the lists of a value per rank: their types, in C, not per item
            return lambda value: isinstance(value, list | tuple) and set(map(type, value)) <= {int}
        each = _checker(item)
        return lambda value: isinstance(value, list | tuple) and all(map(each, value))
    if origin is dict:
        k, v = (_checker(a) for a in typing.get_args(option))
        return lambda value: (
            isinstance(value, Mapping) and all(k(a) and v(b) for a, b in value.items())
        )
    if option is int:  # a bool is an int to isinstance, not to a layout
        return lambda value: (
            type(value) is int or (isinstance(value, int) and not isinstance(value, bool))
        )
    if option is bool:
        return lambda value: isinstance(value, bool)
    return lambda value: isinstance(value, option)


def _plural(hint: Any) -> str:
    return {int: "integers", str: "strings", bool: "booleans"}.get(hint, _describe(hint))


def _describe(hint: Any) -> str:
    if _is_union(hint):
        return " or ".join(_describe(o) for o in typing.get_args(hint))
    if hint is type(None):
        return "none"
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_plural(typing.get_args(hint)[0])}"
    if origin is dict:
        k, v = typing.get_args(hint)
        return f"a table of {_plural(k)} to {_plural(v)}"
    if dataclasses.is_dataclass(hint):
        return f"a table of {', '.join(f.name for f in dataclasses.fields(hint))}"
    return {int: "an integer", bool: "true or false", str: "a string"}.get(hint, str(hint))


__all__ = [
    "CONTEXT_GATHER",
    "CONTEXT_KINDS",
    "CONTEXT_REDUCE_SCATTER",
    "LAST_BACKWARD",
    "QUERIES_BACKWARD",
    "QUERIES_FORWARD",
    "RESHARD_POLICIES",
    "ROOT_UNIT",
    "STEP",
    "ExpertCopies",
    "Layout",
    "LayoutError",
    "ReplicaGroup",
    "parse_record",
    "reshards",
    "unit_of",
]
