"""Preference pairs in a micro-batch: which paths pair up (:func:`pair_layout`), the step's
normalizer (its number of pairs), and how a step's pair records group into units and micro-batches
that never split a pair (:func:`pair_units`, :func:`pack_pair_units`, :func:`merge_pairs`).

A pair is two paths that share their prompt: ``chosen`` then ``rejected`` (see
:mod:`treetrain.data.preference`; path ids ``2k`` and ``2k + 1`` of a tree form pair ``k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treetrain.trees.packing import PackedTree
from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "PairLayout",
    "check_pair_record",
    "merge_pairs",
    "pack_pair_units",
    "pair_layout",
    "pair_microbatches",
    "pair_units",
    "preference_normalizer",
]


@dataclass(frozen=True)
class PairLayout:
    """Which paths of a micro-batch form pairs: ``chosen [K]``, ``rejected [K]`` (path indices in
    batch order) and each pair's ``margin [K]`` (float64)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    margin: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.chosen.numel()


def _trees(batch) -> tuple[TrajectoryTree, ...]:
    if isinstance(batch, PackedTree):
        return batch.trees
    if isinstance(batch, TrajectoryTree):
        return (batch,)
    return tuple(batch)


def pair_layout(batch: PackedTree | TrajectoryTree | Sequence[TrajectoryTree]) -> PairLayout:
    """The pairs of a micro-batch. Its paths must come as whole pairs, chosen right before rejected
    (path ids ``2k``, ``2k + 1`` of their record), as :func:`pair_microbatches` makes them.

    Example: a pair tree ``[prompt+chosen, prompt+rejected]`` gives ``chosen=[0]``, ``rejected=[1]``;
    two one-path trees cut from it (the baseline) give the same.
    """
    trees = _check_pairs(_trees(batch))
    ids = np.concatenate([t.path_ids for t in trees])
    margins = np.concatenate([t.fields["margins"] for t in trees])
    chosen = np.flatnonzero(ids % 2 == 0)
    rejected = chosen + 1
    assert rejected.size == 0 or rejected[-1] < ids.size, "a micro-batch ends inside a pair"
    assert (ids[rejected] == ids[chosen] + 1).all() and 2 * chosen.size == ids.size, "paths are not in pairs"
    return PairLayout(
        torch.as_tensor(chosen),
        torch.as_tensor(rejected),
        torch.as_tensor(margins[chosen], dtype=torch.float64),
    )


def check_pair_record(tree: TrajectoryTree, info, objective: str) -> None:
    """A record for ``--objective dpo|reward``: a preference pair; the error names file and line
    (``info``: the reader's ``SampleInfo``)."""
    if "margins" not in tree.fields:
        raise ValueError(
            f"{info.file}:{info.line}: --objective {objective} trains on preference pairs "
            f"(prompt_ids/chosen_ids/rejected_ids, or prompt/chosen/rejected messages), but this record "
            f"is {info.format} data; pass a preference file, or another --objective for this one"
        )


def _check_pairs(trees: Sequence[TrajectoryTree]) -> Sequence[TrajectoryTree]:
    for t in trees:
        if "margins" not in t.fields:
            raise ValueError(
                "dpo/reward objectives train on preference pairs: records with prompt_ids/chosen_ids/"
                "rejected_ids (or prompt/chosen/rejected messages); this batch holds a tree of other data"
            )
    return trees


def preference_normalizer(trees: Sequence[TrajectoryTree]) -> float:
    """The step's ``N``: how many pairs its trees hold (the losses are means over pairs)."""
    return float(sum(t.num_paths // 2 for t in trees))


def pair_microbatches(
    trees: Sequence[TrajectoryTree], packing: str, capacity: int
) -> list[list[TrajectoryTree]]:
    """Micro-batches of whole pairs, at most ``capacity`` tokens each where a pair fits.

    ``tree``: the pair trees of a micro-batch merged into ONE tree (:func:`merge_pairs`), so pairs
    that share a prompt (several pairs per prompt, pairs from one multi-turn history) share its
    tokens too; a pair over ``capacity`` runs as its two paths, one-path trees. ``sequence``: every
    path its own one-path tree. Pairs are never split across micro-batches, so each micro-batch's
    loss is a sum over its pairs. (:func:`pair_units`, then :func:`pack_pair_units`.)
    """
    return pack_pair_units(pair_units(trees, packing, capacity), packing, capacity)


def pair_units(trees: Sequence[TrajectoryTree], packing: str, capacity: int) -> list[list[TrajectoryTree]]:
    """The step's units of whole pairs, one per record: ``[tree]`` (``tree`` packing, when it fits
    ``capacity``) or the record's paths as one-path trees, in order. A unit is never split across
    micro-batches or ranks."""
    units = []
    for t in trees:
        if t.num_paths % 2:
            raise ValueError(f"a preference tree needs whole pairs of paths, got {t.num_paths} paths")
        if packing == "tree" and t.num_tokens <= capacity:
            units.append([t])
        else:
            units.append([t.subset([i]) for i in range(t.num_paths)])
    return units


def pack_pair_units(
    units: Sequence[Sequence[TrajectoryTree]], packing: str, capacity: int
) -> list[list[TrajectoryTree]]:
    """Units of :func:`pair_units` into micro-batches, in order, a new one when the next unit would
    pass ``capacity``; ``tree``: each micro-batch of pair trees merged into one tree."""
    micro: list[list[TrajectoryTree]] = []
    size = 0
    for unit in units:
        n = sum(u.num_tokens for u in unit)
        if not micro or size + n > capacity:
            micro.append([])
            size = 0
        micro[-1].extend(unit)
        size += n
    if packing == "tree":  # merging only removes tokens: the budget still holds
        return [[merge_pairs(mb)] if all(t.num_paths % 2 == 0 for t in mb) else mb for mb in micro]
    return micro


def merge_pairs(trees: Sequence[TrajectoryTree]) -> TrajectoryTree:
    """Pair trees -> one tree of all their paths, in order (pair ``k``: path ids ``2k``, ``2k + 1``),
    shared prefixes merged across pairs.

    Example: pairs ``([1 2] + [3] | [4])`` and ``([1 2] + [5] | [6])``: 8 path tokens, 6 distinct
    tokens in the merged tree (the prompt ``[1 2]`` once).
    """
    if len(_check_pairs(trees)) == 1:
        return trees[0]
    paths = [t.path(i) for t in trees for i in range(t.num_paths)]
    fields = {
        "loss_masks": [m for t in trees for m in t.fields["loss_masks"]],
        "margins": np.concatenate([t.fields["margins"] for t in trees]),
    }
    if any(t.image_table is not None for t in trees):  # a path's images travel with it
        fields["images"] = [imgs for t in trees for imgs in t.fields.get("images") or [[]] * t.num_paths]
    groups = [t.path_groups for t in trees]  # rope regimes (models.rope.split_regimes) stay apart
    groups = np.concatenate(groups) if all(g is not None for g in groups) else None
    return TrajectoryTree.from_paths(paths, groups=groups, **fields)
