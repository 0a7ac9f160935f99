"""What a policy objective is: :class:`Objective` (name, clip range, KL and entropy terms, aggregation)
and what it needs from the data (:func:`objective_needs`). The formulas are in
:mod:`treetrain.objectives.policy.loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "Objective",
    "ObjectiveNeeds",
    "objective_needs",
]


OBJECTIVES = ("sft", "reinforce", "grpo", "ppo", "gspo")
AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)


KL_ESTIMATORS = ("k1", "k2", "k3")
_PG = ("reinforce", "grpo", "ppo", "gspo")  # need advantages
_RATIO = ("grpo", "ppo", "gspo")  # need old log-probs
_DEFAULT_CLIP = {"gspo": (3e-4, 4e-4)}  # GSPO paper; ppo/grpo: 0.2 both sides


@dataclass(frozen=True)
class Objective:
    """What to optimize. See the module docstring for every formula.

    name: ``sft`` | ``reinforce`` | ``grpo`` | ``ppo`` | ``gspo`` (grpo = ppo's clipped surrogate
      with group-normalized advantages from the data).
    agg_mode: how per-token losses become one number (``AGG_MODES``, verl's ``loss_agg_mode``).
    norm_length: the constant length of ``seq-mean-token-sum-norm`` (required there only).
    clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]``; defaults 0.2 / 0.2
      for ppo and grpo, 3e-4 / 4e-4 for gspo (GSPO's sequence ratios sit much closer to 1).
    dual_clip_c: dual-clip bound (> 1) for negative advantages, ppo/grpo only; None disables it.
    kl_coef, kl_estimator: KL-to-reference penalty weight and estimator (``k1`` | ``k2`` | ``k3``).
    entropy_coef: entropy bonus weight (the loss subtracts ``entropy_coef * H``).
    use_token_weights: run linear objectives (sft, reinforce; no KL) as per-token weights on the
      tree log-probs instead of the expanded per-path view (same value, same gradient).
    report_entropy: compute the entropy metric even when ``entropy_coef == 0`` (one more pass over
      every head chunk's logits); False skips it (``treetrain bench`` does, as a plain HF step does).
    """

    name: str = "sft"
    agg_mode: str = "token-mean"
    norm_length: float | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    use_token_weights: bool = True
    report_entropy: bool = True

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective name: expected one of {OBJECTIVES}, got {self.name!r}")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode: expected one of {AGG_MODES}, got {self.agg_mode!r}")
        if self.agg_mode == "seq-mean-token-sum-norm":
            if self.norm_length is None or not _finite(self.norm_length) or self.norm_length <= 0:
                raise ValueError(
                    "agg_mode 'seq-mean-token-sum-norm' divides each path's token sum by a constant: "
                    f"set norm_length to a positive number (e.g. the max response length), got "
                    f"{self.norm_length!r}"
                )
        elif self.norm_length is not None:
            raise ValueError(
                f"norm_length is used only by agg_mode 'seq-mean-token-sum-norm', not {self.agg_mode!r}; "
                "remove it"
            )
        low, high = _DEFAULT_CLIP.get(self.name, (0.2, None))
        low = low if self.clip_low is None else self.clip_low
        high = (low if high is None else high) if self.clip_high is None else self.clip_high
        if not (_finite(low) and 0 <= low < 1):
            raise ValueError(
                f"clip_low: the ratio's lower bound is 1 - clip_low; need 0 <= clip_low < 1, got {low}"
            )
        if not (_finite(high) and high >= 0):
            raise ValueError(f"clip_high: need a finite value >= 0, got {high}")
        object.__setattr__(self, "clip_low", float(low))
        object.__setattr__(self, "clip_high", float(high))
        if self.dual_clip_c is not None:
            if self.name not in ("ppo", "grpo"):
                raise ValueError(f"dual_clip_c applies to ppo and grpo only, not {self.name!r}; remove it")
            if not (_finite(self.dual_clip_c) and self.dual_clip_c > 1):
                raise ValueError(f"dual_clip_c: need a value > 1 (typically 3), got {self.dual_clip_c}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not (_finite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef: need a finite value >= 0, got {self.kl_coef}")
        if not _finite(self.entropy_coef):
            raise ValueError(f"entropy_coef: need a finite value, got {self.entropy_coef}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class ObjectiveNeeds:
    """What an objective reads besides the model's log-probs."""

    advantages: bool  # per-path advantages in the data
    old_logprobs: bool  # the sampling policy's log-probs in the data
    ref_logprobs: bool  # reference log-probs: from the data or a ref_model
    entropy: bool  # the model's entropies carry gradient
    token_weights: bool  # linear in the log-probs: compute_loss takes the per-token-weight fast path


def objective_needs(cfg: Objective) -> ObjectiveNeeds:
    return ObjectiveNeeds(
        advantages=cfg.name in _PG,
        old_logprobs=cfg.name in _RATIO,
        ref_logprobs=cfg.kl_coef != 0,
        entropy=cfg.entropy_coef != 0,
        token_weights=cfg.use_token_weights and cfg.name in ("sft", "reinforce") and cfg.kl_coef == 0,
    )
