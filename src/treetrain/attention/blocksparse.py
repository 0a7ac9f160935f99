"""Block-sparse tree attention for CPU, forward and backward, at the cost of the allowed pairs.

SDPA with an explicit ``[T, T]`` mask computes all ``T^2`` scores whatever the tree shares. Here
tiles, each one call of PyTorch's CPU flash-attention kernel (what SDPA runs for 4-D inputs),
cover the allowed pairs ``k <= q < subtree_end[k]`` and little else.

Rows are grouped in blocks of ``block``, ``block * FANOUT``, ``block * FANOUT**2``, ... tokens.
Every row block attends the keys of the earlier row blocks inside its parent block. Relative to
the rows ``[s, e)``, a key ``k < s`` is

- *dead* if ``subtree_end[k] <= s``: no row sees it; dropped,
- *full* if ``subtree_end[k] >= e``: every row sees it; all such keys form one unmasked tile,
- *partial* otherwise: pushed down to the child row blocks and classified again.

At the finest level the *local tile* of ``[s, e)`` holds its own keys (plainly causal when no
subtree ends inside the block) and its partial keys, under a small mask. The only masked-out work
is the local tiles' upper triangles plus at most ``block`` rows per key (a key is partial for the
one local block its subtree ends in): under ``1.5 * T * block`` pairs. Unmasked tiles have about
as many keys as rows (up to ``FANOUT - 1`` times, plus keys pushed down from above), which keeps
the kernel near its long-sequence rate. GQA: each call takes a key head's whole group of query
heads as its rows (``_fold``), so every key is read once per group.

Rows covered by several tiles are merged by log-sum-exp. The backward runs the kernel's backward
per tile with the *merged* output and log-sum-exp, which makes each tile's probabilities the
global ones, so the tiles' gradients add up exactly.

Example, ``subtree_end = [8, 6, 4, 4, 6, 6, 8, 8]`` (paths ``A B C D``, ``A B E F``, ``A G H``),
``block = 2``, ``FANOUT = 2`` (row blocks of 2, 4, 8)::

    rows [0, 2) x keys [0, 2)       causal      (local)
    rows [2, 4) x keys [0, 4)       masked      (local: earlier keys [0, 2) and itself)
    rows [4, 8) x keys {A}          unmasked    (A ends at 8: full; B ends at 6: partial; C, D dead)
    rows [4, 6) x keys {B} + [4, 6) masked      (local: B pushed down)
    rows [6, 8) x keys [6, 8)       causal      (local: E, F end at 6, dead)

The plan (:mod:`.blockplan`) depends on ``subtree_end`` only and is cached in the ``TreeMask``: every
layer of a forward shares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treetrain.attention.alibi import tile_bias
from treetrain.attention.blockplan import BlockSparsePlan, Tile, build_plan
from treetrain.attention.blockrule import block_and_fanout
from treetrain.attention.mask import TreeMask, TreeScores, tree_scores
from treetrain.attention.relbias import rel_bias_tile, rel_bias_tile_grad
from treetrain.attention.sinks import add_sinks, sink_grad

if TYPE_CHECKING:
    from typing_extensions import Unpack

try:  # the CPU flash kernel behind SDPA, called directly for its log-sum-exp and backward
    _flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
except (AttributeError, RuntimeError) as e:  # the registry then falls back to dense
    raise ImportError(f"this torch {torch.__version__} has no CPU flash-attention kernel: {e}") from e


def _keys(x: torch.Tensor, tile: Tile) -> torch.Tensor:
    """``x [1, Hkv, T, D]`` -> the tile's keys ``[1, Hkv, n, D]`` (a view unless gathered)."""
    return x[:, :, tile.key_start : tile.key_stop] if tile.index is None else x.index_select(2, tile.index)


