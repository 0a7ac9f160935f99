"""A padded batch's image inputs, as a processor batches them, split into one ``ImageInput`` per image
per row: what a tree forward of the rows needs (:func:`treetrain.integrations.flat.flat_logprobs`).

A processor called on ``B`` samples returns the images of all samples in one set of tensors
(``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...) and TRL adds ``num_images`` (images per
row). How those tensors split per image depends on the model's layout (:data:`LAYOUTS`, TRL's own
split in ``GRPOTrainer._get_per_token_logps_and_entropies``):

=============  ===========================================================  ==============================
layout         tensors of image ``i``                                        models
=============  ===========================================================  ==============================
``grid``       ``pixel_values`` rows ``[o_i, o_i + prod(grid_i))``,            Qwen2/2.5/3-VL, Qwen3.5, GLM-4V
               ``image_grid_thw[i]``; ``prod(grid_i) / merge^2`` tokens
``positions``  ``pixel_values[i]``, ``image_position_ids[i]``                Gemma 4
``per_image``  ``pixel_values[i]`` (and ``image_sizes[i]``)                  Gemma 3, LLaVA(-NeXT), Mistral 3
``per_row``    row ``r``'s sub-image stack (padding sub-images dropped) and     Idefics3, SmolVLM (one image
               its ``pixel_attention_mask``                                   per row)
=============  ===========================================================  ==============================

Refused by name: tile-indexed images (``num_tiles``: InternVL; ``spatial_shapes``: LFM2-VL), whose
tiles per image the batch does not carry.

An image's placeholder count is its grid's (``grid``) or read from its row: the row's placeholders
when the row has one image, else one image per maximal run of placeholder tokens, else an equal share
among images of one shape. Without ``num_images`` (TRL's DPO collator), the rows take the images in
order, each row as many as its placeholders need. The same pixels in several rows (a prompt's ``G``
samples, a pair's chosen and rejected) hash equal, so the tree encodes them once and shares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from treetrain.models.head import unwrap
from treetrain.models.vision import is_multimodal
from treetrain.trees.images import ImageInput

__all__ = ["IMAGE_FIELDS", "LAYOUTS", "TOKEN_TYPE_FIELDS", "image_layout", "row_images", "split_images"]

# the batched image tensors TRL's scoring passes (and DPO's collator), besides the token types
IMAGE_FIELDS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "image_position_ids",
    "spatial_shapes",
    "batch_num_images",
)
TOKEN_TYPE_FIELDS = ("token_type_ids", "mm_token_type_ids")
_SAMPLE_COUNT = "batch_num_images"  # LLaVA-OneVision: images per processor sample (tiling depends on it)


@dataclass(frozen=True)
class Layout:
    """How one model family batches its images: ``needs`` (fields that pick it), ``models`` (for
    messages), ``refused`` (why not supported, or empty)."""

    name: str
    needs: tuple[str, ...]
    models: str
    refused: str = ""


LAYOUTS: dict[str, Layout] = {
    "grid": Layout("grid", ("image_grid_thw",), "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V"),
    "positions": Layout("positions", ("image_position_ids",), "Gemma 4"),
    "shapes": Layout(
        "shapes",
        ("spatial_shapes",),
        "LFM2-VL",
        "tile-indexed images (spatial_shapes): the batch does not say which tiles are whose image",
    ),  # fmt: skip
    "tiles": Layout(
        "tiles",
        ("num_tiles",),
        "InternVL",
        "tile-indexed images (num_tiles): the batch does not say which tiles are whose image",
    ),  # fmt: skip
    "per_image": Layout("per_image", (), "Gemma 3, LLaVA, LLaVA-NeXT, LLaVA-OneVision, Mistral 3"),
    "per_row": Layout("per_row", (), "Idefics3, SmolVLM (one image per row)"),
}


def image_layout(fields: dict, num_tiles=None) -> Layout:
    """The layout of a batch's image ``fields`` (TRL's order of tests); raises ``ValueError`` for a
    refused one, naming it."""
    given = dict(fields, num_tiles=num_tiles)
    for layout in LAYOUTS.values():
        if layout.needs and all(given.get(k) is not None for k in layout.needs):
            break
    else:
        # pixel masks beside row-indexed sub-image stacks: Idefics3's layout (TRL slices them by row)
        per_row = fields.get("pixel_attention_mask") is not None or (
            fields["pixel_values"].dim() == 5 and fields.get("image_sizes") is None
        )
        layout = LAYOUTS["per_row" if per_row else "per_image"]
    if layout.refused:
        raise ValueError(
            f"tree scoring of image batches: the {layout.name!r} layout ({layout.models}) is not supported: "
            f"{layout.refused}; use the TRL trainer for these models"
        )
    return layout


def split_images(layout: Layout, fields: dict) -> list[dict]:
    """Per image (batch order), the tensors its model's feature function takes for it alone. For
    ``per_row``, one entry per row (None for a row without an image)."""
    pv = fields["pixel_values"]
    if layout.name == "grid":
        grid = fields["image_grid_thw"]
        rows = grid.prod(-1).tolist()
        if sum(rows) != pv.size(0):
            raise ValueError(
                f"pixel_values: {pv.size(0)} patch rows but image_grid_thw covers {sum(rows)} (one per patch)"
            )
        parts = pv.split(rows)
        return [{"pixel_values": p, "image_grid_thw": grid[i : i + 1]} for i, p in enumerate(parts)]
    if layout.name == "per_row":
        return [_row_stack(fields, r) for r in range(pv.size(0))]
    per_image = ("image_position_ids",) if layout.name == "positions" else ("image_sizes",)
    out = []
    for i in range(pv.size(0)):
        tensors = {"pixel_values": pv[i : i + 1]}
        tensors.update({k: fields[k][i : i + 1] for k in per_image if fields.get(k) is not None})
        out.append(tensors)
    return out


def _row_stack(fields: dict, r: int) -> dict | None:
    """Row ``r``'s sub-images without the all-zero padding ones (the model drops them too)."""
    pv = fields["pixel_values"][r]  # [sub, C, H, W]
    keep = (pv != 0).flatten(1).any(1)
    if not bool(keep.any()):
        return None
    out = {"pixel_values": pv[keep][None]}
    mask = fields.get("pixel_attention_mask")
    if mask is not None:
        out["pixel_attention_mask"] = mask[r][keep][None]
    return out


