"""What moves to host memory, as the planner needs to know it: ``plan["host_offload"]``, which
europa-offload's ``europa_plan`` fills and europa-core's planner reads, checked in one place as
``europa.spec.plan_layout.Layout`` is. Pure Python."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from europa.spec.plan_layout import ROOT_UNIT, parse_record


@dataclass(frozen=True)
class HostOffload:
    """``activation_blocks``: name patterns of the blocks whose saved tensors move;
    ``keep_last_blocks``: the last blocks of those that keep theirs (backward needs them
    first); ``min_tensor_bytes``: smaller saved tensors stay; ``optimizer_state``: the
    optimizer state lives on the host between steps, streamed back ``optimizer_chunk_bytes``
    at a time; ``budget_bytes_per_rank``: the host memory a rank may use (None: the
    hardware's), set by ``budget_setting`` (the key and value, for messages)."""

    activation_blocks: list[str] = field(default_factory=list)
    keep_last_blocks: int = 0
    min_tensor_bytes: int = 0
    optimizer_state: bool = False
    optimizer_chunk_bytes: int = 0
    budget_bytes_per_rank: int | None = None
    budget_setting: str = ""

    @classmethod
    def parse(cls, table: Any, plugin: str = "offload") -> HostOffload:
        """The record of ``table`` (None or empty: nothing offloaded), or a one-line error
        naming the plugin and the key."""
        if not table:
            return cls()
        return parse_record(cls, table, plugin, 'plan["host_offload"]')

    def offloaded_blocks(self, blocks: Sequence[str]) -> set[str]:
        """Of ``blocks`` (names, in forward order), those whose saved tensors move."""
        matched = [
            name
            for name in blocks
            if name != ROOT_UNIT
            and any(fnmatch.fnmatchcase(name, p) for p in self.activation_blocks)
        ]
        kept = self.keep_last_blocks
        return set(matched[: len(matched) - kept] if kept else matched)


__all__ = ["HostOffload"]
