"""A segment of a packed forest's DFS order whose paths begin before it: a context-parallel rank's
chunk, or one node of a depth-first walk.

Every recurrent family reaches the tree only through :func:`~treetrain.models.scan.tree_levels` /
:func:`~treetrain.models.scan.tree_scan` and :func:`~treetrain.models.pathconv.path_window` /
:func:`~treetrain.models.pathconv.tree_causal_conv1d`. When the forward's ``TreeMask`` carries a
*segment* (``tree_mask.cache["segment"]``, put there by :mod:`treetrain.parallel`), those return and
run this module's :class:`SegmentLevels` and :class:`HaloWindow` instead, so a family runs on the
segment's tokens alone with no code of its own:

- **Scans.** The segment's nodes (a node cut by the segment's start is split there: its first
  piece lies before) fall in two parts. *Free* nodes descend from a root inside the segment and run
  first, from zeros; *bound* nodes descend from a node before the segment. In DFS order every bound
  node's first ancestor outside the segment is an ancestor of the segment's first token, so what
  crosses the boundary is the final state of each such ancestor (the *incoming* states; a node
  split at the boundary contributes its first piece's state): at most one per tree level. The bound
  part's top nodes start from them. The segment then hands on the states later segments need (the
  *outgoing* states: final states of its own nodes, or incoming ones passed through).
- **Convolutions.** A window reaches ``width - 1`` inputs back along the token's path; those before
  the segment (the *halo*, at most ``width - 1`` per ancestor on the boundary path) come from
  whoever computed them, and this segment's own inputs that later windows read are handed on.

How states and halos travel is the :class:`Link`'s and the window's ``exchange``'s business
(``parallel.cp``: between ranks; ``parallel.depth_first``: through the node stack), with autograd:
the gradient of every handed-over tensor flows back to where it was computed.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (DFS ``A B C D E F G H``) cut into
``A B C | D E F G H``: the second segment's nodes are ``[D]`` (the rest of ``C D``), ``[E F]`` and
``[G H]``, all bound; ``[D]`` starts from the state after ``C``, ``[E F]`` from ``B``'s final state,
``[G H]`` from ``A``'s: three incoming states. With a conv of width 3, ``E``'s window reads ``A B``
and ``D``'s reads ``B C``: the halo is ``A B C``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from treetrain.models.scan import Scan, State, TreeLevels, cat_states, map_state, run_levels, schedule
from treetrain.trees.packing import PackedTree

__all__ = ["HaloWindow", "Link", "SegmentLevels", "build_segment_levels", "segment_view"]


class Link(Protocol):
    """How a segment's scans meet the rest of the tree (implemented in :mod:`treetrain.parallel`).

    Every :func:`~treetrain.models.scan.tree_scan` over a segment is one *op*, numbered by
    ``begin()`` in call order (the same on every segment of a forward, as every segment runs the
    same layers).
    """

    def begin(self) -> int:
        """The next op's number."""
        ...

    def receive(self, op: int, anchor: torch.Tensor) -> State:
        """The incoming states ``[num_in, *state]`` of this op. ``anchor`` (an input of the scan) ties
        them into this segment's graph, so their gradients are handed back when backward passes it."""
        ...

    def send(self, op: int, out: torch.Tensor, states: State) -> torch.Tensor:
        """Hand on the outgoing states ``[m, *state]``; returns ``out`` unchanged, tied to them (their
        gradients come back when backward passes it)."""
        ...


@dataclass(frozen=True, eq=False)
class HaloWindow:
    """Conv windows of a segment: ``index [n, width]`` rows of ``cat([halo, x, zero row])``, where
    ``halo [num_halo, C]`` is what ``exchange(x)`` returns for the conv's input ``x [n, C]`` (and
    hands on the rows of ``x`` later segments read). Row ``num_halo + n``: before a path's start."""

    index: torch.Tensor
    num_halo: int
    exchange: Callable[[torch.Tensor], torch.Tensor]

    @property
    def width(self) -> int:
        return self.index.shape[1]


def _top(parent: np.ndarray) -> np.ndarray:
    """Topmost ancestor of every node (itself for a root) by pointer jumping."""
    top = np.where(parent >= 0, parent, np.arange(parent.size))
    while True:
        nxt = top[top]
        if np.array_equal(nxt, top):
            return top
        top = nxt


