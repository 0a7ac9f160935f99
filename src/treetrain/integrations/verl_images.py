"""verl's multimodal rows as a tree with images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE).

verl hands its engine a vision-language micro-batch as two extra fields (its agent loop builds them
per sample with the model's processor):

- ``multi_modal_inputs``: one dict per row (a ``NonTensorStack``), what the processor returned for
  that row's images: ``pixel_values [patches, C*T*P*P]`` of all its images back to back,
  ``image_grid_thw [images, 3]`` and ``images_seqlens`` (patches per frame, for verl's metrics);
  an empty dict (or None) for a text-only row. verl's FSDP engine concatenates them over the
  micro-batch and runs the vision tower on every row's copy (a prompt's ``n`` samples encode its
  image ``n`` times);
- ``position_ids [B, 4, j]``: per token the text position then the three rotary positions
  (temporal, height, width) of the model's ``get_rope_index``, computed per row in verl's data
  pipeline.

Here each row's dict is split into one :class:`~treetrain.trees.images.ImageInput` per image (its
patches, its grid, ``grid.prod() // merge**2`` placeholder tokens), so the tree keys every
placeholder by its image's content hash: rows sharing a prompt with the same image share its
tokens and one encode; identical placeholder ids with other pixels never merge. The rotary
positions verl gives are checked against the model's own per-path positions
(:mod:`treetrain.models.vision_positions`), which the tree forward uses.

A micro-batch without images still runs the vision tower once on a 16-patch blank image whose
features enter the output times zero, as verl's own forward does: under FSDP every rank must run
the same all-gathers (a text-only rank beside a rank with images), and the tower's gradients are
zeros rather than absent.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict.tensorclass import NonTensorData
from torch import nn

from treetrain.models.vision_encode import vision_model
from treetrain.models.vision_positions import tree_rope_positions
from treetrain.trees.images import ImageInput
from treetrain.trees.packing import PackedTree

__all__ = [
    "VERL_VISION_TYPES",
    "blank_image",
    "check_rope_positions",
    "check_unpatched",
    "row_images",
    "without_verl_vision_patches",
]

# the vision-language types the engine runs: Qwen-style flattened patches with (t, h, w) grids
VERL_VISION_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
_IMAGE_KEYS = {"pixel_values", "image_grid_thw"}
_DERIVED = {"images_seqlens"}  # verl's metrics read it; the grids determine it


def _row_dicts(micro_batch) -> list[dict] | None:
    stack = micro_batch.get("multi_modal_inputs", None)
    if stack is None:
        return None
    items = stack.tolist() if hasattr(stack, "tolist") else list(stack)
    return [(it.data if isinstance(it, NonTensorData) else it) or {} for it in items]


def row_images(micro_batch, model: nn.Module) -> list[list[ImageInput]] | None:
    """Each row's images, in order, from verl's ``multi_modal_inputs`` (None: no row has any).

    Raises ``ValueError`` naming the row for inputs the engine does not run (videos, unknown keys)
    and for patches that do not match the grids."""
    rows = _row_dicts(micro_batch)
    if rows is None or not any(rows):
        return None
    config = model.config
    merge = config.vision_config.spatial_merge_size
    out = []
    for r, inputs in enumerate(rows):
        extra = set(inputs) - _IMAGE_KEYS - _DERIVED
        if extra:
            what = "video inputs" if any("video" in k for k in extra) else "multi_modal_inputs keys"
            raise ValueError(
                f"the treetrain verl engine does not support {what} yet: row {r} has {sorted(extra)} "
                f"(it runs {sorted(_IMAGE_KEYS)})"
            )
        if "pixel_values" not in inputs:
            out.append([])
            continue
        pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"].reshape(-1, 3)
        sizes = grids.prod(-1).tolist()
        if sum(sizes) != pixels.shape[0]:
            raise ValueError(
                f"multi_modal_inputs row {r}: {pixels.shape[0]} patches, but its grids "
                f"{grids.tolist()} hold {sum(sizes)}"
            )
        out.append(
            [
                ImageInput(
                    {"pixel_values": p, "image_grid_thw": g[None]},
                    num_tokens=n // merge**2,
                    token_id=config.image_token_id,
                )
                for p, g, n in zip(pixels.split(sizes), grids, sizes)
            ]
        )
    return out


def check_rope_positions(given: torch.Tensor, dfs: torch.Tensor, packed: PackedTree, model) -> None:
    """``given [3, N]``: verl's rotary positions of the row positions (row-major), which must equal the
    model's own per-path positions of their DFS tokens (``dfs [N]``); else a ``ValueError`` names the
    first row position that differs."""
    own = tree_rope_positions(vision_model(model), packed)
    own = packed.position_ids[None].expand(3, -1) if own is None else own[:, 0]
    expect = own.cpu()[:, dfs]
    given = given.cpu().to(expect.dtype)
    bad = (given != expect).any(0)
    if bool(bad.any()):
        n = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"position_ids: verl's 3-D rotary positions at packed position {n} are {given[:, n].tolist()}, "
            f"the model's own (compute_3d_position_ids over the row and its images) {expect[:, n].tolist()}"
        )


def _blank_image_term(model: nn.Module) -> torch.Tensor:
    """0 times the features of a blank 16-patch image through the model's vision tower (a scalar)."""
    vc = model.config.vision_config
    outer = vision_model(model)
    device = outer.get_input_embeddings().weight.device
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.zeros(16, patch, dtype=outer.visual.dtype, device=device)
    grid = torch.tensor([[1, 4, 4]], device=device)
    out = outer.visual(pixels, grid_thw=grid, return_dict=True)
    feats = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    return sum(0.0 * f.mean() for f in feats)


