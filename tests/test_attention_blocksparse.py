"""Block-sparse CPU tree attention == the dense reference: outputs and dq, dk, dv.

float64 is held to 1e-12 relative: both sides compute the same exact softmax attention, the dense
reference in one softmax over ``T`` keys, the block-sparse one as online softmax inside each
kernel call and log-sum-exp merges across calls. Only the summation order differs, which costs a
few float64 ulps (we measure ~1e-15); 1e-12 leaves three orders of margin and still catches any
wrong, missing or doubled (query, key) pair, which moves results by O(1 / T).
"""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.attention import blockrule, blocksparse
from treetrain.attention.blockplan import build_plan
from treetrain.attention.blocksparse import blocksparse_attention
from treetrain.attention.dense import dense_attention
from treetrain.attention.mask import TreeMask, check_subtree_end, dense_tree_mask

from .strategies import subtree_end_from_parents


def chains(*lengths: int, prefix: int = 0) -> torch.Tensor:
    """A shared ``prefix`` chain, then one chain per length hanging off its end (a root if none)."""
    parent = [t - 1 for t in range(prefix)]
    for n in lengths:
        parent += [prefix - 1] + list(range(len(parent), len(parent) + n - 1))
    return subtree_end_from_parents(parent)


@st.composite
def dfs_trees(draw, max_tokens: int = 96):
    """A random forest in DFS order: each token is a child of the previous one or of one of its
    ancestors, or starts a new root."""
    T = draw(st.integers(1, max_tokens))
    parent, path = [], []  # path: the previous token's ancestors, root first, then itself
    for t in range(T):
        keep = draw(st.integers(0, len(path)))  # 0: a new root
        path = path[:keep]
        parent.append(path[-1] if path else -1)
        path.append(t)
    return subtree_end_from_parents(parent)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


HAND_WRITTEN = {
    "design-doc": torch.tensor([8, 6, 4, 4, 6, 6, 8, 8]),
    "chain": chains(37),
    "group": chains(9, 14, 1, 20, prefix=23),
    "star": chains(*[1] * 30, prefix=1),
    "forest": chains(5, 17, 1, 11),
    "per-turn": subtree_end_from_parents(
        # spine of 3 turns, each with a leaf branch (the response with its reasoning)
        [-1, 0, 1, 2, 3, 2, 5, 6, 7, 8, 9, 7, 11, 12, 13, 14, 15, 13, 17]
    ),
}


def _inputs(T, hq, hkv, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, T, dim, generator=g, dtype=torch.float64)
    k = torch.randn(hkv, T, dim, generator=g, dtype=torch.float64)
    v = torch.randn(hkv, T, dim, generator=g, dtype=torch.float64)
    do = torch.randn(hq, T, dim, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_(i < 3) for i, x in enumerate((q, k, v, do))]


def _run(fn, q, k, v, do, subtree_end, **kw):
    out = fn(q, k, v, TreeMask(subtree_end), scale=q.shape[-1] ** -0.5, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def _rel_errors(subtree_end, block, dtype, hq=4, hkv=2, dim=8, seed=0, fanout=None):
    """Max error of (out, dq, dk, dv), blocksparse in ``dtype`` vs dense in float64, relative to
    ``max(|reference|, 1)`` (a one-token tree has dq = dk = 0 exactly)."""
    q, k, v, do = _inputs(subtree_end.numel(), hq, hkv, dim, dtype, seed)
    got = _run(blocksparse_attention, q, k, v, do, subtree_end, block=block, fanout=fanout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _run(dense_attention, q64, k64, v64, do.double(), subtree_end)
    return [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1)) for a, b in zip(got, ref)]


@pytest.mark.parametrize("name", HAND_WRITTEN)
@pytest.mark.parametrize("block", [1, 4, 8, 1024])  # down to one token; 1024: larger than T
def test_float64_hand_written(name, block):
    errs = _rel_errors(HAND_WRITTEN[name], block, torch.float64)
    assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_float32_hand_written(name):
    errs = _rel_errors(HAND_WRITTEN[name], 4, torch.float32, dim=16)
    assert max(errs) < 2e-5, errs


@pytest.mark.parametrize("name", ["group", "per-turn"])
def test_bfloat16_as_accurate_as_dense(name):
    # bf16 rounds q, k, v and the output: hold blocksparse to the dense bf16 path's own error
    se = HAND_WRITTEN[name]
    q, k, v, do = _inputs(se.numel(), 4, 2, 32, torch.bfloat16)
    got = _run(blocksparse_attention, q, k, v, do, se, block=8)
    dense = _run(dense_attention, q, k, v, do, se)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _run(dense_attention, q64, k64, v64, do.double(), se)
    for a, d, r in zip(got, dense, ref):
        assert a.dtype == torch.bfloat16
        err, dense_err = (float((x.double() - r).abs().max() / r.abs().max()) for x in (a, d))
        assert err < 2 * dense_err + 1e-3, (err, dense_err)


