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
``critic.*``), so resuming continues exactly, on any number of ranks. Under ``torchrun`` both
models are sharded with FSDP2 (their gradients summed over ranks, as the policy's) and a tree's
paths may be split over ranks (GAE runs per path; the value loss is normalized over the step).

Options (``--set loss.NAME=VALUE``): ``vf_coef`` (0.5), ``critic_lr`` (``--lr``), ``gamma`` (1.0),
``lam`` (0.95), ``value_clip`` (0.2), ``critic_model`` (a directory to start the critic from instead,
e.g. a reward model: loaded as token classification, its backbone and 1-label ``score``); every
other ``loss.*`` goes to the policy's ``ppo`` objective (``clip_low``, ``clip_high``,
``dual_clip_c``, ``agg_mode``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from treetrain.objectives.interface import Kit, Trained
from treetrain.objectives.policy.training import PolicyObjective

__all__ = ["CRITIC_OBJECTIVE", "Critic", "PPOCritic", "build_critic", "check_record", "policy_objective"]

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
    """The policy's ``treetrain.objectives.policy.config.Objective`` (``ppo``) from ``cfg.loss`` minus the
    critic's options."""
    from treetrain.objectives.policy.config import Objective

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
            "options of treetrain.objectives.policy.config.Objective"
        ) from None


@dataclass
class Critic(Trained):
    """The value model, its AdamW and the GAE / value-loss options."""

    vf_coef: float = 0.5
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2


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


def build_critic(policy: nn.Module, kit: Kit, opts: dict[str, Any] | None = None) -> Critic:
    """The value model (backbone = the policy's current weights, seeded ``score`` head), sharded
    over the run's ranks (FSDP2, as the policy), and its AdamW.

    ``policy``: a ``...ForCausalLM`` before any adapter is applied and before it is sharded;
    ``opts``: :func:`critic_options` (default: those of ``kit.cfg.loss``).
    """
    import transformers

    cfg = kit.cfg
    opts = critic_options(cfg.loss) if opts is None else opts
    param = next(policy.parameters())
    if opts["critic_model"] is not None:  # e.g. a reward model: its backbone, and its score if 1 label
        model = _load_critic(opts["critic_model"], kit)
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
    model = kit.shard(kit.configure(model))
    lr = cfg.lr if opts["critic_lr"] is None else opts["critic_lr"]
    kw = {k: opts[k] for k in ("vf_coef", "gamma", "lam", "value_clip")}
    return Critic("critic", model, kit.optimizer(model, lr), lr, **kw)


def critic_options(loss: dict[str, Any]) -> dict[str, Any]:
    """The critic's ``loss.*`` options, checked (``--set`` passes numbers as strings)."""
    return {k: _number(k, v) for k, v in _split_options(loss)[0].items()}


def _load_critic(path: str, kit: Kit) -> nn.Module:
    """``loss.critic_model=DIR``: a saved model as ``AutoModelForTokenClassification`` (num_labels=1,
    no dropout), on the policy's device and dtype."""
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"loss.critic_model {path}: not a Hugging Face model directory (no config.json); pass a "
            "directory saved with save_pretrained (a reward model, a previous run's final_critic)"
        )
    model = kit.load(path, "AutoModelForTokenClassification")
    model.config.classifier_dropout = 0.0
    if isinstance(getattr(model, "dropout", None), nn.Dropout):
        model.dropout.p = 0.0
    return model


def summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The policy's metrics (``summarize_metrics``) plus the critic's: ``value_loss`` and per-token
    means ``value``, ``advantage``, ``return``, ``value_clipfrac``."""
    from treetrain.objectives.policy.loss import summarize_metrics

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


class PPOCritic(PolicyObjective):
    """``ppo_critic``: the policy's ``ppo`` objective on GAE advantages from a critic trained alongside
    (micro-batches and rank balancing as the policy objectives: whole paths)."""

    def __init__(self, config, cfg) -> None:
        super().__init__(config, cfg.reference)
        self.name = CRITIC_OBJECTIVE
        self.critic: Critic | None = None
        self.options = critic_options(cfg.loss)  # bad options fail before any model is built

    @classmethod
    def from_config(cls, cfg: Any) -> PPOCritic:
        return cls(policy_objective(cfg), cfg)

    def check_record(self, tree, info) -> None:
        check_record(tree, info)

    def cp_refusal(self) -> str | None:
        return (
            "the critic's values and GAE run along whole paths on one rank, and context parallelism "
            "splits a tree's tokens over the ranks"
        )

    def build_models(self, policy, kit: Kit) -> None:
        self.critic = build_critic(policy, kit, self.options)

    def trained(self) -> list[Trained]:
        return [self.critic] if self.critic is not None else []

    def micro_loss(self, trees, packing):
        """Policy + ``vf_coef`` x value loss of a micro-batch (:func:`compute_ppo_critic_loss`). The value
        loss's normalizer is the step's trained targets (whole trees), so micro-batch losses add up
        to the step's loss whatever the partition."""
        from treetrain.objectives.policy.aggregation import PathMeta, loss_normalizer
        from treetrain.objectives.value import compute_ppo_critic_loss

        meta = PathMeta.from_trees(list(trees))  # once per step, for both normalizers
        cfg, critic, normalizer = self.config, self.critic, loss_normalizer(meta, self.config)
        value_normalizer = float(meta.mask.sum())
        opts = {k: getattr(critic, k) for k in ("gamma", "lam", "vf_coef", "value_clip")}

        def micro(model, packed, *, backend=None):
            return compute_ppo_critic_loss(
                model, critic.model, packed, cfg, normalizer, value_normalizer, packing=packing,
                backend=backend, **opts,
            )  # fmt: skip

        return micro

    def summarize(self, sums):
        return summarize(sums)

    def idle_loss(self, model, backend=None):
        """The policy's idle pass plus ``0 x`` the critic's values of the idle tree (its head too)."""
        from treetrain.objectives.interface import idle_tree
        from treetrain.objectives.value import path_values
        from treetrain.trees.packing import pack

        values = path_values(self.critic.model, pack([idle_tree()]), backend=backend)
        return super().idle_loss(model, backend) + values.sum() * 0.0
