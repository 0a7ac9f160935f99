"""The MoE router auxiliary (load-balancing) loss inside ``treetrain train``.

For a model whose config has ``num_experts_per_tok`` and ``router_aux_loss_coef`` (Qwen3-MoE,
Qwen3-Next, Mixtral-style), every micro-batch's forward runs inside :func:`recording`, and the
micro-batch's aux loss is transformers' ``load_balancing_loss_func`` over its paths
(:mod:`treetrain.models.moe`):

- tree packing: one forward, each distinct token weighted by the number of paths through it;
- sequence packing (the baseline): one forward per path, the per-path sums added.

Both equal the loss of the micro-batch's paths run as one padded batch through the unmodified
model. The step adds ``router_aux_loss_coef * sum_mb (path tokens_mb / path tokens) * aux_mb`` to
the objective (gradient accumulation's token-weighted mean over micro-batches) and reports the
unscaled sum as ``aux_loss``. The load-balancing loss is a product of batch sums, so it is not
additive over micro-batches: tree and sequence packing agree exactly when their micro-batches hold
the same paths (one micro-batch per step, e.g. a ``capacity`` above the step's tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from treetrain.models.moe import (
    _router_targets,
    path_count_weights,
    record_router_logits,
    weighted_load_balancing_loss,
)
from treetrain.trees.packing import PackedTree

__all__ = ["aux_coef", "micro_batch_aux_loss", "recording"]


def aux_coef(model: nn.Module) -> float | None:
    """``router_aux_loss_coef`` of an MoE model that records router logits; None otherwise."""
    cfg = getattr(model.config, "text_config", None) or model.config
    if getattr(cfg, "num_experts_per_tok", None) is None or not _router_targets(model):
        return None
    return float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)


@contextlib.contextmanager
def recording(model: nn.Module, coef: float | None) -> Iterator[list[torch.Tensor] | None]:
    """Router logits of the forwards run inside (None and a no-op when ``coef`` is None)."""
    if coef is None:
        yield None
        return
    with record_router_logits(model) as logits:
        yield logits


def micro_batch_aux_loss(
    model: nn.Module, packed: PackedTree, packing: str, router_logits: list[torch.Tensor]
) -> torch.Tensor:
    """The load-balancing loss of one micro-batch's paths, from its forward's router logits.

    ``router_logits``: ``[T, E]`` per MoE layer of the one forward over the micro-batch: the tree
    (each token weighted by the paths through it) or, with ``sequence`` packing, the paths as packed
    one-path trees (every row once).
    """
    cfg = getattr(model.config, "text_config", None) or model.config
    if packing == "tree":
        weights = path_count_weights(packed)
    else:
        weights = torch.ones(int(packed.path_lengths.sum()))
    assert router_logits[0].shape[0] == weights.shape[0], (router_logits[0].shape, weights.shape)
    return weighted_load_balancing_loss(router_logits, weights, cfg.num_experts_per_tok)
