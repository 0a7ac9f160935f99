"""Objectives: per-path tensors and the losses on them.

Per-path tensors come from the tree forward or from the per-path baseline (:mod:`.baseline`,
:mod:`.path_outputs`); the losses are functions of them plus a global normalizer: the policy family
(:mod:`.policy`: SFT and the policy-gradient objectives), :mod:`.advantages`, the preference family
(:mod:`.preference`: DPO, reward models), :mod:`.value` (critic, GAE) and the MoE router aux loss
(:mod:`.moe_aux`).

What the training loop composes: :mod:`.interface` (``TrainObjective``), one per family
(``policy.training``, ``preference.training``, :mod:`.ppo_critic`) and :mod:`.registry`
(``--objective NAME`` -> its module).

May import: trees, data, attention, models, logprobs.
"""
