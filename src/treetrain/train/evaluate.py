"""``--eval-data FILE`` (``--eval-every N``): the objective's loss on held-out trees, through the same
tree path as training (the objective's micro-batches, tree attention, its normalizer over the whole
held-out set), without gradients; logged as ``eval/...`` beside the step's own metrics.

The held-out file is read and checked once, before the first step (every bad record listed, as for
``--data``), and its packed micro-batches are kept for the run: one evaluation is one pass over the
whole file as one batch. ``eval/loss`` is the objective's loss over that batch (for ``sft`` the mean
token NLL of the loss tokens, normalized as in training); ``eval/reward_mean`` ... are the reward
statistics of records with ``rewards``. Under ``torchrun`` every rank evaluates the whole file (the
same micro-batches in the same order, so FSDP's collectives match) and rank 0 logs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from treetrain.train.batches import StepBatch, _per_tree_budget, _reader_options, data_path, make_batches
from treetrain.train.config import TrainConfig
from treetrain.train.outputs import reward_metrics
from treetrain.train.step import autocast_context

__all__ = ["eval_batch", "eval_due", "eval_step"]


def eval_batch(cfg: TrainConfig, vocab_size: int, objective, progress: bool = False) -> tuple[StepBatch, Any]:
    """The whole ``cfg.eval_data`` file as one batch of micro-batches (the objective's, at
    ``--capacity``) and its ``DataCounts``. Raises ``DataError`` listing every bad record."""
    from treetrain.train.guards import validate_data

    ecfg = _per_tree_budget(dataclasses.replace(cfg, data=cfg.eval_data, steps=1, epochs=None))
    path = data_path(ecfg)
    try:
        counts = validate_data(path, _reader_options(ecfg, vocab_size, objective), progress)
    except ValueError as e:
        raise type(e)(f"--eval-data: {e}") from None
    ecfg = dataclasses.replace(ecfg, batch_trees=counts.samples)
    batch = next(make_batches(ecfg, vocab_size, 1, objective=objective))
    return batch, counts


def eval_due(cfg: TrainConfig, step: int, last_step: int) -> bool:
    """Whether step ``step`` evaluates: every ``eval_every`` steps and after the last one."""
    if cfg.eval_data is None:
        return False
    return step == last_step or (cfg.eval_every > 0 and step % cfg.eval_every == 0)


@torch.no_grad()
def eval_step(
    model: nn.Module,
    batch: StepBatch,
    objective,
    *,
    autocast_dtype: torch.dtype | None = None,
    backend: str | None = None,
    cp=None,
) -> dict[str, float]:
    """The objective's metrics on ``batch`` (``eval/loss``, ...), in eval mode (no dropout), no
    gradient; plus ``eval/reward_*`` for records with rewards. The model's mode is restored."""
    device = next(model.parameters()).device
    loss_fn = objective.micro_loss(batch.trees, batch.packing)
    sums: dict[str, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        for packed in batch.micro:
            cp_scope = cp.scope() if cp is not None else contextlib.nullcontext()
            with autocast_context(device, autocast_dtype), cp_scope:
                _, metrics = loss_fn(model, packed.to(device), backend=backend)
            for k, v in metrics.items():
                v = torch.as_tensor(v).detach().double()
                sums[k] = sums[k] + v if k in sums else v
    finally:
        model.train(was_training)
    out = objective.summarize(sums) | reward_metrics(batch.trees)
    return {f"eval/{k}": float(v) for k, v in out.items()}
