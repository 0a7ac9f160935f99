"""TrajectoryTree and pack(): hand-written layouts and properties over random trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treetrain import TrajectoryTree, pack
from treetrain.attention.mask import dense_tree_mask
from treetrain.trees.partition import partition

from .strategies import tree_paths

A, B, C, D, E, F, G, H = range(10, 18)


def test_design_example():
    packed = pack(TrajectoryTree.from_paths([[A, B, C, D], [A, B, E, F], [A, G, H]]))
    assert packed.input_ids.tolist() == [A, B, C, D, E, F, G, H]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 2, 3, 1, 2]
    assert packed.subtree_end.tolist() == [8, 6, 4, 4, 6, 6, 8, 8]
    assert packed.prev.tolist() == [-1, 0, 1, 2, 1, 4, 0, 6]
    assert packed.path_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 0, 6, 7]
    assert packed.path_offsets.tolist() == [0, 4, 8, 11]
    assert packed.target_index().tolist() == [1, 2, 3, 1, 4, 5, 6, 7]
    assert packed.node_start.tolist() == [0, 1, 2, 4, 6]
    assert packed.node_parent.tolist() == [-1, 0, 1, 1, 0]
    mask = dense_tree_mask(packed.subtree_end).int()
    assert mask[4].tolist() == [1, 1, 0, 0, 1, 0, 0, 0]  # E sees A B E
    assert mask[7].tolist() == [1, 0, 0, 0, 0, 0, 1, 1]  # H sees A G H


def test_duplicates_prefixes_and_forest():
    tree = TrajectoryTree.from_paths([[5, 6, 7], [5, 6], [5, 6, 7], [5], [9, 9]])
    assert tree.num_tokens == 5 and tree.num_path_tokens == 11 and tree.num_paths == 5
    assert [p.tolist() for p in tree.paths()] == [[5, 6, 7], [5, 6], [5, 6, 7], [5], [9, 9]]
    packed = pack(tree)
    assert packed.input_ids.tolist() == [5, 6, 7, 9, 9]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert packed.subtree_end.tolist() == [3, 3, 3, 5, 5]
    assert packed.prev.tolist() == [-1, 0, 1, -1, 3]
    assert tree.path_counts().tolist() == [4, 3, 2, 1, 1]


def test_forest_of_trees_shifts_indices():
    t1 = TrajectoryTree.from_paths([[1, 2], [1, 3]])
    t2 = TrajectoryTree.from_paths([[4, 5, 6]])
    packed = pack([t1, t2])
    assert packed.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert packed.subtree_end.tolist() == [3, 2, 3, 6, 6, 6]
    assert packed.prev.tolist() == [-1, 0, 0, -1, 3, 4]
    assert packed.path_index.tolist() == [0, 1, 0, 2, 3, 4, 5]
    assert packed.node_parent.tolist() == [-1, 0, 0, -1]


def test_one_token_segments_and_split_keeps_leaves():
    # [1 2 3 4] then [1 2] then [1 2 3 9]: the first node is split twice after being a leaf.
    tree = TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2], [1, 2, 3, 9], [1, 7]])
    assert [p.tolist() for p in tree.paths()] == [[1, 2, 3, 4], [1, 2], [1, 2, 3, 9], [1, 7]]
    segs = [tree.tokens[s:e].tolist() for s, e in zip(tree.node_start, tree.node_end)]
    assert segs == [[1], [2], [3], [4], [9], [7]]
    assert tree.node_parent.tolist() == [-1, 0, 1, 2, 2, 0]
    assert tree.node_end[tree.path_leaf].tolist() == [4, 2, 5, 6]


def test_deep_tree_no_recursion_limit():
    long = list(range(1, 30001))
    tree = TrajectoryTree.from_paths([long, long[:20000] + [0], long[:5]])
    assert tree.num_tokens == 30001
    assert pack(tree).position_ids.max().item() == 29999


def test_wide_tree():
    paths = [[0, i] for i in range(1, 5001)]
    tree = TrajectoryTree.from_paths(paths)
    assert tree.num_tokens == 5001 and tree.num_nodes == 5001
    assert pack(tree).subtree_end[0].item() == 5001


@pytest.mark.parametrize(
    "paths, msg",
    [
        ([], "non-empty list"),
        ([[1, 2], []], "path 1: empty path"),
        ([[1, 2], [1, -3]], "path 1: token ids must be >= 0, got -3 at position 1"),
        ([[1, 2.5]], "path 0: token ids must be integers, got 2.5"),
        ([[1], ["a"]], "path 1: token ids must be integers"),
        ([[1], [[1, 2]]], "path 1: expected a flat list"),
        ([np.array([True, False])], "path 0: token ids must be integers"),
    ],
)
def test_bad_paths_name_the_path(paths, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        TrajectoryTree.from_paths(paths)


def test_metadata_validation():
    with pytest.raises(ValueError, match=r"loss_masks\[1\]: expected 2 values"):
        TrajectoryTree.from_paths([[1, 2, 3], [1, 2]], loss_masks=[[0, 1, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match=r"old_logprobs\[0\]: expected 2 values \(len\(path\) - 1"):
        TrajectoryTree.from_paths([[1, 2, 3]], old_logprobs=[[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="weights: expected one entry per path"):
        TrajectoryTree.from_paths([[1, 2, 3]], weights=[1.0, 2.0])
    tree = TrajectoryTree.from_paths([[1, 2], [1, 3]], advantages=[1.0, -1.0], weights=[1, 2])
    assert tree.fields["advantages"].tolist() == [1.0, -1.0]


def test_from_nodes_matches_from_paths():
    # root [1 2] -> {[3], [4 5] -> {[6], []}} : the empty segment makes [1 2 4 5] a path too
    tree = TrajectoryTree.from_nodes([-1, 0, 0, 2, 2], [[1, 2], [3], [4, 5], [6], []])
    assert [p.tolist() for p in tree.paths()] == [[1, 2, 3], [1, 2, 4, 5, 6], [1, 2, 4, 5]]
    with pytest.raises(ValueError, match="node 1: parent must be -1"):
        TrajectoryTree.from_nodes([-1, 3], [[1], [2]])


def test_render_and_repr():
    tree = TrajectoryTree.from_paths([[A, B, C, D], [A, B, E, F], [A, G, H]])
    text = tree.render()
    assert "por=27.3%" in repr(tree)
    assert text.splitlines()[1:] == [
        "- 10",
        "  - 11",
        "    - 12 13  [path 0]",
        "    - 14 15  [path 1]",
        "  - 16 17  [path 2]",
    ]


def _distinct_prefixes(paths) -> int:
    return len({tuple(p[: i + 1]) for p in paths for i in range(len(p))})


@settings(max_examples=300, deadline=None)
@given(paths=tree_paths(vocab=6, max_paths=10, max_len=10))
def test_properties(paths):
    tree = TrajectoryTree.from_paths(paths)
    packed = pack(tree)
    T = packed.num_tokens
    # every path recoverable; distinct tokens = distinct prefixes
    assert [p.tolist() for p in tree.paths()] == paths
    assert T == _distinct_prefixes(paths) == tree.num_tokens
    assert tree.num_path_tokens == sum(map(len, paths))
    ids, pos, se, prev = (
        x.numpy() for x in (packed.input_ids, packed.position_ids, packed.subtree_end, packed.prev)
    )
    for p, path in enumerate(paths):
        idx = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]].numpy()
        assert ids[idx].tolist() == path
        assert pos[idx].tolist() == list(range(len(path)))
        assert prev[idx[1:]].tolist() == idx[:-1].tolist() and prev[idx[0]] == -1
        # the mask lets each path position see exactly its own prefix
        mask = dense_tree_mask(packed.subtree_end)
        for j, q in enumerate(idx):
            assert torch.nonzero(mask[q])[:, 0].tolist() == sorted(idx[: j + 1].tolist())
    assert (se > np.arange(T)).all() and (se <= T).all()
    # nodes: contiguous cover in DFS order, parents first
    assert packed.node_start[0] == 0 and (packed.node_start[1:] == packed.node_end[:-1]).all()
    assert (packed.node_parent < torch.arange(len(packed.node_parent))).all()


@settings(max_examples=50, deadline=None)
@given(paths=tree_paths(vocab=4, max_paths=8, max_len=8), perm_seed=st.integers(0, 1000))
def test_input_order_does_not_change_the_tree(paths, perm_seed):
    perm = np.random.default_rng(perm_seed).permutation(len(paths))
    a = pack(TrajectoryTree.from_paths(paths))
    b = pack(TrajectoryTree.from_paths([paths[i] for i in perm]))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.subtree_end, b.subtree_end)


def test_subset_keeps_metadata_and_ids():
    tree = TrajectoryTree.from_paths([[1, 2], [1, 3], [4]], weights=[1.0, 2.0, 3.0])
    sub = tree.subset([2, 0])
    assert [p.tolist() for p in sub.paths()] == [[4], [1, 2]]
    assert sub.path_ids.tolist() == [2, 0] and sub.fields["weights"].tolist() == [3.0, 1.0]
    assert sub.subset([1]).path_ids.tolist() == [0]


def test_split_by_keys_by_hand():
    """Paths of different keys share no token; order, ids, metadata and the partition keep that."""
    tree = TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 5]], weights=[1.0, 2.0, 3.0])
    split = tree.split_by([0, 1, 0])
    assert split.num_tokens == 7 and split.tokens.tolist() == [1, 2, 3, 5, 1, 2, 4]
    assert [p.tolist() for p in split.paths()] == [[1, 2, 3], [1, 2, 4], [1, 5]]
    assert split.path_index[1].tolist() == [4, 5, 6] and split.fields["weights"].tolist() == [1.0, 2.0, 3.0]
    assert split.path_groups.tolist() == [0, 1, 0] and split.path_ids.tolist() == [0, 1, 2]
    assert tree.split_by([3, 3, 3]).num_tokens == 5  # one key: the same trie, nothing repeated
    sub = split.subset([1, 0])  # a subset (and so every partition part) stays split
    assert sub.num_tokens == 6 and sub.path_groups.tolist() == [1, 0]
    assert split.split_by([0, 0, 1]).num_tokens == 8  # combined with the groups it has: 3 groups
    for part in partition(split, 4):  # parts of whole paths, each still split by group
        groups = part.path_groups
        by_group = [[q for q, h in zip(part.paths(), groups) if h == g] for g in set(groups)]
        assert part.num_tokens == sum(TrajectoryTree.from_paths(q).num_tokens for q in by_group)


@settings(max_examples=50, deadline=None)
@given(paths=tree_paths(vocab=4, max_paths=8, max_len=8), seed=st.integers(0, 1000))
def test_split_by_properties(paths, seed):
    keys = np.random.default_rng(seed).integers(0, 3, len(paths))
    split = TrajectoryTree.from_paths(paths).split_by(keys)
    assert [p.tolist() for p in split.paths()] == paths
    owner = np.full(split.num_tokens, -1)
    for p, idx in enumerate(split.path_index):  # no token on paths of two keys
        assert ((owner[idx] == -1) | (owner[idx] == keys[p])).all()
        owner[idx] = keys[p]
    per_key = [TrajectoryTree.from_paths([q for q, k in zip(paths, keys) if k == g]) for g in set(keys)]
    assert split.num_tokens == sum(t.num_tokens for t in per_key)  # each key's prefixes once
