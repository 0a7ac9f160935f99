"""The per-path view of a batch and how per-token losses aggregate over it: :class:`PathMeta` (the
batch's metadata, one entry per target), the normalizer ``N`` (:func:`loss_normalizer`) and the
coefficients ``c[p, j]`` (:func:`agg_coefficients`).

Notation, for path ``p`` and its target ``j`` (the token ``j + 1`` of the path;
``M = sum_p (len(p) - 1)`` targets in all)::

    lp[p, j]   log-prob of the target under the model being trained (``path_logprobs``)
    m[p, j]    loss_masks[p][j + 1]        (1: the target trains, e.g. an assistant token)
    w[p]       weights[p]                  (default 1)
    A[p, j]    advantages[p] or advantages[p][j + 1]
    old, ref   old_logprobs[p][j], ref_logprobs[p][j]
    n[p]       sum_j m[p, j]               (trainable targets of the path)

A per-token loss ``l[p, j]`` is aggregated with coefficients that need only path ``p`` itself and
a normalizer ``N`` computed once over the WHOLE batch (``loss_normalizer``)::

    loss = sum_p sum_j c[p, j] * l[p, j],   c[p, j] = w[p] * m[p, j] * s[p] / N

    agg_mode                  s[p]             N
    token-mean                1                sum_p w[p] * n[p]
    seq-mean-token-mean       1 / n[p]         sum_p w[p] * [n[p] > 0]
    seq-mean-token-sum        1                sum_p w[p] * [n[p] > 0]
    seq-mean-token-sum-norm   1 / norm_length  sum_p w[p] * [n[p] > 0]   (Dr. GRPO's constant length)
    token-sum                 1                1

A path is never split (partitions are sets of whole paths), so the loss is a sum of per-part
contributions: run ``compute_loss`` on every micro-batch of every rank with the same ``N`` and the
losses (and the accumulated gradients) add up to the full-batch ones, whatever the partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treetrain.objectives.policy.config import AGG_MODES, Objective
from treetrain.trees.packing import PackedTree
from treetrain.trees.tree import TrajectoryTree

__all__ = ["Batch", "PathMeta", "agg_coefficients", "loss_normalizer"]


Batch = PackedTree | TrajectoryTree | Sequence[TrajectoryTree]


def _trees(batch: Batch) -> tuple[TrajectoryTree, ...]:
    if isinstance(batch, PackedTree):
        return batch.trees
    if isinstance(batch, TrajectoryTree):
        return (batch,)
    if isinstance(batch, Sequence) and batch:
        out = []
        for b in batch:
            out.extend(_trees(b))
        return tuple(out)
    raise ValueError(
        f"batch: expected a PackedTree, a TrajectoryTree or a non-empty list of them, got {batch!r}"
    )


def _flat_field(trees: Sequence[TrajectoryTree], name: str) -> np.ndarray | None:
    """One value per target ``[M]`` (float64), paths in batch order; None if no tree has the field."""
    have = [name in t.fields for t in trees]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{name}: given for some trees of the batch but not all; give it for every path")
    out = []
    for t in trees:
        v = t.fields[name]
        if isinstance(v, np.ndarray):  # per-path scalars (advantages, weights)
            out.append(np.repeat(v, t.path_lengths - 1))
        elif name in ("loss_masks", "advantages"):  # per token, aligned with the path: drop token 0
            out.extend(np.asarray(a, dtype=np.float64)[1:] for a in v)
        else:  # per target already
            out.extend(np.asarray(a, dtype=np.float64) for a in v)
    return np.concatenate(out) if out else np.zeros(0)


@dataclass(eq=False)
class PathMeta:
    """The batch's per-path metadata, flattened to one entry per target (``M`` targets, ``P`` paths).

    Entry ``k`` belongs to path ``path_of[k]``; paths are in batch order (tree by tree) and their
    targets contiguous, exactly as ``torch.cat(path_logprobs(model, batch))``.

    num_targets ``[P]`` int64 (``len(p) - 1``); path_of ``[M]`` int64; mask ``[M]`` (0/1);
    weight ``[P]``; advantages, old_logprobs, ref_logprobs ``[M]`` or None.
    """

    num_targets: torch.Tensor
    path_of: torch.Tensor
    mask: torch.Tensor
    weight: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    @classmethod
    def from_trees(cls, batch: Batch, dtype: torch.dtype = torch.float64, device=None) -> PathMeta:
        trees = _trees(batch)
        num_targets = np.concatenate([t.path_lengths for t in trees]) - 1
        M = int(num_targets.sum())
        mask = _flat_field(trees, "loss_masks")
        weights = [t.fields.get("weights") for t in trees]
        weight = np.concatenate(
            [np.ones(t.num_paths) if w is None else np.asarray(w, np.float64) for t, w in zip(trees, weights)]
        )

        def tensor(a):
            return None if a is None else torch.as_tensor(a, dtype=dtype, device=device)

        return cls(
            num_targets=torch.as_tensor(num_targets, dtype=torch.int64, device=device),
            path_of=torch.repeat_interleave(
                torch.arange(num_targets.size, device=device), torch.as_tensor(num_targets, device=device)
            ),
            mask=tensor(np.ones(M) if mask is None else mask),
            weight=tensor(weight),
            advantages=tensor(_flat_field(trees, "advantages")),
            old_logprobs=tensor(_flat_field(trees, "old_logprobs")),
            ref_logprobs=tensor(_flat_field(trees, "ref_logprobs")),
        )

    @property
    def num_paths(self) -> int:
        return self.num_targets.numel()

    def to(self, device=None, dtype: torch.dtype | None = None) -> PathMeta:
        """Move; float fields take ``dtype`` (index fields stay int64)."""
        moved = {}
        for k, v in self.__dict__.items():
            if v is None or v.dtype == torch.int64:
                moved[k] = None if v is None else v.to(device)
            else:
                moved[k] = v.to(device=device, dtype=dtype or v.dtype)
        return PathMeta(**moved)

    def path_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-path sum of a per-target tensor: ``[M] -> [P]``."""
        return x.new_zeros(self.num_paths).index_add(0, self.path_of, x)


