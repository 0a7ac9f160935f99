"""Context parallelism: one packed tree split over the ranks of a process group.

The DFS token order is cut into contiguous chunks, one per rank, balanced by training cost (allowed
attention pairs, optionally plus per-token FLOPs), not by tokens. Every key ``k`` is attended by the
contiguous query range ``[k, subtree_end[k])`` and a query only attends keys ``k <= q``, so a rank's
queries need the keys/values of its own chunk and of EARLIER chunks only.

Each rank runs the unmodified Hugging Face decoder on its chunk (its own ``input_ids``, global
``position_ids``); the ``cp`` tree-attention backend gathers every layer's K/V with autograd (an
all-gather whose backward sums the key gradients of all ranks and keeps this rank's slice) and
attends its queries against keys ``[0, chunk_end)``. Recurrent layers run on the chunk too, from
the states the previous rank hands over (:mod:`treetrain.parallel.cp_recurrent`). The LM head
scores target ``t`` on the rank that holds its context row ``prev[t]`` (which may be any earlier
rank, not only the previous one), and the per-token log-probs are summed over ranks (disjoint
supports, so every rank gets the same ``[T]`` vector bit for bit). Every rank then computes the
same full loss; the all-reduce's backward is the identity, so each rank's parameter gradients are
exactly its share and their SUM over the group is the 1-rank gradient (FSDP's summed reduction,
:func:`treetrain.parallel.fsdp.shard_model`).

Example, 2 ranks, ``A B C D E F G H`` with ``subtree_end = [8 6 4 4 6 6 8 8]``: rank 1 holds
``E F G H`` and attends keys ``A..H``; ``prev[E] = B`` sits on rank 0, so rank 0 scores ``E``.

Use::

    with context_parallel(group):            # or cp_tree_logprobs(model, packed, group)
        loss, metrics = compute_loss(model, packed, objective, normalizer)
    loss.backward()                           # then sum parameter gradients over the group
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from treetrain.attention.mask import TreeMask
from treetrain.logprobs import scoring_override
from treetrain.trees.packing import PackedTree

__all__ = [
    "CPChunk",
    "active_group",
    "context_parallel",
    "cp_attention",
    "cp_recurrent_forward",
    "cp_tree_forward",
    "cp_tree_logprobs",
    "split_balanced",
]


def split_balanced(position_ids: torch.Tensor, world: int, per_token: float = 0.0) -> list[int]:
    """Chunk bounds ``[world + 1]`` cutting ``T`` DFS tokens into contiguous, cost-balanced chunks.

    Token ``t`` costs ``position_ids[t] + 1`` attention pairs (it attends its whole path prefix),
    plus ``per_token`` (linear layers, in units of one pair; ``flops.CostModel`` gives the ratio).
    Every chunk gets at least one token, so ``T >= world`` is required.

    >>> split_balanced(torch.tensor([0, 1, 2, 3, 2, 3, 1, 2]), 2)   # pairs 1 2 3 4 3 4 2 3
    [0, 4, 8]
    """
    T = position_ids.numel()
    if world > T:
        raise ValueError(f"context parallelism: a tree of {T} tokens cannot be split over {world} ranks")
    cost = position_ids.to(torch.float64) + 1.0 + per_token
    cum = torch.cumsum(cost, 0)
    total = float(cum[-1])
    bounds = [0]
    for i in range(1, world):
        target = total * i / world
        j = int(torch.searchsorted(cum, target))  # first prefix reaching the target: cut after j or j-1
        b = j + 1 if j == 0 or float(cum[j]) - target <= target - float(cum[j - 1]) else j
        bounds.append(min(max(b, bounds[-1] + 1), T - (world - i)))
    bounds.append(T)
    return bounds


@dataclass(frozen=True)
class CPChunk:
    """This rank's chunk ``[start, end)`` of the tree; ``bounds [world + 1]`` of every rank's."""

    group: dist.ProcessGroup | None
    rank: int
    bounds: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    def recurrent_forward(
        self, module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, mask: TreeMask
    ) -> torch.Tensor:
        """The recurrent layers' tree routing under CP (called through ``mask.cache["cp"]``)."""
        return cp_recurrent_forward(module, hidden_states, packed, mask)

    def owner(self, index: torch.Tensor) -> torch.Tensor:
        """Rank holding each DFS index."""
        b = torch.as_tensor(self.bounds[1:-1], device=index.device)
        return torch.bucketize(index, b, right=True)