@contextmanager
def blank_image(model: nn.Module, packed: PackedTree):
    """Around a forward of a vision-language ``model`` over ``packed`` without images: the tower runs on
    a blank image first and its features times 0 are added to the input embeddings, where verl's
    forward adds them (and where an image's features enter: under FSDP every rank then runs the
    tower's all-gathers, and in backward its reduce-scatters, in the same order)."""
    if packed.image_index is not None or getattr(model.config, "vision_config", None) is None:
        yield
        return
    term = _blank_image_term(model)
    handle = model.get_input_embeddings().register_forward_hook(lambda mod, args, out: out + term)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def without_verl_vision_patches():
    """verl's engine build without its monkey patches for vision-language models: they replace the
    multimodal model's forward and (with ``use_remove_padding``) its attention layers' forward with
    verl's own, class-wide, calling flash-attention directly; tree attention needs transformers' own
    forward. (With Ulysses and fused kernels refused they patch nothing else the tree reads.)"""
    from verl.workers.engine.fsdp import transformer_impl

    patch = transformer_impl.apply_monkey_patch

    def apply(model, **kwargs):
        if getattr(model.config, "vision_config", None) is None:
            patch(model=model, **kwargs)

    transformer_impl.apply_monkey_patch = apply
    try:
        yield
    finally:
        transformer_impl.apply_monkey_patch = patch


def check_unpatched(classes) -> None:
    """A ``ValueError`` if verl has replaced one of the model's classes' ``forward`` (its own engine,
    ``strategy=fsdp2``, built a model of the same type in this process: its patches are class-wide)."""
    for cls in classes:
        module = getattr(getattr(cls, "forward", None), "__module__", "") or ""
        if module.startswith("verl."):
            raise ValueError(
                f"{cls.__name__}.forward is verl's ({module}): verl's own engine for this model type patched "
                "transformers' classes in this process, and tree attention runs through transformers' own "
                "forward. Run every role of this model with strategy=treetrain (the reference follows the "
                "actor), or keep verl-engine roles of it out of this process"
            )
