"""The one tree-mask representation every attention backend reads: ``subtree_end``.

Query ``q`` may attend key ``k`` iff ``k <= q < subtree_end[k]``. Every key's allowed queries form
one contiguous range, so the whole mask is ``T`` integers (FlashMask's column-wise "end row" form,
with causal=True).

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` in DFS order ``A B C D E F G H``::

    subtree_end = [8, 6, 4, 4, 6, 6, 8, 8]
    dense_tree_mask(subtree_end)[q=4 (E)] = [1, 1, 0, 0, 1, 0, 0, 0]   # sees A B E

Sliding-window layers (Mistral, Qwen2, Gemma 2/3) add one condition, measured along the path:
``pos[q] - pos[k] < window`` (Hugging Face's ``kv_idx > q_idx - window``), where ``pos`` is the
token's index in its own path (``position_ids``). For a tree-visible pair, ``k`` is on ``q``'s path,
so the position distance is exactly the distance a per-path forward sees. With ``window = 2``
the mask above becomes, for ``q = 5`` (F, position 3): ``[0, 0, 0, 0, 1, 1, 0, 0]`` (sees E F).

Bidirectional image blocks (Gemma 3/4: an image's tokens see each other both ways) lower each key's
first query: key ``k`` is seen by ``key_start[k] <= q < subtree_end[k]``, where ``key_start[k]`` is
the first DFS index of ``k``'s image block (``k`` itself for text). An image lies inside one node, so
this is still one interval per key (FlashMask's form with a lower bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from treetrain.attention.alibi import check_alibi
from treetrain.attention.relbias import check_rel_bias


@dataclass(eq=False)
class TreeMask:
    """``subtree_end [T]`` plus a per-forward cache for what backends derive from it.

    One ``TreeMask`` lives for one forward pass, so every layer reuses what the first layer
    derived (block lists, a FlexAttention ``BlockMask``, ...) from the same ``subtree_end``.
    """

    subtree_end: torch.Tensor  # [T] int64
    backend: str = "dense"
    cache: dict = field(default_factory=dict)
    position_ids: torch.Tensor | None = None  # [T] int64; needed by sliding-window layers only
    key_start: torch.Tensor | None = None  # [T] int64: first query that sees each key in a bidirectional
    # layer (image blocks); None: none. Backends read it only when handed ``key_start=``.
    vision_runs: torch.Tensor | None = None  # [B, 2] int64: DFS [start, end) of each run of image tokens

    def window_positions(self, window: int | None) -> torch.Tensor | None:
        """``position_ids`` when ``window`` is set (checked), else None."""
        if window is None:
            return None
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        if self.position_ids is None:
            raise ValueError("a sliding-window layer needs TreeMask.position_ids (the path positions)")
        return self.position_ids

    @property
    def num_tokens(self) -> int:
        return self.subtree_end.numel()

    def cached(self, key, build):
        """Return ``cache[key]``, building it with ``build()`` on first use."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def dense_tree_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
    key_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``[T, T]`` mask, ``mask[q, k] = k <= q < subtree_end[k]``. Reference only: O(T^2).

    With ``window``, also ``position_ids[q] - position_ids[k] < window``; with ``key_start [T]``
    (bidirectional image blocks) the lower bound is ``key_start[k] <= q`` instead of ``k <= q``.
    """
    T = subtree_end.numel()
    idx = torch.arange(T, device=subtree_end.device)
    q, k = idx[:, None], idx[None, :]
    lo = k if key_start is None else key_start[None, :]
    mask = (lo <= q) & (q < subtree_end[None, :])
    if window is not None:
        mask &= position_ids[:, None] - position_ids[None, :] < window
    return mask


class TreeScores(TypedDict, total=False):
    """What the attention scores get besides the tree mask: the keywords every backend entry point
    takes (``dense_attention(q, k, v, mask, scale, window=4)``; None or absent: off; what each
    backend computes: ``treetrain.attention.FEATURES``).

    - ``window``: sliding window along each path, ``pos[q] - pos[k] < window`` (see the module);
    - ``softcap``: Gemma 2's attention logit soft-capping, ``softcap * tanh(scores / softcap)``;
    - ``sinks [Hq]`` or ``[Hq, T]``: sink logits per head (GPT-OSS) or per head and query (Inkling2),
      one more softmax column with a zero value (:mod:`.sinks`);
    - ``alibi [Hq, T]``: ALiBi's per-head bias at each token's path position (:mod:`.alibi`);
    - ``rel_bias [Hq, T, E]``: a learned bias per query and path distance (Inkling, :mod:`.relbias`);
    - ``key_start [T]``: bidirectional image blocks (Gemma 3/4), key ``k`` seen by the queries
      ``key_start[k] <= q < subtree_end[k]`` (see the module).
    """

    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    alibi: torch.Tensor | None
    rel_bias: torch.Tensor | None
    key_start: torch.Tensor | None


SCORE_KEYWORDS = tuple(TreeScores.__annotations__)  # window, softcap, sinks, alibi, rel_bias, key_start


def tree_scores(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TreeMask, scores: Mapping[str, Any]
) -> tuple:
    """A backend entry point's :class:`TreeScores` keywords ``scores`` as ``(window, softcap, sinks,
    alibi, rel_bias, key_start)``, after :func:`check_inputs`; an unknown keyword is a ``TypeError``,
    as Python's own for a function that names its keywords."""
    for key in scores:
        if key not in SCORE_KEYWORDS:
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
    window, softcap, sinks, alibi, rel_bias, key_start = (scores.get(key) for key in SCORE_KEYWORDS)
    check_inputs(name, q, k, v, mask, sinks, alibi, rel_bias)
    if key_start is not None and key_start.shape != mask.subtree_end.shape:
        raise ValueError(f"{name}: key_start must be [T] = [{q.shape[1]}], got {tuple(key_start.shape)}")
    return window, softcap, sinks, alibi, rel_bias, key_start