def _scatter_add(dst: torch.Tensor, src: torch.Tensor, tile: Tile) -> None:
    """``dst [Hkv, T, D] += src [1, Hkv, n, D]`` at the tile's keys."""
    if tile.index is None:
        dst[:, tile.key_start : tile.key_stop] += src[0]
    else:
        dst.index_add_(1, tile.index, src[0].to(dst.dtype))


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[Hq, T, ...]`` -> ``[rep, Hkv, T, ...]`` view (query head ``h`` reads key head ``h // rep``)."""
    return x.unflatten(0, (hkv, x.shape[0] // hkv)).transpose(0, 1)


def _fold(x: torch.Tensor) -> torch.Tensor:
    """``[rep, Hkv, L, ...]`` -> ``[1, Hkv, rep * L, ...]``: a GQA group's query heads as one call's rows.

    The kernel then reads each key once per group and sums dk, dv over the group itself: 5-35%
    faster (more on small tiles) than expanding k, v over ``rep`` batches, copies included. A view
    when ``rep == 1``. A folded tile cannot be causal (each head's rows restart), so it is masked.
    """
    rep, hkv, L = x.shape[:3]
    return x.transpose(0, 1).reshape(1, hkv, rep * L, *x.shape[3:])


def _unfold(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Inverse of ``_fold``: ``[1, Hkv, rep * L, ...]`` -> ``[rep, Hkv, L, ...]`` (a view)."""
    return x[0].unflatten(1, (rep, -1)).transpose(0, 1)


def _bias_mask(t: Tile, hkv: int, base: torch.Tensor | None, dtype, bias: _Bias) -> torch.Tensor:
    """A tile's additive mask with the position biases (ALiBi's, Inkling's): ``[1, Hkv, rep * rows, n]``.

    ``base``: the tile's own ``[1, 1, rep * rows, n]`` mask (0 / -inf) or None; a causal tile gets
    its triangle here (the kernel takes no causal flag beside a mask). Built per tile and call, so
    no per-head copy of the plan's masks is kept.
    """
    rows = slice(t.start, t.stop)
    keys = slice(t.key_start, t.key_stop) if t.index is None else t.index
    tile = 0.0
    if bias.alibi is not None:
        tile = tile_bias(bias.alibi.to(torch.promote_types(dtype, torch.float32)), rows, keys).to(dtype)
    if bias.rel is not None:
        tile = tile + rel_bias_tile(bias.rel.detach(), bias.pos, rows, keys).to(dtype)
    tile = _fold(_grouped(tile, hkv))
    if base is None and t.causal:
        n_rows = t.stop - t.start
        tril = torch.ones(n_rows, t.num_keys, dtype=torch.bool).tril()
        base = torch.zeros(n_rows, t.num_keys, dtype=dtype).masked_fill_(~tril, float("-inf"))
        base = base.repeat(tile.shape[2] // n_rows, 1)[None, None]
    return tile if base is None else tile + base


@dataclass(frozen=True)
class _Bias:
    """The scores' position biases: ALiBi's ``alibi [Hq, T]`` and Inkling's ``rel [Hq, T, E]`` at the
    path positions ``pos [T]`` (CPU int64), each None when absent."""

    alibi: torch.Tensor | None = None
    rel: torch.Tensor | None = None
    pos: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return self.alibi is not None or self.rel is not None


_NO_BIAS = _Bias()


def _tile_mask(masks: dict, i: int, t: Tile, hkv: int, dtype, bias: _Bias):
    """The kernel's mask of tile ``i``: the plan's (or None), or one with the biases."""
    return _bias_mask(t, hkv, masks.get(i), dtype, bias) if bias.any else masks.get(i)


def _forward(q, k, v, plan: BlockSparsePlan, scale: float, pos=None, window=None, bias: _Bias = _NO_BIAS):
    """``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` -> ``out`` like ``q``, ``lse [rep, Hkv, T]``.

    ``out`` has ``q``'s memory layout; ``lse`` the kernel's accumulation dtype (float32, or
    float64 for float64 inputs).
    """
    hkv, T = k.shape[:2]
    q4, k4, v4 = _grouped(q, hkv), k[None], v[None]
    rep = q4.shape[0]
    masks = plan.kernel_masks(q.dtype, rep, pos, window)
    hidden = plan.hidden_rows(pos, window) if window is not None else {}
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q, dtype=acc)  # empty_like keeps the layout: token-major in, token-major out
    out4 = _grouped(out, hkv)
    lse = q.new_empty(rep, hkv, T, dtype=acc)
    for i, t in enumerate(plan.tiles):
        rows = slice(t.start, t.stop)
        m = _tile_mask(masks, i, t, hkv, q.dtype, bias)
        o, l = _flash(
            _fold(q4[:, :, rows]), _keys(k4, t), _keys(v4, t), 0.0, t.causal and rep == 1 and not bias.any,
            attn_mask=m, scale=scale,
        )  # fmt: skip
        o, l = _unfold(o, rep), _unfold(l, rep)
        if i in hidden:  # the window hides all of this tile's keys from some rows: they add nothing
            l = l.masked_fill(hidden[i], float("-inf"))
        if i < plan.num_local:  # the local tiles come first and cover every row once
            out4[:, :, rows] = o
            lse[:, :, rows] = l
            continue
        # merge the tile into the rows' running softmax: the new part weighs sigmoid(l - lse)
        out4[:, :, rows].lerp_(o.to(acc), torch.sigmoid(l - lse[:, :, rows]).unsqueeze(-1))
        lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], l)
    return out.to(q.dtype), lse


def _backward(
    do, q, k, v, out, lse, plan: BlockSparsePlan, scale: float, pos=None, window=None, bias: _Bias = _NO_BIAS
):
    """Gradients of ``_forward``, accumulated over tiles in ``lse.dtype``, in the inputs' layouts."""
    hkv = k.shape[0]
    q4, k4, v4, do4, out4 = _grouped(q, hkv), k[None], v[None], _grouped(do, hkv), _grouped(out, hkv)
    rep = q4.shape[0]
    masks = plan.kernel_masks(q.dtype, rep, pos, window)
    dq = torch.empty_like(q, dtype=lse.dtype)
    dk = torch.zeros_like(k, dtype=lse.dtype)
    dv = torch.zeros_like(v, dtype=lse.dtype)
    dq4 = _grouped(dq, hkv)
    for i, t in enumerate(plan.tiles):
        rows = slice(t.start, t.stop)
        m = _tile_mask(masks, i, t, hkv, q.dtype, bias)
        dqt, dkt, dvt = _flash_backward(
            _fold(do4[:, :, rows]), _fold(q4[:, :, rows]), _keys(k4, t), _keys(v4, t),
            _fold(out4[:, :, rows]), _fold(lse[:, :, rows]), 0.0, t.causal and rep == 1 and not bias.any,
            attn_mask=m, scale=scale,
        )  # fmt: skip
        dqt = _unfold(dqt, rep)
        if i < plan.num_local:
            dq4[:, :, rows] = dqt
        else:
            dq4[:, :, rows] += dqt
        _scatter_add(dk, dkt, t)
        _scatter_add(dv, dvt, t)
    return dq, dk, dv


def _rel_bias_grad(do, q, k, v, out, lse, plan: BlockSparsePlan, scale: float, pos, window, bias: _Bias):
    """Gradient of Inkling's ``rel [Hq, T, E]``: per tile, the scores' gradient
    ``ds = p * (do . v - rowsum(do * out))`` (``p`` recomputed from the merged ``lse``), added at each
    pair's (query, path distance). The CPU kernel's backward does not return ``ds``."""
    hkv = k.shape[0]
    acc = lse.dtype
    q4, do4 = _grouped(q.to(acc), hkv), _grouped(do.to(acc), hkv)
    k4, v4 = k.to(acc)[None], v.to(acc)[None]
    rep = q4.shape[0]
    delta = _grouped((do.to(acc) * out.to(acc)).sum(-1), hkv)  # [rep, Hkv, T]
    masks = plan.kernel_masks(q.dtype, rep, pos, window)
    grad = torch.zeros(bias.rel.shape, dtype=acc)
    for i, t in enumerate(plan.tiles):
        rows = slice(t.start, t.stop)
        m = _unfold(_bias_mask(t, hkv, masks.get(i), q.dtype, bias).to(acc), rep)  # [rep, Hkv, rows, n]
        s = (q4[:, :, rows] @ _keys(k4, t)[0].transpose(-1, -2)) * scale + m
        p = torch.exp(s - lse[:, :, rows, None])
        ds = p * (do4[:, :, rows] @ _keys(v4, t)[0].transpose(-1, -2) - delta[:, :, rows, None])
        keys = slice(t.key_start, t.key_stop) if t.index is None else t.index
        rel_bias_tile_grad(grad, ds.transpose(0, 1).flatten(0, 1), bias.pos, rows, keys)
    return grad.to(bias.rel.dtype)


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_grouped``: ``[rep, Hkv, T]`` -> ``[Hq, T]`` (query head ``kv * rep + r``)."""
    return x.transpose(0, 1).flatten(0, 1)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockSparsePlan, scale: float, pos, window, sinks, alibi, rel, rel_pos):
        bias = _Bias(alibi, rel, rel_pos)
        out, lse = _forward(q, k, v, plan, scale, pos, window, bias)
        if sinks is not None:  # rescale by the sink's share; the backward then runs with out', lse'
            _, new_lse = add_sinks(out, _per_head(lse), sinks, inplace=True)
            lse = _grouped(new_lse, k.shape[0])
        ctx.save_for_backward(q, k, v, out, lse, sinks, rel)
        ctx.plan, ctx.scale, ctx.pos, ctx.window = plan, scale, pos, window
        ctx.alibi, ctx.rel_pos = alibi, rel_pos
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse, sinks, rel = ctx.saved_tensors
        bias = _Bias(ctx.alibi, rel, ctx.rel_pos)
        dq, dk, dv = _backward(do, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.pos, ctx.window, bias)
        ds = drel = None
        if sinks is not None and ctx.needs_input_grad[7]:
            delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [Hq, T]: the flash backward's D
            ds = sink_grad(delta, _per_head(lse), sinks)
        if rel is not None and ctx.needs_input_grad[9]:
            drel = _rel_bias_grad(do, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.pos, ctx.window, bias)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, ds, None, drel, None


def blocksparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TreeMask,
    scale: float,
    block: int | None = None,
    *,
    fanout: int | None = None,
    **scores: Unpack[TreeScores],
) -> torch.Tensor:
    """Tree attention that computes (nearly) only the pairs the tree allows, with autograd. CPU only.

    Shapes: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` with ``Hq % Hkv == 0`` (GQA: query head ``h``
    reads key head ``h // (Hq // Hkv)``); returns ``[Hq, T, D]`` in ``q``'s memory layout (so
    token-major ``[T, H, D]`` storage stays token-major). ``block``: rows of the finest tiles
    (smaller masks fewer pairs but makes more kernel calls), ``fanout``: row blocks per parent
    block; None: chosen from the tree's shape (:func:`.blockrule.choose_block`, benchmarks/attention_cpu.py
    --sweep). The result is exact for any block and fanout. float64, float32, bfloat16
    (accumulated in float32).
    ``window``: sliding window along each path (an extra mask on the tiles that cross it).
    ``sinks [Hq]`` or ``[Hq, T]``: sink logits per head (GPT-OSS) or per head and query (Inkling2)
    (see :mod:`.sinks`), forward and gradient.
    ``alibi [Hq, T]``: ALiBi's bias at each token's path position (:mod:`.alibi`), added to each
    tile's mask (one ``[Hq, rows, keys]`` tile at a time).
    ``rel_bias [Hq, T, E]``: Inkling's bias per query and path distance (:mod:`.relbias`), added to
    each tile's mask the same way; its gradient recomputes each tile's probabilities.
    ``key_start [T]``: bidirectional image blocks (see ``mask.py`` and :func:`build_plan`).
    ``softcap`` is not supported (the CPU flash kernel has no score hook).
    """
    window, softcap, sinks, alibi, rel_bias, key_start = tree_scores(
        "blocksparse_attention", q, k, v, mask, scores
    )
    if softcap is not None:
        raise ValueError(
            f"attention logit softcapping ({softcap}) is not supported by the blocksparse backend; "
            "use attention backend 'dense' (CPU) or 'flex'"
        )
    rel_pos = None
    if rel_bias is not None:
        rel_pos = mask.position_ids.detach().to("cpu", torch.int64)
    if q.device.type != "cpu":
        raise ValueError(f"blocksparse_attention runs on CPU, got {q.device}; use flex or triton")
    if q.shape[1] == 0:
        return q.new_empty(q.shape)
    pos = mask.window_positions(window)
    pos = None if pos is None else pos.detach().to("cpu", torch.int64)
    plan = mask.cached(  # a bad block or fanout raises here (never cached)
        ("blocksparse", block, fanout) + (("bidirectional",) if key_start is not None else ()),
        lambda: build_plan(mask.subtree_end, *block_and_fanout(mask.subtree_end, block, fanout), key_start),
    )
    return _BlockSparseAttention.apply(q, k, v, plan, scale, pos, window, sinks, alibi, rel_bias, rel_pos)
