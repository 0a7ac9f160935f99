"""Data parallelism with FSDP2: process setup, sharding from outside the model, FLOP-balanced work.

The contract that makes a multi-process step equal to a single-process one:

- Whole trees (or whole parts of a partitioned tree) go to ranks, balanced by their FLOP cost
  (:func:`tree_cost`, :func:`assign_to_ranks`), never split across ranks.
- The loss normalizer is computed from the *whole* step batch on every rank (every rank sees all
  of the batch's metadata), so each rank's loss is its share of the global loss and the per-rank
  losses sum to it.
- FSDP's gradient reduction therefore has to **sum**; ``fully_shard`` averages over the world size
  by default. :func:`shard_model` sets every FSDP group's divide factor to 1 and forces plain
  sum collectives, so the reduced gradient is exactly the sum of the per-rank gradients (only the
  floating-point summation order differs from a single process).
- A rank with no work in a step must still run a forward and backward, because FSDP's all-gathers
  and reduce-scatters are collectives: it backpropagates its objective's ``idle_loss`` (zero
  times the log-probs of a two-token tree, :mod:`treetrain.objectives.interface`). Every rank must
  run the same number of forwards per step.

Run under ``torchrun``; without it every function here is a single-process no-op.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "DECODER_METHOD",
    "DistInfo",
    "all_reduce_sum",
    "all_reduce_sum_dict",
    "assign_to_ranks",
    "barrier",
    "clip_grad_norm_",
    "destroy",
    "init_distributed",
    "is_sharded",
    "shard_model",
    "tree_cost",
]

# Name of the method ``shard_model`` attaches to the root module; ``models.hf.tree_forward`` runs
# the decoder through it so that FSDP's root hooks (all-gather of embeddings, final norm and LM
# head; gradient reduce-scatter after backward) fire even though the tree path calls the decoder
# and the LM head separately rather than ``model.forward``.
DECODER_METHOD = "treetrain_decoder"


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, its ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_info: DistInfo | None = None


def _launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def init_distributed(device: str = "auto", backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group ``torchrun`` set up (idempotent); a single-process no-op otherwise.

    ``device``: ``auto`` uses ``cuda:LOCAL_RANK`` with NCCL (plus gloo for CPU-side collectives)
    when CUDA is available, else the CPU with gloo; ``cpu`` forces the CPU and gloo.
    """
    global _info
    if _info is not None:
        return _info
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if not _launched_by_torchrun():
        dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        _info = DistInfo(0, 1, 0, dev, True)
        return _info
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible: "
                "use --nproc_per_node <= the number of GPUs"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = backend or "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = backend or "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    _info = DistInfo(rank, world, local_rank, device, rank == 0)
    return _info


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    """Leave the process group (no-op when none was joined)."""
    global _info
    if dist.is_initialized():
        dist.destroy_process_group()
    _info = None


