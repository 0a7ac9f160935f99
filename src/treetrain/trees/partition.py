"""Budgeted partitioning: split a ``TrajectoryTree`` into parts of whole paths that each fit a token
budget, recomputing as little shared prefix as possible; then pack small trees and parts together.

**The problem.** A part is a set of whole input paths; its cost is its number of distinct tokens
(what one tree forward over it computes). Given ``capacity``, find parts of cost ``<= capacity``,
every path in exactly one part, with the least total cost. A prefix shared by paths in different
parts is recomputed once per part. Example, paths ``P0 = A B C D``, ``P1 = A B E F``,
``P2 = A G H`` (8 distinct tokens), ``capacity = 6``::

    {P0, P1} = A B C D E F (6) + {P2} = A G H (3)    total  9   (optimal)
    {P0, P2} = A B C D G H (6) + {P1} = A B E F (4)    total 10   (A B recomputed)

**Methods** (``beam_dp``, the default; ``greedy_dfs``, ``single_path``, ``first_fit``, ``optimal``):
:mod:`treetrain.trees.partition_methods`. All return parts in the order of their first path.

**Loss normalization must be global.** A partition changes which paths share a forward, never
the loss, provided the loss is a sum over paths with weights fixed for the whole batch: compute
every denominator (predicted-token count of a token-mean, path count of a sequence-mean, group
statistics of GRPO advantages) over the whole batch *before* running any part, then for each part
backpropagate ``sum_{p in part} w_p * loss_p / N_global`` and let gradients accumulate. The sum
over parts is then the unpartitioned loss term for term (each path is in exactly one part), so
the accumulated gradient equals the unpartitioned tree's for any partition. Dividing by a part's
own count instead weights paths by the part they landed in and changes the gradient. Per-path
data travels with the part (``tree.subset`` keeps metadata); ``part.path_ids[j]`` is the index in
the original tree of the part's path ``j``, for anything indexed by the batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from treetrain.trees.binpack import _best_fit_decreasing
from treetrain.trees.partition_methods import (
    _dfs,
    _first_fit,
    _greedy,
    _groups_from_labels,
    _optimal,
    _paths_of,
    _single_path,
    _skeleton,
)
from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "BEAM_MAX_NODES",
    "DEFAULT_BEAM",
    "DEPRECATED_METHODS",
    "METHODS",
    "lower_bound",
    "pack_microbatches",
    "partition",
    "partition_stats",
    "plan",
    "resolve_method",
]


METHODS = ("beam_dp", "greedy_dfs", "single_path", "first_fit", "optimal")


# old names, kept as aliases that warn: "greedy" was the beam DP, "dfs" the paper's greedy
DEPRECATED_METHODS = {"greedy": "beam_dp", "dfs": "greedy_dfs"}
DEFAULT_BEAM = 4
BEAM_MAX_NODES = 20_000  # above this, beam=None means 1: the beam costs ~4x and gained < 0.1% there


def _check(tree: TrajectoryTree, capacity: int) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity: expected a positive number of tokens, got {capacity!r}")
    lengths = tree.path_lengths
    i = int(np.argmax(lengths))
    if lengths[i] > capacity:
        raise ValueError(
            f"path {i} has {int(lengths[i])} tokens, more than the capacity of {capacity}: "
            "a path is never split, so the budget must hold the longest one"
        )


def resolve_method(method: str) -> str:
    """``method`` checked against ``METHODS``; an old name warns and maps to its new one."""
    if method in DEPRECATED_METHODS:
        new = DEPRECATED_METHODS[method]
        warnings.warn(
            f"partition method {method!r} is deprecated, use {new!r} (the name says what it does)",
            DeprecationWarning,
            stacklevel=3,
        )
        return new
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    return method


def plan(
    tree: TrajectoryTree, capacity: int, method: str = "beam_dp", *, beam: int | None = None
) -> list[np.ndarray]:
    """Path ids (indices into ``tree``) of each part, ascending; parts ordered by their first path.

    The assignment only: :func:`partition` builds the part trees from it.

    >>> t = TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 5, 6], [1, 2, 7, 8]])
    >>> [g.tolist() for g in plan(t, 6)]
    [[0, 2], [1]]
    """
    _check(tree, capacity)
    method = resolve_method(method)
    if tree.num_tokens <= capacity:
        return [np.arange(tree.num_paths)]
    sk = _skeleton(tree)
    if method == "first_fit":
        label = _first_fit(sk, capacity)
        return _groups_from_labels(label, int(label.max()) + 1)
    if method == "beam_dp":
        if beam is None:
            beam = DEFAULT_BEAM if sk.num_nodes <= BEAM_MAX_NODES else 1
        groups = _greedy(sk, capacity, max(1, int(beam)))
    elif method == "greedy_dfs":
        groups = _dfs(sk, capacity)
    elif method == "single_path":
        groups = _single_path(sk, capacity, tree.node_subtree_end - tree.node_start)
    else:
        groups = _optimal(sk, capacity)
    return _paths_of(sk, groups)


def partition(
    tree: TrajectoryTree, capacity: int, method: str = "beam_dp", *, beam: int | None = None
) -> list[TrajectoryTree]:
    """Split ``tree`` into parts of whole paths, each with at most ``capacity`` distinct tokens.

    Every path (duplicates and prefix paths included) lands in exactly one part; ``part.path_ids``
    index the original tree (composed through earlier subsets); metadata travels with the paths.
    A tree that fits is returned as ``[tree]``. Raises ``ValueError`` if a path alone exceeds the
    capacity. ``method``: see the module docstring; ``beam``: states kept per node by ``beam_dp``.
    """
    groups = plan(tree, capacity, method, beam=beam)
    if len(groups) == 1:
        return [tree]
    return [tree.subset(g) for g in groups]


def pack_microbatches(
    trees: Sequence[TrajectoryTree],
    capacity: int,
    method: str = "beam_dp",
    *,
    beam: int | None = None,
) -> list[list[TrajectoryTree]]:
    """Group trees into micro-batches of at most ``capacity`` tokens each (one forward per
    micro-batch, e.g. ``pack(mb)``), so many small trees do not become many tiny forwards.

    A tree over the capacity is first partitioned with ``method`` and its parts packed like any
    other tree (a path over the capacity raises). Trees in one micro-batch share nothing, so this
    is plain bin packing of ``num_tokens``: best-fit decreasing. Output is order-stable:
    micro-batches ordered by their first item, items in input order (a tree's parts where the tree
    was). ``O(n log n)`` for ``n`` items. Sizes ``[5, 2, 4, 3]``, capacity 7 ->
    ``[[t0, t1], [t2, t3]]``.
    """
    items: list[TrajectoryTree] = []
    for tree in trees:
        items.extend(partition(tree, capacity, method, beam=beam))
    if not items:
        return []
    sized = [(t.num_tokens, i) for i, t in enumerate(items)]
    groups = _best_fit_decreasing(sized, capacity)
    order = sorted(sorted(i for _, i in g) for g in groups)
    return [[items[i] for i in g] for g in order]


def partition_stats(tree: TrajectoryTree, parts: Sequence[TrajectoryTree]) -> dict:
    """Reuse metrics of a partition (paper v3, section 4.1).

    tree_tokens (distinct tokens, perfect reuse), baseline_tokens (every path alone),
    partitioned_tokens (sum over parts), por = 1 - tree / baseline (what perfect reuse saves),
    err = (baseline - partitioned) / (baseline - tree) (the share of it realized; 1.0 when
    por = 0), num_parts, max_part_tokens. Example: paths ``A B C D``, ``A B E F``, ``A G H`` in
    parts ``{0, 1}``, ``{2}``: tree 8, baseline 11, partitioned 9, por 3/11, err 2/3.
    """
    tree_tokens, baseline = tree.num_tokens, tree.num_path_tokens
    partitioned = sum(p.num_tokens for p in parts)
    return {
        "tree_tokens": tree_tokens,
        "baseline_tokens": baseline,
        "partitioned_tokens": partitioned,
        "por": 1.0 - tree_tokens / baseline,
        "err": 1.0 if baseline == tree_tokens else (baseline - partitioned) / (baseline - tree_tokens),
        "num_parts": len(parts),
        "max_part_tokens": max((p.num_tokens for p in parts), default=0),
    }


def lower_bound(tree: TrajectoryTree, capacity: int) -> int:
    """A lower bound on the optimal total, for trees too large for ``method="optimal"``.

    Every part touching ``u``'s subtree holds at most ``capacity - depth(u)`` tokens below ``u``,
    and the tokens below ``u`` over all parts are ``sum_w len(w) n(w)`` (``w`` strictly below).
    So ``n(u) >= ceil(sum_w len(w) n(w) / (capacity - depth(u)))`` and ``n(u) >= n(child)``,
    bottom-up with the bounds of the ``n(w)``; the bound is ``sum_u len(u) n(u)``. ``O(N)``.
    """
    _check(tree, capacity)
    sk = _skeleton(tree)
    n = np.ones(sk.num_nodes, dtype=np.int64)
    below = np.zeros(sk.num_nodes, dtype=np.int64)  # sum of len(w) * n(w) strictly below
    parent, length, depth = sk.parent.tolist(), sk.length.tolist(), sk.depth.tolist()
    n_l, below_l = n.tolist(), below.tolist()
    for u in range(sk.num_nodes - 1, -1, -1):
        if below_l[u]:
            n_l[u] = max(n_l[u], -(-below_l[u] // (capacity - depth[u])))
        p = parent[u]
        if p >= 0:
            n_l[p] = max(n_l[p], n_l[u])
            below_l[p] += below_l[u] + length[u] * n_l[u]
    return int(np.dot(sk.length, n_l))
