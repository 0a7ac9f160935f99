"""The policy objectives' losses (SFT, REINFORCE, GRPO, PPO, GSPO; KL and entropy terms) on the
per-path view, and one micro-batch's loss (:func:`compute_loss`).

Every objective is the baseline's formula run unchanged on ``path_logprobs``' per-path log-probs,
so it equals the per-sequence baseline by construction. Notation and aggregation (``c[p, j]``, the
normalizer ``N``): :mod:`treetrain.objectives.policy.aggregation`.

Per-token losses (``r = exp(lp - old)``, ``eps_l, eps_h`` = clip_low, clip_high)::

    sft         -lp
    reinforce   -A * lp                                         (fixed advantages, on-policy)
    ppo, grpo   max(-A * r, -A * clip(r, 1 - eps_l, 1 + eps_h)),
                then, with dual-clip c and A < 0: min(that, -A * c)
    gspo        the ppo form with r replaced by the sequence ratio
                s[p] = exp(sum_j m[p, j] * (lp - old) / n[p]), taken per token as
                exp(lp - sg(lp) + sg(log s[p])) (GSPO-token: value s[p], gradient s[p] * d lp)
    + kl_coef * kl(lp, ref)    k1 = lp - ref;  k2 = (lp - ref)^2 / 2;  k3 = exp(ref - lp) - (ref - lp) - 1
    - entropy_coef * H         H: the model's entropy at the target's context

GRPO here is the PPO clipped surrogate with group-normalized advantages provided in the data (see
``group_advantages``); with per-path scalar advantages and ``seq-mean-token-mean``, GSPO-token's
gradient is exactly GSPO's sequence-level one.

Losses linear in the log-probs (``sft`` and ``reinforce`` without a KL term) also have a fast path:
the per-path coefficients collapse to one weight per distinct tree token,
``W[t] = sum over (p, j) targeting t of c[p, j] * A[p, j]``, applied to ``tree_logprobs`` ``[T]``
with no expansion (the papers' "loss weights").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from treetrain.logprobs import DEFAULT_CHUNK, tree_logprobs
from treetrain.objectives.policy.aggregation import Batch, PathMeta, _trees, agg_coefficients
from treetrain.objectives.policy.config import _PG, _RATIO, KL_ESTIMATORS, Objective, objective_needs
from treetrain.trees.packing import PackedTree, pack

__all__ = [
    "compute_loss",
    "gspo_token_loss",
    "kl_penalty",
    "objective",
    "ppo_token_loss",
    "reference_logprobs",
    "summarize_metrics",
    "token_weights",
]


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, all ``[M]``. Returns (loss, clipped, dual_clipped).

    ``r = exp(logp - old)``; ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with
    ``dual_clip_c`` and ``A < 0``: ``min(loss, -A c)``. ``clipped`` (bool): the clipped term is the
    larger (its gradient is 0); ``dual_clipped``: the dual bound is active.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped_obj = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped_obj)
    clipped = clipped_obj > unclipped
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, clipped, dual


def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    meta: PathMeta,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO-token per token ``[M]``. Returns (loss, clipped, sequence log-ratio per token).

    ``log s[p] = sum_j m (logp - old) / n[p]``; per token ``s = exp(logp - sg(logp) + sg(log s[p]))``
    (value ``s[p]``, gradient ``s[p] * d logp``), then PPO's clipped form with ``s`` for ``r``.
    """
    log_seq = meta.path_sum(meta.mask * (logp - old_logp)) / meta.path_sum(meta.mask).clamp(min=1)
    log_seq_tok = log_seq.detach()[meta.path_of]
    ratio = torch.exp(logp - logp.detach() + log_seq_tok)
    unclipped = -advantages * ratio
    clipped_obj = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped_obj), clipped_obj > unclipped, log_seq_tok


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(model || ref)`` from the sampled token (Schulman's k1, k2, k3).

    ``d = logp - ref``: ``k1 = d``, ``k2 = d^2 / 2``, ``k3 = exp(-d) + d - 1`` (>= 0, unbiased).
    """
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1
    raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")


def _require(meta: PathMeta, cfg: Objective, ref_given: bool) -> None:
    if cfg.name in _PG and meta.advantages is None:
        raise ValueError(
            f"objective {cfg.name!r} needs advantages: give them per path in the data "
            "(TrajectoryTree.from_paths(..., advantages=...), one scalar or one value per token per "
            "path)"
            + (
                '; for GRPO, give per-path "rewards" and train with --advantages group (or compute '
                "them with treetrain.objectives.advantages.group_advantages)"
                if cfg.name == "grpo"
                else ""
            )
        )
    if cfg.name in _RATIO and cfg.name != "grpo" and meta.old_logprobs is None:
        raise ValueError(
            f"objective {cfg.name!r} needs old_logprobs (the sampling policy's log-prob of every "
            "target, len(path) - 1 values per path): give them in the data "
            "(TrajectoryTree.from_paths(..., old_logprobs=...)), or use name='reinforce' for a single "
            "on-policy update (the same gradient at ratio 1)"
        )
    if cfg.kl_coef != 0 and not ref_given and meta.ref_logprobs is None:
        raise ValueError(
            f"kl_coef={cfg.kl_coef} needs reference log-probs: pass ref_model= to compute_loss, or give "
            "ref_logprobs per path in the data (TrajectoryTree.from_paths(..., ref_logprobs=...))"
        )


def objective(
    logprobs: torch.Tensor | Sequence[torch.Tensor],
    meta: PathMeta,
    cfg: Objective,
    normalizer: float | torch.Tensor,
    *,
    entropy: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ref_logprobs: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One part's loss on the per-path view, already divided by the global ``normalizer``.

    logprobs: ``path_logprobs`` output (``list[Tensor [len(p) - 1]]``) or its concatenation ``[M]``.
    meta: the same paths' ``PathMeta`` (``PathMeta.from_trees(batch)``).
    entropy: the same layout (``path_logprobs(..., return_entropy=True)``); needed when
      ``entropy_coef != 0``, otherwise only reported. ref_logprobs: overrides ``meta.ref_logprobs``.

    Returns ``(loss, metrics)``. Summed over all parts and ranks, ``loss`` is the full-batch loss;
    every metric is a detached 0-d tensor that also sums over parts (``summarize_metrics``):
      loss, policy_loss, kl_loss, entropy_loss: normalized contributions
        (``loss = policy_loss + kl_coef * kl_loss - entropy_coef * entropy_loss``);
      num_tokens, num_paths: trainable targets and paths with one (unweighted);
      logprob_sum, entropy_sum, kl_sum, ratio_sum, clipped_tokens, dual_clipped_tokens:
        unweighted sums over trainable targets.
    """
    logp = _flat(logprobs)
    if logp.numel() != meta.path_of.numel():
        raise ValueError(
            f"logprobs: {logp.numel()} values for {meta.path_of.numel()} targets in the metadata; "
            "pass the log-probs and the PathMeta of the same batch"
        )
    ref = _flat(ref_logprobs) if ref_logprobs is not None else None
    _require(meta, cfg, ref is not None)
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(
            f"entropy_coef={cfg.entropy_coef} needs the entropies: pass entropy= from "
            "path_logprobs(..., return_entropy=True)"
        )
    meta = meta.to(logp.device, logp.dtype)
    on = meta.mask > 0
    coeff = agg_coefficients(meta, cfg.agg_mode, normalizer, cfg.norm_length)
    # masked targets may carry anything (e.g. no old log-prob for a prompt token): neutralize them so
    # a huge ratio times a zero coefficient cannot become NaN
    adv = torch.where(on, meta.advantages, 0.0) if meta.advantages is not None else None
    old = torch.where(on, meta.old_logprobs, logp.detach()) if meta.old_logprobs is not None else None
    if old is None and cfg.name == "grpo":  # no old_logprobs: on-policy, ratio 1 (TRL, one iteration)
        old = logp.detach()

    metrics: dict[str, torch.Tensor] = {}
    ratio = None
    if cfg.name == "sft":
        per_tok = -logp
    elif cfg.name == "reinforce":
        per_tok = -adv * logp
    elif cfg.name in ("ppo", "grpo"):
        per_tok, clipped, dual = ppo_token_loss(logp, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c)
        ratio = torch.exp(logp.detach() - old)
        metrics["clipped_tokens"] = (clipped & on).sum()
        metrics["dual_clipped_tokens"] = (dual & on).sum()
    else:  # gspo
        per_tok, clipped, log_seq = gspo_token_loss(logp, old, adv, meta, cfg.clip_low, cfg.clip_high)
        ratio = torch.exp(log_seq)
        metrics["clipped_tokens"] = (clipped & on).sum()
    policy_loss = (coeff * per_tok).sum()
    loss = policy_loss
    metrics["policy_loss"] = policy_loss
    if ratio is not None:
        metrics["ratio_sum"] = (ratio * on).sum()

    if cfg.kl_coef != 0:
        ref = ref if ref is not None else meta.ref_logprobs.to(logp.dtype)
        ref = torch.where(on, ref.to(logp.dtype), logp.detach())
        kl = kl_penalty(logp, ref, cfg.kl_estimator)
        kl_loss = (coeff * kl).sum()
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss
        metrics["kl_sum"] = (kl * on).sum()
    if entropy is not None:
        ent = _flat(entropy).to(logp.dtype)
        if cfg.entropy_coef != 0:
            ent_loss = (coeff * ent).sum()
            loss = loss - cfg.entropy_coef * ent_loss
            metrics["entropy_loss"] = ent_loss
        metrics["entropy_sum"] = (ent * on).sum()
    metrics["loss"] = loss
    metrics["logprob_sum"] = (logp * on).sum()
    metrics.update(_counts(meta))
    return loss, {k: v.detach() for k, v in metrics.items()}


def _flat(x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.cat(list(x)) if len(x) else torch.zeros(0)


def _counts(meta: PathMeta) -> dict[str, torch.Tensor]:
    on = meta.mask > 0
    return {"num_tokens": on.sum(), "num_paths": (meta.path_sum(on.to(meta.mask.dtype)) > 0).sum()}


def token_weights(
    meta: PathMeta, packed: PackedTree, cfg: Objective, normalizer: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per distinct tree token ``[T]``: ``(W_logp, W_ent)`` for objectives linear in the log-probs.

    ``W_ent[t] = sum over path targets (p, j) that are token t of c[p, j]``, and ``W_logp`` the same
    sum of ``c[p, j] * A[p, j]`` (reinforce) or ``= W_ent`` (sft), so that, with ``tree_logprobs``'
    ``logp, ent [T]``::

        loss = -(W_logp * logp).sum() - entropy_coef * (W_ent * ent).sum()

    equals the per-path objective without expanding to paths.
    """
    if cfg.name not in ("sft", "reinforce") or cfg.kl_coef != 0:
        raise ValueError(
            f"token_weights: objective {cfg.name!r} (kl_coef={cfg.kl_coef}) is not linear in the "
            "log-probs; only sft and reinforce without a KL term are"
        )
    _require(meta, cfg, False)
    target = packed.target_index().to(meta.mask.device)
    coeff = agg_coefficients(meta, cfg.agg_mode, normalizer, cfg.norm_length)
    T = packed.num_tokens
    w_ent = coeff.new_zeros(T).index_add(0, target, coeff)
    if cfg.name == "sft":
        return w_ent, w_ent
    adv = torch.where(meta.mask > 0, meta.advantages, 0.0)
    return coeff.new_zeros(T).index_add(0, target, coeff * adv), w_ent


def _token_weight_loss(
    logp: torch.Tensor, ent: torch.Tensor, meta: PathMeta, packed: PackedTree, cfg: Objective, normalizer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    w_lp, w_ent = token_weights(meta, packed, cfg, normalizer)
    target = packed.target_index().to(logp.device)
    count = logp.new_zeros(logp.numel()).index_add(0, target, (meta.mask > 0).to(logp.dtype))
    policy_loss = -(w_lp * logp).sum()
    loss = policy_loss
    metrics = {"policy_loss": policy_loss}
    if cfg.entropy_coef != 0:
        ent_loss = (w_ent * ent).sum()
        loss = loss - cfg.entropy_coef * ent_loss
        metrics["entropy_loss"] = ent_loss
    if ent is not None:
        metrics["entropy_sum"] = (count * ent).sum()
    metrics["loss"] = loss
    metrics["logprob_sum"] = (count * logp).sum()
    metrics.update(_counts(meta))
    return loss, {k: v.detach() for k, v in metrics.items()}


def reference_logprobs(
    ref_model: nn.Module, batch: Batch, *, backend: str | None = None, chunk: int = DEFAULT_CHUNK
) -> list[torch.Tensor]:
    """The reference model's per-path log-probs from one tree forward under ``torch.no_grad()``.

    Same layout as ``path_logprobs``; pass them as ``objective(..., ref_logprobs=...)`` or store them
    in the data as ``ref_logprobs``. Put ``ref_model`` in eval mode (no dropout).
    """
    from treetrain.logprobs import path_logprobs

    with torch.no_grad():
        return path_logprobs(ref_model, batch, backend=backend, chunk=chunk)


def compute_loss(
    model: nn.Module,
    packed: Batch,
    cfg: Objective,
    normalizer: float | torch.Tensor,
    ref_model: nn.Module | None = None,
    *,
    backend: str | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch: tree forward, log-probs (+ entropies), reference log-probs if KL, objective.

    ``normalizer`` is ``loss_normalizer(all trees of the step, cfg)``; the returned loss is this
    part's share, so ``loss.backward()`` per part accumulates the full-batch gradient. With
    ``ref_model`` the reference log-probs come from it (one no-grad tree forward), otherwise from
    the data's ``ref_logprobs``. Metrics: see ``objective``.
    """
    if not isinstance(packed, PackedTree):
        packed = pack(list(_trees(packed)))
    meta = PathMeta.from_trees(packed)
    _require(meta, cfg, ref_model is not None)
    # Every objective and metric reads masked targets only: score just those in the LM head.
    needed = torch.zeros(packed.num_tokens, dtype=torch.bool)
    needed[packed.target_index()[meta.mask.cpu() > 0]] = True
    with_ent = cfg.entropy_coef != 0 or cfg.report_entropy
    logp, ent = tree_logprobs(model, packed, backend, chunk, entropy=with_ent, needed=needed)
    ent = ent if with_ent else None
    meta = meta.to(logp.device, logp.dtype)
    if objective_needs(cfg).token_weights:
        return _token_weight_loss(logp, ent, meta, packed, cfg, normalizer)
    target = packed.target_index().to(logp.device)
    ref = None
    if cfg.kl_coef != 0 and ref_model is not None:
        with torch.no_grad():
            ref = tree_logprobs(ref_model, packed, backend, chunk, needed=needed)[0]
            ref = ref.to(logp.device).index_select(0, target)
    ent_paths = None
    if ent is not None:
        ent_paths = (ent if cfg.entropy_coef != 0 else ent.detach()).index_select(0, target)
    return objective(logp.index_select(0, target), meta, cfg, normalizer, entropy=ent_paths, ref_logprobs=ref)


def summarize_metrics(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Means from metric sums (already summed over parts and ranks): clipfrac, kl, entropy, ...

    Keeps the normalized losses as they are; ``*_sum`` and ``*_tokens`` become per-token means.
    """
    m = {k: float(v) for k, v in metrics.items()}
    out = {k: m[k] for k in ("loss", "policy_loss", "kl_loss", "entropy_loss") if k in m}
    tokens = m.get("num_tokens", 0.0)
    if tokens > 0:
        for key, name in (
            ("logprob_sum", "logprob"),
            ("entropy_sum", "entropy"),
            ("kl_sum", "kl"),
            ("ratio_sum", "ratio"),
            ("clipped_tokens", "clipfrac"),
            ("dual_clipped_tokens", "dual_clipfrac"),
        ):
            if key in m:
                out[name] = m[key] / tokens
    out["num_tokens"] = tokens
    if "num_paths" in m:
        out["num_paths"] = m["num_paths"]
    return out
