"""Hugging Face integration: tree attention through the public registry, recurrent-layer routing."""

from treetrain.models.hf import ATTN_NAME, prepare_model, tree_forward

__all__ = ["ATTN_NAME", "prepare_model", "tree_forward"]
