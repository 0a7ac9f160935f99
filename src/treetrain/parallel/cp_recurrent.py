"""Recurrent layers under context parallelism: each rank runs its own chunk, split, not replicated.

A rank's chunk ``[s, e)`` of the DFS order is a segment (:mod:`treetrain.models.segment`), so every
routed family (its ``tree_scan`` and ``tree_causal_conv1d``) runs on the chunk's tokens alone:

- Nodes are cut at every chunk boundary (:func:`refine_nodes`): a node split at ``s`` hands the
  state after its last token before ``s`` to its rest, like a parent to a child.
- The **states** a chunk starts from are the final states of the nodes before ``s`` that have a
  child at or after ``s`` (:func:`chunk_nodes`): in DFS order these are ancestors of token ``s``,
  at most one per tree level. Rank ``r - 1`` holds all of them: each either is its own node or came
  in to it the same way. So the states travel rank by rank: rank ``r`` receives from ``r - 1`` the
  ones it (or a later rank) needs and sends ``r + 1`` its own. The hand-over is sequential
  (rank ``r`` waits for ``r - 1``'s scan) except where a chunk starts a new tree of the forest:
  nodes under a root inside the chunk run before the states arrive, and a rank whose outgoing
  states come only from those sends them before it receives.
- The **conv halo** (the inputs before ``s`` that the chunk's windows read, ``width - 1`` at most
  per ancestor) is one all-gather per conv of the rows each rank exports (:func:`chunk_halo`).

Backward runs the same ways back: a received state's gradient is sent to the rank that sent it
(:class:`_RecvStates`), a sent one's is received (:class:`_SendStates`), a halo row's is summed over
ranks (:class:`_GatherRows`). So every parameter's gradient is each rank's share, and their sum over
the group is the one-process gradient.

Example, ``A B C D E F G H`` (paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``) on two ranks cut
after ``C``: node ``C D`` becomes ``C`` | ``D``; rank 1 receives the final states of ``A``, ``B``
and ``C`` (``G H`` starts from ``A``'s, ``E F`` from ``B``'s, ``D`` from ``C``'s), and with conv
width 3 the halo ``A B C``.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from treetrain.models.pathconv import conv_window_index
from treetrain.models.segment import HaloWindow, SegmentLevels, build_segment_levels, segment_view
from treetrain.trees.packing import PackedTree

__all__ = ["CPSegment", "DistTransport", "Transport", "chunk_halo", "chunk_nodes", "refine_nodes"]

State = torch.Tensor | tuple[torch.Tensor, ...]


def refine_nodes(
    node_start: np.ndarray, node_end: np.ndarray, node_parent: np.ndarray, cuts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nodes ``[N]`` (DFS order, tiling ``[0, T)``) cut at every index of ``cuts`` inside one:
    ``(start, end, parent)``. A cut node's later piece is the child of its earlier one; the node's
    children hang from its last piece.

    >>> refine_nodes(np.array([0, 1, 2, 4, 6]), np.array([1, 2, 4, 6, 8]), np.array([-1, 0, 1, 1, 0]),
    ...              np.array([3]))[2].tolist()   # A B [C D] [E F] [G H] cut at 3: C | D
    [-1, 0, 1, 2, 1, 0]
    """
    start = np.union1d(node_start, cuts).astype(np.int64)
    end = np.append(start[1:], node_end[-1])
    orig = np.searchsorted(node_start, start, side="right") - 1
    last_piece = np.searchsorted(start, node_end - 1, side="right") - 1  # of every original node
    p = node_parent[orig]
    from_parent = np.where(p >= 0, last_piece[np.maximum(p, 0)], -1)
    parent = np.where(start == node_start[orig], from_parent, np.arange(start.size) - 1)
    return start, end, parent


def _incoming(parent: np.ndarray, first: int) -> np.ndarray:
    """Nodes before ``first`` with a child at or after it, in DFS order (root first)."""
    p = parent[first:]
    return np.unique(p[(p >= 0) & (p < first)])


