"""Exact per-path log-probs from one tree forward.

Every distinct (context, target) pair of the tree is scored once: the token at DFS index ``t`` is
predicted from the hidden state at ``prev[t]``. The scores are then *expanded* to the per-path
layout with an index gather, so any per-path loss runs unchanged and autograd sums each shared
token's gradient over the paths through it.

The LM head never materializes ``[T, vocab]``: rows go through it in chunks inside one autograd
function that keeps only the hidden rows and recomputes each chunk's logits in backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .models import tree_forward
from .packing import PackedTree, pack
from .tree import TrajectoryTree

__all__ = ["expand_to_paths", "path_logprobs", "target_logprobs", "tree_logprobs"]

DEFAULT_CHUNK = 1024


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-softmax precision: float32 for half types (as HF losses upcast logits), else the dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _TargetLogprobs(torch.autograd.Function):
    """``logp[n] = log_softmax(h[n] @ W.T + b)[target[n]]`` and the entropy, chunked over rows.

    hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, targets ``[N]`` -> ``[N]``, ``[N]``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int):
        acc = _acc_dtype(hidden.dtype)
        N = hidden.shape[0]
        logp = hidden.new_empty(N, dtype=acc)
        ent = hidden.new_empty(N, dtype=acc)
        for s in range(0, N, chunk):
            z = nn.functional.linear(hidden[s : s + chunk], weight, bias).to(acc)
            lse = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None])[:, 0] - lse
            p = torch.exp(z - lse[:, None])
            ent[s : s + chunk] = lse - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk = chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        acc = _acc_dtype(hidden.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        g_b = torch.zeros_like(bias, dtype=acc) if (need_b and bias is not None) else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            z = nn.functional.linear(h, weight, bias).to(acc)
            p = torch.softmax(z, dim=-1)
            # d logp / dz = onehot - p ;  d entropy / dz = -p * (z - E_p[z])
            g_z = -p * g_logp[s : s + ctx.chunk, None]
            g_z.scatter_add_(1, targets[s : s + ctx.chunk, None], g_logp[s : s + ctx.chunk, None])
            g_z -= g_ent[s : s + ctx.chunk, None] * p * (z - (p * z).sum(-1, keepdim=True))
            g_z = g_z.to(hidden.dtype)
            if need_h:
                g_h[s : s + ctx.chunk] = g_z @ weight
            if need_w:
                g_w += (g_z.T @ h).to(acc)
            if g_b is not None:
                g_b += g_z.sum(0).to(acc)
        g_w = g_w.to(weight.dtype) if g_w is not None else None
        g_b = g_b.to(bias.dtype) if g_b is not None else None
        return g_h, g_w, g_b, None, None


def target_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets [N]`` under ``head(hidden [N, H])`` and the entropy, each ``[N]``.

    ``head`` is the model's output ``nn.Linear``. Peak extra memory is ``chunk x vocab`` logits.
    """
    if not isinstance(head, nn.Linear):
        raise ValueError(f"output head must be an nn.Linear, got {type(head).__name__}")
    return _TargetLogprobs.apply(hidden, head.weight, head.bias, targets, chunk)


def tree_logprobs(
    model: nn.Module,
    packed: PackedTree,
    backend: str | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-prob (and entropy) per distinct tree token: ``[T]`` each, in DFS order.

    Entries with no context (a root's first token) are 0.
    """
    hidden = tree_forward(model, packed, backend)
    packed = packed.to(hidden.device)
    has_prev = packed.prev >= 0
    targets = torch.nonzero(has_prev)[:, 0]
    rows = hidden.index_select(0, packed.prev[targets])
    logp, ent = target_logprobs(rows, model.get_output_embeddings(), packed.input_ids[targets], chunk)
    T = packed.num_tokens
    full_logp = logp.new_zeros(T).index_copy(0, targets, logp)
    full_ent = ent.new_zeros(T).index_copy(0, targets, ent)
    return full_logp, full_ent


def expand_to_paths(per_token: torch.Tensor, packed: PackedTree) -> list[torch.Tensor]:
    """Per-DFS-token values ``[T]`` -> one ``[len(p) - 1]`` tensor per path (the gather)."""
    flat = per_token.index_select(0, packed.target_index().to(per_token.device))
    return list(flat.split((packed.path_lengths - 1).tolist()))


def _as_packed(batch) -> PackedTree:
    if isinstance(batch, PackedTree):
        return batch
    if isinstance(batch, TrajectoryTree):
        return pack(batch)
    if isinstance(batch, Sequence) and batch and all(isinstance(t, TrajectoryTree) for t in batch):
        return pack(list(batch))
    if isinstance(batch, Sequence):
        return pack(TrajectoryTree.from_paths(batch))
    raise ValueError(
        f"batch: expected a PackedTree, a TrajectoryTree, a list of them, or token paths; got {type(batch)}"
    )


def path_logprobs(
    model: nn.Module,
    batch,
    *,
    backend: str | None = None,
    chunk: int = DEFAULT_CHUNK,
    return_entropy: bool = False,
):
    """Per-path log-probs from ONE forward over the packed tree, in input path order.

    ``batch``: token paths (``list[list[int]]``), a ``TrajectoryTree``, a list of trees, or a
    ``PackedTree``. Returns ``list[Tensor [len(p) - 1]]``: entry ``j`` of path ``p`` is
    ``log P(p[j+1] | p[:j+1])``; with ``return_entropy``, also the entropies in the same layout.

    >>> lps = path_logprobs(model, [[1, 2, 3], [1, 2, 4]])  # the shared [1, 2] runs once
    >>> [lp.shape for lp in lps]
    [torch.Size([2]), torch.Size([2])]
    """
    packed = _as_packed(batch)
    logp, ent = tree_logprobs(model, packed, backend, chunk)
    out = expand_to_paths(logp, packed)
    return (out, expand_to_paths(ent, packed)) if return_entropy else out