def check_inputs(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TreeMask,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
) -> None:
    """The checks every backend entry point runs, as ``ValueError``: ``q [Hq, T, D]``,
    ``k, v [Hkv, T, D]`` with ``Hq % Hkv == 0``, one dtype and device, ``subtree_end [T]``, and
    when given: ``sinks [Hq]`` or ``[Hq, T]`` (per head and query), ``alibi [Hq, T]``
    (:func:`.alibi.check_alibi`), ``rel_bias [Hq, T, E]`` (:func:`.relbias.check_rel_bias`)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"{name}: q, k, v must be [H, T, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"{name}: need q [Hq, T, D] and k, v [Hkv, T, D] with the same T and D, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] % k.shape[0]:
        raise ValueError(
            f"{name}: query heads {q.shape[0]} must be a multiple of key/value heads {k.shape[0]}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if mask.subtree_end.shape != (q.shape[1],):
        raise ValueError(
            f"{name}: subtree_end must be [T] = [{q.shape[1]}], got {tuple(mask.subtree_end.shape)}"
        )
    heads, tokens = q.shape[0], q.shape[1]
    if sinks is not None and sinks.shape not in ((heads,), (heads, tokens)):
        raise ValueError(
            f"{name}: sinks must be [Hq] = [{heads}] or [Hq, T] = [{heads}, {tokens}], "
            f"got {tuple(sinks.shape)}"
        )
    if alibi is not None:
        check_alibi(name, alibi, heads, tokens)
    if rel_bias is not None:
        check_rel_bias(name, rel_bias, heads, tokens, mask.position_ids)


def check_subtree_end(subtree_end: torch.Tensor) -> None:
    """Assert the invariants a well-formed DFS tree layout has (internal: packing guarantees them)."""
    T = subtree_end.numel()
    idx = torch.arange(T, device=subtree_end.device)
    assert subtree_end.dtype == torch.int64
    assert bool(((subtree_end > idx) & (subtree_end <= T)).all()), "subtree_end[k] must be in (k, T]"


def block_bounds(subtree_end: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block, min and max of ``subtree_end``: ``[ceil(T / block)]`` each. O(T)."""
    T = subtree_end.numel()
    nb = -(-T // block)
    padded = torch.nn.functional.pad(subtree_end, (0, nb * block - T), value=-1).view(nb, block)
    hi = padded.max(dim=1).values
    lo = padded.masked_fill(padded < 0, T + 1).min(dim=1).values
    return lo, hi


def block_classes(
    subtree_end: torch.Tensor,
    block: int,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
    key_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify (query block, key block) pairs: ``(any_allowed, all_allowed)``, bool ``[nb, nb]``.

    ``all_allowed`` is exact; ``any_allowed`` may over-approximate (such a block is computed with
    its mask applied, so that is safe). O((T / block)^2), never T x T. With a sliding ``window``,
    per-block min/max positions bound ``pos[q] - pos[k]`` for both classes; with ``key_start``
    (bidirectional image blocks) per-block min/max of it bound the lower end.
    """
    T = subtree_end.numel()
    lo, hi = block_bounds(subtree_end, block)
    starts = torch.arange(0, T, block, device=subtree_end.device)
    q0, q1 = starts[:, None], torch.clamp(starts + block, max=T)[:, None]
    k0, k1 = starts[None, :], torch.clamp(starts + block, max=T)[None, :]
    if key_start is not None:
        smin, smax = block_bounds(key_start, block)
        k0, k1 = smin[None, :], smax[None, :] + 1
    any_allowed = (k0 <= q1 - 1) & (hi[None, :] > q0)
    all_allowed = (k1 - 1 <= q0) & (lo[None, :] >= q1)
    if window is not None:
        pmin, pmax = block_bounds(position_ids, block)  # per block min, max position (ints >= 0)
        any_allowed &= pmin[:, None] - pmax[None, :] < window
        all_allowed &= pmax[:, None] - pmin[None, :] < window
    return any_allowed, all_allowed
