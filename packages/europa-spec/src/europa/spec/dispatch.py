"""The chunked expert exchange: what a dispatcher offers so that another package can drive it
chunk by chunk (europa-overlap's overlapped MoE layer drives europa-flexshard's).

Shape letters: ``T`` tokens of this rank, ``D`` the model width, ``K`` the routing top-k,
``R`` rows received for this rank's experts, ``E`` this rank's experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RoutedExchange(Protocol):
    """One layer call's exchange in flight, issued by ``ChunkedDispatcher.begin``."""

    chunks: int

    def arrive(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for ``chunk``'s rows: ``[R, D]`` grouped by local expert, and ``[E]`` rows per
        local expert, ready for the grouped GEMM."""
        ...

    def send_back(self, chunk: int, out: torch.Tensor) -> None:
        """Issue the return of the experts' outputs ``[R, D]`` for ``chunk``."""
        ...

    def finish(self) -> torch.Tensor:
        """Wait for every return; each token's weighted sum of its experts' outputs,
        ``[T, D]``."""
        ...


@runtime_checkable
class ChunkedDispatcher(Protocol):
    """A token dispatcher (torchtitan's ``dispatch``/``combine``) that also offers its
    exchange in chunks."""

    def begin(
        self, x_TD: torch.Tensor, scores_TK: torch.Tensor, ids_TK: torch.Tensor, chunks: int = 1
    ) -> RoutedExchange:
        """Issue every chunk's dispatch of this rank's tokens ``x_TD``, routed to the experts
        ``ids_TK`` with weights ``scores_TK``."""
        ...


__all__ = ["ChunkedDispatcher", "RoutedExchange"]
