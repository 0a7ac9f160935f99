"""Reference backend: a boolean ``[T, T]`` mask through SDPA. Works everywhere, with autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import TreeMask, check_inputs, dense_tree_mask


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TreeMask, scale: float
) -> torch.Tensor:
    """Tree attention with an explicit mask.

    Shapes: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` with ``Hq % Hkv == 0`` (GQA); returns ``[Hq, T, D]``.
    """
    check_inputs("dense_attention", q, k, v, mask)
    dense = mask.cached("dense", lambda: dense_tree_mask(mask.subtree_end))
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    # 4-D inputs: with 3-D ones SDPA takes a slow path that builds the T x T score matrix
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense, scale=scale)[0]
