"""Mixture-of-experts router auxiliary (load-balancing) loss on a tree, equal to the baseline's.

The baseline runs every path as a row of one padded batch with ``output_router_logits=True``;
transformers' ``load_balancing_loss_func`` then averages over every non-padding token of every
path, and over the MoE layers::

    f_e = #{(layer, token): e in top_k(p)} / (L * N)     P_e = sum_{layer, token} p_e / (L * N)
    aux = num_experts * sum_e f_e * P_e

A tree computes each distinct token once, so weighting each by the number of paths through it
(``path_index`` counts, :func:`path_count_weights`) gives the same sums and the same ``N``, hence
the same loss and (through ``P_e``) the same gradient.

Training loop::

    with record_router_logits(model) as router_logits:
        logps = path_logprobs(model, packed)
    aux = tree_router_aux_loss(model, packed, router_logits)
    loss = objective(logps) + model.config.router_aux_loss_coef * aux
    loss.backward()

(With gradient checkpointing, use the non-reentrant kind: the reentrant kind runs the forward
under ``no_grad``, so the recorded logits would carry no gradient.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from treetrain.trees.packing import PackedTree

__all__ = [
    "balancing_loss",
    "has_routers",
    "load_balancing_stats",
    "path_count_weights",
    "record_router_logits",
    "tree_router_aux_loss",
    "weighted_load_balancing_loss",
]


def _router_targets(model: nn.Module) -> list[tuple[type, int]]:
    """(router class, index of the logits in its output) from the models' ``_can_record_outputs``."""
    targets = []
    for m in model.modules():
        spec = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        cls = getattr(spec, "target_class", spec)
        index = getattr(spec, "index", 0)
        if isinstance(cls, type) and (cls, index) not in targets:
            targets.append((cls, index))
    return targets


def has_routers(model: nn.Module) -> bool:
    """Whether ``model`` holds a router whose logits :func:`record_router_logits` records (an MoE
    model type can be built with every layer dense: it declares routers and holds none)."""
    classes = tuple(cls for cls, _ in _router_targets(model))
    return bool(classes) and any(isinstance(m, classes) for m in model.modules())


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the router logits of every MoE layer for the forwards run inside: a list that fills
    with one ``[T, num_experts]`` tensor per MoE layer per forward, in call order.

    Uses the routers transformers itself records for ``output_router_logits`` (the model's
    ``_can_record_outputs["router_logits"]``), through forward hooks removed on exit.
    """
    targets = _router_targets(model)
    if not targets:
        raise ValueError(
            f"{type(model).__name__} declares no router logits to record (not a transformers MoE?)"
        )
    logits: list[torch.Tensor] = []
    handles = []
    for m in model.modules():
        for cls, index in targets:
            if isinstance(m, cls):

                def hook(_mod, _inp, out, index=index):
                    logits.append(out[index] if isinstance(out, (tuple, list)) else out)

                handles.append(m.register_forward_hook(hook))
    try:
        yield logits
    finally:
        for h in handles:
            h.remove()


def path_count_weights(packed: PackedTree, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """How many path positions each distinct token stands for: ``[T]``.

    Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (DFS ``A B C D E F G H``):
    ``[3, 2, 1, 1, 1, 1, 1, 1]``. Sums to the baseline's token count.
    """
    counts = torch.bincount(packed.path_index, minlength=packed.num_tokens)
    return counts.to(dtype)


def load_balancing_stats(
    router_logits: Sequence[torch.Tensor], weights: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted sums the loss is built from, over layers and tokens.

    router_logits: per layer ``[T, E]``; weights ``[T]``, or ``[G, T]`` for ``G`` groups of the
    same tokens at once (each layer's softmax and top-k computed once). Returns ``(counts [E],
    probs [E], rows [])`` (``[G, E]``, ``[G, E]``, ``[G]`` for ``[G, T]`` weights):
    ``counts[e] = sum w_t [e in top_k]``, ``probs[e] = sum w_t softmax(logits_t)[e]``,
    ``rows = L * sum w_t``. Sums over several forwards (parts of one batch) add.
    """
    acc = torch.promote_types(router_logits[0].dtype, torch.float32)  # float32, or float64 models
    E = router_logits[0].shape[-1]
    w = weights.to(device=router_logits[0].device, dtype=acc)
    groups = w.reshape(-1, w.shape[-1])  # [G, T]
    counts = [torch.zeros(E, dtype=acc, device=w.device) for _ in groups]
    probs = [torch.zeros(E, dtype=acc, device=w.device) for _ in groups]
    for layer in router_logits:
        p = torch.softmax(layer.to(acc), dim=-1)
        top = torch.topk(p, top_k, dim=-1).indices.reshape(-1)  # no gradient: the count is a step function
        for g, wg in enumerate(groups):
            counts[g] = counts[g].index_add(0, top, wg.repeat_interleave(top_k))
            probs[g] = probs[g] + (p * wg[:, None]).sum(0)
    stats = torch.stack(counts), torch.stack(probs), groups.sum(-1) * len(router_logits)
    return stats if w.ndim > 1 else tuple(x[0] for x in stats)


def balancing_loss(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` from :func:`load_balancing_stats`' sums:
    ``E * sum_e (counts_e / rows) (probs_e / rows)`` (``[G]`` for grouped sums)."""
    return probs.shape[-1] * ((counts / rows[..., None]) * (probs / rows[..., None])).sum(-1)


def weighted_load_balancing_loss(
    router_logits: Sequence[torch.Tensor], weights: torch.Tensor, top_k: int
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` with a weight per token (``[T]``), a scalar.

    With all weights 1 it is the unmasked HF loss over the ``T`` rows; with path counts it is the
    per-path baseline's over all path tokens.
    """
    if len(router_logits) == 0:
        raise ValueError("no router logits: was the forward run inside record_router_logits(model)?")
    return balancing_loss(*load_balancing_stats(router_logits, weights, top_k))


def tree_router_aux_loss(
    model: nn.Module, packed: PackedTree, router_logits: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The per-path baseline's router aux loss from one tree forward's router logits.

    ``router_logits``: what :func:`record_router_logits` collected over ``packed``'s forward
    (``[T, E]`` per MoE layer). ``top_k`` is the model's ``config.num_experts_per_tok``. Multiply by
    ``config.router_aux_loss_coef`` and add to the objective.
    """
    T = packed.num_tokens
    bad = [tuple(x.shape) for x in router_logits if x.ndim != 2 or x.shape[0] != T]
    if bad:
        raise ValueError(
            f"router logits must be [T={T}, experts] per layer (one tree forward), got shapes {bad[:3]}"
        )
    cfg = getattr(model.config, "text_config", None) or model.config
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if top_k is None:
        raise ValueError(f"{type(model).__name__}: config has no num_experts_per_tok (not an MoE model?)")
    return weighted_load_balancing_loss(router_logits, path_count_weights(packed), top_k)
