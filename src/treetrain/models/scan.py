"""Any recurrence along a packed tree: each node starts from its parent's final state.

A state-carrying layer (Gated DeltaNet, Mamba2, Mamba, linear attention, ...) supplies only its
*scan*: the recurrence over a padded batch of node segments from given initial states. This module
schedules the forest level by level (:func:`treetrain.models.gdn.build_levels`: nodes of one level
are independent given their parents, so a level's nodes run as one batch, or a few batches of
similar length) and hands every node its parent's final state.

Contract of a scan, for one group of ``n`` nodes padded to ``L`` steps::

    scan(xs, init, valid) -> (out, final)
    xs     tuple of [n, L, ...]   the inputs, zero past each node's end
    init   [n, *state] or None    the parents' final states (None: roots, start from zeros)
    valid  [n, L] bool            True on a node's real steps
    out    [n, L, ...]            outputs (padded rows are dropped)
    final  [n, *state]            the state after each node's last *real* step

A family whose zero input is an identity step (the gated delta rule with ``g = beta = 0``, Mamba's
``dt = 0``) can ignore ``valid``; one with a fixed decay per step must mask it. A state may also be
a tuple of tensors (every one ``[n, ...]``).

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``: level 0 runs ``[A]`` from zeros, level 1
runs ``[G H]`` and ``[B]`` (padded to 2 steps) from A's final state twice, level 2 runs ``[C D]``
and ``[E F]`` from B's final state twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treetrain.trees.packing import PackedTree

__all__ = [
    "Level",
    "Scan",
    "TreeArgs",
    "TreeLevels",
    "build_levels",
    "length_groups",
    "tree_levels",
    "tree_scan",
]

State = torch.Tensor | tuple[torch.Tensor, ...]
Scan = Callable[[tuple[torch.Tensor, ...], State | None, torch.Tensor], tuple[torch.Tensor, State]]


# ---- the level schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """The ``n`` nodes of one tree level, in the order their final states are stacked.

    groups: per length group, ``token_index [n_g, L_g]`` int64: the DFS index of each node's
      steps, ``T`` (a zero row) past its end. Nodes of similar length share a group so padding stays
      bounded; each group is one kernel call.
    parent_row ``[n]`` int64: row of each node's parent among the previous level's nodes (level 0:
      zeros, unused).
    cu_seqlens ``[n + 1]``, flat_index ``[sum lengths]`` int64: the unpadded (varlen) layout.
    """

    groups: tuple[torch.Tensor, ...]
    parent_row: torch.Tensor
    cu_seqlens: torch.Tensor
    flat_index: torch.Tensor


@dataclass(frozen=True)
class TreeLevels:
    """Level-by-level schedule of a packed forest, shared by every recurrent layer of a forward.

    padded_row ``[T]``: row of each DFS token in the groups' padded outputs, flattened and
    concatenated (level by level, group by group); varlen_row ``[T]``: the same, unpadded.
    """

    levels: tuple[Level, ...]
    padded_row: torch.Tensor
    varlen_row: torch.Tensor
    num_tokens: int

    @property
    def num_padded(self) -> int:
        """Tokens the padded (PyTorch) path computes, padding included."""
        return sum(g.numel() for lv in self.levels for g in lv.groups)


def node_depth(parent: np.ndarray) -> np.ndarray:
    """Level of every node (roots 0) from ``parent [N]`` (``-1`` for roots) by pointer jumping.

    O(N log depth) vectorized steps: ``depth`` accumulates the hops to the current ``anc``,
    and ``anc`` jumps to its own ancestor, doubling the distance each round.
    """
    depth = (parent >= 0).astype(np.int64)
    anc = parent.copy()
    while (live := anc >= 0).any():
        a = anc[live]
        depth[live] += depth[a]
        anc[live] = anc[a]
    return depth


def length_groups(lengths: np.ndarray, slack: int | None) -> list[int]:
    """Split nodes sorted by decreasing length into runs that pad cheaply; returns the run sizes.

    A node joins the current run (padded to the run's longest, ``L``) if that at most doubles it
    (``2 * n >= L``), or if the run stays within ``slack`` padded tokens (small calls cost more in
    overhead than in padding). So padding is at most 2x outside runs of ``slack`` tokens, and a
    level takes about ``log2(longest / shortest)`` calls. ``slack=None``: one run.
    Example: lengths ``[500, 3, 2, 1, 1]``, slack 64 -> ``[1, 4]`` (5 rows of 500 would be 2500).
    """
    if slack is None or lengths.size == 0:
        return [int(lengths.size)]
    sizes, count, longest = [], 0, 0
    for n in lengths.tolist():
        if count and 2 * n < longest and (count + 1) * longest > slack:
            sizes.append(count)
            count = 0
        if count == 0:
            longest = n
        count += 1
    sizes.append(count)
    return sizes


def build_levels(
    node_start: torch.Tensor,
    node_end: torch.Tensor,
    node_parent: torch.Tensor,
    device=None,
    pad_slack: int | None = 256,
) -> TreeLevels:
    """The level schedule from ``PackedTree.node_start / node_end / node_parent`` (``[N]`` each).

    Within a level, nodes are ordered by decreasing length and split by :func:`length_groups`.
    Example (the module docstring's tree): ``node_start = [0 1 2 4 6]``, ``node_end = [1 2 4 6 8]``,
    ``node_parent = [-1 0 1 1 0]`` -> one group per level: ``[[0]]``, ``[[6 7] [1 8]]`` (G H, then
    B), ``[[2 3] [4 5]]`` with ``parent_row = [1 1]`` (B is row 1 of level 1).
    """
    start = node_start.detach().cpu().numpy().astype(np.int64)
    end = node_end.detach().cpu().numpy().astype(np.int64)
    parent = node_parent.detach().cpu().numpy().astype(np.int64)
    device = node_start.device if device is None else device
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    T = int(end.max()) if end.size else 0
    depth = node_depth(parent)
    lengths = end - start
    row_in_level = np.zeros(start.size, dtype=np.int64)
    padded_row = np.empty(T, dtype=np.int64)
    varlen_row = np.empty(T, dtype=np.int64)
    levels = []
    padded_off = varlen_off = 0
    for d in range(int(depth.max()) + 1 if depth.size else 0):
        nodes = np.flatnonzero(depth == d)
        nodes = nodes[np.argsort(-lengths[nodes], kind="stable")]  # longest first, then DFS order
        row_in_level[nodes] = np.arange(nodes.size)
        lens = lengths[nodes]
        groups, first = [], 0
        for size in length_groups(lens, pad_slack):
            sel = slice(first, first + size)
            steps = np.arange(max(int(lens[sel].max()), 1))
            index = np.where(steps < lens[sel, None], start[nodes[sel], None] + steps, T)
            real = index < T
            padded_row[index[real]] = padded_off + np.flatnonzero(real.ravel())
            padded_off += index.size
            groups.append(as_t(index))
            first += size
        flat_index = np.concatenate([np.arange(s, e) for s, e in zip(start[nodes], end[nodes])])
        varlen_row[flat_index] = varlen_off + np.arange(flat_index.size)
        varlen_off += flat_index.size
        parent_row = row_in_level[np.maximum(parent[nodes], 0)] if d else np.zeros(nodes.size, np.int64)
        levels.append(
            Level(
                groups=tuple(groups),
                parent_row=as_t(parent_row),
                cu_seqlens=as_t(np.concatenate([[0], np.cumsum(lens)])),
                flat_index=as_t(flat_index),
            )
        )
    return TreeLevels(
        levels=tuple(levels), padded_row=as_t(padded_row), varlen_row=as_t(varlen_row), num_tokens=T
    )



# ---- the scan along it --------------------------------------------------------------------------


def _pad_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _map(state: State, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
    return tuple(fn(s) for s in state) if isinstance(state, tuple) else fn(state)


def _cat(states: list[State]) -> State:
    if len(states) == 1:
        return states[0]
    if isinstance(states[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*states))
    return torch.cat(states)


def tree_scan(inputs: Sequence[torch.Tensor], levels: TreeLevels, scan: Scan) -> torch.Tensor:
    """Run ``scan`` along every root-to-leaf path of a packed forest: ``[T, ...]`` outputs.

    inputs: ``[T, ...]`` tensors in DFS order (the same ``T`` as ``levels``). Every node's scan starts
    from its parent's final state (roots: ``init=None``). The result equals running ``scan`` over
    each path alone, token by token (``tests/test_scan.py``).
    """
    T = levels.num_tokens
    padded = [_pad_row(x) for x in inputs]  # row T: the zero input past a node's end
    outs, state = [], None
    for d, lv in enumerate(levels.levels):
        init = _map(state, lambda s, rows=lv.parent_row: s.index_select(0, rows)) if d else None
        states, first = [], 0
        for idx in lv.groups:
            n = idx.shape[0]
            group_init = None if init is None else _map(init, lambda s, a=first, b=first + n: s[a:b])
            out, final = scan(tuple(x[idx] for x in padded), group_init, idx < T)
            outs.append(out.flatten(0, 1))
            states.append(final)
            first += n
        state = _cat(states)
    return torch.cat(outs).index_select(0, levels.padded_row)


@dataclass(frozen=True, eq=False)
class TreeArgs:
    """The tree, handed to routed layers through an argument their decoder passes on unchanged,
    where it passes them no keyword arguments of its own (RWKV's and xLSTM's ``state``)."""

    packed: PackedTree
    mask: object | None = None  # the forward's TreeMask (caches, context parallel), or None


def tree_levels(packed: PackedTree, tree_mask=None, device=None) -> TreeLevels:
    """The level schedule of ``packed``, built once per forward (cached in ``tree_mask``)."""
    device = packed.node_start.device if device is None else device

    def build() -> TreeLevels:
        return build_levels(packed.node_start, packed.node_end, packed.node_parent, device=device)

    return tree_mask.cached(("levels", str(device)), build) if tree_mask is not None else build()