@dataclass(frozen=True, eq=False)
class SegmentLevels:
    """The schedule of a segment's scans (built by :func:`build_segment_levels`).

    free, bound: the two parts' schedules over the segment's ``n`` tokens (None if empty).
    slot ``[n0]``: the incoming state each of the bound part's level-0 rows starts from.
    keep_free, keep_bound: per level, the rows whose final states are handed on.
    send_index ``[m]``: the outgoing states, as rows of ``cat(kept free, kept bound, incoming)``
    (None: nothing is handed on); send_early: all from the free part (handed on before receiving).
    padded_row, varlen_row ``[n]``: each token's row in ``cat(free outputs, bound outputs)``.
    """

    free: TreeLevels | None
    bound: TreeLevels | None
    slot: torch.Tensor
    keep_free: tuple[torch.Tensor, ...]
    keep_bound: tuple[torch.Tensor, ...]
    send_index: torch.Tensor | None
    send_early: bool
    padded_row: torch.Tensor
    varlen_row: torch.Tensor
    num_in: int
    num_tokens: int
    link: Link

    def scan(self, inputs: Sequence[torch.Tensor], scan: Scan, varlen: bool = False) -> torch.Tensor:
        """:func:`~treetrain.models.scan.tree_scan` (``varlen``: ``tree_scan_varlen``) over the
        segment: ``[n, ...]`` outputs."""
        op = self.link.begin()
        parts, pool = [], []
        if self.free is not None:
            out, kept = run_levels(inputs, self.free, scan, keep=self.keep_free, varlen=varlen)
            parts.append(out)
            pool.append(kept)
        if self.send_early:  # the next segment need not wait for this one's incoming states
            parts[0] = self._send(op, parts[0], pool)
        if self.num_in:
            anchor = next((x for x in inputs if x.requires_grad), inputs[0])
            incoming = self.link.receive(op, anchor)
            if self.bound is not None:
                init = map_state(incoming, lambda s: s.index_select(0, self.slot))
                out, kept = run_levels(inputs, self.bound, scan, init, self.keep_bound, varlen)
                parts.append(out)
                pool.append(kept)
            pool.append(incoming)
        if self.send_index is not None and not self.send_early:
            parts[-1] = self._send(op, parts[-1], pool)
        return torch.cat(parts).index_select(0, self.varlen_row if varlen else self.padded_row)

    def _send(self, op: int, out: torch.Tensor, pool: list) -> torch.Tensor:
        states = cat_states([p for p in pool if p is not None])
        return self.link.send(op, out, map_state(states, lambda s: s.index_select(0, self.send_index)))


def _part(nodes: np.ndarray, start, end, parent, n: int, device, pad_slack):
    """Schedule of a subset of the segment's nodes (closed under parents): (levels, depth, row)."""
    if nodes.size == 0:
        return None, None, None
    new = np.full(parent.size, -1, dtype=np.int64)
    new[nodes] = np.arange(nodes.size)
    sub_parent = np.where(parent[nodes] >= 0, new[np.maximum(parent[nodes], 0)], -1)
    return schedule(start[nodes], end[nodes], sub_parent, device, pad_slack, num_tokens=n)


def _keep(sel: np.ndarray, depth, row, device) -> tuple[tuple[torch.Tensor, ...], np.ndarray]:
    """Per level, the rows of the nodes ``sel`` (part-local indices); and each one's position in
    the kept states (level by level, in ``sel`` order within a level)."""
    if depth is None:
        return (), np.zeros(0, dtype=np.int64)
    keep, pos, off = [], np.zeros(sel.size, dtype=np.int64), 0
    for d in range(int(depth.max()) + 1):
        at = np.flatnonzero(depth[sel] == d)
        keep.append(torch.as_tensor(row[sel[at]], device=device))
        pos[at] = off + np.arange(at.size)
        off += at.size
    return tuple(keep), pos


