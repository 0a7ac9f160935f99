"""GRPO advantages from per-path rewards, for ``treetrain train --advantages``.

A record (one tree) is one group: its paths are the group's completions. ``scale`` follows TRL's
``scale_rewards``: ``A = (r - mean_group) / (std + 1e-4)`` with the unbiased std of the group
(``group``) or of every reward in the optimizer step's batch (``batch``), or ``A = r - mean_group``
(``none``, Dr. GRPO). Example, one tree with rewards ``[1, 0, 0, 1]``: mean 0.5, std 0.577, so
``group`` gives ``[0.866, -0.866, -0.866, 0.866]`` and ``none`` gives ``[0.5, -0.5, -0.5, 0.5]``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from treetrain.trees.tree import TrajectoryTree

__all__ = ["SCALES", "assign_advantages", "check_rewards", "group_advantages"]

SCALES = ("group", "batch", "none")
EPS = 1e-4  # TRL's


def check_rewards(tree: TrajectoryTree, info, scale: str) -> None:
    """A record for ``--advantages scale``: per-path ``rewards`` and no ``advantages``, checked when
    the record is read (before step 1); the ``DataError`` names ``info``'s file, line and record id."""
    from treetrain.data.fields import DataError

    where = {"file": info.file, "line": info.line, "record": info.id}
    if "rewards" not in tree.fields:
        raise DataError(
            f"missing; --advantages {scale} computes each path's advantage from its record's rewards: "
            'give one number per path (e.g. "rewards": [1.0, 0.0]), or drop --advantages and give '
            '"advantages" instead',
            field=("rewards",),
            **where,
        )
    if "advantages" in tree.fields:
        raise DataError(
            f'--advantages {scale} computes them from "rewards", which the record has too; keep one of '
            "the two",
            field=("advantages",),
            **where,
        )


def assign_advantages(trees: Sequence[TrajectoryTree], scale: str) -> list[TrajectoryTree]:
    """The same trees with ``advantages [P]`` computed from their ``rewards [P]`` (fields replaced in
    place on shallow copies; the token arrays are shared)."""
    if scale not in SCALES:
        raise ValueError(f"--advantages: expected one of {', '.join(SCALES)}, got {scale!r}")
    for i, t in enumerate(trees):
        if "rewards" not in t.fields:
            raise ValueError(
                f'--advantages {scale}: tree {i} of the batch has no per-path "rewards"; give one number '
                'per path in every record, or drop --advantages and give "advantages" instead'
            )
        if "advantages" in t.fields:
            raise ValueError(
                f'--advantages {scale}: tree {i} of the batch has both "rewards" and "advantages"; '
                "keep one of them"
            )
    rewards = np.concatenate([t.fields["rewards"] for t in trees])
    groups = np.repeat(np.arange(len(trees)), [t.num_paths for t in trees])
    adv = group_advantages(rewards, groups, norm_by_std=scale == "group", eps=EPS)
    if scale == "batch":
        std = rewards.std(ddof=1) if rewards.size > 1 else 0.0
        adv = adv / (std + EPS)
    out, start = [], 0
    for t in trees:
        copy = TrajectoryTree(**{**t.__dict__, "fields": dict(t.fields)})
        copy.fields["advantages"] = adv[start : start + t.num_paths]
        start += t.num_paths
        out.append(copy)
    return out


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], *, norm_by_std: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """GRPO's group-normalized advantages, one per path ``[P]``: ``(r - mean_g) / (std_g + eps)``.

    ``groups[i]`` is the group (e.g. the prompt id) of path ``i``. ``std`` is the unbiased sample
    standard deviation; ``norm_by_std=False`` gives Dr. GRPO's ``r - mean_g``. A group of one keeps
    its raw reward (verl's convention: mean 0, std 1). A group whose rewards are all equal gets
    exactly 0 (``r - mean`` can round to +-1e-17, e.g. rewards ``[0.1, 0.1, 0.1]``).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(groups) != r.size:
        raise ValueError(
            f"group_advantages: need one reward and one group per path, got {r.shape} and {len(groups)}"
        )
    out = np.empty_like(r)
    index: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    for ids in index.values():
        x = r[ids]
        mean, std = (x.mean(), x.std(ddof=1)) if x.size > 1 else (0.0, 1.0)
        centered = x - mean if x.size == 1 or np.ptp(x) else np.zeros_like(x)
        out[ids] = centered / (std + eps) if norm_by_std else centered
    return out
