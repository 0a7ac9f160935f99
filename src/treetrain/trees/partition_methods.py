"""The partitioning methods of :mod:`treetrain.trees.partition` on the path trie (the tree's
structure without tokens): ``beam_dp``, ``greedy_dfs``, ``single_path``, ``first_fit``, ``optimal``.

**On the trie.** Node ``u`` has ``len(u)`` tokens, ``depth(u)`` tokens from the root to its end and
``subtree(u)`` distinct tokens below and including it. A part's cost is the summed length of the
nodes its paths touch, so ``total = sum_u len(u) * n(u)`` with ``n(u)`` the number of parts
touching ``u``'s subtree. Two bins (candidate parts) merged at node ``u`` share ``depth(u)``
tokens. Paths ending on the same node, and a path ending inside another's route (a prefix path),
cost nothing extra next to it: only the trie's leaves are real items, and a prefix path joins a
part holding a leaf below it. Every path must fit the budget alone, else ``ValueError``.

**Methods** (``N`` nodes, ``L`` leaves; all return parts in the order of their first path):

- ``"beam_dp"`` (default; formerly ``"greedy"``): the paper's multi-path DP (Lift + bin packing,
  bottom-up) with each node's candidate states cut to the best ``beam``. A node packs the bins its
  children hand up, items from different children sharing its ``depth``, with a few packers
  (best-fit decreasing, balanced loads, minimum bin slack for a handful of items, no merge); states
  are ranked by
  their total cost if no more merging happened above. ``O(sum_u k_u log k_u)`` for ``k_u`` bins at
  ``u`` (near-linear: about the node count of the partitioned trees), times ``beam``.
  ``beam=1`` is plain bottom-up best-fit decreasing; the default is ``DEFAULT_BEAM`` up to
  ``BEAM_MAX_NODES`` nodes and 1 above, where it costs ~4x for < 0.1% (benchmarks/partition.py).
- ``"greedy_dfs"`` (formerly ``"dfs"``): the paper's greedy: children visited deepest-leaf first
  (leaves of similar depth together), leaves taken in that DFS order, a new part when the next
  leaf overflows. ``O(N log N)``.
- ``"single_path"``: the paper's single-path DP: every part is one whole subtree. With exact
  distinct-token costs the DP's ``max`` always keeps a subtree that fits, so its answer is the
  maximal fitting subtrees, found in one ``O(N)`` pass. Optimal when those are optimal, e.g. a
  forest of chains (per-turn samples of dialogues that fit).
- ``"first_fit"``: paths in input order, a new part when the next path overflows; what trainers
  that pack sequences do today. The baseline, not a recommendation.
- ``"optimal"``: exact minimum total, DP over subsets of leaves, ``O(3^L)``: ground truth for
  small trees (``L <= MAX_OPTIMAL_LEAVES``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treetrain.trees.binpack import (
    _MBS_MAX_ITEMS,
    _balanced,
    _best_fit_decreasing,
    _Bin,
    _Item,
    _min_bin_slack,
    _one_bin,
    _Packer,
    _separate,
    _State,
)
from treetrain.trees.tree import TrajectoryTree

__all__ = ["MAX_OPTIMAL_LEAVES"]

MAX_OPTIMAL_LEAVES = 14


@dataclass(frozen=True)
class _Skeleton:
    """Node arrays in DFS order (``N`` nodes): ``parent``, ``length``, ``depth`` (tokens from the
    root to the node's end), ``children`` (CSR: ``child_ids[child_ptr[u]:child_ptr[u + 1]]``, DFS
    order), ``leaves`` (nodes without children, ascending), ``path_end`` (node each path ends in).
    """

    parent: np.ndarray
    length: np.ndarray
    depth: np.ndarray
    child_ptr: np.ndarray
    child_ids: np.ndarray
    leaves: np.ndarray
    path_end: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parent.size)


def _skeleton(tree: TrajectoryTree) -> _Skeleton:
    parent = tree.node_parent.astype(np.int64)
    N = parent.size
    has_parent = parent >= 0
    child_ids = np.flatnonzero(has_parent)[np.argsort(parent[has_parent], kind="stable")]
    child_ptr = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent[has_parent], minlength=N), out=child_ptr[1:])
    return _Skeleton(
        parent=parent,
        length=(tree.node_end - tree.node_start).astype(np.int64),
        depth=(tree.positions[tree.node_end - 1] + 1).astype(np.int64),
        child_ptr=child_ptr,
        child_ids=child_ids,
        leaves=np.flatnonzero(np.diff(child_ptr) == 0),
        path_end=tree.path_leaf.astype(np.int64),
    )


def _paths_of(sk: _Skeleton, leaf_groups: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Leaf groups -> path-id groups. A path ending on an inner node (a prefix of others) goes with
    the first leaf below it, which is the first leaf at or after it in DFS order: free there.
    """
    group_of_leaf = np.full(sk.num_nodes, -1, dtype=np.int64)
    for g, leaves in enumerate(leaf_groups):
        group_of_leaf[np.asarray(leaves, dtype=np.int64)] = g
    first_leaf = sk.leaves[np.searchsorted(sk.leaves, sk.path_end)]
    group = group_of_leaf[first_leaf]
    assert (group >= 0).all(), "every leaf must be in a group"
    return _groups_from_labels(group, len(leaf_groups))