def build_segment_levels(
    node_start: np.ndarray,
    node_end: np.ndarray,
    node_parent: np.ndarray,
    node_slot: np.ndarray,
    send: np.ndarray,
    num_in: int,
    link: Link,
    device=None,
    pad_slack: int | None = 256,
) -> SegmentLevels:
    """The schedule of a segment's nodes (numpy ``[N]`` int64, DFS order, tiling ``[0, n)``).

    node_parent: the parent's index among the segment's nodes, ``-1`` for a root or a node whose
    parent lies before the segment; node_slot: for the latter, the index of the parent's final state
    among the incoming states (``-1`` otherwise). send ``[m]``: the outgoing states in order, a node
    of the segment (``>= 0``) or incoming state ``j`` passed through (``-1 - j``). num_in: how many
    states come in (the link receives them whenever ``num_in > 0``).

    Example, the module docstring's second segment: nodes ``[D] [E F] [G H]`` = starts ``[0 1 3]``,
    ends ``[1 3 5]``, parents ``[-1 -1 -1]``, slots ``[2 1 0]``, ``num_in = 3`` (incoming: A, B, the
    piece ``C``).
    """
    n = int(node_end[-1]) if node_end.size else 0
    assert node_start.size == 0 or (node_start[0] == 0 and (node_start[1:] == node_end[:-1]).all())
    bound = node_slot[_top(node_parent)] >= 0
    part = {}
    for name, nodes in (("free", np.flatnonzero(~bound)), ("bound", np.flatnonzero(bound))):
        part[name] = (nodes, *_part(nodes, node_start, node_end, node_parent, n, device, pad_slack))
    free_nodes, free, free_depth, free_row = part["free"]
    bound_nodes, bnd, bound_depth, bound_row = part["bound"]

    slot = np.zeros(0, dtype=np.int64)
    if bnd is not None:
        top = np.flatnonzero(bound_depth == 0)
        slot = np.empty(top.size, dtype=np.int64)
        slot[bound_row[top]] = node_slot[bound_nodes[top]]
    assert (slot >= 0).all()

    local = send[send >= 0]
    in_free = np.isin(local, free_nodes)
    keep_free, pos_free = _keep(np.searchsorted(free_nodes, local[in_free]), free_depth, free_row, device)
    at_bound = np.searchsorted(bound_nodes, local[~in_free])
    keep_bound, pos_bound = _keep(at_bound, bound_depth, bound_row, device)
    n_free, n_bound = pos_free.size, pos_bound.size
    index = np.empty(send.size, dtype=np.int64)
    local_at = np.flatnonzero(send >= 0)
    index[local_at[in_free]] = pos_free
    index[local_at[~in_free]] = n_free + pos_bound
    index[send < 0] = n_free + n_bound + (-1 - send[send < 0])

    token_bound = torch.as_tensor(np.repeat(bound, node_end - node_start), device=device)
    rows = {}
    for key in ("padded_row", "varlen_row"):
        f = getattr(free, key) if free is not None else None
        b = getattr(bnd, key) if bnd is not None else None
        if f is None or b is None:
            rows[key] = f if b is None else b
        else:
            offset = free.num_padded if key == "padded_row" else int((~token_bound).sum())
            rows[key] = torch.where(token_bound, b + offset, f)
    assert (node_slot < num_in).all() and (-1 - send[send < 0] < num_in).all()
    return SegmentLevels(
        free=free,
        bound=bnd,
        slot=torch.as_tensor(slot, device=device),
        keep_free=keep_free,
        keep_bound=keep_bound,
        send_index=torch.as_tensor(index, device=device) if send.size else None,
        send_early=bool(send.size) and bool((send >= 0).all()) and bool(in_free.all()),
        padded_row=rows["padded_row"],
        varlen_row=rows["varlen_row"],
        num_in=num_in,
        num_tokens=n,
        link=link,
    )


def segment_view(input_ids: torch.Tensor, position_ids: torch.Tensor) -> PackedTree:
    """What a routed layer is handed for a segment: its tokens ``input_ids [n]`` and their path
    positions ``position_ids [n]``. The tree's structure fields are None: a family reaches the tree
    only through ``tree_levels`` and ``path_window``, which read the segment."""
    none = dict.fromkeys(("subtree_end", "prev", "node_start", "node_end", "node_parent"))
    return PackedTree(
        input_ids=input_ids, position_ids=position_ids, **none, path_index=None, path_offsets=None, trees=()
    )
