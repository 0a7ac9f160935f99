"""Tree-aware data parallelism (``treetrain.parallel.balance``): FLOP-balanced plans and imbalance."""

from __future__ import annotations

import random

import pytest

from treetrain import TrajectoryTree
from treetrain.parallel.balance import balanced_plan, imbalance, makespan, rank_loads, split_in_two
from treetrain.trees.flops import tree_cost


def test_imbalance_and_loads():
    assert imbalance([3.0, 1.0]) == 1.5
    assert imbalance([2.0, 2.0, 2.0]) == 1.0
    assert imbalance([0.0, 0.0]) == 1.0
    assert rank_loads([5.0, 1.0, 2.0], [[0], [1, 2]]) == [5.0, 3.0]
    assert makespan([10.0, 1.0, 1.0], 2) == 10.0


def _tree(rng: random.Random, prefix: int, paths: int, tail: int) -> TrajectoryTree:
    head = [rng.randrange(50) for _ in range(prefix)]
    return TrajectoryTree.from_paths([head + [rng.randrange(50) for _ in range(tail)] for _ in range(paths)])


def _paths(pieces: list[TrajectoryTree]) -> list[tuple[int, ...]]:
    return sorted(tuple(p) for t in pieces for p in t.paths())


def test_split_in_two_keeps_every_path():
    tree = _tree(random.Random(0), 8, 6, 20)
    parts = split_in_two(tree)
    assert len(parts) >= 2
    assert _paths(parts) == _paths([tree])
    assert all(p.num_tokens < tree.num_tokens for p in parts)
    single = TrajectoryTree.from_paths([[1, 2, 3]])
    assert split_in_two(single) == [single]


def test_one_big_tree_is_split_across_ranks():
    rng = random.Random(1)
    big = _tree(rng, 16, 8, 40)  # ~340 tokens
    small = [_tree(rng, 4, 2, 5) for _ in range(3)]
    pieces = [big, *small]
    before = imbalance(rank_loads([tree_cost(p) for p in pieces], _lpt(pieces, 4)))
    out, plan, after = balanced_plan(pieces, 4, tree_cost)
    assert before > 2.0 and after < 1.5, (before, after)
    assert _paths(out) == _paths(pieces)  # every path in exactly one piece
    assert sorted(i for items in plan for i in items) == list(range(len(out)))
    assert after == pytest.approx(imbalance(rank_loads([tree_cost(p) for p in out], plan)))


def test_balanced_trees_are_not_split():
    rng = random.Random(2)
    pieces = [_tree(rng, 10, 3, 10) for _ in range(8)]
    out, _, imb = balanced_plan(pieces, 2, tree_cost)
    assert len(out) == len(pieces) and imb < 1.2
    out, plan, imb = balanced_plan(pieces, 1, tree_cost)  # one rank: nothing to balance
    assert out == pieces and plan == [list(range(8))] and imb == 1.0


def _lpt(pieces, world):
    from treetrain.parallel.fsdp import assign_to_ranks

    return assign_to_ranks([tree_cost(p) for p in pieces], world)
