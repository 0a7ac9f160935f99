"""One optimizer step: forward and backward over a step's micro-batches with the objective's loss
(:class:`treetrain.objectives.interface.TrainObjective`), gradients reduced over ranks, clipped,
and the step applied unless the loss or a gradient norm is not finite (:class:`NonFiniteError`).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from treetrain.parallel import fsdp as distributed
from treetrain.train.batches import StepBatch
from treetrain.train.kit import clip_extras


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
    backend: str | None = None,
    cp=None,
) -> dict[str, float]:
    """Forward and backward over every micro-batch, then clip and step.

    ``objective``: a :class:`treetrain.objectives.interface.TrainObjective` (its extra models: a
    reference it reads, a critic it trains and steps here). Each micro-batch's loss is its share of
    the step loss, normalized over the whole trees of the step, so the accumulated gradient is the
    full-batch gradient. Returns the step's objective metrics (``objective.summarize`` of the
    micro-batch metric sums over ranks) plus ``grad_norm`` (before clipping) and, for each extra
    trained model, ``NAME_grad_norm``.
    """
    from treetrain.objectives import moe_aux

    device = next(model.parameters()).device
    loss_fn = objective.micro_loss(batch.trees, batch.packing)
    sums: dict[str, torch.Tensor] = {}
    cp_size = cp.cp_size if cp is not None else 1  # parallel.cp.CPLayout: ranks sharing each tree
    aux_coef = moe_aux.aux_coef(model)  # MoE router load-balancing loss, see treetrain.objectives.moe_aux
    for packed in batch.micro:
        cp_scope = cp.scope() if cp is not None else contextlib.nullcontext()
        with autocast_context(device, autocast_dtype), cp_scope, moe_aux.recording(model, aux_coef) as router:
            loss, metrics = loss_fn(model, packed.to(device), backend=backend)
        if aux_coef is not None:
            share = sum(t.num_path_tokens for t in packed.trees) / batch.path_tokens
            aux = share * moe_aux.micro_batch_aux_loss(model, packed, batch.packing, router)
            loss, metrics["aux_loss"] = loss + aux_coef * aux, aux.detach()
        loss.backward()
        for k, v in metrics.items():
            sums[k] = sums[k] + v.double() if k in sums else v.double()
    for _ in range(batch.passes - len(batch.micro)):  # FSDP's collectives need every rank's pass
        with autocast_context(device, autocast_dtype):
            idle = objective.idle_loss(model, backend)
        idle.backward()
    sums = distributed.all_reduce_sum_dict(sums)
    if cp_size > 1:  # every rank of a context-parallel group computed the same full metrics
        sums = {k: v / cp_size for k, v in sums.items()}
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip else float("inf")
    grad_norm = distributed.clip_grad_norm_(params, max_norm)
    out = objective.summarize(sums) | {"grad_norm": float(grad_norm)}
    if "aux_loss" in sums:
        out["aux_loss"] = float(sums["aux_loss"])
    extra_norms = clip_extras(objective, grad_clip)  # each extra model (a critic): its own norm and clip
    out |= extra_norms
    finite = math.isfinite(out.get("loss", 0.0)) and math.isfinite(out["grad_norm"])
    if not (finite and all(math.isfinite(v) for v in extra_norms.values())):
        optimizer.zero_grad(set_to_none=True)  # the same values on every rank: all stop together
        for t in objective.trained():
            t.optimizer.zero_grad(set_to_none=True)
        extra = "".join(f", {k.removesuffix('_grad_norm')} {v}" for k, v in extra_norms.items())
        norms = f"{out['grad_norm']}{extra}"
        raise NonFiniteError(f"non-finite loss ({out.get('loss')}) or gradient norm ({norms})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for t in objective.trained():
        t.step(optimizer)
    return out
