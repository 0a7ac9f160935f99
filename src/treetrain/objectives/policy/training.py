"""``--objective sft | reinforce | grpo | ppo | gspo``: the policy objectives as a
:class:`treetrain.objectives.interface.TrainObjective`.

The loss is :func:`treetrain.objectives.policy.loss.compute_loss` (``--packing tree``) or the per-path
baseline's :func:`treetrain.objectives.baseline.sequence_loss` (``--packing sequence``); the
normalizer :func:`treetrain.objectives.policy.aggregation.loss_normalizer` over the step's whole trees. With
``loss.kl_coef > 0`` and ``--reference model`` the KL reference is a frozen copy of the initial
policy. Trees over the capacity are partitioned into parts of whole paths, and the balancer may
split a costly tree further (every path's loss stays whole).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from treetrain.objectives.interface import Kit, TrainObjective, loss_options
from treetrain.objectives.policy.config import Objective
from treetrain.trees.tree import TrajectoryTree

__all__ = ["PolicyObjective"]


class PolicyObjective(TrainObjective):
    """A policy objective (``config``: its :class:`treetrain.objectives.policy.config.Objective`)."""

    def __init__(self, config: Objective, reference_from: str = "model") -> None:
        self.config = config
        self.name = config.name
        self.reference_from = reference_from  # --reference: model (a frozen initial copy) | data

    @classmethod
    def from_config(cls, cfg: Any) -> PolicyObjective:
        return cls(loss_options(Objective, cfg.objective, cfg.loss), cfg.reference)

    def build_models(self, policy, kit: Kit) -> None:
        if self.config.kl_coef and self.reference_from == "model":
            self.reference = kit.frozen(policy)

    def _units(self, trees: Sequence[TrajectoryTree], packing: str) -> list[TrajectoryTree]:
        from treetrain.objectives.baseline import sequences

        return list(trees) if packing == "tree" else sequences(trees)

    def microbatches(self, trees, packing, capacity):
        from treetrain.trees.partition import pack_microbatches

        return pack_microbatches(self._units(trees, packing), capacity)

    def units(self, trees, packing, capacity):
        from treetrain.trees.partition import partition

        return [[part] for unit in self._units(trees, packing) for part in partition(unit, capacity)]

    def pack(self, units, packing, capacity):
        from treetrain.trees.partition import pack_microbatches

        return pack_microbatches([t for unit in units for t in unit], capacity)

    def normalizer(self, trees):
        from treetrain.objectives.policy.aggregation import loss_normalizer

        return loss_normalizer(trees, self.config)

    def micro_loss(self, trees, packing):
        from treetrain.objectives.baseline import sequence_loss
        from treetrain.objectives.policy.loss import compute_loss

        loss = compute_loss if packing == "tree" else sequence_loss
        cfg, ref, normalizer = self.config, self.reference, self.normalizer(trees)

        def micro(model, packed, *, backend=None):
            return loss(model, packed, cfg, normalizer, ref, backend=backend)

        return micro

    def summarize(self, sums: Mapping[str, torch.Tensor]) -> dict[str, float]:
        from treetrain.objectives.policy.loss import summarize_metrics

        return summarize_metrics(sums)
