"""Reference backend: a boolean ``[T, T]`` mask through SDPA. Works everywhere, with autograd."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from treetrain.attention.alibi import alibi_scores
from treetrain.attention.mask import TreeMask, TreeScores, dense_tree_mask, tree_scores
from treetrain.attention.relbias import rel_bias_scores
from treetrain.attention.selected import KeySelection, selected_attention

if TYPE_CHECKING:
    from typing_extensions import Unpack


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TreeMask,
    scale: float,
    selection: KeySelection | None = None,
    **scores: Unpack[TreeScores],
) -> torch.Tensor:
    """Tree attention with an explicit mask.

    Shapes: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` with ``Hq % Hkv == 0`` (GQA); returns ``[Hq, T, D]``.
    ``window``: sliding window along each path (``pos[q] - pos[k] < window``, see ``mask.py``).
    ``softcap``: Gemma 2's attention logit soft-capping, ``softcap * tanh(scores / softcap)``.
    ``sinks [Hq]`` or ``[Hq, T]``: sink logits per head (GPT-OSS) or per head and query (Inkling2),
    one more softmax column with a zero value (as HF's eager attention: the column joins the softmax
    and is dropped after it).
    ``alibi [Hq, T]``: ALiBi's per-head bias at each token's path position; the scores get
    ``alibi[h, k] - alibi[h, q]`` (see ``alibi.py``).
    ``rel_bias [Hq, T, E]``: a learned bias per query and path distance (Inkling); the scores get
    ``rel_bias[h, q, pos[q] - pos[k]]`` below distance ``E`` (see ``relbias.py``).
    ``key_start [T]``: bidirectional image blocks, key ``k`` seen from query ``key_start[k]`` on
    (see ``mask.py``).
    ``selection``: a sparse attention's per-query key subset (:mod:`.selected`), attended in chunks of
    queries together with the tree mask; with ``sinks [Hq]`` only.
    """
    if selection is not None:
        _, _, sinks, *_ = tree_scores("dense_attention", q, k, v, mask, scores)
        others = sorted(name for name, x in scores.items() if x is not None and name != "sinks")
        if others or (sinks is not None and sinks.dim() != 1):
            what = ", ".join(others) or "per-query sinks"
            raise ValueError(f"dense_attention: a key selection with {what} is not supported")
        return selected_attention(q, k, v, mask, scale, selection, sinks)
    window, softcap, sinks, alibi, rel_bias, key_start = tree_scores("dense_attention", q, k, v, mask, scores)
    pos = mask.window_positions(window)
    key = ("dense", window) + (("bidirectional",) if key_start is not None else ())
    dense = mask.cached(key, lambda: dense_tree_mask(mask.subtree_end, pos, window, key_start))
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    if any(x is not None for x in (softcap, sinks, alibi, rel_bias)):  # the scores in full, as HF's eager
        scores = (q @ k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if alibi is not None:
            bias = alibi_scores(alibi.to(torch.promote_types(scores.dtype, torch.float32)))
            scores = scores + bias.to(scores.dtype)
        if rel_bias is not None:
            scores = scores + rel_bias_scores(rel_bias, mask.position_ids).to(scores.dtype)
        scores = scores.masked_fill(~dense, float("-inf"))
        if sinks is None:
            return torch.softmax(scores, dim=-1) @ v
        sink = sinks.to(scores.dtype)
        sink = (sink[:, None, None] if sink.dim() == 1 else sink[:, :, None]).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return probs @ v
    # 4-D inputs: with 3-D ones SDPA takes a slow path that builds the T x T score matrix
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense, scale=scale)[0]