def _groups_from_labels(label: np.ndarray, n: int) -> list[np.ndarray]:
    """Path ids per label (ascending ids), groups ordered by their first path; empty ones dropped."""
    order = np.argsort(label, kind="stable")
    groups = np.split(order, np.cumsum(np.bincount(label, minlength=n))[:-1])
    groups = [g for g in groups if g.size]
    groups.sort(key=lambda g: int(g[0]))
    return groups


def _merged(group: list[_Item], depth: int) -> _Bin:
    """One bin of the items packed together at a node of this depth."""
    if len(group) == 1:
        return group[0][1]
    return (sum(it[0] for it in group) + depth, tuple(it[1] for it in group))


def _combos(child_states: list[list[_State]], width: int) -> list[list[_State]]:
    """The best state of every child, plus up to ``width - 1`` variants swapping one child to an
    alternative, cheapest swap first: a node's work does not grow with ``width x children``.
    """
    best = [s[0] for s in child_states]
    if width == 1:
        return [best]
    alternatives = [(s[j][0] - s[0][0], i, j) for i, s in enumerate(child_states) for j in range(1, len(s))]
    swaps = sorted(alternatives)[: width - 1]
    return [best] + [best[:i] + [child_states[i][j]] + best[i + 1 :] for _, i, j in swaps]


def _packers(n_items: int, below: int, cap: int, width: int, first: bool) -> tuple[_Packer, ...]:
    if below <= cap:  # everything fits one bin; the only other shape worth keeping is all apart
        return (_one_bin,) if width == 1 else (_one_bin, _separate)
    if width == 1 or not first:  # alternatives of the children get the main packer only
        return (_best_fit_decreasing,)
    extra = (_min_bin_slack,) if n_items <= _MBS_MAX_ITEMS else ()
    return (_best_fit_decreasing, _balanced, _separate, *extra)


