"""A rank's memory in the planner's terms, from every storage its program makes.

Design note. ``MemoryLedger`` watches every fake op's outputs (``FakeDeviceMode``'s
observer) and every storage resize (``torch.UntypedStorage.resize_``, which no dispatch
mode sees; europa-flexshard frees and refills gathered parameters that way), and keeps,
per storage, its bytes, its device kind ("device" or "host"), when it came and when it
went (weak references tell). A running total per kind finds the peak instant; what was
alive then is summed by *term* once the program is over, so a storage named late (a
gradient is known for one only once autograd has put it in ``.grad``) still counts under
its final name.

Terms, strongest first:

1. state the program names after the fact: ``parameters``, ``gradients``,
   ``optimizer_state`` and ``model_buffers`` (``name_state``);
2. tags packages put on buffers as they make them (``europa.spec.tags.mark_memory``,
   ``mark_gathered``): ``gathered_parameters``, ``gradient_buffers``, ``expert_buffers``,
   host ``activations`` (offload's pool), host ``optimizer_state``;
3. the phase a storage was made in, for everything else: ``activations`` in forward,
   ``activation_gradients`` in backward (the gradients flowing between layers and the
   recomputed forward's tensors), ``optimizer_workspace`` in the optimizer step,
   ``other`` outside the step.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from europa.spec import tags

DEVICE, HOST = "device", "host"
STATE_TERMS = ("parameters", "gradients", "optimizer_state")
PHASE_TERMS = {
    "forward": "activations",
    "backward": "activation_gradients",
    "optimizer": "optimizer_workspace",
    "setup": "other",
}


@dataclass
class _Storage:
    kind: str
    nbytes: int
    born: int
    died: int | None = None
    term: str = "other"
    strength: int = 3  # 1: named state, 2: tagged, 3: by phase
    made_by: str = ""  # the op that made it


@dataclass
class Peak:
    kind: str
    total: int = 0
    at: int = -1
    by_term: dict[str, int] = field(default_factory=dict)
    largest: list[tuple[int, str, str]] = field(default_factory=list)  # (bytes, term, op)


class MemoryLedger:
    """Install with ``with ledger:``; feed it ops through ``FakeDeviceMode`` observers."""

    def __init__(self, device_type: str) -> None:
        """``device_type``: what the program's device tensors are ("cpu" when the planned
        machine computes on CPUs: all its memory is then device memory)."""
        self.device_type = device_type
        self.clock = 0
        self.phase = "setup"
        self._entries: list[_Storage] = []
        self._by_storage: dict[int, int] = {}  # storage identity -> live entry
        self._live: dict[str, int] = defaultdict(int)
        self._peak: dict[str, tuple[int, int]] = {}  # kind -> (bytes, clock)
        self._phase_peak: dict[tuple[str, str], tuple[int, int]] = {}  # (kind, phase) -> ...
        self._resize = torch.UntypedStorage.resize_
        self._stop_observing = None

    # -- wiring ------------------------------------------------------------------------------

    def __enter__(self) -> MemoryLedger:
        ledger, resize = self, self._resize

        def resize_(storage: torch.UntypedStorage, size: int):
            result = resize(storage, size)
            ledger._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._stop_observing = tags.observe(self._tagged)
        return self

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        if self._stop_observing is not None:
            self._stop_observing()

    def op(self, func, args, kwargs, out) -> None:
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, str(func))

    # -- storages ----------------------------------------------------------------------------

    def _kind(self, tensor: torch.Tensor) -> str | None:
        device = tensor.device.type
        if device == "meta":
            return None
        return DEVICE if device == self.device_type else HOST

    def _track(self, tensor: torch.Tensor, made_by: str = "") -> int | None:
        kind = self._kind(tensor)
        if kind is None:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        index = self._by_storage.get(key)
        if index is not None:
            return index
        self.clock += 1
        term = PHASE_TERMS[self.phase]
        entry = _Storage(kind, storage.nbytes(), self.clock, term=term, made_by=made_by)
        index = len(self._entries)
        self._entries.append(entry)
        self._by_storage[key] = index
        weakref.finalize(storage, self._died, key, index)
        self._add(kind, entry.nbytes)
        return index

    def _died(self, key: int, index: int) -> None:
        entry = self._entries[index]
        if entry.died is None:
            self.clock += 1
            entry.died = self.clock
            self._live[entry.kind] -= entry.nbytes
        if self._by_storage.get(key) == index:
            del self._by_storage[key]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A storage that changes size is, for the ledger, one that dies and one that comes
        (same term)."""
        key = storage._cdata
        index = self._by_storage.get(key)
        if index is None:
            return
        old = self._entries[index]
        if old.nbytes == storage.nbytes():
            return
        self._died(key, index)
        self.clock += 1
        entry = _Storage(
            old.kind,
            storage.nbytes(),
            self.clock,
            term=old.term,
            strength=old.strength,
            made_by=old.made_by,
        )
        self._entries.append(entry)
        self._by_storage[key] = len(self._entries) - 1
        weakref.finalize(storage, self._died, key, len(self._entries) - 1)
        self._add(entry.kind, entry.nbytes)

    def _add(self, kind: str, nbytes: int) -> None:
        self._live[kind] += nbytes
        live = self._live[kind]
        if live > self._peak.get(kind, (-1, 0))[0]:
            self._peak[kind] = (live, self.clock)
        if live > self._phase_peak.get((kind, self.phase), (-1, 0))[0]:
            self._phase_peak[kind, self.phase] = (live, self.clock)

    # -- naming ------------------------------------------------------------------------------

    def _name(self, tensor: torch.Tensor, term: str, strength: int) -> None:
        index = self._track(tensor)
        if index is None:
            return
        entry = self._entries[index]
        if strength <= entry.strength:
            entry.term, entry.strength = term, strength

    def _tagged(self, tensor, tag: str, value) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if tag == tags.MEMORY:
            self._name(tensor, value, 2)
        elif tag == tags.GATHERED_PARAMETER:
            self._name(tensor, "gathered_parameters", 2)

    def name_state(self, term: str, tensors: Iterable[torch.Tensor | None]) -> None:
        """Name these tensors' storages ``term`` (one of ``STATE_TERMS``, or the model's
        buffers), whatever they were named before."""
        for tensor in tensors:
            if tensor is not None:
                self._name(tensor, term, 1)

    # -- what it found -----------------------------------------------------------------------

    def restart_peaks(self) -> None:
        """Peaks from now on only (what is alive now counts, as it would at a later peak)."""
        self._peak = {kind: (live, self.clock) for kind, live in self._live.items()}
        self._phase_peak = {}

    def phase_peaks(self, kind: str) -> dict[str, int]:
        """The highest ``kind`` bytes reached in each phase since the peaks restarted."""
        return {phase: v[0] for (k, phase), v in self._phase_peak.items() if k == kind}

    def live(self, kind: str) -> int:
        return self._live.get(kind, 0)

    def peak(self, kind: str, largest: int = 12) -> Peak:
        """The peak of ``kind`` and what was alive at that instant, by term, with the
        ``largest`` storages then alive."""
        total, at = self._peak.get(kind, (0, -1))
        by_term: dict[str, int] = defaultdict(int)
        alive = [
            entry
            for entry in self._entries
            if entry.kind == kind and entry.born <= at and (entry.died is None or entry.died > at)
        ]
        for entry in alive:
            by_term[entry.term] += entry.nbytes
        biggest = sorted(alive, key=lambda e: -e.nbytes)[:largest]
        return Peak(
            kind, total, at, dict(by_term), [(e.nbytes, e.term, e.made_by) for e in biggest]
        )

    def storages(self) -> int:
        return len(self._entries)
