"""The planner's saved-activation estimate against the bytes autograd really
keeps, measured through ``saved_tensors_hooks`` on the trainer's forward and
loss (one process, CPU: SDPA's math path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from europa.core.model import build_moe_model
from europa.core.model.materialise import materialise
from europa.core.plan.activations import block_activations
from europa.core.session import open_session

TOLERANCE = 0.15  # the bound the plan promises; the list is built to match exactly


def measured_saved_bytes(
    config, batch: int, seq_len: int, attention: str = "sdpa"
) -> dict[str, int]:
    """Distinct storages autograd saves, per block, parameters and buffers excluded."""
    bf16 = config.training.dtype == "bfloat16"
    model = build_moe_model(config.model, native_dtype_experts=not bf16, attention=attention)
    materialise(model, torch.device("cpu"), 0)
    if bf16:  # as FSDP2 mixed precision hands the blocks bf16 parameters
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current, seen, per_block = ["<root>"], set(), {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned and ptr not in seen:
            seen.add(ptr)
            per_block[current[0]] = per_block.get(current[0], 0) + t.untyped_storage().nbytes()
        return t

    for name, block in model.layers.items():
        block.register_forward_pre_hook(lambda m, a, n=f"layers.{name}": current.__setitem__(0, n))
        block.register_forward_hook(lambda m, a, o: current.__setitem__(0, "<root>"))
    generator = torch.Generator().manual_seed(0)
    vocab = config.model.vocab_size
    inputs = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    labels = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(inputs)  # the trainer's loss, as in europa.core.train.loop
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return per_block


@pytest.mark.parametrize(
    ("preset", "overrides", "batch", "seq_len"),
    [
        ("debug", [], 2, 64),
        ("debug", [], 1, 256),  # one sequence: SDPA keeps v as a view of wkv_b's output
        ("debug", ["training.dtype='bfloat16'", "model.q_lora_rank=64"], 1, 96),
        ("tiny", ["model.num_shared_experts=0"], 3, 32),
    ],
)
def test_saved_activation_estimate_matches_the_saved_tensor_hooks(
    preset, overrides, batch, seq_len
):
    _check_estimate(preset, overrides, batch, seq_len, attention="sdpa", kernel="math")


@pytest.mark.parametrize(
    ("preset", "overrides", "batch", "seq_len"),
    [
        ("debug", [], 2, 64),
        ("debug", ["training.dtype='bfloat16'"], 1, 96),  # 96: blocks of unequal width
    ],
)
def test_block_causal_estimate_matches_the_saved_tensor_hooks(preset, overrides, batch, seq_len):
    _check_estimate(
        preset, overrides, batch, seq_len, attention="block_causal", kernel="block_causal"
    )


def _check_estimate(preset, overrides, batch, seq_len, *, attention: str, kernel: str) -> None:
    config, _ = open_session(preset, overrides)
    measured = measured_saved_bytes(config, batch, seq_len, attention)
    dtype_bytes = 2 if config.training.dtype == "bfloat16" else 4
    planned = {
        b.name: b.saved_bytes(batch * seq_len)
        for b in block_activations(
            config.model, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes, kernel=kernel
        )
    }
    assert set(planned) == set(measured)
    for name, want in measured.items():
        assert abs(planned[name] - want) <= TOLERANCE * want, (name, planned[name], want)
    total_planned, total_measured = sum(planned.values()), sum(measured.values())
    assert abs(total_planned - total_measured) <= TOLERANCE * total_measured