def _node_states(child_states: list[list[_State]], depth: int, capacity: int, width: int) -> list[_State]:
    """Lift + bin packing at one node: the ``width`` best states of its subtree."""
    if len(child_states) == 1:  # one child (a path ends here): nothing to merge
        return child_states[0]
    cap = capacity - depth
    if width == 1:  # the plain greedy, without the beam's bookkeeping
        bins = [b for s in child_states for b in s[0][2]]
        total = sum(b[0] for b in bins) - (len(bins) - 1) * depth
        if total <= capacity:
            return [(total, 0, ((total, tuple(bins)),))]
        groups = _best_fit_decreasing([(b[0] - depth, b) for b in bins], cap)
        merged = tuple(_merged(g, depth) for g in groups)
        return [(sum(b[0] for b in merged), 0, merged)]
    found: dict[tuple[int, ...], _State] = {}
    for n, combo in enumerate(_combos(child_states, width)):
        items = [(b[0] - depth, b) for state in combo for b in state[2]]
        below = sum(it[0] for it in items)
        for pack in _packers(len(items), below, cap, width, n == 0):
            bins = tuple(_merged(g, depth) for g in pack(items, cap))
            totals = tuple(sorted(b[0] for b in bins))
            state = (sum(totals), -sum(t * t for t in totals), bins)
            if totals not in found or state[:2] < found[totals][:2]:
                found[totals] = state
    return sorted(found.values(), key=lambda s: s[:2])[:width]


@contextlib.contextmanager
def _cyclic_gc_paused():
    """The greedy allocates ~N small acyclic tuples that stay alive until the root; the cyclic
    collector would rescan them over and over (measured 2.5x slower on 100k nodes). Reference
    counting still frees everything.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _greedy(sk: _Skeleton, capacity: int, beam: int) -> list[list[int]]:
    """Bottom-up over the nodes (children before parents: reverse DFS order)."""
    with _cyclic_gc_paused():
        return _greedy_pass(sk, capacity, beam)


def _greedy_pass(sk: _Skeleton, capacity: int, beam: int) -> list[list[int]]:
    states: list[list[_State] | None] = [None] * sk.num_nodes
    depth = sk.depth.tolist()
    ptr, ids = sk.child_ptr.tolist(), sk.child_ids.tolist()
    for u in range(sk.num_nodes - 1, -1, -1):
        if ptr[u] == ptr[u + 1]:
            states[u] = [(depth[u], -depth[u] * depth[u], ((depth[u], u),))]
            continue
        kids = ids[ptr[u] : ptr[u + 1]]
        states[u] = _node_states([states[k] for k in kids], depth[u], capacity, beam)
        for k in kids:
            states[k] = None
    roots = np.flatnonzero(sk.parent < 0).tolist()
    top = _node_states([states[r] for r in roots], 0, capacity, beam)  # a forest merges at depth 0
    return [_leaves_of(b) for b in top[0][2]]


def _leaves_of(bin_: _Bin) -> list[int]:
    out, stack = [], [bin_]
    while stack:
        content = stack.pop()[1]
        if isinstance(content, tuple):
            stack.extend(content)
        else:
            out.append(content)
    return out


def _dfs(sk: _Skeleton, capacity: int) -> list[list[int]]:
    """Leaves in a DFS that visits the child with the deepest leaf first; a running part takes the
    next leaf if its new tokens (below the branch point with the previous leaf) still fit.
    """
    depth, parent = sk.depth.tolist(), sk.parent.tolist()
    ptr, ids = sk.child_ptr.tolist(), sk.child_ids.tolist()
    deepest = list(depth)
    for u in range(sk.num_nodes - 1, 0, -1):
        p = parent[u]
        if p >= 0 and deepest[u] > deepest[p]:
            deepest[p] = deepest[u]
    by_deepest = lambda nodes: sorted(nodes, key=lambda n: deepest[n])  # noqa: E731
    groups: list[list[int]] = []
    load = capacity + 1  # forces a new part at the first leaf
    stack = [(r, 0) for r in by_deepest(np.flatnonzero(sk.parent < 0).tolist())]  # (node, shared)
    branch = 0  # depth shared by the next leaf with the previous one
    while stack:
        u, above = stack.pop()
        branch = min(branch, above)
        if ptr[u] < ptr[u + 1]:
            stack.extend((k, depth[u]) for k in by_deepest(ids[ptr[u] : ptr[u + 1]]))
            continue
        new = depth[u] - branch
        if load + new <= capacity:
            groups[-1].append(u)
            load += new
        else:
            groups.append([u])
            load = depth[u]
        branch = depth[u]
    return groups


def _single_path(sk: _Skeleton, capacity: int, subtree_tokens: np.ndarray) -> list[list[int]]:
    """Maximal subtrees that fit: a node whose tokens above plus subtree fit, under a parent whose
    do not. Each becomes one part (its leaves).
    """
    above = sk.depth - sk.length
    fits = above + subtree_tokens <= capacity
    top = fits & ((sk.parent < 0) | ~fits[np.maximum(sk.parent, 0)])
    owner = np.where(top, np.arange(sk.num_nodes), -1).tolist()
    parent = sk.parent.tolist()
    for u in range(sk.num_nodes):  # parents precede children: inherit the owning subtree
        if owner[u] < 0 and parent[u] >= 0:
            owner[u] = owner[parent[u]]
    leaf_owner = np.asarray(owner)[sk.leaves]
    order = np.argsort(leaf_owner, kind="stable")
    cuts = np.flatnonzero(np.diff(leaf_owner[order])) + 1
    return [g.tolist() for g in np.split(sk.leaves[order], cuts)]


def _first_fit(sk: _Skeleton, capacity: int) -> np.ndarray:
    """Part label per path: input order, a new part when the next path's new tokens overflow."""
    parent, length = sk.parent.tolist(), sk.length.tolist()
    label = np.empty(sk.path_end.size, dtype=np.int64)
    seen: set[int] = set()
    part, load = -1, capacity + 1
    for i, end in enumerate(sk.path_end.tolist()):
        new, u = 0, end
        while u >= 0 and u not in seen:
            new, u = new + length[u], parent[u]
        if load + new > capacity:
            part, seen, load = part + 1, set(), 0
            new = int(sk.depth[end])
        u = end
        while u >= 0 and u not in seen:
            seen.add(u)
            u = parent[u]
        load += new
        label[i] = part
    return label


