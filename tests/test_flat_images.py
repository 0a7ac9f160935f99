"""A processor's batched image inputs, split per image per row, scored as one tree: per layout.

Each layout of ``integrations.flat_images.LAYOUTS`` gets a padded batch built from the VLM zoo's
images the way a processor batches them (the inverse of the split: patches concatenated for Qwen,
one entry per image for LLaVA / Gemma, crops padded to the most for LLaVA-NeXT, one zero-padded
sub-image stack per row for SmolVLM), with TRL's ``num_images`` and without (DPO's collator, where
the placeholders tell whose images are whose). ``flat_logprobs`` of the batch equals each row alone
through the unmodified HF model with its images (float64, summation order only). The split gives
back each image's content hash, so rows that carry the same image share it (it is encoded once).
"""

from __future__ import annotations

import pytest
import torch

from treetrain.integrations.flat import FlatBatch, flat_logprobs
from treetrain.integrations.flat_images import LAYOUTS, image_layout, row_images

from .vlm_zoo import (
    IMAGE,
    forward_token_types,
    path_inputs,
    reference_vlm_logprobs,
    vlm_model,
    vlm_tree,
    zoo_image,
)

F64 = 1e-12  # float64: summation order only


def batched(model, images: list[list]) -> dict[str, torch.Tensor]:
    """The rows' images as a processor batches them (each row's images in order, rows in order)."""
    flat = [im for row in images for im in row]
    names = list(flat[0].tensors)
    out = {}
    if "pixel_attention_mask" in names and flat[0].tensors["pixel_values"].dim() == 5:  # sub-image stacks
        stacks = [path_inputs(model, row) for row in images]
        most = max(s["pixel_values"].shape[1] for s in stacks)
        for name in ("pixel_values", "pixel_attention_mask"):
            pad = [(0, 0) * (s[name].dim() - 2) + (0, most - s[name].shape[1]) for s in stacks]
            out[name] = torch.cat([torch.nn.functional.pad(s[name], p) for s, p in zip(stacks, pad)])
        return out
    for name in names:
        if name == "batch_num_images":
            out[name] = torch.tensor([len(row) for row in images])
            continue
        parts = [im.tensors[name] for im in flat]
        if name == "pixel_values" and parts[0].dim() == 5:  # crops of anyres grids: padded to the most
            most = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
        out[name] = torch.cat(parts)
    return out


def padded(model, paths, images, left: bool = True):
    """``input_ids [B, L]``, ``attention_mask [B, L]`` and the token types a processor adds."""
    L = max(len(p) for p in paths)
    ids = torch.zeros(len(paths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = {}
    for r, (p, ims) in enumerate(zip(paths, images)):
        sl = slice(L - len(p), L) if left else slice(0, len(p))
        ids[r, sl], mask[r, sl] = torch.tensor(p), 1
        for name, t in forward_token_types(model, torch.tensor(p), ims or [object()]).items():
            types.setdefault(name, torch.zeros_like(ids))[r, sl] = t[0]
    return ids, mask, types


def check_equal_reference(model, paths, images, fields, **kw):
    ids, mask, types = padded(model, paths, images)
    out = flat_logprobs(model, ids, mask, images={**fields, **types, **kw})
    ref = reference_vlm_logprobs(model, paths, images)
    L = ids.shape[1]
    for r, (p, lp) in enumerate(zip(paths, ref)):
        got = out[r, L - len(p) + 1 :]
        assert (got - lp).abs().max().item() < F64, (r, (got - lp).abs().max().item())
    return ids, mask, types


def _one_image_rows(model):
    """Rows with one image each: three share image A in their prompt, one has image B."""
    A, B = zoo_image(model, 1), zoo_image(model, 2, size=1)
    head = [5, 6, 7]
    img = lambda im: [IMAGE] * im.num_tokens  # noqa: E731
    a, b = head + img(A), head + img(B)
    paths = [a + [8, 9, 10], a + [8, 11], a + [12], b + [8, 9]]
    return paths, [[A], [A], [A], [B]]


# layout -> a zoo type that batches that way
LAYOUT_TYPES = {"grid": "qwen2_vl", "per_image": "llava", "positions": "gemma4", "per_row": "smolvlm"}


@pytest.mark.parametrize("layout", list(LAYOUT_TYPES))
@pytest.mark.parametrize("counts", ["num_images", "from_placeholders"])
def test_layout_split_equals_each_row_alone(layout, counts):
    model = vlm_model(LAYOUT_TYPES[layout])
    paths, images = _one_image_rows(model)
    fields = batched(model, images)
    assert image_layout(fields).name == layout
    kw = {"num_images": [1, 1, 1, 1]} if counts == "num_images" else {}
    ids, mask, types = check_equal_reference(model, paths, images, fields, **kw)
    split = row_images(model, ids, mask, **fields, **types, **kw)
    if layout != "per_row":  # per-row stacks lose their zero padding: other tensors, same features
        assert [[im.key for im in row] for row in split] == [[im.key for im in row] for row in images]
    batch = FlatBatch.build(ids, mask, images=split)
    assert len(batch.tree.image_table.images) == 2  # A once for its three rows, and B


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava", "gemma3", "llava_next"])
def test_several_images_per_row(model_type):
    """The zoo's tree (an image in the prompt, one in a tool result, the same image in two branches,
    two images behind identical ids): rows with two images each, counts from grids, from runs of
    placeholders, or from TRL's num_images."""
    model = vlm_model(model_type)
    paths, images = vlm_tree(model)
    fields = batched(model, images)
    check_equal_reference(model, paths, images, fields, num_images=[len(r) for r in images])
    check_equal_reference(model, paths, images, fields)


def test_refused_layouts_and_mismatches_name_the_cause():
    pv = torch.zeros(2, 3, 4, 4)
    for fields, kw, what in [
        ({"pixel_values": pv, "spatial_shapes": torch.ones(2, 2)}, {}, "LFM2-VL"),
        ({"pixel_values": pv}, {"num_tiles": [2]}, "InternVL"),
    ]:
        with pytest.raises(ValueError, match=what):
            image_layout(fields, **kw)
    model = vlm_model("llava")
    paths, images = _one_image_rows(model)
    fields = batched(model, images)
    ids, mask, types = padded(model, paths, images)
    with pytest.raises(ValueError, match="num_images"):
        row_images(model, ids, mask, num_images=[1, 1, 1], **fields)
    types = {k: v.clone() for k, v in types.items()}
    bad = {"token_type_ids": torch.zeros_like(ids)}
    with pytest.raises(ValueError, match="token types must mark exactly"):
        row_images(model, ids, mask, **fields, **bad)
    with pytest.raises(ValueError, match="unexpected fields"):
        row_images(model, ids, mask, **fields, pixel_values_videos=pv)
    assert set(LAYOUTS) >= {"grid", "per_image", "positions", "per_row", "tiles", "shapes"}
