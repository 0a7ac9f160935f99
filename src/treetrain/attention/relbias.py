"""A learned bias per query and path distance (Inkling), measured along each token's path.

A backend takes the bias as ``rel_bias [Hq, T, E]``: row ``rel_bias[h, q]`` is query ``q``'s own bias
for the keys ``0 .. E - 1`` steps back (Inkling computes it from the query's hidden state: a
differentiable input, not a constant). The score of query ``q`` and key ``k`` gets
``rel_bias[h, q, pos[q] - pos[k]]`` when that distance is below ``E``, nothing beyond, where
``pos`` is the token's index in its own path (``TreeMask.position_ids``). A tree-visible key is an
ancestor of the query on the query's path, so ``pos[q] - pos[k]`` is exactly the distance the
path's own forward sees, and a query reaches each distance through at most one key: the gradient of
``rel_bias[h, q, d]`` is the score gradient of that one key (zero when no visible key is ``d`` back).

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (positions ``0 1 2 3 2 3 1 2``), ``E = 2``:
query E (position 2) adds ``rel[h, E, 1]`` to key B and ``rel[h, E, 0]`` to itself, nothing to A
(2 back); query G adds ``rel[h, G, 1]`` to A; C and D, 0 and 1 back in DFS order, are not visible.
"""

from __future__ import annotations

import torch

__all__ = ["check_rel_bias", "rel_bias_scores", "rel_bias_tile", "rel_bias_tile_grad"]


def check_rel_bias(name: str, rel_bias: torch.Tensor, heads: int, tokens: int, position_ids) -> None:
    """``rel_bias`` must be ``[Hq, T, E]`` floating point, with the path positions given."""
    if rel_bias.dim() != 3 or rel_bias.shape[:2] != (heads, tokens) or rel_bias.shape[2] < 1:
        raise ValueError(
            f"{name}: rel_bias must be [Hq, T, E] = [{heads}, {tokens}, E >= 1], got {tuple(rel_bias.shape)}"
        )
    if not rel_bias.is_floating_point():
        raise ValueError(f"{name}: rel_bias must be floating point, got {rel_bias.dtype}")
    if position_ids is None:
        raise ValueError(f"{name}: a relative position bias needs TreeMask.position_ids (the path positions)")


def _distance(pos: torch.Tensor, rows, keys, extent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, near)``, ``[len(rows), len(keys)]`` each: ``pos[q] - pos[k]`` clamped into
    ``[0, extent)``, and whether it lies there unclamped."""
    d = pos[rows][:, None] - pos[keys][None, :]
    return d.clamp(0, extent - 1), (d >= 0) & (d < extent)


def rel_bias_tile(rel_bias: torch.Tensor, pos: torch.Tensor, rows, keys) -> torch.Tensor:
    """``[Hq, len(rows), len(keys)]``: the bias of queries ``rows`` against ``keys`` (a slice or an
    index tensor each; ``pos [T]`` on ``rel_bias``'s device), zero where the distance is negative
    or ``E`` or more. Differentiable in ``rel_bias``."""
    index, near = _distance(pos, rows, keys, rel_bias.shape[2])
    table = rel_bias[:, rows]  # [Hq, rows, E]
    bias = table.gather(2, index.expand(table.shape[0], -1, -1))
    return bias.masked_fill(~near, 0.0)


def rel_bias_scores(rel_bias: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[Hq, T, T]``: the bias of every (query, key) pair (reference: ``O(T^2)``)."""
    every = slice(None)
    return rel_bias_tile(rel_bias, pos, every, every)


def rel_bias_tile_grad(grad: torch.Tensor, ds: torch.Tensor, pos: torch.Tensor, rows: slice, keys) -> None:
    """``grad [Hq, T, E] += `` the scores' gradient ``ds [Hq, len(rows), len(keys)]`` of one tile,
    each at its (query, distance); pairs at distance ``E`` or more (or negative) add nothing.

    ``ds`` must be zero at pairs the mask hides (their probability is zero), so a query's keys at
    one distance add up to the one visible key's.
    """
    index, near = _distance(pos, rows, keys, grad.shape[2])
    heads = grad.shape[0]
    grad[:, rows].scatter_add_(2, index.expand(heads, -1, -1), ds.masked_fill(~near, 0.0).to(grad.dtype))