def _optimal(sk: _Skeleton, capacity: int) -> list[list[int]]:
    """Minimum total over all partitions of the leaves: ``best[S] = min over G in S holding S's
    lowest leaf, cost(G) <= capacity, of cost(G) + best[S - G]``. ``cost`` of all ``2^L`` subsets
    at once from a leaf-by-node ancestor matrix; the recursion visits ``3^L / 2`` pairs.
    """
    L = sk.leaves.size
    if L > MAX_OPTIMAL_LEAVES:
        raise ValueError(
            f"optimal: {L} leaves, the exact search is exponential; at most {MAX_OPTIMAL_LEAVES} "
            "(use method='beam_dp')"
        )
    ancestors = np.zeros((L, sk.num_nodes), dtype=bool)
    for i, leaf in enumerate(sk.leaves.tolist()):
        u = leaf
        while u >= 0:
            ancestors[i, u] = True
            u = int(sk.parent[u])
    member = (np.arange(1 << L)[:, None] >> np.arange(L)) & 1
    cost = ((member @ ancestors) > 0).astype(np.int64) @ sk.length
    cost = np.where(cost <= capacity, cost, -1).tolist()  # -1: over budget
    best, choice = [0] * (1 << L), [0] * (1 << L)
    for S in range(1, 1 << L):
        low = S & -S
        rest = S ^ low
        sub, b, arg = rest, None, 0
        while True:
            g = sub | low
            if cost[g] >= 0 and (b is None or cost[g] + best[S ^ g] < b):
                b, arg = cost[g] + best[S ^ g], g
            if not sub:
                break
            sub = (sub - 1) & rest
        best[S], choice[S] = b, arg
    groups, S = [], (1 << L) - 1
    while S:
        g = choice[S]
        groups.append([int(sk.leaves[i]) for i in range(L) if g >> i & 1])
        S ^= g
    return groups
