"""One interface for every training objective: what the training loop needs to know, declared by
the objective, so the loop (:mod:`treetrain.train.loop`, ``step``, ``batches``) composes it with no
``if objective == ...`` of its own.

An objective (a :class:`TrainObjective`) says:

- ``model_class``: the transformers auto class of the trained model (None: a causal LM);
- ``check_record``: which data records it accepts (errors name file and line);
- ``cp_refusal``: why it cannot run with ``--cp N`` (None: it can);
- ``build_models``: its extra models (a frozen reference, a critic), built through the
  :class:`Kit` the loop lends (device, dtype, FSDP2 sharding, AdamW), and ``trained``: those of
  them that train (sharded, stepped, clipped, checkpointed, resumed and exported alongside);
- how a step's trees group: ``microbatches`` (one process), ``units`` (groups that are never split
  across ranks or micro-batches, e.g. whole preference pairs), ``pack`` (a rank's units into
  micro-batches) and ``split_units`` (whether the balancer may cut a costly unit into parts of
  whole paths, :mod:`treetrain.parallel.balance`);
- its loss: ``micro_loss`` (one micro-batch's share of the step loss, normalized over the step's
  whole trees so micro-batch and rank losses add up to the step's loss, and its metric sums),
  ``summarize`` (the step's metrics from the sums over micro-batches and ranks) and ``idle_loss``
  (zero times a tiny forward through every trained parameter, for a rank with no work: FSDP's
  collectives).

Objectives live in one module each and one entry of :mod:`treetrain.objectives.registry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from treetrain.trees.tree import TrajectoryTree

__all__ = ["Kit", "MicroLoss", "TrainObjective", "Trained", "idle_tree", "loss_options"]

# (model, packed micro-batch, *, backend) -> (its share of the step loss, metric sums)
MicroLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Kit(Protocol):
    """What the training loop lends an objective for its extra models (objectives/ imports neither
    ``train`` nor ``parallel``): the run's config, device, dtype, FSDP2 and optimizer."""

    cfg: Any
    distributed: bool

    def load(self, directory: str | None, auto_class: str | None = None) -> nn.Module:
        """A model from a directory (or the embedded tiny config), seeded, tree attention on."""

    def configure(self, model: nn.Module) -> nn.Module:
        """Tree attention on, training mode, ``--activation-checkpointing``."""

    def frozen(self, model: nn.Module) -> nn.Module:
        """A frozen copy (eval mode, no gradients): a reference model."""

    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over the run's ranks (a no-op in one process); before its optimizer is built."""

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The run's AdamW over ``model`` at ``lr`` (no empty parameter group)."""


@dataclass
class Trained:
    """An extra model that trains with the policy (a critic): its own AdamW at ``lr`` times the
    policy's schedule factor. Checkpoints hold it under ``name.*``; the run exports it to
    ``OUTPUT/final_<name>``."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr: float

    def step(self, policy_optimizer: torch.optim.Optimizer) -> None:
        """AdamW step at ``lr`` x the policy's current schedule factor, then zero the grads."""
        group = policy_optimizer.param_groups[0]
        factor = group["lr"] / group.get("initial_lr", group["lr"])
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TrainObjective:
    """Base class: the defaults of a policy objective on causal-LM trees (see the module)."""

    name: str = ""
    model_class: str | None = None
    split_units: bool = True
    reference: nn.Module | None = None  # a frozen model the loss reads (built by ``build_models``)

    def check_record(self, tree: TrajectoryTree, info) -> None:
        """Raise ``ValueError`` naming ``info.file:info.line`` for a record this objective cannot train on."""

    def cp_refusal(self) -> str | None:
        """Why ``--cp N > 1`` cannot run this objective (None: it can)."""
        return None

    def build_models(self, policy: nn.Module, kit: Kit) -> None:
        """Build the extra models from the policy before it is sharded (and before any adapter)."""

    def trained(self) -> list[Trained]:
        """The extra models that train (each sharded, clipped, stepped, checkpointed, exported)."""
        return []

    def microbatches(self, trees: Sequence[TrajectoryTree], packing: str, capacity: int):
        """One process: the step's trees as micro-batches of at most ``capacity`` tokens each."""
        raise NotImplementedError

    def units(self, trees: Sequence[TrajectoryTree], packing: str, capacity: int):
        """Several ranks: the step's pieces, each a group of trees that stays on one rank and in
        one micro-batch (``list[list[TrajectoryTree]]``)."""
        raise NotImplementedError

    def pack(self, units: Sequence[Sequence[TrajectoryTree]], packing: str, capacity: int):
        """One rank's units as micro-batches of at most ``capacity`` tokens, units kept whole."""
        raise NotImplementedError

    def micro_loss(self, trees: Sequence[TrajectoryTree], packing: str) -> MicroLoss:
        """The loss of one micro-batch of this step: its share of the step loss, normalized over
        ``trees`` (all of the step's whole trees, on every rank), and its metric sums."""
        raise NotImplementedError

    def summarize(self, sums: Mapping[str, torch.Tensor]) -> dict[str, float]:
        raise NotImplementedError

    def idle_loss(self, model: nn.Module, backend: str | None = None) -> torch.Tensor:
        """``0 x`` the log-prob sum of :func:`idle_tree`: every parameter of the policy (LM head
        included) takes part in FSDP's collectives and gets exactly zero gradient."""
        from treetrain.logprobs import path_logprobs

        (lp,) = path_logprobs(model, idle_tree(), backend=backend)
        return lp.sum() * 0.0


def idle_tree() -> TrajectoryTree:
    """A two-token tree for a rank with no work in a step (see ``TrainObjective.idle_loss``)."""
    return TrajectoryTree.from_paths([[0, 0]], loss_masks=[[0, 1]])


def loss_options(cls: type, name: str, loss: Mapping[str, Any], objective: str | None = None):
    """``cls(name=name, **loss)`` with an error that lists the valid ``loss.*`` options."""
    known = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    unknown = sorted(set(loss) - set(known))
    if unknown:
        raise ValueError(
            f"loss: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"valid loss options: {', '.join(known)} (for --objective {objective or name})"
        )
    try:
        return cls(name=name, **loss)
    except TypeError as e:
        raise ValueError(f"loss: {e}; see {cls.__module__}.{cls.__name__} for the options") from None
