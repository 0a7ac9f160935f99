"""``treetrain train --objective ppo_critic``: PPO with a learned value model, trained alongside.

The critic is a separate model, ``AutoModelForTokenClassification`` with ``num_labels=1``: its
backbone starts from the policy's initial weights, its ``score`` head (``[hidden] -> [1]``) from
the seed. A token-classification model rather than a value head bolted onto the policy because it
is a stock transformers class: ``OUTPUT/final_critic`` loads with
``AutoModelForTokenClassification.from_pretrained`` and its ``logits[..., 0]`` are the values the
run trained (``classifier_dropout`` is set to 0, as the tree forward has no dropout); and it gives
the critic its own weights and AdamW state, as in TRL's PPO and verl.

Every step (:mod:`treetrain.objectives.value`): the critic scores each distinct token once, GAE runs
along each path from the record's per-path ``rewards``, the policy takes PPO's clipped surrogate on
those advantages (``old_logprobs`` optional: without them the ratio is 1, on-policy) and the critic
the clipped value loss; ``loss = policy_loss + vf_coef * value_loss``, one backward. Each model's
gradient is clipped on its own (``--grad-clip``) and stepped by its own AdamW; the critic's lr is
``loss.critic_lr`` (default ``--lr``) times the policy's schedule factor, so it needs no state of
its own. Checkpoints hold both models and optimizers (one DCP state, keys ``policy.*`` and
``critic.*``), so resuming continues exactly. One process only for now.

Options (``--set loss.NAME=VALUE``): ``vf_coef`` (0.5), ``critic_lr`` (``--lr``), ``gamma`` (1.0),
``lam`` (0.95), ``value_clip`` (0.2), ``critic_model`` (a directory to start the critic from instead,
e.g. a reward model: loaded as token classification, its backbone and 1-label ``score``); every
other ``loss.*`` goes to the policy's ``ppo`` objective (``clip_low``, ``clip_high``,
``dual_clip_c``, ``agg_mode``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "CRITIC_OBJECTIVE",
    "Critic",
    "build_critic",
    "check_record",
    "drop_empty_groups",
    "policy_objective",
    "summarize",
    "with_critic",
]

CRITIC_OBJECTIVE = "ppo_critic"
CRITIC_OPTIONS = {
    "vf_coef": 0.5,
    "critic_lr": None,
    "gamma": 1.0,
    "lam": 0.95,
    "value_clip": 0.2,
    "critic_model": None,
}


def _split_options(loss: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(critic options, policy objective options)`` of the ``loss`` dict."""
    critic = {k: loss.get(k, v) for k, v in CRITIC_OPTIONS.items()}
    return critic, {k: v for k, v in loss.items() if k not in CRITIC_OPTIONS}


def policy_objective(cfg):
    """The policy's ``treetrain.objectives.policy.Objective`` (``ppo``) from ``cfg.loss`` minus the
    critic's options."""
    from treetrain.objectives.policy_config import Objective

    _, rest = _split_options(cfg.loss)
    for name in ("kl_coef", "entropy_coef"):
        if rest.get(name):
            raise ValueError(
                f"loss.{name}: not supported with --objective {CRITIC_OBJECTIVE} yet (the critic's loss "
                f"has no KL or entropy term); remove it, or use --objective ppo with advantages"
            )
    try:
        return Objective(name="ppo", **rest)
    except TypeError as e:
        raise ValueError(
            f"loss: {e}; --objective {CRITIC_OBJECTIVE} takes {', '.join(CRITIC_OPTIONS)} and the ppo "
            "options of treetrain.objectives.policy.Objective"
        ) from None


@dataclass
class Critic:
    """The value model, its AdamW and the GAE / value-loss options."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr: float
    vf_coef: float = 0.5
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2

    def loss_fn(self, trees, packing: str):
        """``compute_loss``-shaped loss for one step: policy + ``vf_coef`` x value loss of a micro-batch.

        The value loss's normalizer is the step's trained targets (whole trees), so micro-batch losses
        add up to the step's loss whatever the partition.
        """
        from treetrain.objectives.policy import PathMeta

        value_normalizer = float(PathMeta.from_trees(list(trees)).mask.sum())
        return functools.partial(_micro_loss, critic=self, value_normalizer=value_normalizer, packing=packing)

    def clip(self, grad_clip: float | None) -> float:
        """Clip the critic's gradient (its own norm); returns the norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf")))

    def step(self, policy_optimizer: torch.optim.Optimizer) -> None:
        """AdamW step at ``critic_lr`` x the policy's current schedule factor, then zero the grads."""
        group = policy_optimizer.param_groups[0]
        factor = group["lr"] / group.get("initial_lr", group["lr"])
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def check_record(tree, info) -> None:
    """A record for ``ppo_critic``: per-path ``rewards``, no ``advantages``; errors name file and line."""
    where = f"{info.file}:{info.line}"
    if "advantages" in tree.fields:
        raise ValueError(
            f"{where}: advantages: --objective {CRITIC_OBJECTIVE} computes them (GAE from the critic's "
            "values and the per-path `rewards`); remove `advantages`, or use --objective ppo"
        )
    if "rewards" not in tree.fields:
        raise ValueError(
            f"{where}: rewards: missing; --objective {CRITIC_OBJECTIVE} needs one reward per path, "
            'e.g. "rewards": [1.0, 0.0]'
        )


