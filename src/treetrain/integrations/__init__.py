"""Drop-in use from RL trainers: a framework-neutral padded-batch entry point (``flat``) and a TRL
``GRPOTrainer`` subclass (``trl``, needs ``pip install treetrain[trl]``)."""

from .flat import FlatBatch, flat_logprobs, score_packed

__all__ = ["FlatBatch", "flat_logprobs", "score_packed"]
