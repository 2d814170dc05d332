"""The mappings the planning hooks receive, typed: ``PlanMapping`` is ``europa_plan``'s
``plan``, ``SearchInputs`` is ``europa_search_levers``'s. Plain values only, so a plugin
needs nothing of europa-core to read or fill them; the records inside them
(``europa.spec.plan_layout.Layout``, ``europa.spec.offload.HostOffload``) are checked where
the planner reads them."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class PlanMapping(TypedDict):
    """What europa-core fills in before calling ``europa_plan``, and the keys it reads back.

    Any other key a plugin adds (its own name, by convention: ``plan["offload"]``) is
    reported as is."""

    world_size: int  # ranks of the planned run
    parameter_shapes: dict[str, tuple[int, ...]]  # {parameter name: full shape}
    parameter_itemsize: int  # bytes per element of the stored parameters
    # the fields of ``europa.spec.plan_layout.Layout``: core's FSDP2 layout, replaced by a
    # plugin that lays parameters out its own way
    layout: dict[str, Any]
    hardware: NotRequired[dict[str, Any]]  # the hardware profile's keys, when planning for one
    # what moves to host memory: the fields of ``europa.spec.offload.HostOffload``
    host_offload: NotRequired[dict[str, Any]]
    # the communication kinds a plugin runs beside compute (absent: the layout's own)
    overlapped_kinds: NotRequired[list[str]]
    # which gathered blocks free their parameters after forward: one of
    # ``europa.spec.plan_layout.RESHARD_POLICIES`` (absent: "all")
    reshard_after_forward: NotRequired[str]


class SearchInputs(TypedDict):
    """What ``europa plan --search`` tells each plugin's ``europa_search_levers``, so it can
    leave out the alternatives that cannot fit."""

    parameter_shapes: dict[str, tuple[int, ...]]  # {parameter name: full shape}
    parameter_itemsize: int
    hardware: dict[str, Any]  # the hardware profile's keys
    device_bytes_per_rank: int  # the device memory one rank may use


__all__ = ["PlanMapping", "SearchInputs"]