def image_token_id(config) -> int:
    """The image placeholder's token id of a vision-language config."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} names no image token id (image_token_id / image_token_index)")


def _grid_tokens(config, image: dict) -> int | None:
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if merge is None or "image_grid_thw" not in image:
        return None
    return int(image["image_grid_thw"].prod()) // int(merge) ** 2


def _runs(row: np.ndarray, token_id: int) -> list[int]:
    """Lengths of the maximal runs of ``token_id`` in ``row``."""
    hit = np.concatenate([[False], row == token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return (edges[1::2] - edges[::2]).tolist()


def _signature(image: dict) -> tuple:
    sizes = image.get("image_sizes")
    return tuple((k, tuple(v.shape)) for k, v in sorted(image.items())) + (
        None if sizes is None else tuple(sizes.flatten().tolist()),
    )


def _counts_in_rows(rows: list[np.ndarray], images: list[dict], token_id: int, per_row) -> list[int]:
    """Each image's placeholder count, read from the rows: ``per_row[r]`` images in row ``r`` (None:
    unknown, then one image per run)."""
    if per_row is None:
        runs = [_runs(row, token_id) for row in rows]
        if sum(len(r) for r in runs) == len(images):
            return [n for r in runs for n in r]
        total = sum(int((row == token_id).sum()) for row in rows)
        if images and len({_signature(im) for im in images}) == 1 and total % len(images) == 0:
            return [total // len(images)] * len(images)
        raise ValueError(
            f"{len(images)} images but the rows' placeholders (token {token_id}) do not say which are whose: "
            "pass num_images (images per row)"
        )
    counts = []
    start = 0
    for r, (row, k) in enumerate(zip(rows, per_row)):
        mine = images[start : start + k]
        start += k
        n = int((row == token_id).sum())
        runs = _runs(row, token_id)
        if k == 1:
            counts.append(n)
        elif len(runs) == k:
            counts.extend(runs)
        elif k and len({_signature(im) for im in mine}) == 1 and n % k == 0:
            counts.extend([n // k] * k)
        elif k:
            raise ValueError(
                f"row {r}: {k} images of different shapes in {len(runs)} runs of placeholders (token "
                f"{token_id}): cannot tell which placeholders are whose"
            )
    return counts


def _assign(counts: list[int], rows: list[np.ndarray], token_id: int) -> list[int]:
    """Images per row: each row takes the next images until its placeholders are filled."""
    per_row, i = [], 0
    for r, row in enumerate(rows):
        need, k = int((row == token_id).sum()), 0
        while need > 0 and i < len(counts):
            need -= counts[i]
            i, k = i + 1, k + 1
        if need != 0:
            raise ValueError(f"row {r}: its placeholders (token {token_id}) do not match its images' counts")
        per_row.append(k)
    if i != len(counts):
        raise ValueError(f"{len(counts) - i} images left over after every row's placeholders were filled")
    return per_row


def row_images(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    num_images: Sequence[int] | None = None,
    num_tiles=None,
    **fields,
) -> list[list[ImageInput]] | None:
    """The images of each row of ``input_ids [B, L]`` (``attention_mask [B, L]``) as ``ImageInput``s,
    from the batched ``fields`` (:data:`IMAGE_FIELDS`, :data:`TOKEN_TYPE_FIELDS`; None values ignored)
    and ``num_images`` (images per row, TRL's; None: read from the placeholders). None without
    ``pixel_values`` (a text batch). Token types, when given, must mark exactly the placeholders.
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(fields) - set(IMAGE_FIELDS) - set(TOKEN_TYPE_FIELDS))
    if unknown:
        known = IMAGE_FIELDS + TOKEN_TYPE_FIELDS
        raise ValueError(f"image inputs: unexpected fields {unknown} (known: {known}; no videos)")
    if fields.get("pixel_values") is None:
        if any(k in fields for k in IMAGE_FIELDS):
            raise ValueError(f"image inputs: {sorted(fields)} without pixel_values")
        return None
    if not is_multimodal(unwrap(model)):
        name = type(unwrap(model)).__name__
        raise ValueError(
            f"image inputs ({', '.join(sorted(fields))}) given, but {name} is a text-only model: load the "
            "vision-language model (AutoModelForImageTextToText) to score images"
        )
    config = unwrap(model).config
    token_id = image_token_id(config)
    ids = input_ids.detach().cpu().numpy()
    real = np.ones(ids.shape, bool) if attention_mask is None else attention_mask.detach().cpu().numpy() > 0
    rows = [ids[b][real[b]] for b in range(ids.shape[0])]
    _check_token_types(fields, ids, real, token_id)
    layout = image_layout(fields, num_tiles)
    images = split_images(layout, fields)
    if layout.name == "per_row":
        return _per_row_images(images, rows, token_id)
    if num_images is not None and sum(num_images) != len(images):
        raise ValueError(f"num_images: {sum(num_images)} images in the rows, the tensors hold {len(images)}")
    grid = [_grid_tokens(config, im) for im in images]
    counts = grid if images and None not in grid else _counts_in_rows(rows, images, token_id, num_images)
    per_row = list(num_images) if num_images is not None else _assign(counts, rows, token_id)
    _sample_counts(images, per_row, fields.get(_SAMPLE_COUNT))
    out, start = [], 0
    for k in per_row:
        out.append([ImageInput(im, num_tokens=n, token_id=token_id) for im, n in
                    zip(images[start : start + k], counts[start : start + k])])  # fmt: skip
        start += k
    return out


