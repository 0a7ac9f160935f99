"""partition(): every path once, every part within budget, total tokens against the exact optimum
and against first-fit in input order; gradients of a globally normalized loss equal the
unpartitioned tree's for any partition; forest packing into micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.partition import SHAPES, err, plan_tokens, small_tree
from treetrain import TrajectoryTree, path_logprobs
from treetrain.trees.partition import (
    METHODS,
    lower_bound,
    pack_microbatches,
    partition,
    partition_stats,
    plan,
)
from treetrain.trees.partition_methods import MAX_OPTIMAL_LEAVES

from .reference import float64_casts, grads, random_coeffs, rel_err, tiny_model
from .strategies import tree_paths

A, B, C, D, E, F, G, H = range(10, 18)
DESIGN = [[A, B, C, D], [A, B, E, F], [A, G, H]]


def check_parts(tree: TrajectoryTree, parts: list[TrajectoryTree], capacity: int) -> None:
    """Every path of ``tree`` in exactly one part, unchanged; every part within the budget."""
    ids = np.concatenate([p.path_ids for p in parts])
    assert sorted(ids.tolist()) == sorted(tree.path_ids.tolist())
    where = {int(pid): k for k, pid in enumerate(tree.path_ids)}
    for part in parts:
        assert part.num_tokens <= capacity
        for j, i in enumerate(part.path_ids.tolist()):
            assert part.path(j).tolist() == tree.path(where[i]).tolist()


@st.composite
def trees_with_capacity(draw, **kw) -> tuple[TrajectoryTree, int]:
    """A random tree and a budget between its longest path and its size."""
    tree = TrajectoryTree.from_paths(draw(tree_paths(**kw)))
    longest = int(tree.path_lengths.max())
    return tree, draw(st.integers(longest, max(longest, tree.num_tokens - 1)))


# ---- hand-checked cases -------------------------------------------------------------------------


def test_design_example_and_stats():
    tree = TrajectoryTree.from_paths(DESIGN)
    parts = partition(tree, 6)
    check_parts(tree, parts, 6)
    assert [p.path_ids.tolist() for p in parts] == [[0, 1], [2]]
    stats = partition_stats(tree, parts)
    assert stats["tree_tokens"] == 8 and stats["baseline_tokens"] == 11
    assert stats["partitioned_tokens"] == 9 and stats["num_parts"] == 2
    assert stats["por"] == pytest.approx(3 / 11) and stats["err"] == pytest.approx(2 / 3)
    assert partition_stats(tree, [tree])["err"] == 1.0
    chain = TrajectoryTree.from_paths([[1, 2, 3]])  # nothing shared: POR 0, ERR 1 by definition
    assert (partition_stats(chain, [chain])["por"], partition_stats(chain, [chain])["err"]) == (0.0, 1.0)


@pytest.mark.parametrize("method", METHODS)
def test_a_tree_that_fits_is_returned_unchanged(method):
    tree = TrajectoryTree.from_paths(DESIGN)
    assert partition(tree, tree.num_tokens, method)[0] is tree
    assert len(partition(tree, 100, method)) == 1


def test_errors_name_the_problem():
    tree = TrajectoryTree.from_paths([[1, 2], [1, 2, 3, 4, 5, 6, 7], [9]])
    with pytest.raises(ValueError, match=r"path 1 has 7 tokens, more than the capacity of 5"):
        partition(tree, 5)
    with pytest.raises(ValueError, match="method"):
        partition(tree, 8, method="magic")
    with pytest.raises(ValueError, match="capacity"):
        partition(tree, 0)
    many = TrajectoryTree.from_paths([[0, i] for i in range(1, MAX_OPTIMAL_LEAVES + 2)])
    with pytest.raises(ValueError, match="at most"):
        partition(many, 4, method="optimal")


def test_duplicates_and_prefix_paths_each_land_once_for_free():
    # [1 2] and [1] are prefixes of the others, [1 2 3] appears twice
    paths = [[1, 2, 3], [1, 2], [1, 2, 3], [1], [1, 4, 5, 6], [1, 2, 7, 8], [9, 9]]
    tree = TrajectoryTree.from_paths(paths)
    for method in METHODS:
        parts = partition(tree, 5, method)
        check_parts(tree, parts, 5)
        where = {int(i): k for k, p in enumerate(parts) for i in p.path_ids}
        assert where[0] == where[2]  # duplicates together
        assert where[1] in (where[0], where[5])  # a prefix rides with a path it is a prefix of
    assert plan_tokens(tree, plan(tree, 5)) == plan_tokens(tree, plan(tree, 5, "optimal")) == 11


def test_metadata_travels_and_ids_compose():
    paths = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8], [1, 7, 9, 9]]
    tree = TrajectoryTree.from_paths(
        paths, weights=[1.0, 2.0, 3.0, 4.0], advantages=[0.5, -0.5, 1.5, -1.5]
    ).subset([3, 2, 1, 0])  # ids now compose through a subset
    for part in partition(tree, 6):
        ids = part.path_ids
        assert part.fields["weights"].tolist() == (ids + 1.0).tolist()  # path i had weight i + 1
        assert part.fields["advantages"].tolist() == [[0.5, -0.5, 1.5, -1.5][i] for i in ids]
    check_parts(tree, partition(tree, 6), 6)


def test_methods_on_a_hand_example():
    # one prompt [P P] with continuations of 4, 3, 3, 2 tokens, in that input order; capacity 8
    # (room 6 below the prompt): first fit [4], [3 3], [2]; packing [4 2], [3 3].
    paths = [[0, 0, 1, 1, 1, 1], [0, 0, 2, 2, 2], [0, 0, 3, 3, 3], [0, 0, 4, 4]]
    tree = TrajectoryTree.from_paths(paths)
    assert [g.tolist() for g in plan(tree, 8, "first_fit")] == [[0], [1, 2], [3]]
    assert [g.tolist() for g in plan(tree, 8, "greedy_dfs")] == [[0], [1, 2], [3]]  # deepest first: no 4 + 2
    for method in ("beam_dp", "optimal"):
        assert [g.tolist() for g in plan(tree, 8, method)] == [[0, 3], [1, 2]], method
    assert [g.tolist() for g in plan(tree, 8, "single_path")] == [[0], [1], [2], [3]]


def test_single_path_is_optimal_on_a_forest_of_chains():
    rng = np.random.default_rng(0)
    paths = []
    for d in range(5):  # per-turn samples of 5 dialogues: nested prefixes
        dialogue = (1000 * d + rng.integers(0, 999, 60)).tolist()
        cuts = sorted(rng.choice(np.arange(2, 60), size=4, replace=False).tolist())
        paths += [dialogue[:c] for c in cuts]
    tree = TrajectoryTree.from_paths(paths)
    for cap in (60, 90, 150):
        opt = plan_tokens(tree, plan(tree, cap, "optimal"))
        assert plan_tokens(tree, plan(tree, cap, "single_path")) == opt
        assert plan_tokens(tree, plan(tree, cap)) == opt


# ---- against the exact optimum ------------------------------------------------------------------


def _brute_force(tree: TrajectoryTree, capacity: int) -> int:
    """Minimum total over every set partition of the paths (restricted growth strings)."""
    P, best = tree.num_paths, None

    def rec(i: int, label: list[int], n: int) -> None:
        nonlocal best
        if i == P:
            groups = [np.flatnonzero(np.asarray(label) == g) for g in range(n)]
            costs = [plan_tokens(tree, [g]) for g in groups]
            if max(costs) <= capacity and (best is None or sum(costs) < best):
                best = sum(costs)
            return
        for g in range(n + 1):
            rec(i + 1, [*label, g], max(n, g + 1))

    rec(0, [], 0)
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees_with_capacity(max_paths=6))
def test_against_brute_force(tree_cap):
    tree, cap = tree_cap
    opt = plan_tokens(tree, plan(tree, cap, "optimal"))
    assert opt == _brute_force(tree, cap)
    assert lower_bound(tree, cap) <= opt
    for method in METHODS:
        parts = partition(tree, cap, method)
        check_parts(tree, parts, cap)
        total = sum(p.num_tokens for p in parts)
        assert total == plan_tokens(tree, plan(tree, cap, method)) >= opt


def test_sweep_against_optimum():
    """400 random small trees (3-10 leaves, 5 shapes, tight budgets): excess over the optimum."""
    rng = np.random.default_rng(2026)
    excess: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(400):
        tree, cap = small_tree(rng)
        opt = plan_tokens(tree, plan(tree, cap, "optimal"))
        assert lower_bound(tree, cap) <= opt
        for method in METHODS:
            groups = plan(tree, cap, method)
            excess[method].append(plan_tokens(tree, groups) / opt - 1)
        parts = partition(tree, cap)
        check_parts(tree, parts, cap)
    print("\nexcess over the optimum, 400 trees:")
    for method, e in excess.items():
        e = np.asarray(e)
        print(f"  {method:12s} mean {e.mean():7.3%}  worst {e.max():7.2%}  optimal {(e == 0).mean():6.1%}")
    beam_dp = np.asarray(excess["beam_dp"])
    assert beam_dp.mean() <= 0.02 and beam_dp.max() <= 0.10
    assert beam_dp.mean() < np.mean(excess["greedy_dfs"])


# ---- against first fit in input order, on realistic shapes -------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_err_at_least_first_fit_on_realistic_shapes(shape):
    print()
    for cap in (4096, 8192, 16384):
        tree = SHAPES[shape](np.random.default_rng(cap), cap)
        ours = err(tree, plan_tokens(tree, plan(tree, cap)))
        first_fit = err(tree, plan_tokens(tree, plan(tree, cap, "first_fit")))
        print(
            f"  {shape:15s} capacity {cap:5d}: ERR greedy {ours:.3f}, first-fit {first_fit:.3f} "
            f"({ours - first_fit:+.3f})"
        )
        assert ours >= first_fit


# ---- gradients ------------------------------------------------------------------------------------


def _accumulated_grads(model, batches, coeffs, denom) -> dict[str, torch.Tensor]:
    """Backward every part's share of ``sum_p c_p . logprobs_p / denom`` and accumulate."""
    model.zero_grad()
    for part in batches:
        lps = path_logprobs(model, part)
        loss = sum((coeffs[i] * lp).sum() for i, lp in zip(part.path_ids.tolist(), lps)) / denom
        loss.backward()
    return grads(model)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees_with_capacity(max_paths=6, min_len=2), st.sampled_from(["beam_dp", "first_fit", "single_path"]))
