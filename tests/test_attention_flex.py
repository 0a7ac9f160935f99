"""FlexAttention backend: the BlockMask is built at block granularity from subtree_end."""

from __future__ import annotations

import torch

from treetrain import TrajectoryTree, pack
from treetrain.attention.dense import dense_attention
from treetrain.attention.flex import flex_tree_attention, tree_block_mask
from treetrain.attention.mask import TreeMask, block_classes, dense_tree_mask


def _group_tree(prompt=40, branches=5, tail=25):
    paths = [list(range(prompt)) + [1000 + b * 100 + i for i in range(tail)] for b in range(branches)]
    return pack(TrajectoryTree.from_paths(paths))


def test_block_tables_are_never_t_by_t():
    packed = _group_tree()
    T, block = packed.num_tokens, 16
    bm = tree_block_mask(packed.subtree_end, block=block)
    nb = -(-T // block)
    tensors = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
    for t in tensors:
        assert t.numel() <= nb * nb  # O((T / block)^2) ints
    assert max(t.numel() for t in tensors) < T * T // (block * block) + 2 * nb
    # the mask_mod closes over subtree_end [T] only
    closure = [c.cell_contents for c in bm.mask_mod.__closure__]
    assert all(c.numel() == T for c in closure if isinstance(c, torch.Tensor))


def test_block_classes_match_dense():
    packed = _group_tree(prompt=13, branches=4, tail=11)
    se, block = packed.subtree_end, 8
    any_allowed, full = block_classes(se, block)
    dense = dense_tree_mask(se)
    T = se.numel()
    for qb in range(any_allowed.shape[0]):
        for kb in range(any_allowed.shape[1]):
            tile = dense[qb * block : min(T, qb * block + block), kb * block : min(T, kb * block + block)]
            assert bool(full[qb, kb]) == bool(tile.all())
            if tile.any():
                assert any_allowed[qb, kb]


def test_flex_forward_matches_dense_on_cpu():
    packed = _group_tree(prompt=70, branches=3, tail=50)  # 220 tokens: partial and full blocks
    T = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, T, 16, generator=g)
    k, v = torch.randn(2, T, 16, generator=g), torch.randn(2, T, 16, generator=g)
    mask = TreeMask(packed.subtree_end)
    out = flex_tree_attention(q, k, v, mask, scale=0.25)
    ref = dense_attention(q, k, v, TreeMask(packed.subtree_end), scale=0.25)
    # float32, different accumulation order (online softmax per block vs one softmax)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()
