"""``--objective NAME`` -> its :class:`treetrain.objectives.interface.TrainObjective`.

Adding an objective: one module with a ``TrainObjective`` subclass (a ``from_config(cfg)``
classmethod reading ``cfg.loss`` and the options it needs), and one entry here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing an objective's module loads torch: only on use
    from treetrain.objectives.interface import TrainObjective

__all__ = ["REGISTRY", "build_objective"]

# name -> "module:class"; imported on use, so building one objective loads only its module
REGISTRY: dict[str, str] = {
    "sft": "treetrain.objectives.policy.training:PolicyObjective",
    "reinforce": "treetrain.objectives.policy.training:PolicyObjective",
    "grpo": "treetrain.objectives.policy.training:PolicyObjective",
    "ppo": "treetrain.objectives.policy.training:PolicyObjective",
    "gspo": "treetrain.objectives.policy.training:PolicyObjective",
    "dpo": "treetrain.objectives.preference.training:PreferenceTraining",
    "reward": "treetrain.objectives.preference.training:PreferenceTraining",
    "ppo_critic": "treetrain.objectives.ppo_critic:PPOCritic",
}


def build_objective(cfg: Any) -> TrainObjective:
    """The objective of ``cfg.objective`` with its ``cfg.loss`` options (a ``TrainConfig``, or
    anything with ``objective``, ``loss``, ``reference``, ``ref_model``)."""
    if cfg.objective not in REGISTRY:
        raise ValueError(f"--objective: expected one of {', '.join(REGISTRY)}, got {cfg.objective!r}")
    module, cls = REGISTRY[cfg.objective].split(":")
    return getattr(importlib.import_module(module), cls).from_config(cfg)