def _micro_loss(policy, packed, objective, normalizer, *, critic, value_normalizer, packing, **kw):
    from treetrain.objectives.value import compute_ppo_critic_loss

    if any("advantages" in t.fields for t in packed.trees):
        raise ValueError(
            f"--objective {CRITIC_OBJECTIVE}: a record carries `advantages`, but here they come from the "
            "critic (GAE on the per-path `rewards`); remove `advantages`, or use --objective ppo"
        )
    if not all("rewards" in t.fields for t in packed.trees):
        raise ValueError(
            f"--objective {CRITIC_OBJECTIVE}: every record needs per-path `rewards` (one number per path, "
            'e.g. "rewards": [1.0, 0.0]); some records of this batch have none'
        )
    return compute_ppo_critic_loss(
        policy,
        critic.model,
        packed,
        objective,
        normalizer,
        value_normalizer,
        packing=packing,
        gamma=critic.gamma,
        lam=critic.lam,
        vf_coef=critic.vf_coef,
        value_clip=critic.value_clip,
        backend=kw.get("backend"),
    )


def _number(name: str, v: Any) -> float | str | None:
    """A finite number >= 0 (``--set loss.critic_lr=1e-3`` reaches here as the string '1e-3')."""
    if name == "critic_model":
        return None if v is None else str(v)
    if v is None and name == "critic_lr":
        return None
    try:
        x = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else math.nan
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"loss.{name}: need a finite number >= 0, got {v!r}")
    return x


def build_critic(policy: nn.Module, cfg, distributed: bool = False) -> Critic:
    """The value model (backbone = the policy's current weights, seeded ``score`` head) and its AdamW.

    ``policy``: a ``...ForCausalLM`` before any adapter is applied. Raises under ``torchrun``.
    """
    import transformers

    from treetrain.train.build import build_optimizer, configure_model

    if distributed:
        raise ValueError(
            f"--objective {CRITIC_OBJECTIVE}: one process only for now (the critic is not sharded with "
            "FSDP2 and its gradients are not reduced across ranks); run without torchrun"
        )
    if cfg.cp > 1:
        raise ValueError(f"--objective {CRITIC_OBJECTIVE}: --cp {cfg.cp} is not supported; use --cp 1")
    opts = {k: _number(k, v) for k, v in _split_options(cfg.loss)[0].items()}
    param = next(policy.parameters())
    if opts["critic_model"] is not None:  # e.g. a reward model: its backbone, and its score if 1 label
        model = _load_critic(opts["critic_model"], cfg, param)
    else:
        config = copy.deepcopy(policy.config)
        config.num_labels, config.classifier_dropout = 1, 0.0
        torch.manual_seed(cfg.seed)
        try:
            model = transformers.AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
        except ValueError as e:
            raise ValueError(
                f"--objective {CRITIC_OBJECTIVE}: the critic is an AutoModelForTokenClassification and "
                f"{type(policy).__name__} has none in transformers ({e})"
            ) from None
        model = model.to(device=param.device, dtype=param.dtype)
        model.base_model.load_state_dict(policy.base_model.state_dict())  # the policy's backbone
    model = configure_model(model, cfg.activation_checkpointing)
    lr = cfg.lr if opts["critic_lr"] is None else opts["critic_lr"]
    optimizer = drop_empty_groups(build_optimizer(model, dataclasses.replace(cfg, lr=lr)))
    kw = {k: opts[k] for k in ("vf_coef", "gamma", "lam", "value_clip")}
    return Critic(model, optimizer, lr, **kw)


def _load_critic(path: str, cfg, like: torch.Tensor) -> nn.Module:
    """``loss.critic_model=DIR``: a saved model as ``AutoModelForTokenClassification`` (num_labels=1,
    no dropout), on the policy's device and dtype."""
    from pathlib import Path

    from treetrain.train.build import build_model

    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"loss.critic_model {path}: not a Hugging Face model directory (no config.json); pass a "
            "directory saved with save_pretrained (a reward model, a previous run's final_critic)"
        )
    auto = "AutoModelForTokenClassification"
    remote = cfg.trust_remote_code
    model = build_model(path, cfg.seed, like.dtype, like.device, auto, trust_remote_code=remote)
    model.config.classifier_dropout = 0.0
    if isinstance(getattr(model, "dropout", None), nn.Dropout):
        model.dropout.p = 0.0
    return model


def drop_empty_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Remove parameter groups with no parameters (a LoRA policy's no-decay group): DCP saves and
    loads several optimizers together only without them. Call before the LR scheduler is built."""
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    return optimizer


def with_critic(model: nn.Module, optimizer, critic: Critic | None):
    """What a checkpoint saves and loads: ``(model, optimizer)``, or with a critic both models as one
    ``ModuleDict`` (keys ``policy.*``, ``critic.*``) and both optimizers."""
    if critic is None:
        return model, optimizer
    return nn.ModuleDict({"policy": model, "critic": critic.model}), [optimizer, critic.optimizer]


def summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The policy's metrics (``summarize_metrics``) plus the critic's: ``value_loss`` and per-token
    means ``value``, ``advantage``, ``return``, ``value_clipfrac``."""
    from treetrain.objectives.policy import summarize_metrics

    out = summarize_metrics(sums)
    out["value_loss"] = float(sums["value_loss"])
    tokens = float(sums["num_tokens"])
    if tokens > 0:
        for key, name in (
            ("value_sum", "value"),
            ("advantage_sum", "advantage"),
            ("return_sum", "return"),
            ("value_clipped_tokens", "value_clipfrac"),
        ):
            out[name] = float(sums[key]) / tokens
    return out
