"""What a vision-language model's tree forward receives beyond the tokens: the images' features
(each distinct image encoded once), the positions each path's own forward gives its tokens, the
token types the model's masks read, and the image blocks its attention sees bidirectionally.

A ``...ForConditionalGeneration`` runs through its multimodal ``...Model`` (``model.base_model``),
whose forward embeds the tokens, scatters the precomputed encoder outputs into the placeholders in
order, derives the masks and calls its language model: the same call the per-path forward makes,
with the tree's DFS tokens.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from torch import nn

from treetrain.models.support import VERIFIED_FROM, _version
from treetrain.models.support_vision import VIDEO_EXACT
from treetrain.models.vision_encode import dfs_encoder_outputs, vision_model
from treetrain.models.vision_positions import mm_token_types, tree_rope_positions
from treetrain.trees.packing import PackedTree

__all__ = ["image_blocks_may_be_bidirectional", "is_multimodal", "vision_inputs", "vision_runs"]


def is_multimodal(model: nn.Module) -> bool:
    """Whether ``model`` is a vision-language model: its base model encodes images."""
    try:
        outer = vision_model(model)
    except AttributeError:
        return False
    return callable(getattr(outer, "get_image_features", None))


def image_blocks_may_be_bidirectional(model: nn.Module) -> bool:
    """Whether the model's code builds block masks over image tokens (``block_sequence_ids``: Gemma
    3/4, PaliGemma, ...): its tree attention may then need ``key_start``, so a backend that
    computes it is picked (the forward decides per layer: :func:`.layer_masks.mask_interface`)."""
    import sys

    if not is_multimodal(model):
        return False
    module = sys.modules.get(type(vision_model(model)).__module__)
    try:
        return "block_sequence_ids" in inspect.getsource(module)
    except (OSError, TypeError):
        return True  # no source to read: assume it may


def _forward_params(outer: nn.Module) -> set[str]:
    return set(inspect.signature(outer.forward).parameters)


def _check_placeholders(packed: PackedTree) -> None:
    """Every DFS token with a placeholder id must carry an image: the model scatters features into
    all of them, in order."""
    ids = packed.input_ids
    for token_id in sorted({im.token_id for im in packed.images}):
        with_id = ids == token_id
        carried = with_id & (packed.image_index >= 0)
        if bool((with_id != carried).any()):
            t = int(torch.nonzero(with_id & ~carried)[0, 0])
            raise ValueError(
                f"token {token_id} is an image placeholder, but DFS token {t} has it without an image "
                "(a path holds placeholder tokens its images do not fill: pass that path's images)"
            )


def _check_videos(outer: nn.Module, packed: PackedTree) -> None:
    """Videos only where they are compared: a type of ``VIDEO_EXACT`` on transformers >= 5.24."""
    if not any(im.modality == "video" for im in packed.images):
        return
    model_type = outer.config.model_type
    installed = transformers.__version__
    if model_type in VIDEO_EXACT and _version(installed) >= _version(VERIFIED_FROM):
        return
    raise ValueError(
        f"video inputs (an ImageInput of modality 'video': pixel_values_videos and video placeholders): "
        f"model type {model_type!r} on transformers {installed} is verified exact with images only; videos "
        f"are compared against each path's own forward for {', '.join(sorted(VIDEO_EXACT))} on transformers "
        f">= {VERIFIED_FROM}: pass the frames as images, or use one of those types"
    )


def vision_inputs(model: nn.Module, packed: PackedTree) -> tuple[torch.Tensor | None, dict]:
    """``(positions, keywords)`` for the decoder call over ``packed``: ``positions [R, 1, T]`` from the
    model's own position function (None: the path positions), and ``mm_encoder_outputs`` plus the
    token types the model's forward reads. ``(None, {})`` for a text-only forest."""
    if packed.image_index is None:
        return None, {}
    if not is_multimodal(model):
        raise ValueError(
            f"the trees carry images, but {type(model).__name__} is a text-only model: load the model's "
            "...ForConditionalGeneration (AutoModelForImageTextToText) to train on images"
        )
    _check_placeholders(packed)
    outer = vision_model(model)
    _check_videos(outer, packed)
    extra: dict = {"mm_encoder_outputs": dfs_encoder_outputs(outer, packed)}
    params = _forward_params(outer)
    types = mm_token_types(packed.input_ids, packed.images)[None]
    if "mm_token_type_ids" in params:
        extra["mm_token_type_ids"] = types
    elif "token_type_ids" in params:
        extra["token_type_ids"] = types
    return tree_rope_positions(outer, packed), extra


def vision_runs(packed: PackedTree) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """``(runs [B, 2], key_start [T])``: the DFS ``[start, end)`` of every maximal run of image
    tokens (what a model's blockwise mask groups, read along DFS order), and per key the first DFS
    index of its image block along its path (the run cut at node starts; the key itself for text).

    A model with bidirectional image blocks (Gemma 3/4) lets a block's tokens see each other both
    ways: shareable only when a block lies inside one node. Raises ``ValueError`` when a path's run
    of image tokens continues from a node into its child (two images back to back across a branch
    point), whose first tokens would then see different later tokens on different branches.

    Example: DFS tokens ``t P P | P P t`` with nodes ``[0, 3)`` and ``[3, 6)`` siblings (not parent
    and child): runs ``[[1, 5]]``, ``key_start = [0, 1, 1, 3, 3, 5]``.
    """
    if packed.image_index is None:
        return None, None
    vis = (packed.image_index >= 0).cpu()
    T = vis.numel()
    idx = torch.arange(T)
    starts = torch.zeros(T, dtype=torch.bool)
    starts[packed.node_start.cpu()] = True
    parent = packed.node_parent.cpu()
    child_first = packed.node_start.cpu()[parent >= 0]
    parent_last = packed.node_end.cpu()[parent[parent >= 0]] - 1
    across = vis[child_first] & vis[parent_last]
    if bool(across.any()):
        t = int(child_first[across][0])
        raise ValueError(
            f"DFS token {t}: a run of image tokens continues across a branch point (an image right after "
            "another with no text between, where paths part); such a block cannot be shared"
        )
    first_of_run = vis & torch.cat([torch.tensor([True]), ~vis[:-1]])
    segment = first_of_run | (vis & starts)
    seg_start = torch.where(segment, idx, torch.zeros_like(idx)).cummax(0).values
    key_start = torch.where(vis, seg_start, idx)
    run_start = torch.nonzero(first_of_run)[:, 0]
    run_end = torch.nonzero(vis & torch.cat([~vis[1:], torch.tensor([True])]))[:, 0] + 1
    device = packed.input_ids.device
    return torch.stack([run_start, run_end], 1).to(device), key_start.to(device)
