"""Per-rank memory, term by term, from a layout, the saved activations and what
plugins move to host memory.

State (parameters, gradients, optimizer state) is exact for the layouts
europa runs: fp32 storage, gradients in storage of the parameters' size, AdamW's
two moments and its fp32 step counter, Muon's momentum. The transient terms
(gathered parameters, gradient buffers, expert buffers, the optimizer's
workspace) are estimates of the largest moment, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from europa.core.plan.activations import BlockActivations
from europa.core.plan.moments import Moment, RankMemory, device_moments
from europa.spec.offload import HostOffload
from europa.spec.optim import FP32, optimizer_state_bytes, uses_muon
from europa.spec.plan_layout import ROOT_UNIT, reshards


@dataclass(frozen=True)
class RankState:
    """Bytes of state each rank of the layout's group holds."""

    parameters: list[int]
    gradients: list[int]
    optimizer_state: list[int]

    @classmethod
    def of(cls, layout: dict) -> RankState:
        stored = [n * FP32 for n in layout["stored_elements"]]
        optimizer = [
            optimizer_state_bytes(muon, adamw, layout["adamw_tensors"])
            for muon, adamw in zip(layout["muon_elements"], layout["adamw_elements"], strict=True)
        ]
        return cls(parameters=stored, gradients=list(stored), optimizer_state=optimizer)

    def totals(self) -> list[int]:
        return [
            sum(t) for t in zip(self.parameters, self.gradients, self.optimizer_state, strict=True)
        ]

    def most_loaded(self) -> int:
        totals = self.totals()
        return totals.index(max(totals))


@dataclass(frozen=True)
class Activations:
    device: int  # peak bytes kept on the device for one micro-batch
    host: int  # bytes moved to host memory
    per_block: dict[str, int]  # saved bytes per block, before offload
    recompute: int = 0  # of ``device``, one block's full set while it is recomputed


def activations(
    blocks: list[BlockActivations],
    tokens: int,
    recompute: bool,
    offload: HostOffload,
    kept: dict[str, int] | None = None,
) -> Activations:
    """Saved bytes of one micro-batch at the end of forward (plus, with full
    recomputation, one block's full set, live while it is recomputed). ``kept``: bytes a
    recomputed block keeps beside its input (its expert exchanges' results)."""
    offloaded = offload.offloaded_blocks([b.name for b in blocks])
    device = host = 0
    per_block = {}
    for block in blocks:
        if recompute and block.name != "<root>":
            pieces = [block.input_bytes_per_token * tokens]
            if kept and kept.get(block.name):
                pieces.append(kept[block.name])
        else:
            pieces = [t.bytes_per_token * tokens for t in block.tensors] + [block.fixed_bytes]
        per_block[block.name] = sum(pieces)
        moved = (
            sum(p for p in pieces if p >= offload.min_tensor_bytes)
            if block.name in offloaded
            else 0
        )
        host += moved
        device += per_block[block.name] - moved
    recomputed = 0
    if recompute:
        recomputed = max(b.saved_bytes(tokens) for b in blocks if b.name != "<root>")
    return Activations(device + recomputed, host, per_block, recomputed)


def kept_blocks(units: dict[str, int], policy: str) -> list[str]:
    """The blocks of ``units`` (``gathered_unit_elements``) that keep their gathered
    parameters from forward to backward under the reshard-after-forward ``policy``."""
    blocks = sorted((u for u in units if u != ROOT_UNIT), key=_block_index)
    return [b for i, b in enumerate(blocks) if not reshards(policy, i, len(blocks))]


def _block_index(unit: str) -> tuple[int, str]:
    tail = unit.rsplit(".", 1)[-1]
    return (int(tail), unit) if tail.isdigit() else (-1, unit)


@dataclass(frozen=True)
class MemoryModel:
    """What the device-memory moments (``europa.core.plan.moments``) need, for any rank of
    the layout's group."""

    layout: dict
    state: RankState
    offload: HostOffload
    model_buffers: int
    compute_bytes: int
    reduce_bytes: int
    activations: Activations  # one micro-batch's
    expert_buffers: int
    kept_blocks: list[str]
    micro_batches: int
    attention_gradients: int = 0  # one layer's, while its block's backward runs
    attention_scores: int = 0  # QK-clip's block of scores, in a block's forward

    def moments(self, rank: int) -> list[Moment]:
        state, offload = self.state, self.offload
        optimizer_state = state.optimizer_state[rank]
        if offload.optimizer_state:  # on the host between steps, a chunk at a time in it
            between, during = 0, min(optimizer_state, offload.optimizer_chunk_bytes)
        else:
            between = during = optimizer_state
        memory = RankMemory(
            parameters=state.parameters[rank],
            gradients=state.gradients[rank],
            optimizer_state=between,
            optimizer_step_state=during,
            root_gradients=FP32 * _root_elements(self.layout, rank),
            model_buffers=self.model_buffers,
            index=rank,
        )
        return device_moments(
            self.layout,
            memory,
            compute_bytes=self.compute_bytes,
            reduce_bytes=self.reduce_bytes,
            activations=self.activations.device,
            recomputed=self.activations.recompute,
            expert_buffers=self.expert_buffers,
            kept_blocks=self.kept_blocks,
            micro_batches=self.micro_batches,
            attention_gradients=self.attention_gradients,
            attention_scores=self.attention_scores,
        )


def _root_elements(layout: dict, rank: int) -> int:
    """The root unit's elements ``rank`` stores (an even share where the layout does not
    say)."""
    per_rank = layout.get("root_stored_elements")
    if per_rank:
        return per_rank[rank]
    root = layout["gathered_unit_elements"].get(ROOT_UNIT, 0)
    return -(-root // layout["gather_group_size"])


def unique_state_bytes(parameters, optimizer: str) -> int:
    """The model's fp32 parameters and optimizer state counted once: what one checkpoint
    holds whatever the layout and however many copies train (torch.distributed.checkpoint
    writes a tensor held by several ranks from one of them). ``parameters``: the model's
    ``ParameterShape``s."""
    muon = adamw = adamw_tensors = 0
    for p in parameters:
        if optimizer == "muon" and uses_muon(p.name, p.shape):
            muon += p.numel
        else:
            adamw += p.numel
            adamw_tensors += 1
    return FP32 * (muon + adamw) + optimizer_state_bytes(muon, adamw, adamw_tensors)
