"""Any recurrence along a packed tree: each node starts from its parent's final state.

A state-carrying layer (Gated DeltaNet, Mamba2, Mamba, linear attention, ...) supplies only its
*scan*: the recurrence over a padded batch of node segments from given initial states. This module
schedules the forest level by level (:func:`build_levels`: nodes of one level
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

Under context parallelism and depth-first execution a forward holds only a segment of the DFS
order; :func:`tree_levels` then returns the segment's schedule and :func:`tree_scan` runs it,
taking the states of the nodes before the segment and handing its own on
(:mod:`treetrain.models.segment`). A family needs no code of its own for that.
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
    "ScanVarlen",
    "TreeArgs",
    "TreeLevels",
    "balanced_chunk",
    "build_levels",
    "cat_states",
    "chunked_rule_scan",
    "length_groups",
    "map_state",
    "merge_chains",
    "run_levels",
    "schedule",
    "tree_levels",
    "tree_scan",
    "tree_scan_varlen",
]

State = torch.Tensor | tuple[torch.Tensor, ...]
Scan = Callable[[tuple[torch.Tensor, ...], State | None, torch.Tensor], tuple[torch.Tensor, State]]
ScanVarlen = Scan  # (xs, init, cu_seqlens) -> (out, final): see tree_scan_varlen


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


def balanced_chunk(length: int, max_chunk: int) -> int:
    """The chunk size for a chunked scan over ``length`` steps: as few chunks of at most
    ``max_chunk`` as cover them, sized equally so the last one pads least:
    ``ceil(length / ceil(length / max_chunk))``.

    Example: 110 steps, chunks of at most 64 -> 55 (2 chunks; 64 would pad to 128); 20 -> 20
    (one chunk, no padding to 64); 256 -> 64.
    """
    chunks = max(1, -(-length // max_chunk))
    return max(1, -(-length // chunks))


def chunked_rule_scan(
    rule: Callable, max_chunk: int, *, use_qk_l2norm: bool = True, piece_chunks: int | None = None
) -> Scan:
    """The scan of a transformers chunked delta rule (Gated DeltaNet's
    ``torch_chunk_gated_delta_rule``, KDA's ``chunk_kimi_delta_attention``: one signature).

    ``xs`` = ``(q, k, v, g, beta)``, each ``[n, L, H, ...]``; chunks of
    ``balanced_chunk(L, max_chunk)``. ``piece_chunks``: call the rule on pieces of that many chunks,
    each from the previous piece's final state (the same chunks, so the same math); None: one call.
    Example: ``L = 110``, ``max_chunk = 64``, ``piece_chunks = 1``: two calls of one 55-step chunk.
    """

    def scan(xs, init, valid):
        chunk = balanced_chunk(xs[0].shape[1], max_chunk)  # 110 steps: 2 chunks of 55, not 2 of 64
        pieces = [xs] if piece_chunks is None else zip(*(x.split(chunk * piece_chunks, dim=1) for x in xs))
        outs, state = [], init
        for qg, kg, vg, gg, bg in pieces:
            out, state = rule(
                qg, kg, vg, g=gg, beta=bg, chunk_size=chunk, initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm,
            )  # fmt: skip
            outs.append(out)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), state

    return scan


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
    as_np = lambda t: t.detach().cpu().numpy().astype(np.int64)  # noqa: E731
    device = node_start.device if device is None else device
    return schedule(as_np(node_start), as_np(node_end), as_np(node_parent), device, pad_slack)[0]


def schedule(
    start: np.ndarray,
    end: np.ndarray,
    parent: np.ndarray,
    device,
    pad_slack: int | None = 256,
    num_tokens: int | None = None,
) -> tuple[TreeLevels, np.ndarray, np.ndarray]:
    """:func:`build_levels` on numpy arrays; also returns each node's level and row in its level.

    ``num_tokens`` (default ``end.max()``): the padding index and the length of ``padded_row`` /
    ``varlen_row``, whose entries for tokens outside the nodes are left unset (a segment schedules
    its nodes in two parts, :func:`build_segment_levels`).
    """
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    T = (int(end.max()) if end.size else 0) if num_tokens is None else num_tokens
    depth = node_depth(parent)
    lengths = end - start
    row_in_level = np.zeros(start.size, dtype=np.int64)
    padded_row = np.zeros(T, dtype=np.int64)
    varlen_row = np.zeros(T, dtype=np.int64)
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
    tree_levels = TreeLevels(
        levels=tuple(levels), padded_row=as_t(padded_row), varlen_row=as_t(varlen_row), num_tokens=T
    )
    return tree_levels, depth, row_in_level


# ---- the scan along it --------------------------------------------------------------------------


def _pad_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def map_state(state: State, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
    """``fn`` on a state's tensor, or on each tensor of a tuple state."""
    return tuple(fn(s) for s in state) if isinstance(state, tuple) else fn(state)


def cat_states(states: list[State]) -> State:
    """States of ``[n_i, ...]`` rows joined along rows (tuple states part by part)."""
    if len(states) == 1:
        return states[0]
    if isinstance(states[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*states))
    return torch.cat(states)


def run_levels(
    inputs: Sequence[torch.Tensor],
    levels: TreeLevels,
    scan: Scan,
    init: State | None = None,
    keep: Sequence[torch.Tensor] | None = None,
    varlen: bool = False,
) -> tuple[torch.Tensor, State | None]:
    """The level loop of :func:`tree_scan` (``varlen``: :func:`tree_scan_varlen`).

    Returns the outputs in the schedule's row order (``levels.padded_row`` / ``varlen_row`` maps
    tokens to them) and the final states of the rows ``keep[d]`` of every level ``d``, concatenated
    level by level (None if none is kept). ``init``: the states level 0 starts from, in its row
    order (None: roots, from zeros).
    """
    T = levels.num_tokens
    if not varlen:
        inputs = [_pad_row(x) for x in inputs]  # row T: the zero input past a node's end
    outs, kept, state = [], [], None
    for d, lv in enumerate(levels.levels):
        level_init = map_state(state, lambda s, rows=lv.parent_row: s.index_select(0, rows)) if d else init
        if varlen:
            out, state = scan(tuple(x[lv.flat_index] for x in inputs), level_init, lv.cu_seqlens)
            outs.append(out)
        else:
            states, first = [], 0
            for idx in lv.groups:
                n = idx.shape[0]
                group_init = (
                    None
                    if level_init is None
                    else map_state(level_init, lambda s, a=first, b=first + n: s[a:b])
                )
                out, final = scan(tuple(x[idx] for x in inputs), group_init, idx < T)
                outs.append(out.flatten(0, 1))
                states.append(final)
                first += n
            state = cat_states(states)
        if keep is not None and keep[d].numel():
            kept.append(map_state(state, lambda s, rows=keep[d]: s.index_select(0, rows)))
    return torch.cat(outs), (cat_states(kept) if kept else None)


def tree_scan(inputs: Sequence[torch.Tensor], levels: TreeLevels, scan: Scan) -> torch.Tensor:
    """Run ``scan`` along every root-to-leaf path of a packed forest: ``[T, ...]`` outputs.

    inputs: ``[T, ...]`` tensors in DFS order (the same ``T`` as ``levels``). Every node's scan starts
    from its parent's final state (roots: ``init=None``). The result equals running ``scan`` over
    each path alone, token by token (``tests/test_scan.py``).

    ``levels`` may instead be a segment's schedule (:class:`treetrain.models.segment.SegmentLevels`:
    a context-parallel rank's chunk, a depth-first node), which also takes the states of the nodes
    before the segment and hands its own on.
    """
    if not isinstance(levels, TreeLevels):
        return levels.scan(inputs, scan)
    out, _ = run_levels(inputs, levels, scan)
    return out.index_select(0, levels.padded_row)


def tree_scan_varlen(inputs: Sequence[torch.Tensor], levels: TreeLevels, scan: ScanVarlen) -> torch.Tensor:
    """:func:`tree_scan` through a varlen kernel: one call per level over its unpadded tokens.

    ``scan(xs, init, cu_seqlens) -> (out, final)``: ``xs`` tuple of ``[sum lengths, ...]`` (the
    level's nodes one after another), ``init [n, *state]`` or None, ``cu_seqlens [n + 1]``;
    ``out [sum lengths, ...]``, ``final [n, *state]``.
    """
    if not isinstance(levels, TreeLevels):
        return levels.scan(inputs, scan, varlen=True)
    out, _ = run_levels(inputs, levels, scan, varlen=True)
    return out.index_select(0, levels.varlen_row)


@dataclass(frozen=True, eq=False)
class TreeArgs:
    """The tree, handed to routed layers through an argument their decoder passes on unchanged,
    where it passes them no keyword arguments of its own (RWKV's and xLSTM's ``state``)."""

    packed: PackedTree
    mask: object | None = None  # the forward's TreeMask (caches, context parallel), or None


def merge_chains(
    node_start: torch.Tensor, node_end: torch.Tensor, node_parent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold every node that is its parent's only child into its parent: ``(start, end, parent)`` of
    the resulting runs (CPU tensors, the same DFS order and meaning as ``PackedTree.node_*``).

    An only child directly follows its parent in DFS order and starts from its parent's final state,
    so a chain of only children is one contiguous run of tokens that a scan can take in one piece:
    one call instead of one per node, one level instead of one per node. Per-turn samples of one
    dialogue (nested prefixes) are such a chain. Example: nodes ``[A] [B C] [D]`` with parents
    ``[-1 0 1]`` (``node_start = [0 1 3]``, ``node_end = [1 3 4]``) -> one run ``[0, 4)``; a node
    with two children ends its run: parents ``[-1 0 0]`` keep all three nodes.
    """
    as_np = lambda x: x.detach().cpu().numpy().astype(np.int64)  # noqa: E731
    start, end, parent = as_np(node_start), as_np(node_end), as_np(node_parent)
    has_parent = parent >= 0
    children = np.bincount(parent[has_parent], minlength=start.size)
    only = has_parent & (children[np.maximum(parent, 0)] == 1)
    folded = np.flatnonzero(only)
    assert (parent[folded] == folded - 1).all() and (start[folded] == end[folded - 1]).all(), "not DFS order"
    run = np.cumsum(~only) - 1  # each node's run: its own if it heads one, else its parent's
    head = np.flatnonzero(~only)
    run_end = np.zeros(head.size, dtype=np.int64)
    np.maximum.at(run_end, run, end)
    run_parent = np.where(parent[head] >= 0, run[np.maximum(parent[head], 0)], -1)
    return tuple(torch.from_numpy(a) for a in (start[head], run_end, run_parent))


def tree_levels(packed: PackedTree, tree_mask=None, device=None) -> TreeLevels:
    """The level schedule of ``packed``, built once per forward (cached in ``tree_mask``), with
    chains of only children folded into one run each (:func:`merge_chains`).

    Where ``tree_mask.cache["segment"]`` holds a segment (context parallelism, depth-first), the
    segment's schedule (:class:`treetrain.models.segment.SegmentLevels`) instead (its nodes as cut,
    not folded).
    """
    device = packed.input_ids.device if device is None else device
    segment = tree_mask.cache.get("segment") if tree_mask is not None else None
    if segment is not None:
        return tree_mask.cached(("segment_levels", str(device)), lambda: segment.levels(device))

    def build() -> TreeLevels:
        runs = merge_chains(packed.node_start, packed.node_end, packed.node_parent)
        return build_levels(*runs, device=device)

    return tree_mask.cached(("levels", str(device)), build) if tree_mask is not None else build()