def test_gradients_invariant_to_partition(tree_cap, method):
    """The loss is a sum over paths divided by a count fixed for the whole batch, and every path
    is in exactly one part, so the accumulated gradient is the same sum. In float64 (the models'
    float32 casts lifted) only the order of the additions differs (other key sets in attention,
    gradients accumulated part by part): we measure ~2e-15; 1e-12 leaves 2-3 orders of margin
    while any misweighted path (1e-3 and up, see the next test) still fails."""
    tree, cap = tree_cap
    parts = partition(tree, cap, method)
    coeffs = random_coeffs(tree.paths(), seed=len(parts))
    denom = float(tree.num_path_tokens - tree.num_paths)  # predicted tokens over the whole batch
    with float64_casts():
        model = tiny_model("qwen3")
        whole = _accumulated_grads(model, [tree], coeffs, denom)
        split = _accumulated_grads(model, parts, coeffs, denom)
    assert max(rel_err(split[n], whole[n]) for n in whole) < 1e-12


def test_per_part_normalization_would_change_the_gradient():
    tree = TrajectoryTree.from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [1, 2, 9, 9, 9]])
    parts = partition(tree, 8)
    assert len(parts) > 1
    coeffs = random_coeffs(tree.paths(), seed=0)
    with float64_casts():
        model = tiny_model("qwen3")
        whole = _accumulated_grads(model, [tree], coeffs, tree.num_path_tokens - tree.num_paths)
        model.zero_grad()
        for part in parts:  # the mistake: each part divides by its own token count
            lps = path_logprobs(model, part)
            n = part.num_path_tokens - part.num_paths
            (sum((coeffs[i] * lp).sum() for i, lp in zip(part.path_ids.tolist(), lps)) / n).backward()
        wrong = grads(model)
    assert max(rel_err(wrong[n], whole[n]) for n in whole) > 1e-3


