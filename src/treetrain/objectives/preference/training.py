"""``--objective dpo | reward``: the preference objectives (:mod:`treetrain.objectives.preference.loss`)
as a :class:`treetrain.objectives.interface.TrainObjective`.

Records are preference pairs (path ids ``2k``, ``2k + 1``: chosen, rejected). A pair is never
split: a record is one unit (:func:`treetrain.objectives.preference.pairs.pair_units`), whole on one rank
and in one micro-batch, so every micro-batch's loss is a sum over whole pairs divided by the step's
number of pairs, on any number of ranks. ``dpo`` with loss type ``sigmoid`` or ``ipo`` scores the
pairs under a frozen reference (``--ref-model DIR``, or a copy of the initial policy); under
``torchrun`` every rank holds a full copy of it (it has no gradient, so it takes part in no
collective). ``reward`` trains an ``AutoModelForSequenceClassification`` (one label). ``dpo`` runs
with ``--cp N`` too; ``reward`` refuses it (:meth:`PreferenceTraining.cp_refusal`).
"""

from __future__ import annotations

from typing import Any

import torch

from treetrain.objectives.interface import Kit, TrainObjective, loss_options
from treetrain.objectives.preference.loss import PreferenceObjective as PreferenceConfig
from treetrain.objectives.preference.pairs import check_pair_record
from treetrain.trees.tree import TrajectoryTree

__all__ = ["PreferenceTraining"]


class PreferenceTraining(TrainObjective):
    """``dpo`` (loss types sigmoid | ipo | simpo) or ``reward`` (Bradley-Terry)."""

    split_units = False  # whole pairs only

    def __init__(self, config: PreferenceConfig, ref_model: str | None = None) -> None:
        self.config = config
        self.name = config.name
        self.ref_model = ref_model
        self.model_class = "AutoModelForSequenceClassification" if config.name == "reward" else None

    @classmethod
    def from_config(cls, cfg: Any) -> PreferenceTraining:
        return cls(loss_options(PreferenceConfig, cfg.objective, cfg.loss), cfg.ref_model)

    def check_record(self, tree: TrajectoryTree, info) -> None:
        check_pair_record(tree, info, self.config.name)

    def cp_refusal(self) -> str | None:
        """``dpo`` runs with ``--cp``: its log-probs come from ``tree_logprobs``, which context
        parallelism serves (each rank scores its chunk, the group sums them), so every rank of a
        group computes the same pair losses. ``reward`` does not."""
        if self.config.name == "reward":
            return (
                "the reward head reads each path's last hidden state, and context parallelism leaves "
                "the hidden states of a tree split over the ranks"
            )
        return None

    def build_models(self, policy, kit: Kit) -> None:
        if not self.config.needs_reference:
            return
        if self.ref_model is None:  # the initial weights
            self.reference = kit.frozen(policy)
            return
        with torch.random.fork_rng():  # loading reseeds: a LoRA policy's init draws stay the same
            self.reference = kit.frozen(kit.load(self.ref_model))

    def microbatches(self, trees, packing, capacity):
        from treetrain.objectives.preference.pairs import pair_microbatches

        return pair_microbatches(trees, packing, capacity)

    def units(self, trees, packing, capacity):
        from treetrain.objectives.preference.pairs import pair_units

        return pair_units(trees, packing, capacity)

    def pack(self, units, packing, capacity):
        from treetrain.objectives.preference.pairs import pack_pair_units

        return pack_pair_units(units, packing, capacity)

    def micro_loss(self, trees: list[TrajectoryTree], packing: str):
        from treetrain.objectives.preference.loss import compute_preference_loss
        from treetrain.objectives.preference.pairs import preference_normalizer

        cfg, ref, normalizer = self.config, self.reference, preference_normalizer(trees)

        def micro(model, packed, *, backend=None):
            return compute_preference_loss(
                model, packed, cfg, normalizer, ref_model=ref, packing=packing, backend=backend
            )

        return micro

    def summarize(self, sums):
        from treetrain.objectives.preference.loss import summarize_preference

        return summarize_preference(sums)

    def idle_loss(self, model, backend=None):
        if self.config.name != "reward":
            return super().idle_loss(model, backend)
        from treetrain.objectives.interface import idle_tree
        from treetrain.objectives.path_outputs import path_last_hidden
        from treetrain.objectives.preference.loss import reward_head
        from treetrain.trees.packing import pack

        hidden = path_last_hidden(model, pack([idle_tree()]), "tree", backend=backend)
        return reward_head(model)(hidden).sum() * 0.0
