"""What the loop lends an objective for its extra models (:class:`treetrain.objectives.interface.Kit`),
and how the loop treats those models alongside the policy: one checkpoint state, their gradient
clipping and the final export.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from treetrain.parallel import fsdp as distributed
from treetrain.train.build import build_model, build_optimizer, build_reference_model, configure_model
from treetrain.train.config import TrainConfig

__all__ = ["RunKit", "checkpoint_state", "clip_extras", "drop_empty_groups", "export_extras"]


@dataclass
class RunKit:
    """The run's config, device and dtype, FSDP2 and AdamW, for an objective's extra models."""

    cfg: TrainConfig
    device: torch.device
    param_dtype: torch.dtype
    distributed: bool = False
    mixed_precision: bool = False

    def load(self, directory: str | None, auto_class: str | None = None) -> nn.Module:
        cfg, dtype = self.cfg, self.param_dtype
        return build_model(
            directory, cfg.seed, dtype, self.device, auto_class, trust_remote_code=cfg.trust_remote_code
        )

    def configure(self, model: nn.Module) -> nn.Module:
        return configure_model(model, self.cfg.activation_checkpointing)

    def frozen(self, model: nn.Module) -> nn.Module:
        return build_reference_model(configure_model(model, False))

    def shard(self, model: nn.Module) -> nn.Module:
        return distributed.shard_model(model, mixed_precision=self.mixed_precision)

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return drop_empty_groups(build_optimizer(model, dataclasses.replace(self.cfg, lr=lr)))


def drop_empty_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Remove parameter groups with no parameters (a LoRA policy's no-decay group): DCP saves and
    loads several optimizers together only without them. Call before the LR scheduler is built."""
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    return optimizer


def checkpoint_state(model: nn.Module, optimizer, objective):
    """What a checkpoint saves and loads: ``(model, optimizer)``, or with extra trained models (a
    critic) all models as one ``ModuleDict`` (keys ``policy.*``, ``critic.*``) and all optimizers."""
    extras = objective.trained()
    if not extras:
        return model, optimizer
    models = nn.ModuleDict({"policy": model} | {t.name: t.model for t in extras})
    return models, [optimizer, *(t.optimizer for t in extras)]


def clip_extras(objective, grad_clip: float | None) -> dict[str, float]:
    """Clip each extra trained model's gradient on its own; ``{NAME_grad_norm: norm before}``."""
    out = {}
    for t in objective.trained():
        params = [p for p in t.model.parameters() if p.grad is not None]
        out[f"{t.name}_grad_norm"] = float(distributed.clip_grad_norm_(params, grad_clip or math.inf))
    return out


def export_extras(objective, out: Path) -> dict[str, Path]:
    """Each extra trained model to ``OUTPUT/final_NAME`` (loadable with transformers)."""
    from treetrain.train.checkpoint import export_pretrained

    return {t.name: export_pretrained(t.model, out / f"final_{t.name}") for t in objective.trained()}
