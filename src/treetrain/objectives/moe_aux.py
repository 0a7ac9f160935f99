"""The MoE router auxiliary (load-balancing) loss inside ``treetrain train``.

A model gets the loss exactly where its Hugging Face ``...ForCausalLM`` computes one (its forward
calls ``load_balancing_loss_func`` and adds ``coef * aux_loss``): the coefficient and top-k are the
ones that forward uses, the causal LM's own ``router_aux_loss_coef`` (JetMoE: ``aux_loss_coef``;
DBRX: its ``ffn_config.moe_loss_weight``) and ``num_experts_per_tok`` (DBRX: ``moe_top_k``), else
the text config's (multimodal wrappers that read them there). Models whose HF forward computes none
(DeepSeek-V3-style bias-balanced routers and the other types without the call) get none, and so do
models that build no MoE layer at all (:func:`aux_coef`). Every micro-batch's forward runs inside
:func:`recording`, and the micro-batch's aux loss is transformers' ``load_balancing_loss_func``
over its paths (:mod:`treetrain.models.moe`):

- tree packing: one forward, each distinct token weighted by the number of paths through it;
- sequence packing (the baseline): one forward per path, the per-path sums added.

Both equal HF's loss over the micro-batch's paths, each path's router logits from its own forward
(the paths as one padded batch, where that batch is exact). The step adds ``coef * sum_mb (path
tokens_mb / path tokens) * aux_mb`` to the objective (gradient accumulation's token-weighted mean
over micro-batches) and reports the unscaled sum as ``aux_loss``. The load-balancing loss is a
product of batch sums, so it is not additive over micro-batches: tree and sequence packing agree
exactly when their micro-batches hold the same paths (one micro-batch per step, e.g. a
``capacity`` above the step's tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from treetrain.models.head import unwrap
from treetrain.models.moe import (
    has_routers,
    path_count_weights,
    record_router_logits,
    weighted_load_balancing_loss,
)
from treetrain.trees.packing import PackedTree

__all__ = ["aux_coef", "micro_batch_aux_loss", "recording"]


# where HF's causal LMs keep the coefficient their forward multiplies the aux loss by
_COEF_ATTRS = ("router_aux_loss_coef", "aux_loss_coef")


def _text_config(model: nn.Module):
    return getattr(model.config, "text_config", None) or model.config


def _hf_coef(model: nn.Module) -> float | None:
    """The coefficient HF's forward multiplies its aux loss by; None: it computes no aux loss."""
    lm, cfg = unwrap(model), _text_config(model)
    for owner in (lm, cfg):
        for name in _COEF_ATTRS:
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def _top_k(model: nn.Module) -> int:
    """The experts per token HF's aux loss counts (the causal LM's, else the text config's)."""
    k = getattr(unwrap(model), "num_experts_per_tok", None) or getattr(
        _text_config(model), "num_experts_per_tok", None
    )
    if not isinstance(k, int):
        raise ValueError(
            f"{type(model).__name__}: no num_experts_per_tok for the router aux loss (not an MoE model?)"
        )
    return k


def _user_set_coef(model: nn.Module) -> tuple[str, float] | None:
    """(field, value) of a nonzero coefficient the text config sets away from its class default."""
    cfg = _text_config(model)
    for name in _COEF_ATTRS:
        value = getattr(cfg, name, None)
        if isinstance(value, (int, float)) and value and value != getattr(type(cfg), name, None):
            return name, float(value)
    return None


def aux_coef(model: nn.Module) -> float | None:
    """The router aux loss coefficient HF's forward uses for ``model``; None: nothing to add (its HF
    forward computes no aux loss, or the model builds no MoE layer, so no router logits to record).

    Raises ``ValueError`` for a model without routers whose config sets a nonzero coefficient other
    than its class default: the user asked for a loss no layer can give.
    """
    coef = _hf_coef(model)
    if coef is None:
        return None
    if not has_routers(model):
        user = _user_set_coef(model)
        if user is not None:
            name, value = user
            raise ValueError(
                f"{type(unwrap(model)).__name__}: config sets {name}={value:g}, but every layer is dense (no "
                f"MoE router to balance); set {name} to 0, or give the config sparse (MoE) layers"
            )
        return None
    return coef


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
    if not router_logits:
        raise ValueError(
            f"{type(unwrap(model)).__name__}: no router logits recorded over the micro-batch's forward "
            "(run it inside recording(model, aux_coef(model)); aux_coef is None for a model without routers)"
        )
    if packing == "tree":
        weights = path_count_weights(packed)
    else:
        weights = torch.ones(int(packed.path_lengths.sum()))
    assert router_logits[0].shape[0] == weights.shape[0], (router_logits[0].shape, weights.shape)
    return weighted_load_balancing_loss(router_logits, weights, _top_k(model))