def test_rows_whose_first_kernel_block_is_all_masked():
    # two 600-token trees in one 1024-row tile: the kernel walks keys in blocks of 512, so rows of
    # the second tree see nothing in the first block (the online softmax must skip it cleanly)
    se = chains(600, 600)
    errs = _rel_errors(se, 1024, torch.float64, hq=2, hkv=1, dim=4)
    assert max(errs) < 1e-12, errs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    subtree_end=dfs_trees(),
    block=st.sampled_from([1, 2, 3, 4, 8, 16]),
    fanout=st.sampled_from([2, 4, 8]),
    heads=st.sampled_from([1, 2]),
)
def test_float64_random_trees(subtree_end, block, fanout, heads):
    check_subtree_end(subtree_end)
    errs = _rel_errors(subtree_end, block, torch.float64, hq=2 * heads, hkv=heads, fanout=fanout)
    assert max(errs) < 1e-12, errs


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subtree_end=dfs_trees(), block=st.sampled_from([2, 4, 8]))
def test_float32_random_trees(subtree_end, block):
    errs = _rel_errors(subtree_end, block, torch.float32, hq=3, hkv=1, dim=16)
    assert max(errs) < 2e-5, errs


def _coverage(plan, T):
    """How many times the plan's tiles compute each (query, key) pair, unmasked."""
    seen = torch.zeros(T, T, dtype=torch.int64)
    for t in plan.tiles:
        keys = torch.arange(t.key_start, t.key_stop) if t.index is None else t.index
        rows = t.stop - t.start
        if t.causal:
            allowed = torch.ones(rows, rows, dtype=torch.bool).tril()
        elif t.mask is not None:
            allowed = t.mask
            assert bool(allowed.any(1).all()), "a row with no key: the kernel returns lse = 0 there"
        else:
            allowed = torch.ones(rows, keys.numel(), dtype=torch.bool)
        seen[t.start : t.stop, keys] += allowed.long()
    return seen


@settings(max_examples=60, deadline=None)
@given(
    subtree_end=dfs_trees(max_tokens=160),
    block=st.sampled_from([1, 2, 4, 8, 32]),
    fanout=st.sampled_from([2, 3, 4, 8]),
)
def test_plan_covers_each_allowed_pair_once(subtree_end, block, fanout):
    T = subtree_end.numel()
    plan = build_plan(subtree_end, block, fanout)
    assert torch.equal(_coverage(plan, T), dense_tree_mask(subtree_end).long())
    assert plan.allowed_pairs == int(dense_tree_mask(subtree_end).sum())
    # the masked-out work: the local tiles' upper triangles, plus each key at most once in the
    # one local tile whose rows its subtree ends in
    assert plan.computed_pairs <= plan.allowed_pairs + 1.5 * T * block
    local = plan.tiles[: plan.num_local]
    assert [(t.start, t.stop) for t in local] == [(s, min(s + block, T)) for s in range(0, T, block)]


def test_disjoint_trees_skip_each_other():
    # eight independent chains of 64 tokens: no tile may reach across chains
    se = chains(*[64] * 8)
    plan = build_plan(se, block=16)
    for t in plan.tiles:
        keys = torch.arange(t.key_start, t.key_stop) if t.index is None else t.index
        assert keys.min() // 64 == keys.max() // 64 == t.start // 64 == (t.stop - 1) // 64
    # the only masked-out work: upper triangles of the local tiles that also see earlier keys
    assert plan.computed_pairs <= plan.allowed_pairs + 512 * 15 // 2


def test_group_tree_work_is_the_allowed_pairs():
    se = chains(*[200] * 6, prefix=300)
    T = se.numel()
    plan = build_plan(se, block=64)
    assert plan.allowed_pairs < 0.6 * T * (T + 1) // 2
    # nothing but the local tiles' upper triangles (and a little at the branch boundaries)
    assert plan.computed_pairs <= plan.allowed_pairs + T * 63 // 2 + 2 * 64**2


def test_plan_is_cached_across_layers():
    se = HAND_WRITTEN["group"]
    mask = TreeMask(se)
    q, k, v, _ = _inputs(se.numel(), 2, 2, 8, torch.float64)
    blocksparse_attention(q, k, v, mask, scale=0.3, block=8)
    plan = mask.cache[("blocksparse", 8, None)]
    blocksparse_attention(q, k, v, mask, scale=0.3, block=8)
    assert mask.cache[("blocksparse", 8, None)] is plan
    assert len(plan._additive) == 1  # one set of kernel masks per (dtype, GQA group size)


# a 2,000-token prompt and 8 branches of 40: segment mean (2000^2 + 8 * 40^2) / 2320 ~ 1730, a long
# prompt for any rule with a threshold; 2,320 tokens make several levels at every block the rule picks
LONG_PROMPT = chains(*[40] * 8, prefix=2000)
SHORT_BRANCHES = chains(*[24] * 12, prefix=40)  # segment mean (40^2 + 12 * 24^2) / 328 ~ 26


