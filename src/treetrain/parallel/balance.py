"""Tree-aware data parallelism: trees and subtrees to ranks by FLOP cost, and the imbalance.

``treetrain.parallel.fsdp.assign_to_ranks`` places whole pieces (trees, or capacity-sized parts of
whole paths) by LPT on their training FLOPs (``flops.tree_cost``: tokens + attention pairs). A
single tree costlier than a rank's fair share still makes every other rank wait, so
:func:`balanced_plan` also splits such a piece into two parts of whole paths (recomputing their
shared prefix, which the cost counts) while that shortens the busiest rank.

Example: trees of cost 10, 1, 1 on 2 ranks: loads 10 | 2, imbalance ``10 / 6 = 1.67``; splitting
the big tree into two parts of cost 5.5 (its prefix counted twice) gives loads 6.5 | 6.5.

An objective whose units must stay whole (preference pairs: :func:`balanced_units` with
``split=False``) is balanced by LPT on the units' costs alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from treetrain.parallel.fsdp import assign_to_ranks
from treetrain.trees.tree import TrajectoryTree

__all__ = ["balanced_plan", "balanced_units", "imbalance", "makespan", "rank_loads", "split_in_two"]


def rank_loads(costs: Sequence[float], plan: Sequence[Sequence[int]]) -> list[float]:
    """Total cost of each rank's items."""
    return [float(sum(costs[i] for i in items)) for items in plan]


def imbalance(loads: Sequence[float]) -> float:
    """``max / mean`` of the per-rank loads: 1.0 when ranks finish together (and for no work).

    >>> imbalance([3.0, 1.0])
    1.5
    """
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def makespan(costs: Sequence[float], world_size: int) -> float:
    """The busiest rank's load under :func:`treetrain.parallel.fsdp.assign_to_ranks`."""
    return max(rank_loads(costs, assign_to_ranks(costs, world_size)))


def split_in_two(tree: TrajectoryTree) -> list[TrajectoryTree]:
    """Two (or a few) parts of whole paths of about half the tree's distinct tokens each, by Tree
    Partitioning; ``[tree]`` when it cannot be split (one path, or one path as long as the tree)."""
    from treetrain.trees.partition import partition

    longest = int(tree.path_lengths.max())
    half = max(longest, -(-tree.num_tokens // 2))
    if tree.num_paths < 2 or half >= tree.num_tokens:
        return [tree]
    return partition(tree, half)


def balanced_plan(
    pieces: list[TrajectoryTree],
    world_size: int,
    cost: Callable[[TrajectoryTree], float],
    max_splits: int = 64,
) -> tuple[list[TrajectoryTree], list[list[int]], float]:
    """Split the costliest piece while that lowers the makespan, then assign by LPT.

    Returns ``(pieces, plan, imbalance)``: ``plan[r]`` indexes ``pieces``. Every path of the input
    is in exactly one output piece (splits are partitions into whole paths). Deterministic: every
    rank computes the same plan from the same pieces.
    """
    pieces = list(pieces)
    costs = [cost(p) for p in pieces]
    if world_size > 1:
        for _ in range(max_splits):
            big = max(range(len(pieces)), key=lambda i: (costs[i], -i))
            parts = split_in_two(pieces[big])
            if len(parts) == 1:
                break
            new_pieces = pieces[:big] + parts + pieces[big + 1 :]
            new_costs = costs[:big] + [cost(p) for p in parts] + costs[big + 1 :]
            if makespan(new_costs, world_size) >= makespan(costs, world_size):
                break
            pieces, costs = new_pieces, new_costs
    plan = assign_to_ranks(costs, world_size)
    return pieces, plan, imbalance(rank_loads(costs, plan))


def balanced_units(
    units: list[list[TrajectoryTree]],
    world_size: int,
    cost: Callable[[TrajectoryTree], float],
    split: bool,
) -> tuple[list[list[TrajectoryTree]], list[list[int]], float]:
    """Units (groups of trees that stay on one rank) to ranks: ``(units, plan, imbalance)``.

    ``split``: the units are single trees that :func:`balanced_plan` may cut into parts of whole
    paths; otherwise each unit stays whole (a unit's cost: the sum of its trees') and LPT places it.
    """
    if split:
        assert all(len(u) == 1 for u in units), "only one-tree units can be split"
        pieces, plan, imb = balanced_plan([u[0] for u in units], world_size, cost)
        return [[p] for p in pieces], plan, imb
    costs = [float(sum(cost(t) for t in u)) for u in units]
    plan = assign_to_ranks(costs, world_size)
    return list(units), plan, imbalance(rank_loads(costs, plan))
