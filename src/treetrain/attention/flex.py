"""FlexAttention backend: a ``BlockMask`` built from ``subtree_end`` at block granularity.

The block tables come from per-key-block min/max of ``subtree_end`` (``[nb, nb]`` ints), and the
``mask_mod`` closes over ``subtree_end [T]`` only: nothing T x T is ever built.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from treetrain.attention.mask import TreeMask, TreeScores, block_classes, tree_scores
from treetrain.attention.sinks import add_sinks

if TYPE_CHECKING:
    from typing_extensions import Unpack

FLEX_BLOCK = 128


def tree_block_mask(
    subtree_end: torch.Tensor,
    block: int = FLEX_BLOCK,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
    key_start: torch.Tensor | None = None,
) -> BlockMask:
    """``BlockMask`` for ``k <= q < subtree_end[k]`` with partial and full block tables.

    With ``window``, also ``position_ids[q] - position_ids[k] < window``; with ``key_start`` the lower
    bound is ``key_start[k] <= q`` (bidirectional image blocks). Closes over ``[T]`` tensors only.
    """
    T = subtree_end.numel()
    any_allowed, full = block_classes(subtree_end, block, position_ids, window, key_start)
    partial = any_allowed & ~full

    def table(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Row-wise: the allowed key blocks first, in order. [1, 1, nb] counts, [1, 1, nb, nb] indices.
        counts = sel.sum(dim=1, dtype=torch.int32)
        order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    se, pos, ks = subtree_end, position_ids, key_start

    def causal_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < se[kv_idx])

    def bidir_mod(b, h, q_idx, kv_idx):
        return (ks[kv_idx] <= q_idx) & (q_idx < se[kv_idx])

    tree_mod = causal_mod if key_start is None else bidir_mod

    def window_mod(b, h, q_idx, kv_idx):
        return tree_mod(b, h, q_idx, kv_idx) & (pos[q_idx] - pos[kv_idx] < window)

    mask_mod = tree_mod if window is None else window_mod

    kv_num, kv_idx = table(partial)
    full_num, full_idx = table(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(T, T)
    )


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex(device: torch.device):
    """Compiled (fused) on CUDA; eager elsewhere (CPU has no flex backward: tests and inference)."""
    if device.type == "cuda":
        return _compiled_flex()
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


def _softcap_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def _alibi_mod(alibi: torch.Tensor, inner=None):
    """``score + alibi[h, kv] - alibi[h, q]`` (after ``inner``, the softcap, if any): ALiBi along the
    path (:mod:`.alibi`), a ``score_mod`` closing over ``[Hq, T]`` only."""

    def score_mod(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        return score + (alibi[h, kv_idx] - alibi[h, q_idx]).to(score.dtype)

    return score_mod


def _rel_bias_mod(rel_bias: torch.Tensor, pos: torch.Tensor, inner=None):
    """``score + rel_bias[h, q, pos[q] - pos[kv]]`` below distance ``E`` (after ``inner``, if any): a
    ``score_mod`` closing over ``[Hq, T, E]`` and ``[T]``; flex differentiates the captured table."""
    extent = rel_bias.shape[2]

    def score_mod(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        d = pos[q_idx] - pos[kv_idx]
        bias = rel_bias[h, q_idx, d.clamp(0, extent - 1)]
        return score + torch.where((d >= 0) & (d < extent), bias, torch.zeros_like(bias)).to(score.dtype)

    return score_mod


def flex_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TreeMask,
    scale: float,
    **scores: Unpack[TreeScores],
) -> torch.Tensor:
    """``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` -> ``[Hq, T, D]``. CPU: forward only (no flex backward).

    ``window``: sliding window along each path; ``softcap``: Gemma 2's logit soft-capping (a
    ``score_mod`` on the scaled scores); ``sinks [Hq]``: GPT-OSS's sink logits, applied from the
    kernel's log-sum-exp (:mod:`.sinks`; the gradient flows through flex's differentiable lse), or
    ``[Hq, T]``: Inkling2's per-query sinks;
    ``alibi [Hq, T]``: ALiBi's bias at each token's path position (:mod:`.alibi`), a ``score_mod``;
    ``rel_bias [Hq, T, E]``: Inkling's bias per query and path distance (:mod:`.relbias`), a
    ``score_mod`` reading the table (its gradient: flex's captured-buffer gradient);
    ``key_start [T]``: bidirectional image blocks (see ``mask.py``).
    """
    window, softcap, sinks, alibi, rel_bias, key_start = tree_scores(
        "flex_tree_attention", q, k, v, mask, scores
    )
    pos = mask.window_positions(window)
    bm = mask.cached(
        ("flex", window) + (("bidirectional",) if key_start is not None else ()),
        lambda: tree_block_mask(mask.subtree_end, FLEX_BLOCK, pos, window, key_start),
    )
    gqa = q.shape[0] != k.shape[0]
    score_mod = None if softcap is None else _softcap_mod(softcap)
    if alibi is not None:
        score_mod = _alibi_mod(alibi.to(torch.promote_types(q.dtype, torch.float32)), score_mod)
    if rel_bias is not None:
        score_mod = _rel_bias_mod(rel_bias.contiguous(), mask.position_ids, score_mod)
    if sinks is None:
        out = _flex(q.device)(
            q[None], k[None], v[None], score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa
        )
        return out[0]
    out, aux = _flex(q.device)(
        q[None], k[None], v[None], score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
        return_aux=AuxRequest(lse=True),
    )  # fmt: skip
    lse = aux.lse[0].to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return add_sinks(out[0], lse, sinks)[0]
