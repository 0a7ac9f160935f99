"""Preference objectives on trees: the DPO family and Bradley-Terry reward models.

A pair is two paths that share their prompt: ``chosen`` then ``rejected``
(:mod:`treetrain.objectives.preference.pairs`). Every loss here is a function of per-path
quantities (masked log-prob sums, or a scalar score per path) and a global normalizer ``N`` = the
number of pairs in the optimizer step, so the tree forward and
the per-path baseline (:mod:`treetrain.objectives.path_outputs`) give the same numbers, and a step's
micro-batches (each holding whole pairs) add up to the full-batch loss and gradient.

Notation for pair ``i`` (TRL's definitions, ``beta``: ``loss.beta``)::

    c, r        sum of the response's log-probs (loss-masked targets) under the policy
    c0, r0      the same under the reference model (frozen; ``--ref-model`` or the initial weights)
    n_c, n_r    response target counts (clamped to >= 1)
    ls          label_smoothing

    sigmoid (DPO)  d = (c - c0) - (r - r0);  loss = -(1 - ls) log s(beta d) - ls log s(-beta d)
    ipo            d = (c - c0) / n_c - (r - r0) / n_r;  loss = (d - 1 / (2 beta))^2
    simpo          d = c / n_c - r / n_r - gamma / beta  (no reference);
                   loss = -(1 - ls) log s(beta d) - ls log s(-beta d)
    reward (BT)    s_c, s_r = the scalar head at the last token; loss = -log s(s_c - s_r - margin)
                   (+ center_rewards_coefficient * (s_c + s_r)^2)

Metrics as TRL logs them: ``rewards/chosen`` = ``beta (c - c0)`` (simpo: ``beta c / n_c``), the same
for rejected, ``rewards/accuracies`` (chosen > rejected), ``rewards/margins``; the reward model logs
``accuracy``, ``margin`` and ``mean_reward``. At the first step of DPO the policy is its reference,
so ``d = 0`` and the loss is ``ln 2``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.objectives.path_outputs import path_last_hidden, path_target_logprobs, score_head
from treetrain.objectives.preference.pairs import PairLayout, pair_layout
from treetrain.trees.packing import PackedTree

__all__ = [
    "LOSS_TYPES",
    "PREFERENCE_OBJECTIVES",
    "PreferenceObjective",
    "compute_preference_loss",
    "dpo_loss",
    "masked_path_sums",
    "reward_head",
    "reward_loss",
    "summarize_preference",
]

PREFERENCE_OBJECTIVES = ("dpo", "reward")
LOSS_TYPES = ("sigmoid", "ipo", "simpo")


@dataclass(frozen=True)
class PreferenceObjective:
    """``dpo`` (loss types ``sigmoid`` | ``ipo`` | ``simpo``) or ``reward`` (Bradley-Terry).

    beta: DPO's temperature (TRL's default 0.1). label_smoothing: sigmoid and simpo (conservative
    DPO / cDPO), in ``[0, 0.5)``. simpo_gamma: SimPO's target margin (TRL's default 0.5).
    center_rewards_coefficient: reward models only (TRL's option; None: off).
    """

    name: str = "dpo"
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    center_rewards_coefficient: float | None = None

    def __post_init__(self) -> None:
        if self.name not in PREFERENCE_OBJECTIVES:
            raise ValueError(f"objective: expected one of {PREFERENCE_OBJECTIVES}, got {self.name!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not (_finite(self.beta) and self.beta > 0):
            raise ValueError(f"beta: need a finite number > 0, got {self.beta!r}")
        if not (_finite(self.label_smoothing) and 0 <= self.label_smoothing < 0.5):
            raise ValueError(
                f"label_smoothing: need 0 <= label_smoothing < 0.5, got {self.label_smoothing!r}"
            )
        if self.label_smoothing and self.loss_type == "ipo":
            raise ValueError("label_smoothing applies to loss_type sigmoid and simpo, not ipo; remove it")
        if not _finite(self.simpo_gamma):
            raise ValueError(f"simpo_gamma: need a finite number, got {self.simpo_gamma!r}")
        c = self.center_rewards_coefficient
        if c is not None and not (_finite(c) and c >= 0):
            raise ValueError(f"center_rewards_coefficient: need a finite number >= 0, got {c!r}")
        if self.name == "reward" and (self.loss_type != "sigmoid" or self.label_smoothing):
            raise ValueError(
                "the reward objective is Bradley-Terry: loss_type and label_smoothing do not apply"
            )

    @property
    def needs_reference(self) -> bool:
        """DPO sigmoid and ipo score the pair under a frozen reference model; simpo and reward do not."""
        return self.name == "dpo" and self.loss_type != "simpo"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- the losses (per-path tensors in, loss and metric sums out) -------------------------------------


def masked_path_sums(
    lp: torch.Tensor, mask: torch.Tensor, num_targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-path sums of masked log-probs and the masked counts: ``lp, mask [M]`` -> ``[P]``, ``[P]``.

    ``num_targets [P]`` splits ``M`` into paths (``len(p) - 1`` each).
    """
    path_of = torch.repeat_interleave(
        torch.arange(num_targets.numel(), device=lp.device), num_targets.to(lp.device)
    )
    zeros = lp.new_zeros(num_targets.numel())
    return zeros.index_add(0, path_of, lp * mask), zeros.index_add(0, path_of, mask)


def _smoothed_logsigmoid(x: torch.Tensor, ls: float) -> torch.Tensor:
    loss = -F.logsigmoid(x)
    return loss if ls == 0 else (1 - ls) * loss - ls * F.logsigmoid(-x)


def dpo_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    counts: torch.Tensor,
    pairs: PairLayout,
    cfg: PreferenceObjective,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO family on per-path sums: ``logps, ref_logps, counts [P]`` -> ``(sum_i loss_i / N, metrics)``.

    Metrics are sums over the pairs (``num_pairs`` counts them; :func:`summarize_preference` makes means).
    """
    c, r = logps[pairs.chosen], logps[pairs.rejected]
    n_c, n_r = counts[pairs.chosen].clamp(min=1), counts[pairs.rejected].clamp(min=1)
    beta, ls = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "simpo":
        reward_c, reward_r = beta * c / n_c, beta * r / n_r
        losses = _smoothed_logsigmoid(beta * (c / n_c - r / n_r - cfg.simpo_gamma / beta), ls)
    else:
        if ref_logps is None:
            raise ValueError(f"dpo loss_type {cfg.loss_type!r} needs the reference model's log-probs")
        c0, r0 = ref_logps[pairs.chosen], ref_logps[pairs.rejected]
        reward_c, reward_r = beta * (c - c0), beta * (r - r0)
        if cfg.loss_type == "sigmoid":
            losses = _smoothed_logsigmoid(beta * ((c - c0) - (r - r0)), ls)
        else:  # ipo, length-normalized as in TRL
            losses = ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 * beta)) ** 2
    loss = losses.sum() / normalizer
    reward_c, reward_r = reward_c.detach(), reward_r.detach()
    metrics = {
        "loss": loss,
        "rewards/chosen_sum": reward_c.sum(),
        "rewards/rejected_sum": reward_r.sum(),
        "rewards/accuracies_sum": (reward_c > reward_r).to(reward_c.dtype).sum(),
        "rewards/margins_sum": (reward_c - reward_r).sum(),
        "logps/chosen_sum": c.detach().sum(),
        "logps/rejected_sum": r.detach().sum(),
        "num_pairs": torch.tensor(float(pairs.num_pairs)),
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def reward_loss(
    scores: torch.Tensor, pairs: PairLayout, cfg: PreferenceObjective, normalizer: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry on per-path scores ``[P]``: ``-log s(s_c - s_r - margin)``, summed / ``N``."""
    s_c, s_r = scores[pairs.chosen], scores[pairs.rejected]
    margin = pairs.margin.to(device=scores.device, dtype=scores.dtype)
    losses = -F.logsigmoid(s_c - s_r - margin)
    if cfg.center_rewards_coefficient:
        losses = losses + cfg.center_rewards_coefficient * (s_c + s_r) ** 2
    loss = losses.sum() / normalizer
    s_c, s_r = s_c.detach(), s_r.detach()
    metrics = {
        "loss": loss,
        "accuracy_sum": (s_c > s_r).to(s_c.dtype).sum(),
        "margin_sum": (s_c - s_r).sum(),
        "reward_sum": (s_c + s_r).sum() / 2,
        "num_pairs": torch.tensor(float(pairs.num_pairs)),
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def summarize_preference(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Means over the step's pairs from summed metrics: ``rewards/chosen_sum`` -> ``rewards/chosen``."""
    m = {k: float(v) for k, v in sums.items()}
    pairs = m.get("num_pairs", 0.0)
    out = {"loss": m["loss"], "num_pairs": pairs}
    for k, v in m.items():
        if k.endswith("_sum") and pairs > 0:
            name = k.removesuffix("_sum")
            out["mean_reward" if name == "reward" else name] = v / pairs
    return out


# ---- one micro-batch ------------------------------------------------------------------------------


def reward_head(model: nn.Module) -> nn.Linear:
    """The scalar head of an ``AutoModelForSequenceClassification`` (``num_labels=1``)."""
    return score_head(model, "the reward objective needs a sequence-classification model with one label")


def compute_preference_loss(
    model: nn.Module,
    packed: PackedTree,
    cfg: PreferenceObjective,
    normalizer: float,
    ref_model: nn.Module | None = None,
    *,
    packing: str = "tree",
    backend: str | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch of whole pairs: forward (tree or per path), then :func:`dpo_loss` or
    :func:`reward_loss` under the step's normalizer ``N`` (:func:`preference_normalizer`)."""
    pairs = pair_layout(packed)
    if cfg.name == "reward":
        scores = reward_head(model)(path_last_hidden(model, packed, packing, backend=backend))[:, 0]
        scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores  # autocast
        return reward_loss(scores, pairs, cfg, normalizer)
    from treetrain.objectives.policy.aggregation import PathMeta

    meta = PathMeta.from_trees(packed)
    needed = meta.mask > 0
    logp = path_target_logprobs(model, packed, packing, needed, backend=backend, chunk=chunk)
    mask = meta.mask.to(device=logp.device, dtype=logp.dtype)
    sums, counts = masked_path_sums(logp, mask, meta.num_targets)
    ref_sums = None
    if cfg.needs_reference:
        if ref_model is None:
            raise ValueError(f"dpo loss_type {cfg.loss_type!r} needs a reference model (ref_model)")
        with torch.no_grad():
            ref = path_target_logprobs(ref_model, packed, packing, needed, backend=backend, chunk=chunk)
            ref_sums = masked_path_sums(ref.to(logp.device, logp.dtype), mask, meta.num_targets)[0]
    return dpo_loss(sums, ref_sums, counts, pairs, cfg, normalizer)
