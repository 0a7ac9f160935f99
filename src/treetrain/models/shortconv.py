"""Short convolutions (LFM2, LFM2-MoE, LFM3) along a packed tree.

A short convolution carries no recurrent state: its output at a token is a depthwise causal conv of
the last ``L`` inputs along the token's own path (:mod:`treetrain.models.pathconv`; a node shorter
than ``L - 1`` reaches through its parent into its grandparents). LFM2's ``ShortConv`` gates around
it (its ``forward``)::

    B, C, x = in_proj(h).chunk(3)          # [T, H] each
    y = out_proj(C * conv(B * x))          # conv along each token's path

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``, ``L = 3``: E's conv reads ``A B E``
(``B * x`` at those tokens), G's reads ``_ A G`` (``_``: before the path start, a zero input): never
``E F``, which sit right before G in DFS order but on another branch.

Transformers' code paths: with no cache (the tree forward takes none) the layer's conv gets no
state, only zero left padding, which is what a path start gets here.
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.trees.packing import PackedTree

__all__ = ["SHORTCONV_LAYERS", "tree_shortconv_forward"]

# exact class name of every LFM-style gated short convolution (checked against transformers 5.24)
SHORTCONV_LAYERS = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def tree_shortconv_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """An LFM2 ``ShortConv`` over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``.

    ``tree_mask`` (a ``TreeMask``, optional) caches the conv windows for the other layers of the
    same forward.
    """
    x = hidden_states[0]
    B, C, xx = module.in_proj(x).chunk(3, dim=-1)
    w = module.conv.weight[:, 0]  # [H, L]
    window = path_window(packed, w.shape[1], tree_mask, x.device)
    conv = tree_causal_conv1d((B * xx).to(w.dtype), w, module.conv.bias, window).to(x.dtype)
    return module.out_proj(C * conv)[None]
