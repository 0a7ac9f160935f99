"""RWKV (v4) along a packed tree: the time-mix (``RwkvSelfAttention``) and the channel-mix
(``RwkvFeedForward``).

Both mix each token with the one before it (``time_shift``): along the token's own path, that is a
width-2 window (:func:`treetrain.models.pathconv.path_window`; zero before a path's first token).
The time-mix then runs the WKV recurrence per channel, a running softmax-weighted average of the
values with a decay ``w = -exp(time_decay)`` per step and a bonus ``u = time_first`` for the
current token, kept as ``(num, den, max)`` for stability (the model's own CPU recurrence)::

    o_t   = (e^{m - m'} num + e^{u + k_t - m'} v_t) / (e^{m - m'} den + e^{u + k_t - m'}),
            m' = max(m, u + k_t)
    state <- (e^{m + w - m''} num + e^{k_t - m''} v_t,  e^{m + w - m''} den + e^{k_t - m''},  m''),
             m'' = max(m + w, k_t)

run level by level (:func:`~treetrain.models.scan.tree_scan`), each node from its parent's final
state; the padding after a node is masked (a zero key would still decay and add to the state).

``RwkvModel`` passes its blocks no keyword arguments, only ``state``: :func:`rwkv_decoder_forward`
(the decoder's instance ``forward`` on a tree call) hands the tree to the layers as that ``state``
(a :class:`~treetrain.models.scan.TreeArgs`) and runs the model's own forward, which passes it on.

Example, paths ``[A B C]`` and ``[A D]``: B's and D's time-shift both read A; C's reads B.
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.models.pathconv import path_window
from treetrain.models.scan import TreeArgs, tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["rwkv_decoder_forward", "tree_rwkv_ffn_forward", "tree_rwkv_time_mix_forward", "wkv_scan"]


def _shifted(x: torch.Tensor, packed: PackedTree, tree_mask) -> torch.Tensor:
    """``x [T, C]`` -> the previous token's row along each path (zeros at a path's first token)."""
    prev = path_window(packed, 2, tree_mask, x.device)[:, 0]  # T where the path has none
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, prev)


def _mix(x: torch.Tensor, shifted: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    return x * ratio[0, 0] + shifted * (1 - ratio[0, 0])


def wkv_scan(w: torch.Tensor, u: torch.Tensor):
    """``tree_scan``'s scan of the WKV recurrence with decay ``w = -exp(time_decay)`` and bonus
    ``u = time_first`` (``[A]``): ``xs = (k, v)`` ``[n, L, A]``, state ``(num, den, max)``."""

    def scan(xs, init, valid):
        k, v = xs
        if init is None:  # as the model: float32 zeros, max -1e38
            num = torch.zeros(k.shape[0], k.shape[2], dtype=torch.float32, device=k.device)
            den, m = torch.zeros_like(num), torch.zeros_like(num) - 1e38
        else:
            num, den, m = init
        outs = []
        for t in range(k.shape[1]):
            kt, vt, keep = k[:, t].float(), v[:, t], valid[:, t, None]
            top = torch.maximum(m, kt + u)
            e1, e2 = torch.exp(m - top), torch.exp(kt + u - top)
            outs.append(((e1 * num + e2 * vt) / (e1 * den + e2)).to(v.dtype))
            top = torch.maximum(m + w, kt)
            e1, e2 = torch.exp(m + w - top), torch.exp(kt - top)
            num = torch.where(keep, e1 * num + e2 * vt, num)
            den = torch.where(keep, e1 * den + e2, den)
            m = torch.where(keep, top, m)
        return torch.stack(outs, dim=1), (num, den, m)

    return scan


def tree_rwkv_time_mix_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """``RwkvSelfAttention`` over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``."""
    x = hidden_states[0]
    shifted = _shifted(x, packed, tree_mask)
    k = module.key(_mix(x, shifted, module.time_mix_key))
    v = module.value(_mix(x, shifted, module.time_mix_value))
    r = torch.sigmoid(module.receptance(_mix(x, shifted, module.time_mix_receptance)))
    scan = wkv_scan(-torch.exp(module.time_decay), module.time_first)
    wkv = tree_scan((k, v), tree_levels(packed, tree_mask, x.device), scan)
    return module.output(r * wkv)[None]


def tree_rwkv_ffn_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """``RwkvFeedForward`` (the channel-mix: a token shift, no recurrence) over a packed forest."""
    x = hidden_states[0]
    shifted = _shifted(x, packed, tree_mask)
    key = torch.square(torch.relu(module.key(_mix(x, shifted, module.time_mix_key))))
    r = torch.sigmoid(module.receptance(_mix(x, shifted, module.time_mix_receptance)))
    return (r * module.value(key))[None]


def rwkv_decoder_forward(self: nn.Module, *args, **kwargs):
    """Instance ``forward`` of ``RwkvModel``: on a tree call (``packed_tree=`` given) the model's own
    forward with the tree as every block's ``state``; otherwise the class's forward unchanged."""
    packed, mask = kwargs.pop("packed_tree", None), kwargs.pop("tree_mask", None)
    if packed is None:
        return type(self).forward(self, *args, **kwargs)
    if kwargs.get("state") is not None or kwargs.get("use_cache"):
        raise ValueError("a tree forward takes no RWKV state (use_cache=False): states are routed per node")
    kwargs.pop("position_ids", None)  # RWKV has no positions; the tree's order is in `packed`
    kwargs.update(attention_mask=None, state=TreeArgs(packed, mask), use_cache=False)  # not RWKV's mask
    return type(self).forward(self, *args, **kwargs)
