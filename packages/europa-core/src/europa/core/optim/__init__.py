"""Optimizers that understand sharded (DTensor) and stacked-expert parameters."""

from europa.core.optim.muon import MuonWithAdamW, orthogonalise

__all__ = ["MuonWithAdamW", "orthogonalise"]
