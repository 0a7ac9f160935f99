"""Sparse attention's key selection on a tree: each query's indexer picks among its own path's keys.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, A.X K2, HY-V4, dots.llm3's indexed layers) scores
every key ``j`` a query ``i`` sees, ``sum_h w[i, h] * relu(q[i, h] . k[j])``, and keeps the
``index_topk`` best; MiniMax-M3's sparse layers max-pool per-head scores ``q[i, h] . k[j]`` over blocks
of ``index_block_size`` positions, always keep the ``index_local_blocks`` blocks ending at the query's
own, and keep the ``index_topk_blocks`` best blocks per indexer head (one head per key/value head).
HF's indexer scores the keys of one sequence and its eager and SDPA paths fold the selection into
the mask; any other attention function receives it as ``indices`` / ``block_indices``.

In a tree forward HF's indexer would score the packed forest (every path's keys, masked by a dummy).
So :func:`patch_indexers` gives each indexer an instance ``forward`` that returns a
:class:`PendingSelection` (its call, not yet run), which the model hands to its attention function
as it would the indices (GLM-5's and HY-V4's ``"shared"`` layers reuse the previous layer's: the
same object, evaluated once). The ``treetrain`` attention then evaluates it:

- in a tree forward, :meth:`PendingSelection.tree`: the same scores for each query over its own
  ancestors only (``j <= i < subtree_end[j]``, at their path positions: the rotary tables are the
  path positions'), the same top-k; blocks are ``position // index_block_size`` along the query's
  path. The result is an :class:`~treetrain.attention.selected.KeySelection` that the dense backend
  attends together with the tree mask (:mod:`treetrain.attention.selected`). Cost: chunks of queries,
  ``O(index_heads * chunk * T)`` memory at a time, no gradient;
- in an ordinary call of a prepared model, :meth:`PendingSelection.fold`: HF's own indexer and HF's
  own folding of its result into the mask.

Gradients: HF's DSA indexers run under ``torch.no_grad``, and MiniMax-M3's returns integer block
indices, so in HF no gradient reaches an indexer's parameters (their ``.grad`` stays None); the
selection here runs without gradient too, so they match.

Ties: a DSA score is a weighted sum of ReLUs, so keys can score exactly the same (e.g. 0 when every
head's ReLU is 0). Where such a tie straddles the ``index_topk``-th place, HF keeps whichever of the
tied keys ``torch.topk`` returns for its sequence, an implementation-defined choice; the tree's
``torch.topk`` over the packed forest may return another, so a tree forward is exact where no tie
sits at the boundary (random float scores: ties need all of a key's heads at 0, rare with many
indexer heads). MiniMax-M3's block scores are maxima of dot products (ties have probability 0), and
its local blocks score ``+inf``: more local blocks than ``index_topk_blocks`` would tie there, which
is refused.
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.attention.mask import TreeMask
from treetrain.attention.selected import KeySelection, chunk_rows, visible_keys
from treetrain.models.classes import own_class

__all__ = [
    "BLOCK_INDEXERS",
    "DSA_INDEXERS",
    "PendingSelection",
    "patch_indexers",
    "pending_selection",
    "top_blocks",
    "top_keys",
    "uses_selection",
]


@dataclass(frozen=True)
class DsaLayout:
    """How a DSA indexer lays out its index heads, as its HF ``forward`` computes them."""

    interleaved: bool  # rotary on interleaved pairs (apply_rotary_pos_emb_interleave), else half-split
    rope_last: bool  # the rotary channels after the others (HY-V4), else before
    scale_in_weights: bool  # softmax_scale multiplies the head weights (HY-V4), else the scores
    k_norm_own_dtype: bool  # the key norm in its weight's dtype (HY-V4)


_HALF = DsaLayout(interleaved=False, rope_last=False, scale_in_weights=False, k_norm_own_dtype=False)
_INTERLEAVED = DsaLayout(interleaved=True, rope_last=False, scale_in_weights=False, k_norm_own_dtype=False)
_HY = DsaLayout(interleaved=True, rope_last=True, scale_in_weights=True, k_norm_own_dtype=True)
# exact class name -> its layout (each checked against transformers 5.24)
DSA_INDEXERS: dict[str, DsaLayout] = {
    "DeepseekV32Indexer": _HALF,
    "AXK2Indexer": _HALF,
    "GlmMoeDsaIndexer": _INTERLEAVED,
    "Dots3NoteTextIndexer": _INTERLEAVED,
    "HYV4Indexer": _HY,
    "HYV4VLIndexer": _HY,
}
BLOCK_INDEXERS = ("MiniMaxM3VLIndexer",)


def _indexer_class(module: nn.Module) -> type | None:
    return own_class(module, (*DSA_INDEXERS, *BLOCK_INDEXERS))


class PendingSelection:
    """An indexer's call, evaluated by the attention that receives it (see the module)."""

    def __init__(self, indexer: nn.Module, args: tuple, kwargs: dict):
        self.indexer, self.args, self.kwargs = indexer, args, kwargs
        self.cls = _indexer_class(indexer)
        self.call = inspect.signature(self.cls.forward).bind(indexer, *args, **kwargs).arguments
        self._hf: torch.Tensor | None = None
        self._tree: tuple[TreeMask, KeySelection] | None = None

    def hf(self) -> torch.Tensor:
        """HF's own result: DSA ``[B, S, topk]`` key indices, MiniMax-M3 ``[B, H_idx, S, topk]`` blocks."""
        if self._hf is None:
            self._hf = self.cls.forward(self.indexer, *self.args, **self.kwargs)
        return self._hf

    def tree(self, mask: TreeMask) -> KeySelection:
        """The selection of a tree forward over ``mask``'s tokens (each query's own path)."""
        if self._tree is None or self._tree[0] is not mask:
            if self.call.get("cache") is not None:
                raise ValueError("a tree forward takes no cache (use_cache=False): the indexer got one")
            if mask.position_ids is None:
                raise ValueError(
                    "a sparse attention's selection needs TreeMask.position_ids (path positions)"
                )
            with torch.no_grad():
                if self.cls.__name__ in BLOCK_INDEXERS:
                    sel = _block_selection(self.indexer, self.cls, self.call, mask)
                else:
                    sel = _dsa_selection(self.indexer, self.cls, self.call, mask)
            self._tree = (mask, sel)
        return self._tree[1]

    def fold(self, attention_mask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """An ordinary call's mask with HF's selection folded in, as HF's eager and SDPA paths fold it:
        ``attention_mask`` boolean (True = attend) or additive ``[B, 1, S, T]``, or None (causal)."""
        got = self.hf()
        B, S, Tk = query.shape[0], query.shape[2], key.shape[2]
        if self.cls.__name__ in BLOCK_INDEXERS:
            pos = self.call["position_ids"]
            return self.indexer.build_block_mask(got, attention_mask, Tk, query.dtype, query.device, pos)
        if attention_mask is None:
            attention_mask = torch.ones(S, Tk, dtype=torch.bool, device=query.device).tril(Tk - S)
        dropped = got.new_ones((B, S, Tk), dtype=torch.bool).scatter(-1, got.long(), False).unsqueeze(1)
        if attention_mask.dtype == torch.bool:
            return attention_mask & ~dropped
        return attention_mask.masked_fill(dropped, torch.finfo(query.dtype).min)


def _pending_forward(self: nn.Module, *args, **kwargs) -> PendingSelection:
    """Instance ``forward`` of a patched indexer: its call, for the attention function to evaluate."""
    return PendingSelection(self, args, kwargs)


def patch_indexers(model: nn.Module) -> int:
    """Give every sparse attention indexer of ``model`` the pending ``forward``. Returns how many.
    Idempotent."""
    n = 0
    for module in model.modules():
        if _indexer_class(module) is not None:
            if not isinstance(module.__dict__.get("forward"), types.MethodType):
                module.forward = types.MethodType(_pending_forward, module)
            n += 1
    return n


def uses_selection(model: nn.Module) -> bool:
    """Whether ``model`` has a sparse attention indexer treetrain routes."""
    return any(_indexer_class(m) is not None for m in model.modules())


def pending_selection(module: nn.Module, kwargs: dict) -> PendingSelection | None:
    """The selection an attention call received (``indices`` or ``block_indices``), or None.

    Raises ``ValueError`` for indices from an indexer treetrain does not route (a plain tensor)."""
    for name in ("indices", "block_indices"):
        got = kwargs.get(name)
        if isinstance(got, PendingSelection):
            return got
        if got is not None:
            routed = ", ".join(sorted((*DSA_INDEXERS, *BLOCK_INDEXERS)))
            raise ValueError(
                f"{type(module).__name__} passes a sparse attention's key selection ({name}) from an "
                f"indexer treetrain does not route; routed: {routed}"
            )
    return None


def _dsa_parts(ix: nn.Module, cls: type, call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DSA indexer's index queries ``[T, H, D]``, keys ``[T, D]`` and head weights ``[T, H]`` (float),
    computed as its HF ``forward`` computes them."""
    lay = DSA_INDEXERS[cls.__name__]
    hf = sys.modules[cls.__module__]
    hidden, q_resid = call["hidden_states"], call["q_resid"]
    cos, sin = call["position_embeddings"]
    B, S, _ = hidden.shape
    if B != 1:
        raise ValueError(f"a tree forward takes batch size 1 (a packed forest), got {B}")
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    rot = ix.qk_rope_head_dim
    sizes = [ix.head_dim - rot, rot] if lay.rope_last else [rot, ix.head_dim - rot]
    if lay.k_norm_own_dtype:
        k = ix.k_norm(ix.wk(hidden).to(ix.k_norm.weight.dtype)).to(hidden.dtype).unsqueeze(2)
    else:
        k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    rope = hf.apply_rotary_pos_emb_interleave if lay.interleaved else hf.apply_rotary_pos_emb
    parts = []
    for x in (q, k):
        a, b = torch.split(x, sizes, dim=-1)
        parts.append((a, b) if lay.rope_last else (b, a))  # (pass, rotary)
    (q_pass, q_rot), (k_pass, k_rot) = parts
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    order = (lambda p, r: [p, r]) if lay.rope_last else (lambda p, r: [r, p])
    q = torch.cat(order(q_pass, q_rot), dim=-1)
    k = torch.cat(order(k_pass, k_rot), dim=-1).squeeze(2)
    w = ix.weights_proj(hidden.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads**-0.5)
    if lay.scale_in_weights:
        w = w * ix.softmax_scale
    return q.float()[0], k.float()[0], w[0]


def top_keys(index: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """DSA's pick: ``index [C, E]`` scores of ``C`` queries over keys ``[0, E)``, ``visible [C, E]``
    the tree mask -> ``[C, min(k, E)]`` the ``k`` best visible keys per query (all of them when fewer),
    ``-1`` padding. As HF's ``index_scores.topk(min(index_topk, T))`` over a path, whose masked keys
    sort last."""
    top = index.masked_fill(~visible, float("-inf")).topk(min(k, index.shape[-1]), dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)


def top_blocks(
    scores: torch.Tensor,
    visible: torch.Tensor,
    key_block: torch.Tensor,
    query_block: torch.Tensor,
    blocks: int,
    k: int,
    local: int,
) -> torch.Tensor:
    """MiniMax-M3's pick: ``scores [H, C, E]`` per indexer head, ``visible [C, E]`` the tree mask,
    ``key_block [E]`` and ``query_block [C]`` the tokens' blocks along their paths, ``blocks`` more
    than any -> ``[H, C, k]`` block ids, ``-1`` padding: per head, the ``local`` blocks ending at the
    query's own (clamped at 0) and the best of the rest by their keys' maximum score, ``k`` in all (as
    HF's ``MiniMaxM3VLIndexer.forward``; blocks without a visible key are never picked)."""
    scores = scores.masked_fill(~visible, float("-inf"))
    pooled = scores.new_full((*scores.shape[:2], blocks), float("-inf"))
    pooled.scatter_reduce_(-1, key_block.expand_as(scores), scores, "amax")  # max over each block
    if local > 0:
        near = (query_block[:, None] - torch.arange(local, device=scores.device)).clamp(min=0)  # [C, local]
        pooled.scatter_(-1, near.expand(scores.shape[0], -1, -1), float("inf"))
    top = pooled.topk(k, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)


def _dsa_selection(ix: nn.Module, cls: type, call: dict, mask: TreeMask) -> KeySelection:
    """Each query's top ``index_topk`` ancestors by index score: DFS key indices ``[1, T, K]``."""
    lay = DSA_INDEXERS[cls.__name__]
    q, k, w = _dsa_parts(ix, cls, call)
    T = k.shape[0]
    K = min(ix.index_topk, T)
    chosen = torch.full((1, T, K), -1, dtype=torch.int32, device=k.device)
    rows = chunk_rows(ix.n_heads, T)
    for start in range(0, T, rows):
        end = min(start + rows, T)
        scores = torch.matmul(q[start:end], k[:end].transpose(0, 1))  # [C, H, end]
        if not lay.scale_in_weights:
            scores = scores * ix.softmax_scale
        scores = F.relu(scores)
        index = torch.matmul(w[start:end].unsqueeze(-2), scores).squeeze(-2)  # [C, end]
        picked = top_keys(index, visible_keys(mask, start, end), K)
        chosen[0, start:end, : picked.shape[1]] = picked.to(torch.int32)
    return KeySelection(chosen, torch.arange(T, device=k.device))


def _block_selection(ix: nn.Module, cls: type, call: dict, mask: TreeMask) -> KeySelection:
    """Per indexer head, each query's local blocks and top ``index_topk_blocks`` blocks of its own
    path: block ids ``[H_idx, T, K]`` (``position // index_block_size``)."""
    if ix.local_blocks > ix.topk_blocks:
        raise ValueError(
            f"{cls.__name__}: index_local_blocks ({ix.local_blocks}) > index_topk_blocks "
            f"({ix.topk_blocks}): HF keeps an implementation-defined subset of the local blocks (tied "
            "scores), which a tree forward cannot reproduce"
        )
    hf = sys.modules[cls.__module__]
    hidden = call["hidden_states"]
    cos, sin = call["position_embeddings"]
    B, S, _ = hidden.shape
    if B != 1:
        raise ValueError(f"a tree forward takes batch size 1 (a packed forest), got {B}")
    D = ix.head_dim
    idx_q = ix.q_norm(ix.q_proj(hidden).view(B, S, -1, D)).transpose(1, 2)  # [1, H, T, D]
    idx_k = ix.k_norm(ix.k_proj(hidden).view(B, S, 1, D)).transpose(1, 2)  # [1, 1, T, D]
    idx_q, idx_k = hf.apply_rotary_pos_emb(idx_q, idx_k, cos[..., :D], sin[..., :D])
    q, k = idx_q.float()[0], idx_k.float()[0, 0]
    H, T = q.shape[0], q.shape[1]
    block = mask.position_ids // ix.block_size  # [T]: each token's block along its path
    nb = int(block.max()) + 1
    K = min(ix.topk_blocks, nb)
    chosen = torch.full((H, T, K), -1, dtype=torch.int32, device=k.device)
    local = ix.local_blocks
    rows = chunk_rows(H, T)
    for start in range(0, T, rows):
        end = min(start + rows, T)
        scores = torch.matmul(q[:, start:end], k[:end].transpose(0, 1))  # [H, C, end]
        picked = top_blocks(
            scores, visible_keys(mask, start, end), block[:end], block[start:end], nb, K, local
        )
        chosen[:, start:end] = picked.to(torch.int32)
    return KeySelection(chosen, block)
