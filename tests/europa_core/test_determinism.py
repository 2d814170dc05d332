"""``training.deterministic``: torch's deterministic algorithms, without the NaN fill of
every new allocation (1496 ``aten::fill_`` calls, 18.5% of self CPU time, in two
profiled debug steps of ``benchmarks/e2e.py`` before; 316 and 0.7% after). That runs
stay deterministic without the fill is what test_train.py's exactness tests show (resume
reproduces the uninterrupted run; two ranks equal one process)."""

from __future__ import annotations

import pytest
import torch

from europa.core.train.loop import use_deterministic_algorithms


@pytest.fixture
def restores_torch_modes():
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_follows_the_setting_and_never_fills_new_memory(
    deterministic, restores_torch_modes
):
    torch.use_deterministic_algorithms(not deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = True

    use_deterministic_algorithms(deterministic)

    assert torch.are_deterministic_algorithms_enabled() is deterministic
    assert torch.utils.deterministic.fill_uninitialized_memory is False
