"""MiniMax lightning attention along a packed tree.

Per head, lightning attention is a linear recurrence with a fixed decay ``lam = exp(-slope)``::

    S_t = lam * S_{t-1} + k_t^T v_t        (S: [D, D], k_t, v_t: [1, D])
    o_t = q_t S_t

The model computes it in blocks of ``block_size`` (within a block the pairs ``(i, j <= i)`` weigh
``exp(-slope (i - j))``, across blocks the state carries over); so does :func:`lightning_rule`,
with one change: the decay of a step is ``exp(g_t)``, ``g_t = -slope`` on a node's real steps and
``0`` on the padding after it (``tree_scan``'s ``valid``), so a padded step keeps the state. A
fixed decay applied to the padding would shrink every node's final state by ``lam`` per padded
step: it must be masked. Every node starts from its parent's final state (``tree_scan``).

The layer forward (:func:`tree_lightning_forward`) reuses the module's own projections, norm,
output gate and output projection; the decays are the module's ``slope_rate``.

Example, one head, ``lam = 1/2``, ``q = k = v = 1`` (``D = 1``), a node of 2 steps from its
parent's state ``S = 4``: ``S_1 = 2 + 1 = 3``, ``S_2 = 1.5 + 1 = 2.5``, outputs ``[3, 2.5]``;
padded to 4 steps its final state stays ``2.5`` (``g = 0``: ``S <- 1 * S + 0``).
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.models.scan import tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["lightning_rule", "lightning_scan", "tree_lightning_forward"]


def lightning_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    init: torch.Tensor | None = None,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decayed linear recurrence over a batch, in blocks: ``(o [n, L, H, D], S [n, H, D, D])``.

    q, k, v ``[n, L, H, D]``; g ``[n, L, H]`` the log decay of each step (``<= 0``); init
    ``[n, H, D, D]`` or None (zeros). Within a block of ``C`` steps with ``b = cumsum(g)``:
    ``o_i = sum_{j <= i} (q_i . k_j) exp(b_i - b_j) v_j + exp(b_i) q_i S``, then
    ``S <- exp(b_C) S + sum_j exp(b_C - b_j) k_j^T v_j``.
    """
    n, L, H, D = q.shape
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))  # [n, H, L, ...]
    S = q.new_zeros(n, H, D, v.shape[-1]) if init is None else init.to(q.dtype)
    outs = []
    for s in range(0, L, block):
        e = min(s + block, L)
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
        b = torch.cumsum(g[:, :, s:e], dim=-1)  # [n, H, C]
        C = e - s
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")))
        out = ((qc @ kc.transpose(-1, -2)) * decay) @ vc + (qc * b.exp()[..., None]) @ S
        outs.append(out)
        last = b[..., -1:]  # [n, H, 1]
        S = last.exp()[..., None] * S + (kc * (last - b).exp()[..., None]).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2).transpose(1, 2), S


def lightning_scan(slope: torch.Tensor, block: int):
    """The :func:`~treetrain.models.scan.tree_scan` scan of lightning attention with per-head
    ``slope [H]``: padded steps get ``g = 0`` (the state is kept)."""

    def scan(xs, init, valid):
        q, k, v = xs
        g = -slope.to(q.dtype) * valid[..., None].to(q.dtype)  # [n, L, H]
        return lightning_rule(q, k, v, g, init, block)

    return scan


def tree_lightning_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """``MiniMaxLightningAttention`` over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``."""
    x = hidden_states[0]
    T, H, D = x.shape[0], module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(x)).reshape(T, H, 3 * D)
    q, k, v = torch.split(qkv, D, dim=-1)
    slope = module.slope_rate.reshape(H)
    levels = tree_levels(packed, tree_mask, x.device)
    out = tree_scan((q, k, v), levels, lightning_scan(slope, module.block_size))  # [T, H, D]
    out = module.norm(out.reshape(1, T, H * D))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out)
