"""ALiBi (BLOOM, MPT, Falcon): a linear position bias per head, measured along each token's path.

A backend takes the bias as ``alibi [Hq, T]``: per head, the model's own bias at each token's path
position (``alibi[h, t] = slope_h * position_ids[t]``, rounded as the model rounds it). The score
of query ``q`` and key ``k`` gets ``alibi[h, k] - alibi[h, q]``, which is ``slope_h * (pos[k] -
pos[q])``: the key's distance back along the query's path. Hugging Face's models add only the key's
term (``alibi[h, k]``): the query's term is one constant per softmax row, which the softmax ignores,
so both are the same attention; subtracting it keeps the scores small however long the paths are.
For a tree-visible pair the key lies on the query's path, so the distance is the one the path's own
forward sees. The bias is a constant (it takes no gradient).

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (positions ``0 1 2 3 2 3 1 2``), slope
``0.5``: query E (position 2) adds ``[-1, -0.5, 0]`` to its keys A, B, E; query G (position 1)
``[-0.5, 0]`` to A, G.
"""

from __future__ import annotations

import torch

__all__ = ["alibi_scores", "check_alibi", "tile_bias"]


def check_alibi(name: str, alibi: torch.Tensor, heads: int, tokens: int) -> None:
    """``alibi`` must be ``[Hq, T]`` floating point, without a gradient."""
    if alibi.shape != (heads, tokens):
        raise ValueError(f"{name}: alibi must be [Hq, T] = [{heads}, {tokens}], got {tuple(alibi.shape)}")
    if not alibi.is_floating_point():
        raise ValueError(f"{name}: alibi must be floating point, got {alibi.dtype}")
    if alibi.requires_grad:
        raise ValueError(f"{name}: the ALiBi bias is a constant of the positions; pass it detached")


def alibi_scores(alibi: torch.Tensor) -> torch.Tensor:
    """``[Hq, T]`` -> ``[Hq, T, T]``: ``alibi[h, k] - alibi[h, q]`` at ``[h, q, k]`` (reference: O(T^2))."""
    return alibi[:, None, :] - alibi[:, :, None]


def tile_bias(alibi: torch.Tensor, rows: torch.Tensor | slice, keys: torch.Tensor | slice) -> torch.Tensor:
    """``[Hq, len(rows), len(keys)]``: the bias of one tile of queries ``rows`` against ``keys``."""
    return alibi[:, keys][:, None, :] - alibi[:, rows][:, :, None]
