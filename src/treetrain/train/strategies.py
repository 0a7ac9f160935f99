"""Packing strategies: how a step's trees become micro-batches, and each micro-batch's loss.

Two strategies, one interface (``units``, ``microbatches``, ``rank_plan``, ``loss``):

- :class:`TreePacking` (``--packing tree``): whole trees, those over ``capacity`` partitioned into
  parts of whole paths; every shared prefix is computed once per part.
- :class:`SequencePacking` (``--packing sequence``, the baseline of :mod:`treetrain.objectives.baseline`):
  every path its own sequence, packed padding-free.

They differ only in the units they pack; the forward, the LM head and the objective are the same
call (:func:`treetrain.objectives.policy.compute_loss`), so the per-path log-probs and losses agree.

>>> tree = TrajectoryTree.from_paths([[1, 2], [1, 3]])
>>> [t.num_paths for t in get_strategy("sequence").units([tree])]
[1, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from treetrain.trees.packing import PackedTree
from treetrain.trees.tree import TrajectoryTree

__all__ = ["PACKINGS", "SequencePacking", "TreePacking", "get_strategy"]


@dataclass(frozen=True)
class TreePacking:
    """Tree packing: every shared prefix once (per part of a tree over the capacity)."""

    name: str = "tree"

    def units(self, trees: Sequence[TrajectoryTree]) -> list[TrajectoryTree]:
        """What gets packed: whole trees (partitioned later if over the capacity)."""
        return list(trees)

    def microbatches(self, trees: Sequence[TrajectoryTree], capacity: int) -> list[list[TrajectoryTree]]:
        """The units packed into micro-batches of at most ``capacity`` tokens each."""
        from treetrain.trees.partition import pack_microbatches

        return pack_microbatches(self.units(trees), capacity)

    def rank_plan(
        self, trees: Sequence[TrajectoryTree], capacity: int, rank: int, world_size: int, model_config
    ) -> tuple[list[list[TrajectoryTree]], int, int, float]:
        """This rank's micro-batches when the step's work is split over ``world_size`` ranks.

        The units (trees or paths), partitioned to ``capacity``, go to ranks by their training
        FLOPs (``distributed.tree_cost``, LPT); then each rank packs its own pieces. Every rank
        computes the same plan from the same trees, with no communication. Returns (this rank's
        micro-batches, the most micro-batches any rank has, the tokens all ranks compute, the FLOP
        imbalance max/mean over ranks, :mod:`treetrain.parallel.balance`).
        """
        from treetrain.parallel import fsdp as distributed
        from treetrain.parallel.balance import balanced_plan
        from treetrain.trees.partition import pack_microbatches, partition

        pieces = [part for unit in self.units(trees) for part in partition(unit, capacity)]
        # LPT by FLOPs; a piece costlier than a fair share is split in parts of whole paths
        pieces, plan, imbalance = balanced_plan(
            pieces, world_size, lambda t: distributed.tree_cost(t, model_config)
        )
        per_rank = [pack_microbatches([pieces[i] for i in idx], capacity) for idx in plan]
        computed = sum(t.num_tokens for mbs in per_rank for mb in mbs for t in mb)
        return per_rank[rank], max(len(mbs) for mbs in per_rank), computed, imbalance

    def loss(
        self,
        model: nn.Module,
        packed: PackedTree,
        objective,
        normalizer: float | torch.Tensor,
        ref_model: nn.Module | None = None,
        *,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of the step loss and its metrics (``losses.compute_loss``)."""
        from treetrain.objectives.policy import compute_loss

        return compute_loss(model, packed, objective, normalizer, ref_model, backend=backend)


@dataclass(frozen=True)
class SequencePacking(TreePacking):
    """The per-path baseline: every path its own sequence, packed padding-free (varlen)."""

    name: str = "sequence"

    def units(self, trees: Sequence[TrajectoryTree]) -> list[TrajectoryTree]:
        from treetrain.objectives.baseline import sequences

        return sequences(trees)

    def loss(self, model, packed, objective, normalizer, ref_model=None, *, backend=None):
        from treetrain.objectives.baseline import sequence_loss

        return sequence_loss(model, packed, objective, normalizer, ref_model, backend=backend)


PACKINGS = {"tree": TreePacking(), "sequence": SequencePacking()}


def get_strategy(packing: str | TreePacking) -> TreePacking:
    """The strategy for a ``--packing`` value (a strategy object passes through)."""
    if isinstance(packing, TreePacking):
        return packing
    if packing not in PACKINGS:
        raise ValueError(f"packing: expected one of {tuple(PACKINGS)}, got {packing!r}")
    return PACKINGS[packing]
