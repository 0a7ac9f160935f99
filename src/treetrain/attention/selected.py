"""Tree attention over a per-query key subset: the tree mask AND a sparse attention's key selection.

Sparse attention (DeepSeek Sparse Attention, MiniMax-M3's sparse layers) lets each query attend only
the keys its indexer selected. A selection is not one interval of queries per key, so the tree mask
(``subtree_end``) cannot express it; this module computes it next to the mask, in chunks of queries.

A :class:`KeySelection` says which keys each query keeps, in ``G`` groups of ``Hq / G`` query heads
(DSA: one selection for every head, ``G = 1``; MiniMax-M3: one per key/value head). Keys are sorted
into ids ``key_id [T]``: a key's own DFS index (DSA's per-token top-k) or its block along its path
(MiniMax-M3: ``position // index_block_size``). ``chosen [G, T, K]`` holds the ids each query keeps,
``-1`` padding the unused slots. Query ``i`` (head group ``g``) attends key ``j`` iff ``j`` is on its
path (``j <= i < subtree_end[j]``) and ``key_id[j]`` is in ``chosen[g, i]``; since ``j`` is on ``i``'s
path, a block id names the block of ``i``'s own path, so a block may mix shared-prefix and branch
tokens exactly as the path's own forward groups them.

Example, paths ``[A B C D]`` and ``[A B E]`` in DFS order ``A B C D E`` (``subtree_end = [5, 5, 4,
4, 5]``), ``key_id = [0, 1, 2, 3, 4]``, ``chosen[0, 4] = [1, 4]`` (E keeps B and itself): E attends
B and E, not A (dropped by the selection) nor C, D (another branch).

Cost: the scores of a chunk of ``C`` query rows against the keys before its end, ``O(Hq * C * T)``
memory at a time (``C`` from :data:`CHUNK_ELEMENTS`), ``O(Hq * T^2 * D)`` time as the dense backend.
With autograd each chunk runs under ``torch.utils.checkpoint`` (when there are several), so what a
backward keeps is ``q``, ``k``, ``v`` and the selection, not the ``T x T`` probabilities; the chunk's
scores are computed again in the backward (exactly the same operations, so the same values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from treetrain.attention.mask import TreeMask

__all__ = ["CHUNK_ELEMENTS", "KeySelection", "chunk_rows", "selected_attention", "visible_keys"]

# score elements of one chunk of query rows (heads x rows x keys): 2^25, 128 MiB in float32
CHUNK_ELEMENTS = 1 << 25


@dataclass(eq=False)
class KeySelection:
    """Which keys each query keeps besides the tree mask (see the module).

    ``chosen [G, T, K]`` int: the key ids each query keeps, per head group, ``-1`` padding;
    ``key_id [T]`` int64: each key's id (its DFS index, or its block along its path), ``>= 0``.
    """

    chosen: torch.Tensor
    key_id: torch.Tensor

    @property
    def groups(self) -> int:
        return self.chosen.shape[0]

    def keys(self, start: int, end: int) -> torch.Tensor:
        """Bool ``[G, end - start, end]``: whether each query of ``[start, end)`` keeps each key of
        ``[0, end)`` (its id chosen; the tree mask not applied)."""
        ids = self.key_id[:end]
        n = int(ids.max()) + 1 if end else 0
        chosen = self.chosen[:, start:end].long()
        chosen = chosen.masked_fill(chosen < 0, n)  # padding: a throwaway column
        kept = torch.zeros(*chosen.shape[:2], n + 1, dtype=torch.bool, device=chosen.device)
        kept.scatter_(-1, chosen, True)
        return kept[..., ids]


def visible_keys(mask: TreeMask, start: int, end: int) -> torch.Tensor:
    """Bool ``[end - start, end]``: the tree mask of queries ``[start, end)`` over keys ``[0, end)``."""
    q = torch.arange(start, end, device=mask.subtree_end.device)[:, None]
    k = torch.arange(end, device=mask.subtree_end.device)[None, :]
    return (k <= q) & (q < mask.subtree_end[None, :end])


def chunk_rows(per_row: int, tokens: int) -> int:
    """Query rows per chunk when each row costs ``per_row * tokens`` elements (at least 1)."""
    return max(1, CHUNK_ELEMENTS // max(1, per_row * tokens))


def _chunk(q, k, v, allowed, scale, sinks):
    """One chunk: ``q [Hq, C, D]``, ``k, v [Hq, E, D]``, ``allowed [G, C, E]`` -> ``[Hq, C, D]``, as
    HF's eager attention (scores, masked, softmax in float32 or wider then the query's dtype; a sink
    column joins the softmax and is dropped after it)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    g = allowed.shape[0]
    scores = scores.view(g, -1, *scores.shape[1:]).masked_fill(~allowed[:, None], float("-inf"))
    scores = scores.view(-1, *scores.shape[2:])
    if sinks is None:
        wide = torch.promote_types(q.dtype, torch.float32)
        probs = torch.softmax(scores, dim=-1, dtype=wide).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values  # as HF's eager with sinks
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype)
    return probs @ v


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TreeMask,
    scale: float,
    selection: KeySelection,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention over the selected keys: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` -> ``[Hq, T, D]``.

    ``selection``: the keys each query keeps (``G`` groups dividing ``Hq``); ``sinks [Hq]``: per-head
    sink logits (HY-V4), one more softmax column with a zero value.
    """
    Hq, T, _ = q.shape
    if Hq % k.shape[0] or Hq % selection.groups:
        raise ValueError(
            f"selected_attention: query heads {Hq} must be a multiple of key/value heads {k.shape[0]} "
            f"and of selection groups {selection.groups}"
        )
    if selection.chosen.shape[1] != T or selection.key_id.shape != (T,):
        raise ValueError(
            f"selected_attention: selection for {selection.chosen.shape[1]} queries and "
            f"{selection.key_id.numel()} keys, the forward has {T} tokens"
        )
    rep = Hq // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    rows = chunk_rows(Hq, T)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for start in range(0, T, rows):
        end = min(start + rows, T)
        allowed = visible_keys(mask, start, end)[None] & selection.keys(start, end)
        args = (q[:, start:end], k[:, :end], v[:, :end], allowed, scale, sinks)
        if grad and rows < T:  # several chunks: recompute each in the backward, O(chunk * T) memory
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    return torch.cat(outs, dim=1)
