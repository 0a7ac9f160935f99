"""The per-path baseline: what a careful per-sequence trainer runs, on the same model.

Every path of every tree is its own sequence. Sequences are packed several to a micro-batch with no
padding (varlen), the way padding-free trainers pack them, and run with everything a per-sequence
trainer can have and the tree mode has:

- the same attention backend family: a forest of one-path trees under the tree mask *is* varlen
  causal attention (``subtree_end[k]`` = the end of ``k``'s sequence), so the baseline runs the
  tree forward of :mod:`treetrain.models` on it (on CPU the block-sparse kernel, which ran 1.0-1.6x
  faster than SDPA's causal kernel called once per sequence on these forests), and a micro-batch of
  one sequence runs SDPA's plain causal kernel;
- the same chunked LM head (:func:`treetrain.logprobs.target_logprobs`), never ``[L, vocab]``
  logits in one piece;
- the head only on targets that train (a prompt token nobody trains on is not scored);
- the same objective entry, :func:`treetrain.objectives.policy.loss.compute_loss`, so every objective computes
  its loss from per-path log-probs in one place for both modes.

The only difference to the tree mode is the unit: paths instead of shared prefixes. Example, paths
``[A B C D]``, ``[A B E F]``: the tree runs ``A B C D E F`` (6 tokens), the baseline
``A B C D | A B E F`` (8 tokens, each sequence causal on its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from treetrain.logprobs import DEFAULT_CHUNK, tree_logprobs
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "baseline_path_logprobs",
    "is_sequences",
    "sequence_loss",
    "sequence_microbatches",
    "sequence_parts",
    "sequences",
]


def sequence_parts(tree: TrajectoryTree) -> list[TrajectoryTree]:
    """Every path of ``tree`` as its own one-path tree (metadata and ``path_ids`` kept)."""
    if tree.num_paths == 1:
        return [tree]
    return [tree.subset([i]) for i in range(tree.num_paths)]


def sequences(trees: Sequence[TrajectoryTree]) -> list[TrajectoryTree]:
    """The baseline's units for a batch of trees: every path alone, tree by tree, in path order."""
    return [seq for tree in trees for seq in sequence_parts(tree)]


def sequence_microbatches(trees: Sequence[TrajectoryTree], capacity: int) -> list[list[TrajectoryTree]]:
    """The paths of ``trees`` packed into micro-batches of at most ``capacity`` tokens (no padding).

    Best-fit decreasing over path lengths (:func:`treetrain.trees.partition.pack_microbatches`); a path
    longer than ``capacity`` raises, as in the tree mode.
    """
    from treetrain.trees.partition import pack_microbatches

    return pack_microbatches(sequences(trees), capacity)


def is_sequences(packed: PackedTree) -> bool:
    """Whether every tree of the forest is one path (what the baseline runs)."""
    return all(t.num_paths == 1 for t in packed.trees)


def sequence_loss(
    model: nn.Module,
    packed: PackedTree,
    objective,
    normalizer: float | torch.Tensor,
    ref_model: nn.Module | None = None,
    *,
    backend: str | None = None,
    chunk: int | None = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The baseline's loss for one micro-batch of sequences (one-path trees, e.g. from
    :func:`sequence_microbatches`): one varlen forward, then
    :func:`treetrain.objectives.policy.loss.compute_loss`.

    Raises ``ValueError`` if a tree of ``packed`` shares a prefix between paths: that would be
    the tree mode, not the baseline.
    """
    from treetrain.objectives.policy.loss import compute_loss

    if not is_sequences(packed):
        raise ValueError(
            "sequence_loss: the micro-batch holds a tree with shared prefixes; the baseline runs "
            "every path alone: build it with treetrain.objectives.baseline.sequence_microbatches"
        )
    return compute_loss(model, packed, objective, normalizer, ref_model, backend=backend, chunk=chunk)


def baseline_path_logprobs(
    model: nn.Module,
    trees: TrajectoryTree | Sequence[TrajectoryTree],
    *,
    capacity: int | None = None,
    backend: str | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    return_entropy: bool = False,
):
    """Per-path log-probs (``list[Tensor [len(p) - 1]]``, paths tree by tree in input order) with
    every path run alone, micro-batched under ``capacity`` tokens (None: all in one forward).

    The same layout as :func:`treetrain.logprobs.path_logprobs`, so the two compare entry by entry.
    """
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    # shallow copies: the same tree given twice must still yield two entries (indexed by id below)
    seqs = [dataclasses.replace(s) for s in sequences(trees)]
    total = sum(s.num_tokens for s in seqs)
    cap = capacity or total
    # number every sequence so outputs return to input order after micro-batch packing
    from treetrain.trees.partition import pack_microbatches

    index = {id(s): i for i, s in enumerate(seqs)}
    out: list = [None] * len(seqs)
    ents: list = [None] * len(seqs)
    for mb in pack_microbatches(seqs, cap):
        packed = pack(mb)
        logp, ent = tree_logprobs(model, packed, backend, chunk, entropy=return_entropy)
        target = packed.target_index().to(logp.device)
        sizes = (packed.path_lengths - 1).tolist()
        for s, lp, en in zip(mb, logp[target].split(sizes), ent[target].split(sizes)):
            out[index[id(s)]], ents[index[id(s)]] = lp, en
    return (out, ents) if return_entropy else out
