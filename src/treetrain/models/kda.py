"""Kimi Delta Attention (KDA: Kimi Linear, Bailing hybrid) along a packed tree.

KDA is the gated delta rule with a decay per *channel* instead of per head: with ``S`` the
``[Dk, Dv]`` state of a head, at every step ``S <- diag(exp(g_t)) S``, then the delta update
``S <- S + beta_t k_t (v_t - S^T k_t)^T`` and ``o_t = S^T q_t`` (q, k l2-normalized, q scaled by
``Dk^-1/2``). Its causal conv1d runs on the concatenated q, k, v projections before the rule.

Along the tree, as for Gated DeltaNet (:mod:`treetrain.models.gdn`): the conv reads each token's
own path (:mod:`treetrain.models.pathconv`) and the rule runs level by level
(:func:`treetrain.models.scan.tree_scan`), every node from its parent's final state. A padded step
(``q = k = v = 0``, ``g = 0``, ``beta = 0``) is the identity (``exp(0) = 1``, no update), so a node
padded to its group's length ends in its last real step's state.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``: level 1 runs ``[G H]`` and ``[B]`` from
A's final state; level 2 runs ``[C D]`` and ``[E F]``, both from B's.

The rule is transformers' own PyTorch ``chunk_kimi_delta_attention`` (from the layer's modeling
module, past the hub-kernel dispatch), called with ``initial_state`` and ``output_final_state``; it
casts to float32 internally, as the layer does. No fused kernel is used (CPU and CUDA alike).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN

from treetrain.models.classes import required_class
from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.scan import TreeLevels, chunked_rule_scan, tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["KDA_LAYOUTS", "tree_kda_forward", "tree_kda_rule"]

# OutputGate: module, hidden [T, H] -> the gate of the output norm, [T, H * Dv]
OutputGate = Callable[[nn.Module, torch.Tensor], torch.Tensor]

# exact class name -> its output gate (checked against transformers 5.24)
KDA_LAYOUTS: dict[str, OutputGate] = {
    "KimiLinearDeltaAttention": lambda m, x: m.g_b_proj(m.g_a_proj(x)),  # low rank
    "BailingHybridDeltaAttention": lambda m, x: m.g_proj(x),
}


def _layout(module: nn.Module) -> tuple[type, OutputGate]:
    """The KDA class (through FSDP2's ``FSDP<Name>`` subclass) and its output gate."""
    c = required_class(module, KDA_LAYOUTS, "KDA layout")
    return c, KDA_LAYOUTS[c.__name__]


def _torch_rule(cls: type) -> Callable:
    """The layer's own PyTorch chunked KDA rule, past the kernel dispatch."""
    return inspect.unwrap(sys.modules[cls.__module__].chunk_kimi_delta_attention)


def tree_kda_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    levels: TreeLevels,
    rule: Callable,
    *,
    max_chunk: int = 64,
    piece_chunks: int = 2,
) -> torch.Tensor:
    """The KDA rule over a packed forest, level by level: ``[T, H, Dv]``.

    q, k ``[T, H, Dk]``, v ``[T, H, Dv]``, g (log decay per channel) ``[T, H, Dk]``, beta
    ``[T, H]``, all in DFS order; ``rule``: a ``chunk_kimi_delta_attention``. Every node starts
    from its parent's final state ``[H, Dk, Dv]`` (roots from zeros).

    A group longer than ``piece_chunks`` chunks goes through the rule in pieces of that many
    chunks, each from the previous piece's final state (the same chunks, so the same math): the
    rule indexes its ``[.., chunk, chunk, Dk]`` decay mask chunk by chunk, and each index's backward
    fills a zero tensor of the whole mask, so one call costs O(chunks^2). Fwd+bwd of 1024 tokens,
    4 heads of 64, one thread: 1011 ms in one call, 267 ms in pieces of 2 chunks.
    """
    scan = chunked_rule_scan(rule, max_chunk, piece_chunks=piece_chunks)
    return tree_scan((q, k, v, g, beta), levels, scan)


def tree_kda_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """A KDA layer over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``.

    Reuses the module's projections, forget gate, gated norm and output layer; replaces the conv
    and the rule. ``tree_mask`` (a ``TreeMask``, optional) caches the level schedule and the conv
    windows for the other layers of the same forward.
    """
    cls, output_gate = _layout(module)
    x, dev = hidden_states[0], hidden_states.device
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    w = module.conv1d.weight[:, 0]  # [3 H Dk, width]
    conv = tree_causal_conv1d(
        mixed.to(w.dtype), w, module.conv1d.bias, path_window(packed, w.shape[1], tree_mask, dev)
    )
    if module.activation is not None:
        conv = ACT2FN[module.activation](conv)
    heads = lambda t: t.unflatten(-1, (-1, module.head_dim))  # noqa: E731
    q, k, v = (heads(t) for t in conv.to(x.dtype).split([module.qkv_dim] * 3, dim=-1))

    g = module.forget_gate(hidden_states)[0]  # [T, H, Dk], as the layer computes it
    beta = module.b_proj(x).sigmoid()
    core = tree_kda_rule(q, k, v, g, beta, tree_levels(packed, tree_mask, dev), _torch_rule(cls))
    out = module.o_norm(core, heads(output_gate(module, x)))
    return module.o_proj(out.flatten(-2))[None]
