"""One optimizer step: the objective from the config, then forward and backward over a step's
micro-batches, gradients reduced over ranks, clipped, and the step applied unless the loss or the
gradient norm is not finite (:class:`NonFiniteError`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
from torch import nn

from treetrain.parallel import fsdp as distributed
from treetrain.train.batches import StepBatch
from treetrain.train.config import TrainConfig
from treetrain.train.strategies import get_strategy


def build_objective(cfg: TrainConfig):
    """``treetrain.objectives.policy.Objective`` from ``--objective`` and the ``loss`` options (dpo and
    reward:
    ``treetrain.objectives.preference.PreferenceObjective``)."""
    from treetrain.objectives.policy_config import Objective
    from treetrain.objectives.preference import PREFERENCE_OBJECTIVES, PreferenceObjective

    if cfg.objective == "ppo_critic":  # the policy's ppo objective; the critic's options: train.critic
        from treetrain.train.critic import policy_objective

        return policy_objective(cfg)
    cls = PreferenceObjective if cfg.objective in PREFERENCE_OBJECTIVES else Objective
    known = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    unknown = sorted(set(cfg.loss) - set(known))
    if unknown:
        raise ValueError(
            f"loss: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"valid loss options: {', '.join(known)} (for --objective {cfg.objective})"
        )
    try:
        return cls(name=cfg.objective, **cfg.loss)
    except TypeError as e:
        raise ValueError(f"loss: {e}; see {cls.__module__}.{cls.__name__} for the options") from None


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite; the step was not applied."""


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    objective,
    *,
    grad_clip: float | None,
    autocast_dtype: torch.dtype | None = None,
    ref_model: nn.Module | None = None,
    backend: str | None = None,
    cp=None,
    critic=None,
) -> dict[str, float]:
    """Forward and backward over every micro-batch, then clip and step.

    The normalizer comes from the whole trees of the step, so the micro-batch losses sum to the
    full-batch loss and the accumulated gradient is the full-batch gradient. Returns the step's
    objective metrics (``treetrain.objectives.policy.summarize_metrics`` of the summed micro-batch metrics)
    plus ``grad_norm`` (before clipping).
    """
    from treetrain.objectives import moe_aux
    from treetrain.objectives import preference as pref
    from treetrain.objectives.policy import loss_normalizer, summarize_metrics

    loss_fn = get_strategy(batch.packing).loss
    device = next(model.parameters()).device
    if isinstance(objective, pref.PreferenceObjective):  # dpo, reward: per-path tensors, either packing
        loss_fn = functools.partial(pref.compute_preference_loss, packing=batch.packing)
        normalizer, summarize_metrics = pref.preference_normalizer(batch.trees), pref.summarize_preference
    else:
        normalizer = loss_normalizer(batch.trees, objective)
    if critic is not None:  # ppo_critic: GAE advantages from the value model (treetrain.train.critic)
        from treetrain.train.critic import summarize as summarize_metrics

        loss_fn = critic.loss_fn(batch.trees, batch.packing)
    sums: dict[str, torch.Tensor] = {}
    cp_size = cp.cp_size if cp is not None else 1  # parallel.cp.CPLayout: ranks sharing each tree
    aux_coef = moe_aux.aux_coef(model)  # MoE router load-balancing loss, see treetrain.objectives.moe_aux
    for packed in batch.micro:
        cp_scope = cp.scope() if cp is not None else contextlib.nullcontext()
        with autocast_context(device, autocast_dtype), cp_scope, moe_aux.recording(model, aux_coef) as router:
            loss, metrics = loss_fn(
                model, packed.to(device), objective, normalizer, ref_model=ref_model, backend=backend
            )
        if aux_coef is not None:
            share = sum(t.num_path_tokens for t in packed.trees) / batch.path_tokens
            aux = share * moe_aux.micro_batch_aux_loss(model, packed, batch.packing, router)
            loss, metrics["aux_loss"] = loss + aux_coef * aux, aux.detach()
        loss.backward()
        for k, v in metrics.items():
            sums[k] = sums[k] + v.double() if k in sums else v.double()
    for _ in range(batch.passes - len(batch.micro)):  # FSDP's collectives need every rank's pass
        with autocast_context(device, autocast_dtype):
            idle = distributed.dummy_loss(model, backend)
        idle.backward()
    sums = distributed.all_reduce_sum_dict(sums)
    if cp_size > 1:  # every rank of a context-parallel group computed the same full metrics
        sums = {k: v / cp_size for k, v in sums.items()}
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip else float("inf")
    grad_norm = distributed.clip_grad_norm_(params, max_norm)
    out = summarize_metrics(sums) | {"grad_norm": float(grad_norm)}
    if "aux_loss" in sums:
        out["aux_loss"] = float(sums["aux_loss"])
    if critic is not None:  # its own gradient norm and clip
        out["critic_grad_norm"] = critic.clip(grad_clip)
    finite = math.isfinite(out.get("loss", 0.0)) and math.isfinite(out["grad_norm"])
    if not (finite and math.isfinite(out.get("critic_grad_norm", 0.0))):
        optimizer.zero_grad(set_to_none=True)  # the same values on every rank: all stop together
        if critic is not None:
            critic.optimizer.zero_grad(set_to_none=True)
        norms = f"{out['grad_norm']}" + (f", critic {out['critic_grad_norm']}" if critic is not None else "")
        raise NonFiniteError(f"non-finite loss ({out.get('loss')}) or gradient norm ({norms})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if critic is not None:
        critic.step(optimizer)
    return out