def _path_scale(meta: PathMeta, agg_mode: str, norm_length: float | None) -> torch.Tensor:
    """``s[p]`` of the module docstring's table ``[P]``."""
    if agg_mode == "seq-mean-token-mean":
        return 1.0 / meta.path_sum(meta.mask).clamp(min=1)
    if agg_mode == "seq-mean-token-sum-norm":
        return meta.weight.new_full((meta.num_paths,), 1.0 / norm_length)
    return meta.weight.new_ones(meta.num_paths)


def loss_normalizer(
    batch: Batch | PathMeta,
    agg_mode: str | Objective,
    *,
    norm_length: float | None = None,
    check: bool = True,
) -> float:
    """The divisor ``N`` of the aggregation (module docstring), over the WHOLE batch's paths.

    Call it once per optimizer step on every tree of the step, before any part runs, and pass the
    same value to every ``compute_loss`` call of the step. Except for ``token-sum`` (always 1) it
    is a sum over paths, so disjoint batches add up: per-rank values may be all-reduced with SUM
    (``check=False`` on ranks that may hold no trainable token).

    ``batch``: the trees, or their ``PathMeta``. ``agg_mode`` is a mode name or an ``Objective`` (its
    ``agg_mode`` and ``norm_length``).
    """
    if isinstance(agg_mode, Objective):
        agg_mode, norm_length = agg_mode.agg_mode, agg_mode.norm_length
    if agg_mode not in AGG_MODES:
        raise ValueError(f"agg_mode: expected one of {AGG_MODES}, got {agg_mode!r}")
    if agg_mode == "token-sum":
        return 1.0
    if agg_mode == "seq-mean-token-sum-norm" and (norm_length is None or norm_length <= 0):
        raise ValueError("agg_mode 'seq-mean-token-sum-norm' needs norm_length > 0")
    meta = batch if isinstance(batch, PathMeta) else PathMeta.from_trees(batch)
    n = meta.path_sum(meta.mask)
    if agg_mode == "token-mean":
        total = (meta.weight * n).sum().item()
    else:
        total = (meta.weight * (n > 0)).sum().item()
    if check and not total > 0:
        raise ValueError(
            f"loss normalizer is {total} ({agg_mode}): the batch has no trainable target (every "
            "loss_mask is 0 past the first token, or the weights sum to <= 0)"
        )
    return float(total)


def agg_coefficients(
    meta: PathMeta, agg_mode: str, normalizer: float | torch.Tensor, norm_length: float | None = None
) -> torch.Tensor:
    """``c[p, j] = w[p] * m[p, j] * s[p] / N`` flattened ``[M]``: ``loss = (c * per_token_loss).sum()``."""
    per_path = meta.weight * _path_scale(meta, agg_mode, norm_length) / normalizer
    return per_path[meta.path_of] * meta.mask
