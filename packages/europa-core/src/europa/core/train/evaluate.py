"""Validation loss: forward passes without gradients over this rank's validation share, summed
over every rank (see ``europa.core.data.validation``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from europa.core.data.validation import ValidationBatches
from europa.core.model.load_balance import moe_layers


@contextlib.contextmanager
def restoring_expert_counts(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, and afterwards as it was: its mode, and the tokens its
    routers counted (validation tokens must not move the next step's bias update)."""
    counts = [moe.tokens_per_expert_E.clone() for _, moe in moe_layers(model)]
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        for (_, moe), saved in zip(moe_layers(model), counts, strict=True):
            moe.tokens_per_expert_E.copy_(saved)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """(the weighted sum of token cross-entropies, the weighted token count), float64 on
    the CPU; ``weights``: one per sequence (0 for padding)."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(
        labels.shape
    )
    total = (losses.sum(dim=1).double().cpu() * weights.double()).sum()
    return torch.stack([total, weights.double().sum() * labels.shape[1]])


@torch.no_grad()
def validation_metrics(
    model: nn.Module, batches: ValidationBatches, device: torch.device
) -> dict[str, float]:
    """{"val_loss": mean token cross-entropy, "val_perplexity": its exp}; a collective."""
    sums = torch.zeros(2, dtype=torch.float64)
    with restoring_expert_counts(model):
        for index in range(batches.num_batches):
            inputs, labels, weights = batches.batch(index)
            sums += token_losses(model(inputs.to(device)), labels.to(device), weights)
    return summed_metrics(sums, device)


def summed_metrics(sums: torch.Tensor, device: torch.device) -> dict[str, float]:
    """The metrics of this rank's ``token_losses`` sums added over every rank (a
    collective where torch.distributed runs)."""
    if dist.is_initialized():
        summed = sums.to(device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        sums = summed.cpu()
    loss = (sums[0] / sums[1]).item()
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}
