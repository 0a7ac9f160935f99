"""Bidirectional image blocks (``key_start``) in every CPU backend: key ``k`` is seen by the queries
``[key_start[k], subtree_end[k])``. blocksparse (forward and backward) and flex (forward; no CPU
backward) against the dense reference, on hand-written and random trees with random blocks; the
block-sparse plan covers every allowed pair once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.attention.blockplan import build_plan
from treetrain.attention.blocksparse import blocksparse_attention
from treetrain.attention.dense import dense_attention
from treetrain.attention.flex import flex_tree_attention
from treetrain.attention.mask import TreeMask, dense_tree_mask

from .test_attention_blocksparse import _coverage, _inputs, dfs_trees


def blocks_key_start(subtree_end: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """``key_start`` with an image block of up to ``length`` tokens at each of ``starts``, each block
    a chain (equal ``subtree_end``: inside one node) and disjoint from the others."""
    T = subtree_end.numel()
    key_start = torch.arange(T)
    taken = torch.zeros(T, dtype=torch.bool)
    for b in sorted(set(starts)):
        e = b
        while e < min(T, b + length) and subtree_end[e] == subtree_end[b] and not taken[e]:
            e += 1
        key_start[b:e] = b
        taken[b:e] = True
    return key_start


def test_hand_written_block_is_one_interval_per_key():
    """Paths ``t S P P P E a`` and ``t S P P P E b``: DFS ``t S P P P E a b``, the image ``P P P`` at
    2-4. Query 2 sees keys 0-4 (its block ahead of it); query 6 (a) sees 0-6; query 7 (b) not 6."""
    end = torch.tensor([8, 8, 8, 8, 8, 8, 7, 8])
    key_start = torch.tensor([0, 1, 2, 2, 2, 5, 6, 7])
    mask = dense_tree_mask(end, key_start=key_start)
    assert mask[2].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert mask[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert mask[7].tolist() == [1, 1, 1, 1, 1, 1, 0, 1]


def _errors(fn, subtree_end, key_start, dtype=torch.float64, backward=True, **kw):
    q, k, v, do = _inputs(subtree_end.numel(), 4, 2, 8, dtype)
    scale = q.shape[-1] ** -0.5
    got = fn(q, k, v, TreeMask(subtree_end), scale, key_start=key_start, **kw)
    ref = dense_attention(q, k, v, TreeMask(subtree_end), scale, key_start=key_start)
    errs = [float((got - ref).abs().max())]
    if backward:
        g = torch.autograd.grad(got, (q, k, v), do)
        r = torch.autograd.grad(ref, (q, k, v), do)
        errs += [float((a - b).abs().max() / b.abs().max().clamp_min(1)) for a, b in zip(g, r)]
    return errs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    subtree_end=dfs_trees(max_tokens=80),
    starts=st.lists(st.integers(0, 79), min_size=1, max_size=4),
    length=st.integers(2, 12),
    block=st.sampled_from([1, 2, 4, 8]),
    fanout=st.sampled_from([2, 4]),
)
def test_blocksparse_matches_dense(subtree_end, starts, length, block, fanout):
    key_start = blocks_key_start(subtree_end, [s % subtree_end.numel() for s in starts], length)
    errs = _errors(blocksparse_attention, subtree_end, key_start, block=block, fanout=fanout)
    assert max(errs) < 1e-12, errs
    plan = build_plan(subtree_end, block, fanout, key_start)
    allowed = dense_tree_mask(subtree_end, key_start=key_start)
    assert torch.equal(_coverage(plan, subtree_end.numel()), allowed.long())
    assert plan.allowed_pairs == int(allowed.sum())


@pytest.mark.parametrize("window", [None, 3])
def test_flex_forward_matches_dense(window):
    """flex on CPU (forward only: FlexAttention has no CPU backward), with and without a window."""
    end = torch.tensor([12, 12, 12, 12, 12, 12, 9, 9, 9, 12, 12, 12])
    key_start = blocks_key_start(end, [2, 6], 4)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8])
    q, k, v = (x.detach() for x in _inputs(12, 4, 2, 8, torch.float32)[:3])
    mask = TreeMask(end, position_ids=pos)
    got = flex_tree_attention(q, k, v, mask, 0.35, key_start=key_start, window=window)
    ref = dense_attention(q, k, v, TreeMask(end, position_ids=pos), 0.35, key_start=key_start, window=window)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
