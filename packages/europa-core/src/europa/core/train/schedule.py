"""Linear warm-up, then cosine decay to ``lr × min_lr_ratio`` at the last step."""

from __future__ import annotations

import math

import torch

from europa.core.config.schema import LRScheduleConfig


def lr_factor(step: int, total_steps: int, schedule: LRScheduleConfig) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based)."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * cosine


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, schedule: LRScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, schedule)
    )
