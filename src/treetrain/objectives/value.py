"""PPO with a learned critic on trees: values scored once per distinct token, GAE per path.

A critic (a value head on a decoder: ``AutoModelForTokenClassification`` with ``num_labels=1``, or a
sequence-classification model's ``score`` head) gives the value of every context. The value of
target ``j`` of path ``p`` (the state before token ``j + 1`` is generated) is read at the hidden
state that predicts that token, so it has the log-probs' layout ``[M]``. On a tree the head runs
once per distinct token (``[T]``) and the per-path view is the index gather, exactly as for the
log-probs; a branch point's value is shared by every path through it.

Advantages are NOT shared: a token's successors differ per path, so GAE runs along each path on its
own (``gae_per_path``), over the path's trained targets (``mask`` 1; the others, e.g. tool outputs,
are skipped, as verl's multi-turn GAE does), with the path's scalar reward (the record's
``rewards``) at its last trained target::

    delta_t = r_t + gamma V_{t+1} - V_t      (V after the last trained target: 0)
    A_t     = delta_t + gamma lam A_{t+1},   R_t = A_t + V_t

The clipped value loss (PPO's; ``old``: the critic's values when the advantages were computed)::

    l_t = 1/2 max((V_t - R_t)^2, (old_t + clip(V_t - old_t, -c, c) - R_t)^2)

aggregated as ``sum_t mask_t l_t / N`` with ``N`` the trained targets of the whole step, so any
partition of the step into micro-batches adds up to the same loss and gradient.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from treetrain.models.hf import tree_forward
from treetrain.objectives.path_outputs import _tree_view, score_head
from treetrain.trees.packing import PackedTree

__all__ = ["clipped_value_loss", "compute_ppo_critic_loss", "gae_per_path", "path_values", "value_head"]


def value_head(model: nn.Module) -> nn.Linear:
    """The critic's scalar head: ``score`` of a token- or sequence-classification model (1 label)."""
    kinds = "AutoModelForTokenClassification or AutoModelForSequenceClassification with num_labels=1"
    return score_head(model, f"a critic needs {kinds}")


def path_values(
    model: nn.Module, packed: PackedTree, packing: str = "tree", *, backend: str | None = None
) -> torch.Tensor:
    """The critic's value of every path target ``[M]`` (the state before token ``j + 1``).

    Tree: the head runs once per distinct token ``[T]``, then ``values[prev[target]]``. Sequence:
    every path its own sequence (the baseline's packed one-path trees), the same head. Example:
    paths ``[1 2 3]``, ``[1 2 4]`` give
    ``[V(1), V(1 2), V(1), V(1 2)]``, each computed once on the tree.
    """
    head = value_head(model)
    packed = _tree_view(packed, packing)  # sequence: the paths as packed one-path trees (the baseline)
    hidden = tree_forward(model, packed, backend)
    values = head(hidden)[:, 0]  # [T]: one per distinct token
    packed = packed.to(values.device)
    values = values.index_select(0, packed.prev[packed.target_index()])
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values  # autocast


def gae_per_path(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    num_targets: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE along each path: ``values, mask [M]``, ``rewards, num_targets [P]`` -> ``(advantages,
    returns) [M]`` (0 at untrained targets; no gradient).

    Example, one path with 3 trained targets, values ``[0.5, 0.2, 0.1]``, reward 1, gamma = lam = 1:
    deltas ``[-0.3, -0.1, 0.9]``, advantages ``[0.5, 0.8, 0.9]``, returns ``[1, 1, 1]``.
    """
    values = values.detach()
    adv = torch.zeros_like(values)
    start = 0
    for p, n in enumerate(num_targets.tolist()):
        idx = start + torch.nonzero(mask[start : start + n] > 0)[:, 0].to(values.device)
        start += n
        if idx.numel() == 0:
            continue
        v = values[idx]
        nxt = torch.cat([v[1:], v.new_zeros(1)])
        r = torch.zeros_like(v)
        r[-1] = rewards[p]
        delta = r + gamma * nxt - v
        a = torch.zeros_like(v)
        running = v.new_zeros(())
        for t in range(v.numel() - 1, -1, -1):
            running = delta[t] + gamma * lam * running
            a[t] = running
        adv[idx] = a
    return adv, torch.where(mask > 0, adv + values, 0.0)


def clipped_value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    old_values: torch.Tensor | None = None,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss over ``[M]`` targets, ``sum(mask * l) / normalizer`` (see module).

    ``old_values`` default to the values themselves, detached (the first update on a batch, where
    the clip is inactive).
    """
    old = values.detach() if old_values is None else old_values
    clipped = old + (values - old).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = (per_token * mask).sum() / normalizer
    metrics = {
        "value_loss": loss.detach(),
        "value_sum": (values.detach() * mask).sum(),
        "value_clipped_tokens": (((values - returns) ** 2 < (clipped - returns) ** 2) * mask).sum().detach(),
        "num_tokens": mask.sum(),
    }
    return loss, metrics


def compute_ppo_critic_loss(
    policy: nn.Module,
    critic: nn.Module,
    packed: PackedTree,
    cfg,
    normalizer: float,
    value_normalizer: float,
    *,
    packing: str = "tree",
    gamma: float = 1.0,
    lam: float = 0.95,
    vf_coef: float = 0.5,
    value_clip: float = 0.2,
    backend: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch of PPO with a critic: ``policy_loss + vf_coef * value_loss``.

    ``cfg``: a ``treetrain.objectives.policy.config.Objective`` (``ppo``; the data carries per-path
    ``rewards``, no ``advantages``, and optionally ``old_logprobs``: without them the ratio is 1,
    on-policy).
    ``normalizer``: ``loss_normalizer(step trees, cfg)``; ``value_normalizer``: the step's trained
    targets. The critic's values (one head row per distinct token on a tree), GAE along each path,
    then the policy objective on those advantages.
    """
    from treetrain.objectives.path_outputs import path_target_logprobs
    from treetrain.objectives.policy.aggregation import PathMeta
    from treetrain.objectives.policy.loss import objective

    if not all("rewards" in t.fields for t in packed.trees):
        raise ValueError("PPO with a critic needs per-path `rewards` in every record (not advantages)")
    meta = PathMeta.from_trees(packed)
    rewards = torch.as_tensor(np.concatenate([t.fields["rewards"] for t in packed.trees]))
    values = path_values(critic, packed, packing, backend=backend)
    meta = meta.to(values.device, values.dtype)
    adv, ret = gae_per_path(values, rewards.to(values), meta.mask, meta.num_targets, gamma, lam)
    v_loss, v_metrics = clipped_value_loss(values, ret, meta.mask, value_normalizer, clip=value_clip)
    meta.advantages = adv
    lp = path_target_logprobs(policy, packed, packing, meta.mask > 0, backend=backend)
    if meta.old_logprobs is None:  # no sampling log-probs in the data: on-policy, ratio 1
        meta.old_logprobs = lp.detach()
    p_loss, metrics = objective(lp, meta.to(lp.device, lp.dtype), cfg, normalizer)
    loss = p_loss + vf_coef * v_loss
    sums = {"advantage_sum": (adv * meta.mask).sum(), "return_sum": (ret * meta.mask).sum()}
    return loss, metrics | v_metrics | sums | {"loss": loss.detach()}
