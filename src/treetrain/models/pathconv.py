"""The short causal convolution along each token's own path (Gated DeltaNet's, Mamba's and Mamba2's
conv1d before the recurrence, LFM2's short convolution).

The conv reads the last ``k`` *inputs* along a token's path, which do not depend on any recurrent
state: it runs for all ``T`` tokens at once, as a gather of each token's ``k - 1`` path predecessors
(``PackedTree.prev`` chained; a parent shorter than ``k - 1`` is reached through, into the
grandparents).

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``::

    DFS index           0  1  2  3  4  5  6  7
    token               A  B  C  D  E  F  G  H
    prev               -1  0  1  2  1  4  0  6
    conv window, k = 3  (T = 8 marks "before the path start", read as zeros)
      E (4):  [0 1 4] = A B E        G (6):  [8 0 6] = _ A G
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treetrain.trees.packing import PackedTree

__all__ = ["conv_window_index", "path_conv1d_reference", "path_window", "tree_causal_conv1d"]


def conv_window_index(prev: torch.Tensor, width: int) -> torch.Tensor:
    """``[T, width]``: column ``width - 1`` is the token itself, column ``j`` its ``(width - 1 - j)``-th
    predecessor along its path; ``T`` where the path has no such token (read as a zero input).

    ``prev [T]`` is ``PackedTree.prev`` (``-1`` at a root's first token). Example (module docstring),
    ``width = 3``: row 4 (E) is ``[0 1 4]``, row 6 (G) is ``[8 0 6]``.
    """
    T = prev.numel()
    cols = [torch.arange(T, device=prev.device)]
    for _ in range(width - 1):
        last = cols[-1]
        nxt = prev.index_select(0, last.clamp(max=T - 1))
        cols.append(torch.where((last < T) & (nxt >= 0), nxt, T))
    return torch.stack(cols[::-1], dim=1)


class _TreeConv1d(torch.autograd.Function):
    """``out[t, c] = bias[c] + sum_j weight[c, j] * x[index[t, j], c]`` (``x[T] = 0``).

    Saves only ``x`` and the index (not the ``[T, width, C]`` windows); backward re-gathers one
    column at a time.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, index):
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])])
        out = x.new_zeros(x.shape) if bias is None else bias.expand_as(x).clone()
        for j in range(weight.shape[1]):
            out += xp.index_select(0, index[:, j]) * weight[:, j]
        ctx.save_for_backward(x, weight, index)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, index = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = x.new_zeros(x.shape[0] + 1, x.shape[1]) if need_x else None
        gw = torch.empty_like(weight) if need_w else None
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])]) if need_w else None
        for j in range(weight.shape[1]):
            if need_x:
                gx.index_add_(0, index[:, j], g * weight[:, j])
            if need_w:
                gw[:, j] = (g * xp.index_select(0, index[:, j])).sum(0)
        gb = g.sum(0) if (need_b and ctx.has_bias) else None
        return (gx[:-1] if need_x else None), gw, gb, None


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal conv along each token's path, before the activation.

    x ``[T, C]`` (DFS order), weight ``[C, width]`` (``nn.Conv1d.weight[:, 0]``), bias ``[C]`` or
    None, window ``[T, width]`` from :func:`conv_window_index` -> ``[T, C]``. On a single path it is
    ``F.conv1d(x.T[None], weight[:, None], bias, padding=width - 1, groups=C)[..., :T]``.
    """
    if weight.shape[1] != window.shape[1]:
        raise ValueError(f"conv width {weight.shape[1]} does not match the window index {window.shape[1]}")
    return _TreeConv1d.apply(x, weight, bias, window)


def path_window(packed: PackedTree, width: int, tree_mask=None, device=None) -> torch.Tensor:
    """``[T, width]`` conv window of every token along its own path (:func:`conv_window_index`),
    built once per forward and width (cached in ``tree_mask``)."""
    device = packed.prev.device if device is None else device

    def build() -> torch.Tensor:
        return conv_window_index(packed.prev.to(device), width)

    return tree_mask.cached(("window", width, str(device)), build) if tree_mask is not None else build()


def path_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One path's causal depthwise conv as transformers computes it: x ``[L, C]`` -> ``[L, C]``."""
    L, C = x.shape
    w = weight.shape[1]
    return F.conv1d(x.T[None], weight[:, None], bias, padding=w - 1, groups=C)[0, :, :L].T

