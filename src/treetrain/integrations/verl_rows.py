"""verl's no-padding rows as one prefix tree, and micro-batches cut from the tree.

verl hands an engine a ``TensorDict`` whose ``input_ids`` is a jagged nested tensor ``[B, j]`` (one
row per sample: prompt then response, no padding) and whose ``position_ids`` count ``0..len-1``
along each row. Its FSDP engine packs the rows into one ``[1, sum j]`` sequence and returns, per row
position ``t``, the log-prob of the *next packed token* (``torch.roll(values, -1)``: inside a row
the row's own next token; at a row's last position the first token of the following row, the
last row wrapping to the first; these last-position values are never read by verl's losses but are
part of what the engine returns) and the entropy of the logits at ``t``.

:class:`RowTree` maps the same rows onto a trie: every row position is a DFS index of the tree, so
every ``(context, label)`` pair is computed once (``pairs``) and gathered back to the row layout
(``inverse``). Rows that share a prefix (a prompt's ``n`` samples, multi-turn histories) share its
tokens. Example, rows ``[5 6 7]`` and ``[5 6 8 9]`` (labels rolled over the packed batch)::

    DFS        5 6 7 8 9              row positions -> DFS   [0 1 2] [0 1 3 4]
    labels     row 0: 6 7 5 | row 1: 6 8 9 5                   pairs (0,6) (1,7) (2,5) (1,8) (3,9) (4,5)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from treetrain.models.rope import split_regimes
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.partition import partition
from treetrain.trees.tree import TrajectoryTree

__all__ = ["RowTree", "balanced_parts", "split_rows"]


@dataclass(eq=False)
class RowTree:
    """The rows of one micro-batch as a tree (``T`` distinct tokens, ``N`` row positions).

    ``packed``: the tree's tensors; ``dfs [N]``: DFS index of every row position (row-major, as the
    nested tensor's ``values()``); ``src [M]``, ``labels [M]``: the distinct (context DFS index, label)
    pairs to score; ``inverse [N]``: the pair of every row position; ``offsets [B + 1]``: row starts.
    """

    packed: PackedTree
    dfs: torch.Tensor
    src: torch.Tensor
    labels: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def build(
        cls,
        values: torch.Tensor,
        offsets: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        model: nn.Module | None = None,
        images: list | None = None,
    ) -> RowTree:
        """``values [N]`` token ids of the rows back to back, ``offsets [B + 1]`` (a nested tensor's
        ``values()``/``offsets()``); ``position_ids [N]`` must restart at 0 on every row and count up
        (what the tree gives each token), else a ``ValueError`` names the row; a vision-language
        model's ``[4, N]`` (text position, then three rotary rows: ``verl_images`` checks those) is
        checked on its text row. ``model``: rows in different regimes of its length-dependent rope
        share no token (``models.rope.split_regimes``). ``images``: each row's ``ImageInput`` list
        (``verl_images.row_images``), or None."""
        ids = values.detach().cpu().to(torch.int64)
        off = offsets.detach().cpu().to(torch.int64)
        lengths = off.diff()
        if (lengths <= 0).any():
            row = int(torch.nonzero(lengths <= 0)[0, 0])
            raise ValueError(f"input_ids row {row} is empty: every row needs at least one token")
        if position_ids is not None:
            _check_positions(position_ids.detach().cpu().to(torch.int64), off)
        rows = list(ids.numpy()[o0:o1] for o0, o1 in zip(off[:-1].tolist(), off[1:].tolist()))
        packed = pack(split_regimes(model, TrajectoryTree.from_paths(rows, images=images)))
        dfs = packed.path_index
        labels = torch.roll(ids, -1)  # verl's input_ids_rmpad_rolled
        vocab = int(ids.max()) + 1
        key = dfs * vocab + labels
        uniq, inverse = np.unique(
            key.numpy(), return_inverse=True
        )  # numpy: torch.unique is ~50x slower on CPU
        uniq, inverse = torch.from_numpy(uniq), torch.from_numpy(inverse.reshape(-1))
        return cls(packed, dfs, uniq // vocab, uniq % vocab, inverse, off)

    @property
    def num_tokens(self) -> int:
        return self.packed.num_tokens


def _check_positions(position_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    if position_ids.dim() == 2 and position_ids.shape[0] == 4:  # text row + Qwen-VL's 3 rotary rows
        position_ids = position_ids[0]
    if position_ids.dim() != 1:
        raise ValueError(
            f"position_ids: expected one position per token, or verl's [4, N] (text, then 3 rotary rows), "
            f"got shape {tuple(position_ids.shape)}"
        )
    lengths = offsets.diff()
    row_start = torch.repeat_interleave(offsets[:-1], lengths)
    expect = torch.arange(position_ids.numel()) - row_start
    bad = position_ids != expect
    if bad.any():
        row = int(torch.searchsorted(offsets, torch.nonzero(bad)[0, 0], right=True)) - 1
        raise ValueError(
            f"position_ids row {row}: expected 0, 1, ..., len-1 (no padding inside a row), got "
            f"{position_ids[offsets[row] : offsets[row + 1]].tolist()[:16]}"
        )


def split_rows(
    rows: list[np.ndarray], budget: int, model: nn.Module | None = None, images: list | None = None
) -> list[np.ndarray]:
    """Row indices of micro-batches whose trees hold at most ``budget`` distinct tokens each.

    The rows become one tree (split by ``model``'s rope regimes, as :meth:`RowTree.build` splits
    them), which treetrain's partitioner splits into parts of whole rows (a shared prefix is
    recomputed once per part that needs it). Like verl's own split, a row longer than the budget is
    an error (``max_token_len_per_gpu`` must hold the longest row). ``images``: as in
    :meth:`RowTree.build` (rows whose placeholders carry other pixels share no image token).
    """
    tree = split_regimes(model, TrajectoryTree.from_paths(rows, images=images))
    longest = int(tree.path_lengths.max())
    if longest > budget:
        raise ValueError(
            f"max_token_len_per_gpu ({budget}) must hold the longest row ({longest} tokens); raise it"
        )
    if tree.num_tokens <= budget:
        return [np.arange(len(rows))]
    return [np.sort(part.path_ids) for part in partition(tree, int(budget))]


def balanced_parts(parts: list[np.ndarray], count: int) -> list[np.ndarray]:
    """``parts`` split until there are ``count`` of them (FSDP ranks must run as many forwards): the
    part with the most rows is halved in row order (a prompt's samples are adjacent, so halves keep
    sharing). ``count`` may not exceed the number of rows."""
    parts = list(parts)
    total = sum(len(p) for p in parts)
    if count > total:
        raise ValueError(
            f"cannot run {count} micro-batches over {total} rows on this rank: every data-parallel rank runs "
            "as many micro-batches as the busiest; give each rank at least that many rows"
        )
    while len(parts) < count:
        i = max(range(len(parts)), key=lambda k: (len(parts[k]), -k))
        half = len(parts[i]) // 2
        parts[i : i + 1] = [parts[i][:half], parts[i][half:]]
    return parts
