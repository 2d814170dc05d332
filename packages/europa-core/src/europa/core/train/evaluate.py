"""Validation loss: forward passes without gradients over this rank's validation share, summed
over every rank (see ``europa.core.data.validation``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from europa.core.data.validation import ValidationBatches
from europa.core.model.load_balance import moe_layers


@torch.no_grad()
def validation_metrics(
    model: nn.Module, batches: ValidationBatches, device: torch.device
) -> dict[str, float]:
    """{"val_loss": mean token cross-entropy, "val_perplexity": its exp}; a collective."""
    # The router counts what forward routes, for the next step's bias update; validation
    # tokens must not move the biases, so the counts are put back afterwards.
    counts = [moe.tokens_per_expert_E.clone() for _, moe in moe_layers(model)]
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    try:
        for index in range(batches.num_batches):
            inputs, labels, weights = batches.batch(index)
            logits = model(inputs.to(device))
            losses = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.to(device).flatten(), reduction="none"
            ).view(labels.shape)
            sums[0] += (losses.sum(dim=1).double().cpu() * weights.double()).sum()
            sums[1] += weights.double().sum() * labels.shape[1]
    finally:
        model.train(was_training)
        for (_, moe), saved in zip(moe_layers(model), counts, strict=True):
            moe.tokens_per_expert_E.copy_(saved)
    if dist.is_initialized():
        summed = sums.to(device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        sums = summed.cpu()
    loss = (sums[0] / sums[1]).item()
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}
