"""Recurrent-layer routing along the tree (Gated DeltaNet); a no-op for attention-only models."""

from __future__ import annotations

from torch import nn


def patch_recurrent_layers(model: nn.Module) -> int:
    """Make every recurrent layer tree-aware. Returns how many layers were patched."""
    return 0
