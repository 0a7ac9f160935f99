"""Drop-in use from RL trainers: a framework-neutral padded-batch entry point (``flat``) and a TRL
``GRPOTrainer`` subclass (``trl``, needs ``pip install treetrain[trl]``)."""

from treetrain.integrations.flat import FlatBatch, flat_logprobs, score_packed
from treetrain.integrations.wrapped import install_tree_scoring, wrapped_flat_logprobs

__all__ = ["FlatBatch", "flat_logprobs", "install_tree_scoring", "score_packed", "wrapped_flat_logprobs"]
