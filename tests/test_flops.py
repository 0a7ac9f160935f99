"""FLOP accounting of what each mode computes, on hand-written trees with the numbers spelled out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treetrain import TrajectoryTree
from treetrain.trees.flops import CostModel, Work, baseline_work, flop_bound, tree_work

from .reference import tiny_model

# paths [A B C D], [A B E F], [A G H] (DFS A B C D E F G H, positions 0 1 2 3 2 3 1 2)
PATHS = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]
# a tiny shape: attention projections 8 * 4 * (2*2 + 2*1) = 192, MLP 3 * 8 * 16 = 384 per layer
COST = CostModel.from_config(
    SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        vocab_size=10,
        num_attention_heads=2,
        head_dim=4,
        num_key_value_heads=1,
        intermediate_size=16,
    )
)


def test_cost_model_of_a_tiny_shape():
    assert COST.linear == 2 * 2 * (192 + 384) == 2304  # 2 FLOPs per multiply-add, 2 layers
    assert COST.per_pair == 4 * 2 * 4 * 2 == 64  # QK^T and PV, 2 heads x 4 dims, 2 layers
    assert COST.head == 2 * 8 * 10 == 160
    assert COST.per_token == 2304 + 160


def test_linear_flops_are_twice_the_decoder_matmul_parameters():
    model = tiny_model("qwen3", dtype=torch.float32)
    cost = CostModel.from_config(model.config)
    layers = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n)
    assert cost.linear == 2.0 * layers
    assert cost.head == 2.0 * model.lm_head.weight.numel()


def test_work_of_every_target_trained():
    tree = TrajectoryTree.from_paths(PATHS)
    # tree: 8 tokens; pairs sum(position + 1) = 1+2+3+4+3+4+2+3 = 22; targets: every DFS token but
    # the root's first (B C D E F G H) = 7
    assert tree_work([tree]) == Work(tokens=8, pairs=22, targets=7)
    # baseline: 4 + 4 + 3 = 11 tokens; pairs 10 + 10 + 6 = 26; targets 3 + 3 + 2 = 8
    assert baseline_work([tree]) == Work(tokens=11, pairs=26, targets=8)
    assert Work(8, 22, 7).flops(COST) == 3 * (8 * 2304 + 22 * 64 + 7 * 160) == 62880
    assert Work(11, 26, 8).flops(COST) == 3 * (11 * 2304 + 26 * 64 + 8 * 160) == 84864
    assert flop_bound([tree], COST) == pytest.approx(84864 / 62880)


def test_head_counts_only_trained_targets():
    # path 0 trains C D, path 1 trains B E F, path 2 trains nothing
    masks = [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0]]
    tree = TrajectoryTree.from_paths(PATHS, loss_masks=masks)
    # tree: distinct trained targets C D B E F = 5 (B trained by path 1 only, scored once)
    assert tree_work([tree]) == Work(tokens=8, pairs=22, targets=5)
    # baseline: 2 + 3 + 0 = 5 targets, each path scores its own
    assert baseline_work([tree]) == Work(tokens=11, pairs=26, targets=5)
    # a prefix both paths train on is scored once by the tree, twice by the baseline
    both = TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4]], loss_masks=[[0, 1, 1], [0, 1, 1]])
    assert tree_work([both]).targets == 3 and baseline_work([both]).targets == 4


def test_partitioned_tree_counts_its_parts():
    tree = TrajectoryTree.from_paths(PATHS)
    # capacity 6: parts {P0, P1} = A B C D E F (6 tokens) and {P2} = A G H (3 tokens)
    parts = tree.partition(6)
    assert sorted(p.num_tokens for p in parts) == [3, 6]
    # pairs 1+2+3+4+3+4 = 17 and 1+2+3 = 6; targets 5 and 2
    assert tree_work(parts) == Work(tokens=9, pairs=23, targets=7)
    assert flop_bound([tree], COST, capacity=6) == pytest.approx(84864 / Work(9, 23, 7).flops(COST))


def test_recomputed_head_and_checkpointing_are_priced():
    # a head that recomputes its logits in backward: one more forward head matmul per such target
    assert Work(8, 22, 7, recomputed=7).flops(COST) == Work(8, 22, 7).flops(COST) + 7 * 160
    # checkpointing: every layer's forward again but the MLP's down projection (2 * 8 * 16 per
    # layer), and every attention pair again
    assert COST.checkpointed == 2 * 2 * (192 + 2 * 8 * 16) == 1792
    assert Work(8, 22, 7).flops(COST, checkpointing=True) == Work(8, 22, 7).flops(COST) + 8 * 1792 + 22 * 64
    assert Work(8, 22, 7).forward_flops(COST) == 8 * 2304 + 22 * 64 + 7 * 160
    # treetrain's head keeps a call's logits up to the budget, all or none
    from treetrain.trees.flops import recomputed_targets

    assert recomputed_targets([10, 30], vocab=10, keep_bytes=800) == 30  # 400 bytes kept, 1,200 not