class _GatherChunks(torch.autograd.Function):
    """Concatenate every rank's ``x [H, n_r, D]`` along dim 1 -> ``[H, T, D]``.

    Backward: the gradient of the whole ``[H, T, D]`` is summed over ranks (every rank's queries
    may have used any earlier rank's keys) and this rank's slice is returned.
    """

    @staticmethod
    def forward(ctx, x, chunk: CPChunk):
        sizes = [b - a for a, b in zip(chunk.bounds[:-1], chunk.bounds[1:])]
        pad = max(sizes)
        local = F.pad(x, (0, 0, 0, pad - x.shape[1])).contiguous()
        parts = [torch.empty_like(local) for _ in sizes]
        dist.all_gather(parts, local, group=chunk.group)
        ctx.chunk = chunk
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.chunk.group)
        return g[:, ctx.chunk.start : ctx.chunk.end], None


class _SumSameLoss(torch.autograd.Function):
    """All-reduce sum of per-rank contributions with an identity backward.

    Exact when every rank computes the same loss from the summed tensor: the upstream gradient is
    then the same on every rank, and it is the gradient of each rank's own contribution.
    """

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def _rect_mask(subtree_end: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Bool ``[end - start, end]``: query ``q`` (global ``start + i``) may attend key ``k``."""
    q = torch.arange(start, end, device=subtree_end.device)[:, None]
    k = torch.arange(end, device=subtree_end.device)[None, :]
    return (k <= q) & (q < subtree_end[None, :end])


def cp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TreeMask, scale: float
) -> torch.Tensor:
    """The ``cp`` backend: this rank's queries ``[Hq, n, D]`` against the keys/values of its chunk and
    every earlier rank's (gathered with autograd); ``k, v [Hkv, n, D]``; returns ``[Hq, n, D]``.

    ``mask.subtree_end`` is the WHOLE tree's ``[T]``; ``mask.cache["cp"]`` is the :class:`CPChunk`.
    """
    if "cp" not in mask.cache:
        raise ValueError(
            "attention backend 'cp' runs inside context parallelism only (treetrain train --cp N, or "
            "treetrain.parallel.cp.context_parallel); pick another --attention"
        )
    chunk: CPChunk = mask.cache["cp"]
    end = chunk.end
    keys = _GatherChunks.apply(k, chunk)[:, :end]
    values = _GatherChunks.apply(v, chunk)[:, :end]
    allowed = mask.cached("cp_rect", lambda: _rect_mask(mask.subtree_end, chunk.start, end))
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        keys = keys.repeat_interleave(rep, dim=0)
        values = values.repeat_interleave(rep, dim=0)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed, scale=scale)
    return out[0]


def cp_recurrent_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, mask: TreeMask
) -> torch.Tensor:
    """A routed recurrent layer under CP: ``[1, n, hidden]`` (this rank's chunk) -> ``[1, n, hidden]``.

    The layer runs on this rank's chunk alone, as a segment of the tree
    (:mod:`treetrain.parallel.cp_recurrent`): its nodes start from the states the previous rank
    hands over, its conv windows read the halo the other ranks export. Built once per forward (the
    ``segment`` in ``mask.cache``), shared by every recurrent layer.
    """
    from treetrain.models.recurrent import tree_layer_forward
    from treetrain.parallel.cp_recurrent import CPSegment, DistTransport

    chunk: CPChunk = mask.cache["cp"]
    segment = mask.cached(
        "segment", lambda: CPSegment(packed, chunk.bounds, chunk.rank, DistTransport(chunk.group, chunk.rank))
    )
    return tree_layer_forward(module, hidden_states, segment.view, mask)


def make_chunk(packed: PackedTree, group: dist.ProcessGroup | None, per_token: float = 0.0) -> CPChunk:
    world = dist.get_world_size(group)
    bounds = split_balanced(packed.position_ids, world, per_token)
    return CPChunk(group, dist.get_rank(group), tuple(bounds))


def cp_tree_forward(model: nn.Module, packed: PackedTree, chunk: CPChunk) -> torch.Tensor:
    """Final hidden states of this rank's chunk: ``[end - start, hidden]`` (the decoder, unchanged)."""
    from treetrain.models.hf import prepare_model, rope_lengths, run_decoder

    prepare_model(model)
    if packed.image_index is not None:
        raise ValueError(
            "context parallelism with images in the trees is not built (each image's features would be "
            "needed on every rank holding one of its placeholders); run vision-language trees with --cp 1"
        )
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    # position_ids: a sliding window that binds is refused by name (the cp backend has none)
    mask = TreeMask(packed.subtree_end, backend="cp", cache={"cp": chunk}, position_ids=packed.position_ids)
    # packed_tree: read by recurrent layers only (cp_recurrent_forward)
    rope = rope_lengths(model, packed)  # each token's path length: its rotary table (models.rope)
    return run_decoder(model, packed, mask, chunk.start, chunk.end, rope, packed_tree=packed)


def cp_tree_logprobs(
    model: nn.Module,
    packed: PackedTree,
    group: dist.ProcessGroup | None = None,
    chunk: int | None = None,
    entropy: bool = True,
    needed: torch.Tensor | None = None,
    per_token: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`treetrain.logprobs.tree_logprobs` over the ranks of ``group``: the same ``[T]`` log-probs
    and entropies on every rank (each rank scores the targets whose context row it holds)."""
    from treetrain.logprobs import head_logprobs

    part = make_chunk(packed, group, per_token)
    hidden = cp_tree_forward(model, packed, part)
    packed = packed.to(hidden.device)
    mine = (packed.prev >= part.start) & (packed.prev < part.end)
    if needed is not None:
        mine &= needed.to(mine.device)
    targets = torch.nonzero(mine)[:, 0]
    rows = hidden.index_select(0, packed.prev[targets] - part.start)
    logp, ent = head_logprobs(model, rows, packed.input_ids[targets], chunk, entropy)
    T = packed.num_tokens
    full_logp = _SumSameLoss.apply(logp.new_zeros(T).index_copy(0, targets, logp), group)
    full_ent = logp.new_zeros(T)
    if entropy:
        full_ent = _SumSameLoss.apply(full_ent.index_copy(0, targets, ent), group)
    return full_logp, full_ent


# ---- the context that routes tree_logprobs through CP ------------------------------------------

_active: list[dist.ProcessGroup | None] = []


def active_group() -> tuple[bool, dist.ProcessGroup | None]:
    """(whether a :func:`context_parallel` scope is open, its group)."""
    return (True, _active[-1]) if _active else (False, None)


@contextlib.contextmanager
def context_parallel(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Inside, :func:`treetrain.logprobs.tree_logprobs` runs context-parallel over ``group``
    (``None``: the default group). Every rank of the group must run the same trees."""
    if not dist.is_initialized():
        raise ValueError("context parallelism needs a process group: run under torchrun")
    _active.append(group)
    try:
        with scoring_override(functools.partial(_score_chunk, group)):
            yield
    finally:
        _active.pop()


def _score_chunk(group, model, packed, chunk, entropy, needed):
    return cp_tree_logprobs(model, packed, group, chunk, entropy, needed)


# ---- dp x cp layout for training -----------------------------------------------------------------


@dataclass(frozen=True)
class CPLayout:
    """Where this rank sits in the ``dp x cp`` mesh: ``dp_size`` groups of ``cp_size`` consecutive
    ranks; the ranks of one ``group`` share every tree of their data-parallel shard."""

    dp_rank: int
    dp_size: int
    cp_size: int
    group: dist.ProcessGroup | None

    def scope(self):
        """:func:`context_parallel` over this rank's group (a no-op context with ``cp_size == 1``)."""
        return context_parallel(self.group) if self.cp_size > 1 else contextlib.nullcontext()


def init_cp(cp: int) -> CPLayout:
    """Build the ``dp x cp`` device mesh (``torch.distributed.device_mesh``) of the running job."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if cp == 1:
        return CPLayout(rank, world, 1, None)
    if world % cp:
        raise ValueError(
            f"--cp {cp}: needs torchrun with a world size divisible by {cp} (world size {world}); "
            f"e.g. torchrun --nproc_per_node {cp} -m treetrain.cli train --cp {cp}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    from treetrain.parallel.fsdp import init_distributed

    mesh = init_device_mesh(init_distributed().device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return CPLayout(mesh.get_local_rank("dp"), world // cp, cp, mesh.get_group("cp"))
