"""Positions of a tree with images, as each path's own forward computes them.

Qwen-style models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.xV, ...) give each token a 3D
rotary position (temporal, height, width): an image's placeholders get grid positions and the text
after an image continues from the image's largest position, not from its token count (the "rope
delta"). A token's position is still a function of its path's prefix only, so it is well defined
on the tree. The rule used here is the simplest exact one: run the model's own
``compute_3d_position_ids`` (what its forward calls when no ``position_ids`` are given) on every path
with that path's images, scatter each path's ``[R, L]`` result to the path's DFS indices, and check
that paths sharing a token agree. Integer work, O(path tokens); no family is re-implemented.

Example (Qwen2-VL, merge 2, one 4x4-patch image = 2x2 = 4 placeholders after 2 text tokens)::

    path      t0 t1 P  P  P  P  t2
    temporal  0  1  2  2  2  2  4
    height    0  1  2  2  3  3  4
    width     0  1  2  3  2  3  4

A second path that shares ``t0 t1 P P P P`` and goes on with ``t3`` gives ``t3`` position 4 too.

Models without such a function (LLaVA, Gemma 3, ...) take plain path positions (``position_ids``).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from treetrain.trees.packing import PackedTree

__all__ = ["mm_token_types", "path_model_inputs", "tree_rope_positions"]

_DERIVE = "compute_3d_position_ids"
_MODALITY_TYPE = {"image": 1, "video": 2}  # mm_token_type_ids as the processors write them


def mm_token_types(ids: torch.Tensor, images) -> torch.Tensor:
    """``mm_token_type_ids`` of ``ids [L]`` for these images: 1 at image placeholders, 2 at video ones,
    0 elsewhere (the processors' convention)."""
    types = torch.zeros_like(ids)
    for im in images:
        types[ids == im.token_id] = _MODALITY_TYPE[im.modality]
    return types


def path_model_inputs(images, names, device=None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a path's images, concatenated in order (one per name that some image
    has): what the model's forward receives for that path from its processor."""
    out = {}
    for name in names:
        parts = [im.tensors[name] for im in images if name in im.tensors]
        if parts:
            out[name] = torch.cat(parts).to(device) if device is not None else torch.cat(parts)
    return out


def _path_positions(outer: nn.Module, ids: torch.Tensor, images) -> torch.Tensor | None:
    """``[R, L]`` from the model's own position function for one path, or None (plain positions)."""
    fn = getattr(outer, _DERIVE)
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    kwargs = {p: None for p in params}
    kwargs.update(path_model_inputs(images, params, ids.device))
    kwargs["input_ids"] = ids[None]
    if "inputs_embeds" in kwargs:  # read for its shape only when positions continue a cache
        kwargs["inputs_embeds"] = ids.new_zeros(1, ids.numel(), 1, dtype=torch.float32)
    if "mm_token_type_ids" in kwargs:
        kwargs["mm_token_type_ids"] = mm_token_types(ids, images)[None]
    saved = getattr(outer, "rope_deltas", None)
    try:
        pos = fn(**kwargs)
    finally:
        if hasattr(outer, "rope_deltas"):  # the forward caches deltas for generation: not ours to keep
            outer.rope_deltas = saved
    return None if pos is None else pos[:, 0]


def tree_rope_positions(outer: nn.Module, packed: PackedTree) -> torch.Tensor | None:
    """``[R, 1, T]`` positions of every DFS token as its paths' own forwards compute them, or None when
    the model has no position function of its own or the forest has no images (path positions).

    Raises ``ValueError`` if two paths give a shared token different positions (its position would
    then depend on more than its prefix: such paths cannot share it)."""
    if packed.image_index is None or not hasattr(outer, _DERIVE):
        return None
    ids = packed.input_ids
    plain = packed.position_ids
    per_path = []
    rows = None
    for p in range(packed.num_paths):
        at = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]]
        pos = _path_positions(outer, ids[at], packed.path_images(p))
        per_path.append((at, pos))
        if pos is not None:
            rows = pos.shape[0]
    if rows is None:
        return None
    out = torch.full((rows, packed.num_tokens), -1, dtype=torch.long, device=ids.device)
    for p, (at, pos) in enumerate(per_path):
        pos = plain[at].expand(rows, -1) if pos is None else pos.to(out.device)
        seen = out[:, at]
        clash = (seen >= 0) & (seen != pos)
        if bool(clash.any()):
            t = int(at[clash.any(0)][0])
            raise ValueError(
                f"path {p}: DFS token {t} gets position {pos[:, clash.any(0)][:, 0].tolist()} from this "
                f"path but {seen[:, clash.any(0)][:, 0].tolist()} from another that shares it"
            )
        out[:, at] = pos
    return out[:, None, :]
