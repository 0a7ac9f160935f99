"""xLSTM (xLSTM-7B's mLSTM blocks, transformers' PyTorch path) along a packed tree.

The mLSTM cell is a matrix memory with exponential input and sigmoid forget gates, stabilized by a
running maximum ``m`` (the model's own recurrent step, per head)::

    m_t = max(log sigmoid(f_t) + m_{t-1}, i_t)
    C_t = e^{log sigmoid(f_t) + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t^T v_t     (and n_t with k_t)
    h_t = (q_t / sqrt(d)) C_t / (max(|(q_t / sqrt(d)) . n_t|, e^{-m_t}) + eps)

The model's chunkwise kernel computes the same (its stabilizer is the same running maximum), so
one recurrence serves both of its modes. It runs level by level (:func:`~treetrain.models.scan.tree_scan`),
each node from its parent's final ``(C, n, m)``; the padding after a node is masked.

Hooks, no transformers file changed: ``xLSTMModel`` passes its blocks only a positional ``state``,
so on a tree call its instance forward (:func:`xlstm_decoder_forward`) runs the model's own
embedding, blocks and final norm with the tree (a :class:`~treetrain.models.scan.TreeArgs`) as each
block's state; the layer (``xLSTMLayer``, routed) runs its own forward with the tree as its initial
state, and its kernel backend (``xLSTMBackend``, an instance forward) runs the recurrence along the
tree when its initial state is the tree. So every projection, gate cap and norm is the model's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.models.scan import TreeArgs, tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["mlstm_scan", "tree_xlstm_layer_forward", "xlstm_backend_forward", "xlstm_decoder_forward"]


def mlstm_scan(eps: float):
    """``tree_scan``'s scan of the mLSTM: ``xs = (q, k, v, i, f)``, ``[n, L, H, D]`` and ``[n, L, H]``
    for the gate pre-activations; state ``(C [n, H, Dk, Dv], n [n, H, Dk], m [n, H])`` in float32
    (float64 for float64 inputs), as the model's step kernel keeps it."""

    def scan(xs, init, valid):
        q, k, v, ig, fg = xs
        acc = torch.promote_types(q.dtype, torch.float32)
        n_, _, H, Dk = q.shape
        if init is None:
            zeros = lambda *shape: torch.zeros(n_, H, *shape, dtype=acc, device=q.device)  # noqa: E731
            C, nvec, m = zeros(Dk, v.shape[-1]), zeros(Dk), zeros()
        else:
            C, nvec, m = init
        outs = []
        for t in range(q.shape[1]):
            f_log = F.logsigmoid(fg[:, t].to(acc))
            i_t = ig[:, t].to(acc)
            m_new = torch.maximum(f_log + m, i_t)
            f_act, i_act = torch.exp(f_log + m - m_new), torch.exp(i_t - m_new)
            qs, kt, vt = q[:, t].to(acc) * Dk**-0.5, k[:, t].to(acc), v[:, t].to(acc)
            kv = kt[..., :, None] * vt[..., None, :]
            C_new = f_act[..., None, None] * C + i_act[..., None, None] * kv
            n_new = f_act[..., None] * nvec + i_act[..., None] * kt
            num = (qs[..., None, :] @ C_new)[..., 0, :]
            den = torch.maximum((qs * n_new).sum(-1).abs(), torch.exp(-m_new)) + eps
            outs.append((num / den[..., None]).to(v.dtype))
            keep = valid[:, t, None]
            C = torch.where(keep[..., None, None], C_new, C)
            nvec = torch.where(keep[..., None], n_new, nvec)
            m = torch.where(keep, m_new, m)
        return torch.stack(outs, dim=1), (C, nvec, m)

    return scan


def xlstm_backend_forward(self: nn.Module, query, key, value, igate, fgate, c_initial=None, *args, **kwargs):
    """Instance ``forward`` of ``xLSTMBackend``: along the tree when its initial state is the tree
    (``c_initial``, a TreeArgs); else the class's own. ``query [1, H, T, Dk]``, gates ``[1, H, T]``
    -> ``(h [1, H, T, Dv], the tree)``."""
    if not isinstance(c_initial, TreeArgs):
        return type(self).forward(self, query, key, value, igate, fgate, c_initial, *args, **kwargs)
    tree = c_initial
    per_token = (x[0].transpose(0, 1) for x in (query, key, value, igate, fgate))  # [T, H, ...]
    levels = tree_levels(tree.packed, tree.mask, query.device)
    h = tree_scan(tuple(per_token), levels, mlstm_scan(self.config.eps))  # [T, H, Dv]
    return h.transpose(0, 1)[None], (tree, None, None)


def tree_xlstm_layer_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """``xLSTMLayer`` over a packed forest: its own forward with the tree as its initial state (its
    backend runs the recurrence along the tree). ``[1, T, hidden] -> [1, T, hidden]``."""
    out, _ = type(module).forward(module, hidden_states, (TreeArgs(packed, tree_mask), None, None))
    return out


def xlstm_decoder_forward(self: nn.Module, *args, **kwargs):
    """Instance ``forward`` of ``xLSTMModel``: on a tree call (``packed_tree=``) its embedding, blocks
    (each given the tree as its state) and final norm; otherwise the class's forward unchanged."""
    packed, mask = kwargs.pop("packed_tree", None), kwargs.pop("tree_mask", None)
    if packed is None:
        return type(self).forward(self, *args, **kwargs)
    from transformers.modeling_outputs import BaseModelOutput

    ids, embeds = kwargs.pop("input_ids", None), kwargs.pop("inputs_embeds", None)
    cached = kwargs.get("use_cache") or kwargs.get("cache") is not None
    if args or cached or (ids is None) == (embeds is None):
        raise ValueError("an xLSTM tree forward takes input_ids or inputs_embeds as keywords and no cache")
    hidden = self.embeddings(ids) if embeds is None else embeds
    tree = TreeArgs(packed, mask)
    for block in self.blocks:
        hidden, _ = block(hidden, tree)
    return BaseModelOutput(last_hidden_state=self.out_norm(hidden))
