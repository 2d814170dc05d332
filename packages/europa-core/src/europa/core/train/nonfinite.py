"""Skip a step whose loss or gradients are not finite, up to ``training.max_skipped_steps``.

The test is the total gradient norm that clipping computes anyway: it is reduced over
every rank, so all ranks agree without a collective of their own, and a non-finite loss
on any rank makes it non-finite. A skipped step makes no optimizer update (so no
checkpoint ever holds non-finite weights); its batch is not retried, and the
learning-rate schedule still advances: both follow the step number, as on resume.
"""

from __future__ import annotations

import math
from typing import Any

from europa.core.errors import ConfigError


class SkippedSteps:
    def __init__(self, limit: int, count: int = 0) -> None:
        self.limit = limit
        self.count = count

    def skips(self, step: int, grad_norm: Any) -> bool:
        """True when ``step`` (0-based) must be skipped; past the limit, a ConfigError.
        ``float`` is this step's only host sync here (none when the norm is a float)."""
        norm = float(grad_norm)
        if math.isfinite(norm):
            return False
        self.count += 1
        if self.count > self.limit:
            raise ConfigError(
                f"training.max_skipped_steps = {self.limit}: step {step + 1} has a non-finite "
                f"loss or gradient (gradient norm {norm}), skipped step {self.count}; "
                "expected at most that many: lower optimizer.lr, or raise the limit"
            )
        return True

    def record(self, skipped: bool) -> dict[str, Any]:
        """The keys of this step's metrics record."""
        return {"skipped": skipped, "skipped_steps": self.count}