def exit_rank(rc: int = 0) -> NoReturn:
    """End a torchrun rank's process once its outputs are written and its process group left,
    skipping the interpreter's teardown. Ranks of successful 2-process runs aborted at their very end
    about once in a few runs on CI ("terminate called without an active exception", SIGABRT): in the
    CLI, and in the tests' own torchrun workers, with every rank past a barrier and the group
    destroyed. Likely mechanism (not reproduced on demand): the garbage collector of a finalizing
    interpreter frees gloo's process group and its threads."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def all_reduce_sum(x):
    """Sum a float, an int or a tensor over ranks; the same kind comes back.

    Tensors are summed in float64 on the device the backend needs, then returned with their own
    dtype and device (a new tensor: the input is not modified).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x.clone() if isinstance(x, torch.Tensor) else x
    device = _info.device if _info is not None else torch.device("cpu")
    if isinstance(x, torch.Tensor):
        t = x.detach().to(device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.to(device=x.device, dtype=x.dtype)
    if isinstance(x, (bool, int, float)):
        t = torch.tensor(float(x), dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return type(x)(t.item()) if not isinstance(x, bool) else t.item() != 0
    raise TypeError(f"all_reduce_sum: expected a number or a tensor, got {type(x).__name__}")


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded (FSDP2 ``DTensor``) or plain gradients.

    Same arithmetic as torch's (so a single process gets torch's exact result); the total norm
    comes back as a plain 0-d tensor, the same on every rank. A non-finite norm is returned as is
    and nothing is scaled: the caller decides what to do.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if torch.isfinite(total):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return total.detach()


def all_reduce_sum_dict(values: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
    """Sum a dict of scalars over ranks in one collective; a key missing on a rank counts as 0
    (e.g. a rank with no work this step). Returns float64 0-d tensors, the same on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: torch.as_tensor(v, dtype=torch.float64).detach().clone() for k, v in values.items()}
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(values))
    keys = sorted(set().union(*gathered))
    device = _info.device if _info is not None else torch.device("cpu")
    flat = torch.zeros(len(keys), dtype=torch.float64, device=device)
    for i, k in enumerate(keys):
        if k in values:
            flat[i] = torch.as_tensor(values[k], dtype=torch.float64).detach().to(device)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return {k: flat[i].cpu() for i, k in enumerate(keys)}


# ---- sharding ------------------------------------------------------------------------------------


def _transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of transformer blocks (``model.model.layers`` for HF decoders)."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        blocks = getattr(base, name, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"shard_model: found no list of transformer blocks in {type(model).__name__}")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(
    model: nn.Module,
    mixed_precision: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply FSDP2 from outside: ``fully_shard`` every transformer block, then the root.

    Gradients are *summed* over ranks (not averaged): see the module docstring. With
    ``mixed_precision`` (CUDA), parameters are all-gathered and computed in bfloat16 while the
    sharded master weights, gradients' reduction and optimizer stay float32. In a single process
    (no process group) the model is returned unchanged. Call it after ``prepare_model`` and before
    building the optimizer (the optimizer must see the sharded parameters).
    """
    if not dist.is_initialized():
        return model
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from treetrain.models.hf import prepare_model

    if is_sharded(model):
        return model
    prepare_model(model)
    info = init_distributed()
    mesh = torch.distributed.device_mesh.init_device_mesh(info.device.type, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else None
    )
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
    for block in _transformer_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # root: embeddings, final norm, LM head
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum over ranks: the loss is already globally normalized
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    _attach_decoder(model)
    register_fsdp_forward_method(model, DECODER_METHOD)
    return model


def _attach_decoder(model: nn.Module) -> None:
    """``model.treetrain_decoder(**kw)`` runs ``model.base_model(**kw)``: a root-level entry point."""
    from treetrain.models.hf import decoder_of

    base = decoder_of(model)  # inside a peft.PeftModel too

    def treetrain_decoder(*args, **kwargs):
        return base(*args, **kwargs)

    object.__setattr__(model, DECODER_METHOD, treetrain_decoder)


# ---- work assignment -----------------------------------------------------------------------------


def tree_cost(tree: TrajectoryTree, model_config) -> float:
    """Training FLOPs of one tree (or partition part), for balancing ranks (``treetrain.trees.flops``):
    linear layers ~ distinct tokens x matmul parameters, attention ~ allowed query-key pairs
    ``sum(positions + 1)`` (a token attends its own path prefix). ``model_config``: a Hugging Face
    config or a ``flops.CostModel``.
    """
    from treetrain.trees.flops import CostModel
    from treetrain.trees.flops import tree_cost as _tree_flops

    cost = model_config if isinstance(model_config, CostModel) else CostModel.from_config(model_config)
    return _tree_flops(tree, cost)


def assign_to_ranks(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Longest-processing-time greedy: items by decreasing cost, each to the least-loaded rank.

    Deterministic (ties by item index, then by rank), so every rank computes the same assignment
    from the same costs. Returns one ascending list of item indices per rank; a rank may get none.
    LPT's makespan is within 4/3 of optimal.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    heap = [(0.0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + float(costs[i]), r))
    return [sorted(items) for items in out]