def chunk_nodes(start: np.ndarray, end: np.ndarray, parent: np.ndarray, bounds, rank: int) -> dict:
    """The segment of chunk ``rank`` from refined nodes (:func:`refine_nodes` at ``bounds``): the
    :func:`~treetrain.models.segment.build_segment_levels` arguments (node arrays relative to the
    chunk, ``slot``, ``send``, ``num_in``).

    Example (module docstring, rank 1 of bounds ``[0, 3, 8]``): nodes ``D``, ``E F``, ``G H`` with
    slots ``[2 1 0]`` of incoming ``A B C``; nothing to send.
    """
    first, stop = (int(np.searchsorted(start, b)) for b in (bounds[rank], bounds[rank + 1]))
    incoming = _incoming(parent, first)
    p = parent[first:stop]
    remote = (p >= 0) & (p < first)
    out = _incoming(parent, stop) if rank + 2 < len(bounds) else np.zeros(0, dtype=np.int64)
    passed = out < first
    send = np.where(passed, -1 - np.searchsorted(incoming, out), out - first)
    return dict(
        node_start=start[first:stop] - bounds[rank],
        node_end=end[first:stop] - bounds[rank],
        node_parent=np.where(p >= first, p - first, -1),
        node_slot=np.where(remote, np.searchsorted(incoming, p), -1),
        send=send.astype(np.int64),
        num_in=int(incoming.size),
    )


def chunk_halo(window: np.ndarray, bounds, rank: int) -> dict:
    """The conv halo of chunk ``rank`` from the whole tree's ``window [T, width]``
    (:func:`~treetrain.models.pathconv.conv_window_index`, ``T`` = none).

    Returns ``index [n, width]`` (rows of ``cat(halo, chunk, zero)``), ``export`` (the chunk's rows
    that a later chunk's windows read, chunk-relative), ``sizes [world]`` (every rank's export
    count) and ``take`` (the halo's rows in the concatenation of all ranks' exports).
    """
    T = window.shape[0]
    bounds = np.asarray(bounds)
    owner = np.searchsorted(bounds, np.arange(T), side="right") - 1
    src = np.minimum(window, T - 1)
    crossing = (window < T) & (owner[src] < owner[:, None])
    exported = np.unique(window[crossing])  # sorted: rank by rank
    s, e = int(bounds[rank]), int(bounds[rank + 1])
    mine = window[s:e]
    halo = np.unique(mine[mine < s])
    remap = np.full(T + 1, halo.size + e - s, dtype=np.int64)  # T: the zero row
    remap[halo] = np.arange(halo.size)
    remap[s:e] = halo.size + np.arange(e - s)
    return dict(
        index=remap[mine],
        export=exported[(exported >= s) & (exported < e)] - s,
        sizes=np.bincount(owner[exported], minlength=bounds.size - 1),
        take=np.searchsorted(exported, halo),
    )


class Transport(Protocol):
    """How a chunk's states and halo rows reach the other ranks (with autograd)."""

    def recv(self, op: int, anchor: torch.Tensor) -> State:
        """The states sent by the previous rank for scan ``op``."""
        ...

    def send(self, op: int, out: torch.Tensor, states: State) -> torch.Tensor:
        """Send the next rank ``states``; returns ``out`` tied to them."""
        ...

    def gather(self, op: int, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``rows [sizes[r], C]``, concatenated rank by rank, for conv ``op``."""
        ...


class CPSegment:
    """A context-parallel rank's chunk as a segment (``tree_mask.cache["segment"]``): builds its
    schedule and windows from the whole ``packed`` tree and is its scans' link."""

    def __init__(self, packed: PackedTree, bounds, rank: int, transport: Transport):
        self.bounds, self.rank, self.transport = tuple(int(b) for b in bounds), rank, transport
        s, e = self.bounds[rank], self.bounds[rank + 1]
        self.packed = packed
        self.view = segment_view(packed.input_ids[s:e], packed.position_ids[s:e])
        as_np = lambda t: t.detach().cpu().numpy().astype(np.int64)  # noqa: E731
        self.nodes = refine_nodes(
            as_np(packed.node_start), as_np(packed.node_end), as_np(packed.node_parent),
            np.asarray(self.bounds[1:-1], dtype=np.int64),
        )  # fmt: skip
        self._scans = itertools.count()
        self._convs = itertools.count()

    def levels(self, device) -> SegmentLevels:
        plan = chunk_nodes(*self.nodes, self.bounds, self.rank)
        return build_segment_levels(**plan, link=self, device=device)

    def window(self, width: int, device) -> HaloWindow:
        full = conv_window_index(self.packed.prev.cpu(), width).numpy()
        h = chunk_halo(full, self.bounds, self.rank)
        as_t = lambda a: torch.as_tensor(a, dtype=torch.int64, device=device)  # noqa: E731
        export, take, sizes = as_t(h["export"]), as_t(h["take"]), h["sizes"].tolist()

        def exchange(x: torch.Tensor) -> torch.Tensor:
            op = next(self._convs)
            if not sum(sizes):  # no window crosses a chunk boundary
                return x.new_zeros(0, *x.shape[1:])
            return self.transport.gather(op, x.index_select(0, export), sizes).index_select(0, take)

        return HaloWindow(index=as_t(h["index"]), num_halo=int(take.numel()), exchange=exchange)

    # the Link of models.segment
    def begin(self) -> int:
        return next(self._scans)

    def receive(self, op: int, anchor: torch.Tensor) -> State:
        return self.transport.recv(op, anchor)

    def send(self, op: int, out: torch.Tensor, states: State) -> torch.Tensor:
        return self.transport.send(op, out, states)


# ---- between processes ---------------------------------------------------------------------------

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_HEADER = 64  # int64s: [tuple?, count, then per tensor: dtype, ndim, 8 dims]
_forwards = itertools.count()  # every rank of a group builds its segments in the same order


def _header(tensors: list[torch.Tensor], is_tuple: bool, device) -> torch.Tensor:
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = int(is_tuple), len(tensors)
    for i, t in enumerate(tensors):
        assert t.ndim <= 8 and 2 + 10 * (i + 1) <= _HEADER, "state too large for the CP header"
        h[2 + 10 * i], h[3 + 10 * i] = _DTYPES.index(t.dtype), t.ndim
        h[4 + 10 * i : 4 + 10 * i + t.ndim] = torch.tensor(t.shape)
    return h.to(device)


def _parse(h: torch.Tensor) -> tuple[bool, list[tuple[torch.Size, torch.dtype]]]:
    h = h.tolist()
    specs = []
    for i in range(h[1]):
        dtype, ndim = _DTYPES[h[2 + 10 * i]], h[3 + 10 * i]
        specs.append((torch.Size(h[4 + 10 * i : 4 + 10 * i + ndim]), dtype))
    return bool(h[0]), specs


class _RecvStates(torch.autograd.Function):
    """Receive tensors from ``src``; backward sends their gradients back. ``anchor`` only ties them
    into the graph (its gradient is None)."""

    @staticmethod
    def forward(ctx, anchor, group, src: int, tag: int, specs):
        out = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=anchor.device)
            dist.recv(t, group=group, group_src=src, tag=tag)
            out.append(t)
        ctx.peer = (group, src, tag)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        group, src, tag = ctx.peer
        for g in grads:
            dist.send(g.contiguous(), group=group, group_dst=src, tag=tag)
        return None, None, None, None, None