def _per_row_images(stacks: list, rows: list[np.ndarray], token_id: int) -> list[list[ImageInput]]:
    out = []
    for r, (stack, row) in enumerate(zip(stacks, rows)):
        n = int((row == token_id).sum())
        if (stack is None) != (n == 0):
            has = "no" if stack is None else "an"
            raise ValueError(f"row {r}: {n} image placeholders but {has} image stack")
        out.append([] if stack is None else [ImageInput(stack, num_tokens=n, token_id=token_id)])
    return out


def _sample_counts(images: list[dict], per_row: list[int], given) -> None:
    """LLaVA-OneVision tiles the image of a one-image sample only: each image carries its sample's
    image count (the processor's ``batch_num_images``, one per row)."""
    if given is None:
        return
    given = [int(n) for n in given.tolist()]
    if given != [k for k in per_row]:
        raise ValueError(f"batch_num_images {given} do not match the images per row {per_row}")
    i = 0
    for k in per_row:
        for im in images[i : i + k]:
            im[_SAMPLE_COUNT] = torch.tensor([k])
        i += k


def _check_token_types(fields: dict, ids: np.ndarray, real: np.ndarray, token_id: int) -> None:
    """The tree derives the token types from the placeholders: the given ones must agree."""
    for name in TOKEN_TYPE_FIELDS:
        types = fields.pop(name, None)
        if types is None:
            continue
        t = types.detach().cpu().numpy()
        if t.shape != ids.shape:
            raise ValueError(f"{name}: expected shape {ids.shape} like input_ids, got {t.shape}")
        bad = real & ((t != 0) != (ids == token_id))
        if bad.any():
            r, c = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"{name}[{r}, {c}] = {int(t[r, c])} but input_ids[{r}, {c}] = {int(ids[r, c])}: token types "
                f"must mark exactly the image placeholders (token {token_id}); videos are not supported"
            )
