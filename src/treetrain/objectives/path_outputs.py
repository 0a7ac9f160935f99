"""Per-path model outputs of one micro-batch, by tree forward or by the per-path baseline.

The objectives of :mod:`treetrain.objectives.preference` and :mod:`treetrain.objectives.value` are
functions of these per-path tensors (plus a global normalizer), so one objective runs unchanged in
both modes; the modes differ only in how the tensors are obtained:

- ``packing="tree"``: one forward over the packed forest (tree attention), every distinct token
  once, then the index gather to the per-path layout;
- ``packing="sequence"`` (the baseline, :mod:`treetrain.objectives.baseline`): every path its own sequence,
  packed padding-free (varlen causal attention, the same chunked head on the same targets), the
  shared prefixes recomputed per path.

Layouts (``P`` paths of the micro-batch in batch order, tree by tree; ``M = sum_p (len(p) - 1)``):
log-probs ``[M]`` (path by path, as ``torch.cat(path_logprobs(...))``), last hidden rows
``[P, H]``, per-token hidden rows ``[sum_p len(p), H]``.
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.logprobs import DEFAULT_CHUNK, tree_logprobs
from treetrain.models.hf import tree_forward
from treetrain.objectives.baseline import is_sequences, sequences
from treetrain.trees.packing import PackedTree, pack

__all__ = ["PACKINGS", "path_hidden", "path_last_hidden", "path_target_logprobs", "score_head"]

PACKINGS = ("tree", "sequence")


def _tree_view(packed: PackedTree, packing: str) -> PackedTree:
    """What runs: the forest itself (``tree``), or its paths as one-path trees packed padding-free
    (``sequence``, the library's one baseline, :mod:`treetrain.objectives.baseline`), in the same path
    order."""
    _check(packing)
    if packing == "tree" or is_sequences(packed):
        return packed
    return pack(sequences(packed.trees))


def score_head(model: nn.Module, need: str) -> nn.Linear:
    """The scalar ``score`` head ``nn.Linear(hidden, 1)`` of a classification model (a reward model, a
    critic); ``need`` says in the error who needs it and which models have one."""
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(f"{need} (a `score` head nn.Linear(hidden, 1)); {type(model).__name__} has {head!r}")
    return head


def _check(packing: str) -> None:
    if packing not in PACKINGS:
        raise ValueError(f"packing: expected one of {PACKINGS}, got {packing!r}")


def path_target_logprobs(
    model: nn.Module,
    packed: PackedTree,
    packing: str = "tree",
    needed: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    chunk: int | None = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Log-prob of every path target ``[M]`` (entry ``j`` of path ``p``: ``log P(p[j+1] | p[:j+1])``).

    ``needed [M]`` (bool, per path target) limits the LM head to those targets (the others are 0,
    with no gradient), in both modes. Example: paths ``[1 2 3]`` and ``[1 2 4]`` give
    ``[lp(2|1), lp(3|1 2), lp(2|1), lp(4|1 2)]``; the tree scores ``lp(2|1)`` once.
    """
    packed = _tree_view(packed, packing)
    target = packed.target_index()
    tree_needed = None
    if needed is not None:
        tree_needed = torch.zeros(packed.num_tokens, dtype=torch.bool)
        tree_needed[target[needed.cpu()]] = True
    logp, _ = tree_logprobs(model, packed, backend, chunk, entropy=False, needed=tree_needed)
    return logp.index_select(0, target.to(logp.device))


def path_last_hidden(
    model: nn.Module, packed: PackedTree, packing: str = "tree", *, backend: str | None = None
) -> torch.Tensor:
    """The final hidden state at every path's last token ``[P, H]`` (what a reward head reads)."""
    packed = _tree_view(packed, packing)
    hidden = tree_forward(model, packed, backend)
    last = packed.path_index[packed.path_offsets[1:] - 1]
    return hidden.index_select(0, last.to(hidden.device))


def path_hidden(
    model: nn.Module, packed: PackedTree, packing: str = "tree", *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final hidden states at every path position, ``(rows, index)``.

    Tree: ``rows [T, H]`` (each distinct token once) and ``index = path_index [sum len(p)]``, so a
    head applied to ``rows`` runs once per distinct token and ``out[index]`` is the per-path view.
    Sequence: the same over the one-path trees, so ``rows [sum len(p), H]`` and ``index`` the identity.
    """
    packed = _tree_view(packed, packing)
    hidden = tree_forward(model, packed, backend)
    return hidden, packed.path_index.to(hidden.device)
