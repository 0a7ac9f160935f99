"""Tree scoring for any trainer: a padded flat batch in, per-token log-probs in the same layout out.

RL trainers hold a batch as ``input_ids [B, L]`` with an ``attention_mask [B, L]`` (left or right
padding) and score some positions (TRL: the last ``logits_to_keep`` columns). Rows of a GRPO group
share their prompt; rows of a multi-turn rollout share every earlier turn. Here the real tokens of
every row become one path of a prefix tree (rows that differ anywhere, e.g. by retokenization,
simply branch there), the tree runs once, and each requested ``(row, column)`` gets the log-prob of
``input_ids[row, column]`` given the row's real tokens before it, as an unpadded forward of that
row would give it. The result is differentiable: gradients of shared tokens sum over the rows
through them, exactly as the per-row forwards' would.

Example, right padding, ``logits_to_keep=2``::

    input_ids       attention_mask   paths          tree (DFS)    scored (row, column) -> target
    [5 6 7 0]       [1 1 1 0]        [5 6 7]        5 6 7 8 9     (0, 2) -> 7, (0, 3) -> pad: 0
    [5 6 8 9]       [1 1 1 1]        [5 6 8 9]                    (1, 2) -> 8, (1, 3) -> 9

Positions that are padding, or a row's first real token (no context), are 0 in the output.
Position ids count from each row's first real token. For RoPE models this is what a padded forward
computes too (attention sees only relative offsets), up to float rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from treetrain.integrations.flat_images import row_images
from treetrain.logprobs import auto_chunk, target_logprobs
from treetrain.models.head import lm_head
from treetrain.models.hf import tree_forward
from treetrain.models.rope import split_regimes
from treetrain.trees.images import ImageInput
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.partition import partition
from treetrain.trees.tree import TrajectoryTree

__all__ = ["FlatBatch", "FlatPart", "flat_logprobs", "score_packed"]


@dataclass(eq=False)
class FlatBatch:
    """A padded batch as a prefix tree, and the map back to the caller's layout.

    ``tree``: one path per row with at least one real token (``rows[p]``: that path's batch row).
    ``out_pos [N]``: flat index into the output ``[B, W]`` of every scored position with a context;
    ``path_pos [N]`` and ``path_of [N]``: the target's index in its path, and the path.
    ``shape``: ``(B, W)``, the output layout (``W = logits_to_keep`` or ``L``).
    """

    tree: TrajectoryTree
    rows: np.ndarray
    out_pos: np.ndarray
    path_of: np.ndarray
    path_pos: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        logits_to_keep: int | None = None,
        score_mask: torch.Tensor | None = None,
        model: nn.Module | None = None,
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> FlatBatch:
        """``input_ids [B, L]``; ``attention_mask [B, L]`` (1 real, 0 padding; None: all real).

        Scored: the last ``logits_to_keep`` columns (output ``[B, logits_to_keep]``, TRL's layout),
        or the columns where ``score_mask [B, L]`` is true (output ``[B, L]``), or with neither every
        column (``[B, L]``). Each row's real tokens must be one contiguous run. ``model``: the model
        that will score it; rows in different regimes of its length-dependent rope share no token
        (:func:`treetrain.models.rope.split_regimes`), so every part of the tree is scored exactly.
        """
        ids = _as_2d("input_ids", input_ids)
        B, L = ids.shape
        mask = (
            np.ones((B, L), dtype=bool)
            if attention_mask is None
            else _as_2d("attention_mask", attention_mask)
        )
        if mask.shape != (B, L):
            raise ValueError(f"attention_mask: expected shape {(B, L)} like input_ids, got {mask.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask: values must be 0 (padding) or 1 (real token)")
        mask = mask.astype(bool)
        want, width, col0 = _scored_columns(B, L, logits_to_keep, score_mask)
        start, length = _runs(mask)
        rows = np.flatnonzero(length > 0)
        if rows.size == 0:  # nothing to run: every output is 0
            empty = np.zeros(0, dtype=np.int64)
            return cls(None, rows, empty, empty, empty, (B, width))  # type: ignore[arg-type]
        if images is not None and len(images) != B:
            raise ValueError(f"images: expected one list of images per row ({B}), got {len(images)}")
        tree = TrajectoryTree.from_paths(
            [ids[b, start[b] : start[b] + length[b]] for b in rows],
            images=None if images is None else [images[b] for b in rows],
        )
        if model is not None:
            tree = split_regimes(model, tree)
        # every target (path position j >= 1) with its batch column; keep the requested ones
        n = length[rows]
        path_of = np.repeat(np.arange(rows.size), n - 1)
        path_pos = np.arange(path_of.size) - np.repeat(np.cumsum(n - 1) - (n - 1), n - 1) + 1
        row = rows[path_of]
        col = start[row] + path_pos
        keep = want[row, col]
        out_pos = row[keep] * width + (col[keep] - col0)
        return cls(tree, rows, out_pos, path_of[keep], path_pos[keep], (B, width))

    def parts(self, max_tokens: int | None = None) -> list[FlatPart]:
        """The forwards to run. ``max_tokens`` bounds the distinct tokens of one forward (the tree is
        partitioned into whole rows; a row longer than it runs alone, as a row-chunked padded forward
        would run it). None: one forward.
        """
        if self.tree is None:
            return []
        if max_tokens is None or self.tree.num_tokens <= max_tokens:
            trees = [self.tree]
        else:
            trees = partition(self.tree, max(int(max_tokens), int(self.tree.path_lengths.max())))
        part_of = np.empty(self.tree.num_paths, dtype=np.int64)
        slot = np.empty(self.tree.num_paths, dtype=np.int64)  # a path's rank inside its part
        for k, t in enumerate(trees):
            part_of[t.path_ids], slot[t.path_ids] = k, np.arange(t.num_paths)
        out = []
        for k, t in enumerate(trees):
            sel = np.flatnonzero(part_of[self.path_of] == k)
            offsets = np.concatenate([[0], np.cumsum(t.path_lengths)])
            dfs = np.concatenate(t.path_index)[offsets[slot[self.path_of[sel]]] + self.path_pos[sel]]
            needed = torch.zeros(t.num_tokens, dtype=torch.bool)
            needed[torch.from_numpy(dfs)] = True
            out.append(FlatPart(pack(t), needed, sel, dfs))
        return out

    def scatter(
        self, parts: list[FlatPart], values: list[torch.Tensor], dtype=None, device=None
    ) -> torch.Tensor:
        """Per-part ``[T_k]`` values (one per part of :meth:`parts`) -> ``[B, W]``, zeros elsewhere."""
        B, W = self.shape
        if not parts:
            return torch.zeros(B, W, dtype=dtype or torch.float32, device=device)
        src = torch.cat(
            [v.index_select(0, torch.from_numpy(p.dfs).to(v.device)) for p, v in zip(parts, values)]
        )
        pos = torch.from_numpy(self.out_pos[np.concatenate([p.sel for p in parts])]).to(src.device)
        return src.new_zeros(B * W).index_copy(0, pos, src).view(B, W)


@dataclass(eq=False)
class FlatPart:
    """One forward: ``packed``; ``needed [T]`` (bool) marks its targets to score; ``sel`` are the
    batch's scored positions it serves (indices into ``FlatBatch.out_pos``), ``dfs`` their targets.
    """

    packed: PackedTree
    needed: torch.Tensor
    sel: np.ndarray
    dfs: np.ndarray


def _as_2d(name: str, x) -> np.ndarray:
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"{name}: expected a [batch, length] tensor, got shape {tuple(arr.shape)}")
    return arr


def _scored_columns(B: int, L: int, logits_to_keep, score_mask) -> tuple[np.ndarray, int, int]:
    """``want [B, L]`` (bool), the output width and the output's first column."""
    if logits_to_keep is not None and score_mask is not None:
        raise ValueError("give logits_to_keep or score_mask, not both")
    if logits_to_keep is not None:
        K = int(logits_to_keep)
        if not 0 <= K <= L:
            raise ValueError(f"logits_to_keep: expected 0 <= K <= length ({L}), got {logits_to_keep}")
        want = np.zeros((B, L), dtype=bool)
        want[:, L - K :] = True
        return want, K, L - K
    if score_mask is None:
        return np.ones((B, L), dtype=bool), L, 0
    want = _as_2d("score_mask", score_mask)
    if want.shape != (B, L):
        raise ValueError(f"score_mask: expected shape {(B, L)} like input_ids, got {want.shape}")
    return want.astype(bool), L, 0


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First real column and real-token count of every row; errors name a row with a gap."""
    length = mask.sum(1)
    start = np.where(length > 0, mask.argmax(1), 0)
    cum = np.cumsum(mask, 1)  # all ones after start+length-1 were counted: none may follow it
    contiguous = cum[np.arange(mask.shape[0]), np.maximum(start + length - 1, 0)] == length
    if not contiguous.all():
        b = int(np.flatnonzero(~contiguous)[0])
        raise ValueError(
            f"attention_mask row {b}: the real tokens (1s) must be one contiguous run (left or right "
            f"padding), got {mask[b].astype(int).tolist()}; remove padding from inside the row"
        )
    return start.astype(np.int64), length.astype(np.int64)


def score_packed(
    model: nn.Module,
    packed: PackedTree,
    needed: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    backend: str | None = None,
    chunk: int | None = None,
    head_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree forward: log-probs and entropies ``[T]`` each at the ``needed [T]`` targets (else 0).

    The logits are divided by ``temperature`` before the softmax (as TRL scores its samples). The
    entropy is all zeros unless ``entropy``. ``model`` is the ``...ForCausalLM`` that runs.
    ``head_fp32``: the LM head in float32 outside autocast (TRL's ``cast_lm_head_to_fp32``).
    """
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    hidden = tree_forward(model, packed, backend)
    packed = packed.to(hidden.device)
    targets = torch.nonzero((packed.prev >= 0) & needed.to(hidden.device))[:, 0]
    head = lm_head(model)  # the exact head: projection, logit scales, final softcap
    rows = hidden.index_select(0, packed.prev[targets]).to(head.weight.dtype)  # fp32 heads (TRL's cast)
    if head_fp32:
        rows = rows.float()
        bias = None if head.bias is None else head.bias.float()
        head = dataclasses.replace(head, weight=head.weight.float(), bias=bias)
    chunk = chunk or auto_chunk(head.vocab)
    # TRL divides the model's final logits (after any cap) by the temperature
    with torch.autocast(rows.device.type, enabled=False) if head_fp32 else contextlib.nullcontext():
        logp, ent = target_logprobs(
            rows, head, packed.input_ids[targets], chunk, entropy, post=1.0 / temperature
        )
    T = packed.num_tokens
    full_logp = logp.new_zeros(T).index_copy(0, targets, logp)
    full_ent = logp.new_zeros(T)
    return full_logp, (full_ent.index_copy(0, targets, ent) if entropy else full_ent)


def score_parts(
    input_ids, attention_mask, logits_to_keep, score_mask, max_tokens, score, model=None, images=None
):
    """The rows as a :class:`FlatBatch` (split by ``model``'s rope regimes; ``images`` per row), its
    parts under ``max_tokens``, and ``score(part) -> (logp [T], ent [T])`` of each: ``(batch, parts,
    logps, ents)``, ready for ``batch.scatter``."""
    batch = FlatBatch.build(
        input_ids, attention_mask, logits_to_keep=logits_to_keep, score_mask=score_mask, model=model,
        images=images,
    )  # fmt: skip
    parts = batch.parts(max_tokens)
    scored = [score(part) for part in parts]
    return batch, parts, [lp for lp, _ in scored], [ent for _, ent in scored]


def flat_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int | None = None,
    score_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    max_tokens: int | None = None,
    backend: str | None = None,
    chunk: int | None = None,
    images: Sequence[Sequence[ImageInput]] | Mapping[str, torch.Tensor] | None = None,
):
    """Per-token log-probs of a padded batch from tree forwards, in the batch's layout.

    ``input_ids``, ``attention_mask``: ``[B, L]``. Returns ``[B, logits_to_keep]`` (TRL's layout:
    entry ``[b, k]`` scores ``input_ids[b, L - K + k]``) or, with ``score_mask [B, L]`` or neither,
    ``[B, L]`` (entry ``[b, c]`` scores ``input_ids[b, c]``); padding, unrequested positions and a
    row's first real token are 0. With ``return_entropy``, also the entropies (same layout).
    ``max_tokens`` caps the distinct tokens of one forward (several forwards, same result).
    ``images`` (vision-language models): per row its ``ImageInput``s, or the processor's batched image
    fields as TRL passes them (``pixel_values``, ``image_grid_thw``, ``num_images``, ``image_sizes``,
    ``token_type_ids``, ...), split per image per row by
    :func:`treetrain.integrations.flat_images.row_images`; each distinct image is encoded once.

    >>> ids = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 9]]); am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    >>> flat_logprobs(model, ids, am, logits_to_keep=2).shape  # [5, 6] runs once
    torch.Size([2, 2])
    """
    device = model.get_input_embeddings().weight.device
    if isinstance(images, Mapping):
        images = row_images(model, input_ids, attention_mask, **images)
    batch, parts, logps, ents = score_parts(
        input_ids,
        attention_mask,
        logits_to_keep,
        score_mask,
        max_tokens,
        lambda part: score_packed(
            model,
            part.packed,
            part.needed,
            temperature=temperature,
            entropy=return_entropy,
            backend=backend,
            chunk=chunk,
        ),
        model,
        images,
    )
    dtype = _out_dtype(model)
    out = batch.scatter(parts, logps, dtype=dtype, device=device)
    return (out, batch.scatter(parts, ents, dtype=dtype, device=device)) if return_entropy else out


def _out_dtype(model: nn.Module) -> torch.dtype:
    dtype = model.get_output_embeddings().weight.dtype
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