class _SendStates(torch.autograd.Function):
    """Send ``states`` to ``dst`` and return ``out`` unchanged; backward receives their gradients."""

    @staticmethod
    def forward(ctx, out, group, dst: int, tag: int, *states):
        for s in states:
            dist.send(s.contiguous(), group=group, group_dst=dst, tag=tag)
        ctx.peer = (group, dst, tag)
        ctx.specs = [(s.shape, s.dtype, s.device) for s in states]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        group, dst, tag = ctx.peer
        grads = []
        for shape, dtype, device in ctx.specs:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, group=group, group_src=dst, tag=tag)
            grads.append(t)
        return g, None, None, None, *grads


class _GatherRows(torch.autograd.Function):
    """Concatenate every rank's ``rows [sizes[r], C]``; backward sums the gradient over ranks and
    keeps this rank's rows."""

    @staticmethod
    def forward(ctx, rows, group, sizes: list[int], rank: int):
        pad = max(sizes)
        local = F.pad(rows, (0, 0, 0, pad - rows.shape[0])).contiguous()
        parts = [torch.empty_like(local) for _ in sizes]
        dist.all_gather(parts, local, group=group)
        ctx.group, ctx.first, ctx.rows = group, sum(sizes[:rank]), rows.shape[0]
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g[ctx.first : ctx.first + ctx.rows], None, None, None


class DistTransport:
    """:class:`Transport` over ``torch.distributed`` (point-to-point for states, all-gather for
    halo rows); ``rank`` within ``group``."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.base = (next(_forwards) % 2**16) * 2**12  # a tag per forward and scan

    def recv(self, op: int, anchor: torch.Tensor) -> State:
        tag = self.base + op
        h = torch.empty(_HEADER, dtype=torch.int64, device=anchor.device)
        dist.recv(h, group=self.group, group_src=self.rank - 1, tag=tag)
        is_tuple, specs = _parse(h)
        got = _RecvStates.apply(anchor, self.group, self.rank - 1, tag, specs)
        return tuple(got) if is_tuple else got[0]

    def send(self, op: int, out: torch.Tensor, states: State) -> torch.Tensor:
        tag, flat = self.base + op, list(states) if isinstance(states, tuple) else [states]
        header = _header(flat, isinstance(states, tuple), out.device)
        dist.send(header, group=self.group, group_dst=self.rank + 1, tag=tag)
        return _SendStates.apply(out, self.group, self.rank + 1, tag, *flat)

    def gather(self, op: int, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return _GatherRows.apply(rows, self.group, sizes, self.rank)