def test_block_rule_picks_by_segment_mean(monkeypatch):
    assert blockrule.segment_mean(chains(10)) == 10.0
    assert blockrule.segment_mean(chains(3, 1, prefix=2)) == (4 + 9 + 1) / 6
    assert blockrule.choose_block(LONG_PROMPT) == blockrule.choose_block(SHORT_BRANCHES) == (128, 4)
    # the first row whose threshold the mean reaches wins
    monkeypatch.setattr(blockrule, "BLOCK_RULE", ((100, 32, 2), (20, 16, 3), (0, 8, 4)))
    assert blockrule.choose_block(SHORT_BRANCHES) == (16, 3)
    assert blockrule.choose_block(LONG_PROMPT) == (32, 2)


def test_chosen_block_is_used_and_cached():
    mask = TreeMask(LONG_PROMPT)
    q, k, v, _ = _inputs(LONG_PROMPT.numel(), 2, 1, 4, torch.float64)
    blocksparse_attention(q, k, v, mask, scale=0.5)
    plan = mask.cache[("blocksparse", None, None)]
    assert (plan.block, plan.fanout) == (128, 4)
    blocksparse_attention(q, k, v, mask, scale=0.5, fanout=2)  # an explicit fanout, the rule's block
    plan = mask.cache[("blocksparse", None, 2)]
    assert (plan.block, plan.fanout) == (128, 2)
    with pytest.raises(ValueError, match="fanout >= 2"):
        blocksparse_attention(q, k, v, mask, scale=0.5, fanout=1)


@pytest.mark.parametrize("block,fanout", [(64, 4), (64, 8), (128, 4), (128, 8), (256, 4), (256, 8)])
def test_rule_sizes_cover_each_allowed_pair_once(block, fanout):
    # every block and fanout the rule can pick, on the tree shape it picks them for: each allowed
    # pair computed exactly once (the numerics then follow from the kernel, checked below)
    T = LONG_PROMPT.numel()
    plan = build_plan(LONG_PROMPT, block, fanout)
    assert torch.equal(_coverage(plan, T), dense_tree_mask(LONG_PROMPT).long())
    assert plan.computed_pairs <= plan.allowed_pairs + 1.5 * T * block


@pytest.mark.parametrize("se", [LONG_PROMPT, SHORT_BRANCHES], ids=["long-prompt", "short-branches"])
@pytest.mark.parametrize("block,fanout", [(None, None), (64, 4), (256, 8), (128, 8)])
def test_float64_any_block_and_fanout(se, block, fanout):
    q, k, v, do = _inputs(se.numel(), 2, 1, 4, torch.float64)
    got = _run(blocksparse_attention, q, k, v, do, se, block=block, fanout=fanout)
    ref = _run(dense_attention, q, k, v, do, se)
    errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1)) for a, b in zip(got, ref)]
    assert max(errs) < 1e-12, errs


def test_token_major_inputs_and_partial_grads():
    # q, k, v as [H, T, D] views of [T, H, D] storage (how attention layers produce them)
    se = HAND_WRITTEN["forest"]
    T = se.numel()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, 4, 8, generator=g, dtype=torch.float64).transpose(0, 1).requires_grad_()
    k, v = (torch.randn(T, 1, 8, generator=g, dtype=torch.float64).transpose(0, 1) for _ in range(2))
    out = blocksparse_attention(q, k, v, TreeMask(se), scale=0.35, block=4)
    ref = dense_attention(q, k, v, TreeMask(se), scale=0.35)
    (dq,) = torch.autograd.grad(out, q, out.detach())
    (dq_ref,) = torch.autograd.grad(ref, q, out.detach())
    assert torch.allclose(out, ref, rtol=0, atol=1e-13)
    assert torch.allclose(dq, dq_ref, rtol=0, atol=1e-12)


def test_gradcheck():
    se = HAND_WRITTEN["design-doc"]
    q, k, v, _ = _inputs(se.numel(), 2, 1, 2, torch.float64)
    fn = lambda q, k, v: blocksparse_attention(q, k, v, TreeMask(se), scale=0.5, block=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_edge_cases():
    q = torch.randn(2, 0, 8)
    assert blocksparse_attention(q, q, q, TreeMask(torch.zeros(0, dtype=torch.int64)), 1.0).shape == (2, 0, 8)
    se = HAND_WRITTEN["chain"]
    q, k, v, _ = _inputs(se.numel(), 3, 2, 8, torch.float64)
    with pytest.raises(ValueError, match="multiple"):
        blocksparse_attention(q, k, v, TreeMask(se), 1.0)
    with pytest.raises(ValueError, match="block"):
        build_plan(se, 0)


def test_docstring_examples():
    assert doctest.testmod(blocksparse).failed == 0
    assert doctest.testmod(blockrule).failed == 0