# ---- micro-batches --------------------------------------------------------------------------------


def test_pack_microbatches_combines_small_trees_in_order():
    sizes = [5, 2, 4, 3, 6, 1]
    trees = [TrajectoryTree.from_paths([[100 * i + j for j in range(s)]]) for i, s in enumerate(sizes)]
    batches = pack_microbatches(trees, 7)
    assert [[sizes[trees.index(t)] for t in mb] for mb in batches] == [[5, 2], [4, 3], [6, 1]]
    assert pack_microbatches([], 7) == []


def test_pack_microbatches_partitions_a_tree_over_capacity():
    rng = np.random.default_rng(0)
    trees = [SHAPES["group"](rng, 4096) for _ in range(2)]
    trees += [TrajectoryTree.from_paths([rng.integers(0, 1000, 300).tolist()]) for _ in range(5)]
    batches = pack_microbatches(trees, 4096)
    items = [t for mb in batches for t in mb]
    assert all(sum(t.num_tokens for t in mb) <= 4096 for mb in batches)
    assert sum(t.num_paths for t in items) == sum(t.num_paths for t in trees)
    assert len(batches) < len(items)  # small ones share micro-batches
    firsts = [min(items.index(t) for t in mb) for mb in batches]
    assert firsts == sorted(firsts)
    with pytest.raises(ValueError, match="more than the capacity"):
        pack_microbatches(trees, 1000)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=20), st.integers(40, 100))
def test_pack_microbatches_bin_packs(sizes, cap):
    trees = [TrajectoryTree.from_paths([[1000 * i + j for j in range(s)]]) for i, s in enumerate(sizes)]
    batches = pack_microbatches(trees, cap)
    flat = [trees.index(t) for mb in batches for t in mb]
    assert sorted(flat) == list(range(len(sizes)))
    assert all(sum(t.num_tokens for t in mb) <= cap for mb in batches)
    assert all([trees.index(t) for t in mb] == sorted(trees.index(t) for t in mb) for mb in batches)
    assert len(batches) <= 2 * sum(sizes) / cap + 1  # best fit leaves at most one bin half empty


@pytest.mark.parametrize(("old", "new"), [("greedy", "beam_dp"), ("dfs", "greedy_dfs")])
def test_old_method_names_warn_and_give_the_new_methods(old, new):
    tree = TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8], [9, 10]])
    with pytest.warns(DeprecationWarning, match=f"use {new!r}"):
        got = plan(tree, 6, old)
    assert [g.tolist() for g in got] == [g.tolist() for g in plan(tree, 6, new)]
    with pytest.warns(DeprecationWarning):
        partition(tree, 6, old)
    with pytest.raises(ValueError, match="beam_dp"):
        plan(tree, 6, "beam")
