"""The tiles of block-sparse tree attention: which (row block, key set) pairs one ``subtree_end``
needs, built once per forward and shared by every layer (:mod:`.blocksparse` runs them).

Rows are grouped in blocks of ``block``, ``block * FANOUT``, ``block * FANOUT**2``, ... tokens.
Every row block attends the keys of the earlier row blocks inside its parent block; a key is dead,
full or partial relative to a row block (see :mod:`.blocksparse`), and the finest level's local
tiles take the rest under a small mask. Bidirectional image blocks (``key_start``) add a block's
later keys to its local tiles and one unmasked tile per row block it continues past.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treetrain.attention.blockrule import FANOUT, level_sizes

__all__ = ["BlockSparsePlan", "Tile", "build_plan"]


@dataclass(frozen=True)
class Tile:
    """One kernel call: rows ``[start, stop)`` against a key range or a gathered key index."""

    start: int
    stop: int
    key_start: int
    key_stop: int
    index: torch.Tensor | None = None  # [n] int64 key ids; None: keys are range(key_start, key_stop)
    mask: torch.Tensor | None = None  # [rows, n] bool, True = allowed; None: all allowed (or causal)
    causal: bool = False  # keys are the rows themselves, lower-triangular

    @property
    def num_keys(self) -> int:
        return self.key_stop - self.key_start if self.index is None else self.index.numel()

    @property
    def pairs(self) -> int:
        rows = self.stop - self.start
        return rows * (rows + 1) // 2 if self.causal else rows * self.num_keys


def _keyset(keys: torch.Tensor) -> dict:
    """Sorted key ids -> ``Tile`` key fields: a range when contiguous (a view, no gather)."""
    first, last = int(keys[0]), int(keys[-1])
    if last - first + 1 == keys.numel():
        return {"key_start": first, "key_stop": last + 1}
    return {"key_start": 0, "key_stop": 0, "index": keys}


@dataclass
class BlockSparsePlan:
    """The tiles ``blocksparse_attention`` computes for one ``subtree_end``.

    ``computed_pairs / allowed_pairs`` is the work over the ideal (1.0: not one masked score).
    """

    num_tokens: int
    block: int
    tiles: list[Tile]  # the local tiles first, one per row block, in row order
    num_local: int
    allowed_pairs: int
    computed_pairs: int
    fanout: int = FANOUT
    _additive: dict = field(default_factory=dict, repr=False)

    def kernel_masks(
        self, dtype: torch.dtype, rep: int, position_ids: torch.Tensor | None = None, window=None
    ) -> dict[int, torch.Tensor]:
        """``{tile number: [1, 1, rep * rows, n]}`` additive masks (0 / -inf), the kernel's form.

        The rows repeat ``rep`` times, once per query head of a GQA group (see ``_fold``); causal
        tiles need a mask then too. With a sliding ``window`` every tile whose rows and keys lie
        ``window`` or more positions apart also gets ``pos[q] - pos[k] < window``.
        """
        key = (dtype, rep, window)
        if key not in self._additive:
            masks = {}
            for i, t in enumerate(self.tiles):
                allowed = t.mask
                if t.causal and (rep > 1 or window is not None):
                    allowed = torch.ones(t.stop - t.start, t.num_keys, dtype=torch.bool).tril()
                if window is not None:
                    near = _window_allowed(position_ids, t, window)
                    if near is not None:
                        allowed = near if allowed is None else allowed & near
                if allowed is not None:
                    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
                    masks[i] = additive.repeat(rep, 1)[None, None]
            self._additive[key] = masks
        return self._additive[key]

    def hidden_rows(self, position_ids: torch.Tensor, window: int) -> dict[int, torch.Tensor]:
        """``{tile number: [rows] bool}``: rows the window hides all of a tile's keys from.

        The CPU kernel returns log-sum-exp 0 (not -inf) for such a row, so the merge must skip it.
        """
        key = ("hidden", window)
        if key not in self._additive:
            hidden = {}
            # local tiles come first and are skipped: every row sees itself there
            for i, t in enumerate(self.tiles[self.num_local :], start=self.num_local):
                near = _window_allowed(position_ids, t, window)
                if near is not None and t.mask is not None:
                    near &= t.mask
                if near is not None and not bool(near.any(dim=1).all()):
                    hidden[i] = ~near.any(dim=1)
            self._additive[key] = hidden
        return self._additive[key]


def _window_allowed(pos: torch.Tensor, t: Tile, window: int) -> torch.Tensor | None:
    """``[rows, n]`` bool ``pos[q] - pos[k] < window`` for a tile, or None when all pairs are near."""
    keys = torch.arange(t.key_start, t.key_stop) if t.index is None else t.index
    near = pos[t.start : t.stop, None] - pos[keys][None, :] < window
    return None if bool(near.all()) else near


def build_plan(
    subtree_end: torch.Tensor, block: int = 64, fanout: int = FANOUT, key_start: torch.Tensor | None = None
) -> BlockSparsePlan:
    """Tile the allowed pairs of ``subtree_end [T]``: ``block``-row local tiles, coarser levels above.

    ``key_start [T]`` (bidirectional image blocks, see ``mask.py``): the local tiles also allow a
    block's later keys, and each row block inside an image block gets one unmasked tile of the
    block's keys past its rows (:func:`_lookahead_tiles`).

    >>> plan = build_plan(torch.tensor([8, 6, 4, 4, 6, 6, 8, 8]), block=2, fanout=2)
    >>> [(t.start, t.stop, t.num_keys, t.mask is not None) for t in plan.tiles]
    [(0, 2, 2, False), (2, 4, 4, True), (4, 6, 3, True), (6, 8, 2, False), (4, 8, 1, False)]
    >>> plan.allowed_pairs, plan.computed_pairs
    (22, 24)
    """
    if block < 1 or fanout < 2:
        raise ValueError(f"need block >= 1 and fanout >= 2, got {block}, {fanout}")
    end = subtree_end.detach().to("cpu", torch.int64)
    T = end.numel()
    kstart = None if key_start is None else key_start.detach().to("cpu", torch.int64)
    sizes = level_sizes(T, block, fanout)
    full: dict[tuple[int, int], list[torch.Tensor]] = {}  # (level, row start) -> keys all its rows see
    local: dict[int, list[torch.Tensor]] = {}  # row start -> keys for the masked local tile

    def push(level: int, s: int, keys: torch.Tensor) -> None:
        """Rows ``[s, s + sizes[level])`` attend what they may of ``keys`` (``< s``, seen by row ``s``)."""
        if level == 0:
            local.setdefault(s, []).append(keys)
            return
        e = min(s + sizes[level], T)
        key_end = end[keys]
        seen_by_all = key_end >= e
        if bool(seen_by_all.any()):
            full.setdefault((level, s), []).append(keys[seen_by_all])
        partial = keys[~seen_by_all]
        for c in range(s, e, sizes[level - 1]):
            partial = partial[end[partial] > c]
            if partial.numel() == 0:
                break
            push(level - 1, c, partial)

    # every row block attends the keys of the earlier row blocks of its parent block
    for level, size in enumerate(sizes[:-1]):
        for s in range(0, T, size):
            first = s - s % sizes[level + 1]
            if first < s:
                keys = torch.arange(first, s)
                keys = keys[end[first:s] > s]
                if keys.numel():
                    push(level, s, keys)

    local_tiles = [
        _local_tiles(end, s, min(s + block, T), local.pop(s, []), kstart) for s in range(0, T, block)
    ]
    tiles = [tile for tile, _ in local_tiles] + [split for _, split in local_tiles if split is not None]
    for (level, s), keys in sorted(full.items()):
        tiles.append(Tile(s, min(s + sizes[level], T), **_keyset(torch.cat(keys).sort().values)))
    first = torch.arange(T) if kstart is None else kstart
    if kstart is not None:
        tiles += _lookahead_tiles(kstart, block)
    allowed = int((end - first).sum())
    computed = sum(t.pairs for t in tiles)  # num_local: one local tile per row block
    return BlockSparsePlan(T, block, tiles, -(-T // block), allowed, computed, fanout)


def _masked_tile(end: torch.Tensor, s: int, e: int, keys: torch.Tensor, kstart=None) -> Tile:
    """Rows ``[s, e)`` against sorted ``keys`` with the tree mask (every row must see some key)."""
    rows = torch.arange(s, e)[:, None]
    first = keys if kstart is None else kstart[keys]
    return Tile(s, e, **_keyset(keys), mask=(first <= rows) & (rows < end[keys]))


def _lookahead_tiles(kstart: torch.Tensor, block: int) -> list[Tile]:
    """The pairs ``q < k`` of bidirectional image blocks that the local tiles miss: for each row block
    ``[s, e)`` that an image block ``[b, f)`` (keys with ``kstart == b``) continues past, rows
    ``[max(s, b), e)`` against keys ``[e, f)``, all allowed (an image block lies inside one node).

    >>> tiles = _lookahead_tiles(torch.tensor([0, 1, 1, 1, 1, 5]), 2)  # keys 1-4 one image block
    >>> [(t.start, t.stop, t.key_start, t.key_stop) for t in tiles]
    [(1, 2, 2, 5), (2, 4, 4, 5)]
    """
    T = kstart.numel()
    idx = torch.arange(T)
    starts = torch.nonzero(kstart < idx)[:, 0]
    tiles = []
    for b in torch.unique(kstart[starts]).tolist():
        f = int(torch.nonzero(kstart == b)[:, 0].max()) + 1
        for e in range((b // block + 1) * block, f, block):
            tiles.append(Tile(max(e - block, b), e, e, f))
    return tiles


def _local_tiles(
    end: torch.Tensor, s: int, e: int, keys: list[torch.Tensor], kstart=None
) -> tuple[Tile, Tile | None]:
    """Rows ``[s, e)`` against earlier ``keys`` (each seen by some row) and themselves.

    Returns the local tile and, when it pays, a separate tile for the keys that only the first
    rows see (a subtree that ends inside the block): rows ``[s, m)`` only, so the rows after a
    branch ends do not compute its keys masked.
    """
    keys = torch.cat(keys).sort().values if keys else torch.empty(0, dtype=torch.int64)
    key_end = end[keys]
    partial = keys[key_end < e]
    split = None
    if partial.numel():
        m = int(end[partial].max())
        if partial.numel() * (e - m) >= (e - s) ** 2 // 4:  # masked pairs saved vs one more call
            split = _masked_tile(end, s, m, partial)
            keys = keys[key_end >= e]
    causal = kstart is None or bool((kstart[s:e] == torch.arange(s, e)).all())
    if keys.numel() == 0 and bool((end[s:e] >= e).all()) and causal:
        return Tile(s, e, s, e, causal=True), split
    return _masked_tile(end, s, e, torch.cat([keys, torch.arange(s, e)]), kstart), split
