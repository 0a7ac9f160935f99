"""RecurrentGemma's recurrent block (Griffin's RG-LRU with its causal conv1d) along a packed tree.

The block (``RecurrentGemmaRecurrentBlock``) is ``linear_out(rg_lru(conv1d(linear_x(x))) *
act(linear_y(x)))``. The conv1d reads the last ``conv1d_width`` inputs along the token's own path
(:func:`treetrain.models.pathconv.tree_causal_conv1d`). The RG-LRU's gates are pointwise; its scan
is the diagonal linear recurrence (per channel, accumulated in float32 as the model does)::

    h_t = a_t * h_{t-1} + x_t,    a_t = 0 where position_ids == 0 (the model's reset)

run level by level (:func:`~treetrain.models.scan.tree_scan`), each node from its parent's final
``h``. The padding after a node has ``a = x = 0``, which would zero the state: it is masked
(``valid``). Only roots have path position 0, so the reset fires exactly where each path starts.

Example, one channel, ``a = 1/2`` everywhere, ``x = 1``: a root ``[A]`` ends at ``h = 1`` (reset),
its child ``[B C]`` continues ``1.5, 1.75``; a sibling ``[D]`` of ``[B C]`` padded to 2 steps
ends at ``1.5``, not at ``0`` (the padded step is skipped).
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.scan import tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["rglru_gates", "rglru_scan", "tree_rglru_block_forward"]


def rglru_scan(xs, init, valid):
    """``tree_scan``'s scan of the RG-LRU: ``xs = (a, x)``, each ``[n, L, W]``; state ``[n, W]``
    in float32 (the model's accumulator); outputs in ``x``'s dtype."""
    a, x = xs
    h = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device) if init is None else init
    outs = []
    for t in range(x.shape[1]):
        step = a[:, t].to(torch.float32) * h + x[:, t].to(torch.float32)
        h = torch.where(valid[:, t, None], step, h)
        outs.append(h.to(x.dtype))
    return torch.stack(outs, dim=1), h


def rglru_gates(
    lru: nn.Module, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RG-LRU's pointwise part, as ``RecurrentGemmaRglru.forward`` computes it: ``x [T, W]``,
    ``position_ids [T]`` -> ``(a, normalized x)``, each ``[T, W]`` (``a = 0`` at a reset)."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import SqrtBoundDerivative

    T, W = x.shape
    reset = position_ids[:, None] == 0
    heads = x.reshape(T, lru.num_attention_heads, lru.block_width).transpose(0, 1)  # [H, T, bw]
    input_gate = torch.sigmoid(torch.baddbmm(lru.input_gate_bias[:, None, :], heads, lru.input_gate_weight))
    gate = torch.sigmoid(torch.baddbmm(lru.recurrent_gate_bias[:, None, :], heads, lru.recurrent_gate_weight))
    input_gate, gate = (g.transpose(0, 1).reshape(T, W) for g in (input_gate, gate))
    log_a = -8.0 * gate * nn.functional.softplus(lru.recurrent_param)
    a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
    multiplier = SqrtBoundDerivative.apply(1 - a_square)
    multiplier = reset + ~reset * multiplier
    return a * ~reset, (x * input_gate) * multiplier.type(x.dtype)


def tree_rglru_block_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """``RecurrentGemmaRecurrentBlock`` over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``."""
    x_in = hidden_states[0]
    y = module.act_fn(module.linear_y(x_in))
    x = module.linear_x(x_in)
    w = module.conv_1d.weight[:, 0]  # [W, width]
    x = tree_causal_conv1d(x, w, module.conv_1d.bias, path_window(packed, w.shape[1], tree_mask, x.device))
    a, normalized = rglru_gates(module.rg_lru, x, packed.position_ids.to(x.device))
    h = tree_scan((a, normalized), tree_levels(packed, tree_mask, x.device), rglru_scan)
    return module.linear_out(h * y)[None]
