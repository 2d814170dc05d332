"""Which parameters Muon steps and which AdamW, and how many bytes of state each rule
keeps: what the optimizers, the planner and every plugin's memory budget must agree on.
No torch here, so a planner or a plugin module can read it without loading torch.

Embeddings, the output head, norms, router gates and biases stay on AdamW, as Muon's
authors advise; every other matrix (hidden weights, stacked experts) goes to Muon."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

# Parts of a parameter's name that keep it on AdamW however many dimensions it has.
ADAMW_ONLY_PARTS = ("embed", "lm_head", "norm", "router", "expert_bias")
# fp32 tensors of optimizer state per parameter element, by rule: AdamW's two moments,
# Muon's momentum. Each AdamW tensor also carries a step counter.
STATE_TENSORS = {"muon": 1, "adamw": 2}
FP32 = 4
STEP_COUNTER_BYTES = 4


def uses_muon(name: str, shape: Sequence[int]) -> bool:
    """Hidden weight matrices and stacked expert matrices go to Muon; the rest to AdamW."""
    return len(shape) >= 2 and not _kept_on_adamw(name)


@functools.cache  # a search asks this of every parameter for each of its many layouts
def _kept_on_adamw(name: str) -> bool:
    return any(part in name for part in ADAMW_ONLY_PARTS)


def optimizer_state_bytes(muon_elements: int, adamw_elements: int, adamw_tensors: int) -> int:
    """Bytes of optimizer state for that many elements under each rule."""
    return (
        FP32 * STATE_TENSORS["muon"] * muon_elements
        + FP32 * STATE_TENSORS["adamw"] * adamw_elements
        + STEP_COUNTER_BYTES * adamw_tensors
    )


def muon_adamw_keywords(optimizer: Any) -> dict[str, Any]:
    """A config's ``[optimizer]`` table as the keywords of every Muon/AdamW optimizer
    (``europa.spec.muon.muon_adamw_defaults``): core's and each layout's build them alike."""
    return {
        "lr": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "momentum": optimizer.muon_momentum,
        "ns_steps": optimizer.muon_ns_steps,
        "betas": (optimizer.beta1, optimizer.beta2),
        "eps": optimizer.eps,
    }


__all__ = [
    "ADAMW_ONLY_PARTS",
    "FP32",
    "STATE_TENSORS",
    "STEP_COUNTER_BYTES",
    "muon_adamw_keywords",
    "optimizer_state_bytes",
    "uses_muon",
]
