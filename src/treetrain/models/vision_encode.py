"""Each distinct image of a forward through the vision tower once, its features at every DFS
placeholder that carries it.

A vision-language model's forward (transformers 5.x) takes precomputed encoder outputs,
``mm_encoder_outputs={"image": out, "video": out}``, and scatters ``out.pooler_output`` (Fuyu, whose
features are its patch embeddings, ``out.last_hidden_state``; and Qwen3-VL's ``deepstack_features``,
one per early decoder layer; Granite 4 Vision has no pooled field, only ``deepstack_features`` as
``(decoder layer, per-image features)`` pairs, each added at its layer) into the placeholder positions
of ``input_ids`` in order. The tree forward encodes each distinct image once with the model's own
``get_image_features`` (``get_video_features``), then hands the forward an output whose rows are
gathered into DFS placeholder order: an image reached by three paths is encoded once and its rows
appear three times, so autograd sums the three uses into the tower's gradient, as the per-path
baseline's three encodes would.

Example: distinct images ``a`` (2 rows) and ``b`` (1 row); DFS placeholders carry ``(a,0) (a,1) (b,0)
(a,0) (a,1)``: features ``F = [a0, a1, b0]``, gathered rows ``[0, 1, 2, 0, 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from treetrain.trees.images import ImageInput
from treetrain.trees.packing import PackedTree

__all__ = [
    "EncodedImages",
    "dfs_encoder_outputs",
    "encode_images",
    "feature_field",
    "layer_pairs",
    "scattered_features",
    "vision_model",
]

_FEATURES = {"image": "get_image_features", "video": "get_video_features"}
# what a forward may read from the encoder output besides pooler_output, gathered the same way
_PER_LAYER = ("deepstack_features",)
# the field holding the features the forward scatters: pooler_output, else last_hidden_state (Fuyu's
# get_image_features returns its patch embeddings there and its forward reads them from there)
_POOLED = ("pooler_output", "last_hidden_state")
# an output with no pooled field whose deepstack_features are (decoder layer, per-image features) pairs
# (Granite 4 Vision): its forward counts the placeholders by the first pair's features and adds each
# pair's at its layer
_PAIRED = "deepstack_features"
# an image tensor holding the number of images of the processor sample it came from: LLaVA-OneVision
# tiles the image of a one-image sample and not those of a several-image sample ([k], int)
_SAMPLE_COUNT = "batch_num_images"
# NaViT-packed pixels: where an image carries this tensor, its pixel_values are one row of patches
# side by side ([1, C, P, patches * P], MiniCPM-V's target_sizes of (h, w) patch grids): images batch
# along that last dim, not the first
_PACKED_BY = "target_sizes"


def _cat_dim(names) -> dict[str, int]:
    """Per tensor name the dim a call over several images concatenates it along."""
    return {"pixel_values": -1} if _PACKED_BY in names else {}


def layer_pairs(out) -> list[int] | None:
    """The decoder layers of an output that has no pooled field and holds its features as
    ``deepstack_features`` pairs ``(layer, per-image features)``; None for any other output.

    Example: Granite 4 Vision's ``[(0, [a, b]), (3, [a', b'])]`` -> ``[0, 3]``."""
    if any(getattr(out, name, None) is not None for name in _POOLED):
        return None
    pairs = getattr(out, _PAIRED, None)
    if not pairs or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) for p in pairs):
        return None
    return [layer for layer, _ in pairs]


def feature_field(out) -> str:
    """The name of the field of a feature function's output that its forward scatters into the
    placeholders: ``pooler_output``, or ``last_hidden_state`` where the output has no pooled field, or
    ``deepstack_features`` where it holds ``(layer, features)`` pairs only (:func:`layer_pairs`)."""
    for name in _POOLED:
        if getattr(out, name, None) is not None:
            return name
    if layer_pairs(out) is not None:
        return _PAIRED
    raise ValueError(f"{type(out).__name__} has neither {' nor '.join(_POOLED)}: no features to scatter")


def scattered_features(out):
    """The features whose rows fill the placeholders, one row each (a tensor or a per-image sequence):
    the :func:`feature_field`'s, or the first pair's where the output holds ``(layer, features)`` pairs
    (every pair has the same rows)."""
    value = getattr(out, feature_field(out))
    return value[0][1] if layer_pairs(out) is not None else value


def vision_model(model: nn.Module) -> nn.Module:
    """The multimodal ``...Model`` inside a ``...ForConditionalGeneration`` (the module whose forward
    takes ``mm_encoder_outputs``), also inside a PEFT wrapper."""
    get_base = getattr(model, "get_base_model", None)
    base = (get_base() if callable(get_base) else model).base_model
    return base


@dataclass
class EncodedImages:
    """Per distinct image (input order) its feature rows ``[n_i, H]`` and, per extra layer field
    (``deepstack_features``, its pairs' features where it holds ``(layer, features)`` pairs), one
    ``[n_i, H]`` per layer; ``template``: an output of the model's own class to fill."""

    rows: list[torch.Tensor]
    per_layer: dict[str, list[list[torch.Tensor]]]
    template: object
    # "list" (a sequence per image), "stack" ([n_images, rows, H]), "flat" or "rows" ([rows, 1, H])
    pooled_as: str
    field: str = "pooler_output"  # where the output holds them (:func:`feature_field`)
    layers: list[int] | None = None  # per-layer entries' decoder layers, kept as pairs (:func:`layer_pairs`)


def _signature(im: ImageInput) -> tuple:
    """Images whose tensors agree beyond their first dim (and that are tiled alike) batch into one call."""
    tiled = int(im.tensors[_SAMPLE_COUNT].item()) == 1 if _SAMPLE_COUNT in im.tensors else None
    return (tiled,) + tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in sorted(im.tensors.items()))


def _sample_count(group: Sequence[ImageInput]) -> torch.Tensor:
    """``batch_num_images`` for a call over ``group`` (all tiled alike): one-image samples when tiled,
    else one sample of them all (at least 2: HF tiles the image of a one-image sample; with one
    untiled image the flags it builds run past the images, which it zips away)."""
    m = len(group)
    if int(group[0].tensors[_SAMPLE_COUNT].item()) == 1:
        return torch.ones(m, dtype=torch.long)
    return torch.tensor([max(m, 2)])


def _split(value, sizes: list[int], n: int):
    """A per-image view of an encoder field for ``n`` images of ``sizes`` rows, or None."""
    if isinstance(value, (list, tuple)) and len(value) == n and all(torch.is_tensor(v) for v in value):
        return [v.reshape(-1, v.shape[-1]) for v in value], "list"
    if isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[0] == n:
        return [v.reshape(-1, v.shape[-1]) for v in value], "stack"
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == sum(sizes):
        return list(value.split(sizes)), "flat"
    if isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[:2] == (sum(sizes), 1):
        return list(value[:, 0].split(sizes)), "rows"  # a token per row (Inkling's per-patch tower)
    if n == 1 and isinstance(value, torch.Tensor):
        return [value.reshape(-1, value.shape[-1])], "stack" if value.dim() == 3 else "flat"
    return None


def _call(outer: nn.Module, modality: str, group: Sequence[ImageInput]):
    fn = getattr(outer, _FEATURES[modality], None)
    if fn is None:
        raise ValueError(f"{type(outer).__name__} has no {_FEATURES[modality]}: it cannot read {modality}s")
    device = outer.get_input_embeddings().weight.device
    names = [k for k in group[0].tensors if k != _SAMPLE_COUNT]
    dims = _cat_dim(names)
    kwargs = {k: torch.cat([im.tensors[k] for im in group], dim=dims.get(k, 0)).to(device) for k in names}
    if _SAMPLE_COUNT in group[0].tensors:
        kwargs[_SAMPLE_COUNT] = _sample_count(group).to(device)
    for k, v in kwargs.items():  # pixels in the tower's dtype; grids and masks stay integer/bool
        if v.is_floating_point():
            kwargs[k] = v.to(outer.dtype)
    return fn(**kwargs, return_dict=True)


def _encode_group(outer, modality: str, group: Sequence[ImageInput]):
    """``(rows per image, {field: per layer, rows per image}, output, pooled_as)`` for a group, or None
    when the output cannot be split per image (then each image is encoded alone)."""
    out = _call(outer, modality, group)
    sizes = [im.num_tokens for im in group]
    split = _split(scattered_features(out), sizes, len(group))
    if split is None:
        return None
    rows, pooled_as = split
    paired = layer_pairs(out) is not None
    per_layer = {}
    for name in _PER_LAYER:
        layers = getattr(out, name, None)
        if layers is None:
            continue
        if paired:
            layers = [features for _, features in layers]
        per = [_split(layer, sizes, len(group)) for layer in layers]
        if any(p is None for p in per):
            return None
        per_layer[name] = [p[0] for p in per]
    return rows, per_layer, out, pooled_as


def encode_images(outer: nn.Module, images: Sequence[ImageInput], modality: str) -> EncodedImages:
    """Run ``images`` (distinct, all of ``modality``) through the model's own feature function once:
    images with the same tensor layout in one call (one call each if its output cannot be split)."""
    groups: dict[tuple, list[int]] = {}
    for i, im in enumerate(images):
        groups.setdefault(_signature(im), []).append(i)
    rows: list = [None] * len(images)
    per_layer: dict[str, list] = {}
    template, pooled_as = None, "list"
    for idx in groups.values():
        got = _encode_group(outer, modality, [images[i] for i in idx])
        calls = [(idx, got)] if got is not None or len(idx) == 1 else []
        if not calls:
            calls = [([i], _encode_group(outer, modality, [images[i]])) for i in idx]
        for part, got in calls:
            if got is None:
                raise ValueError(
                    f"{type(outer).__name__}.{_FEATURES[modality]} returned features treetrain cannot "
                    "split per image; this model's images are not supported in trees"
                )
            r, pl, template, pooled_as = got
            for j, i in enumerate(part):
                rows[i] = r[j]
                for name, layers in pl.items():
                    slots = per_layer.setdefault(name, [[None] * len(images) for _ in layers])
                    for slot, feats in zip(slots, layers):
                        slot[i] = feats[j]
    for im, r in zip(images, rows):
        if r.shape[0] != im.num_tokens:
            raise ValueError(
                f"{type(outer).__name__}: an {modality} gave {r.shape[0]} feature rows but its ImageInput "
                f"says num_tokens={im.num_tokens} (build ImageInputs with treetrain.row_images)"
            )
    return EncodedImages(rows, per_layer, template, pooled_as, feature_field(template), layer_pairs(template))


def dfs_encoder_outputs(outer: nn.Module, packed: PackedTree) -> dict:
    """``mm_encoder_outputs`` for the forward over ``packed``: each distinct image encoded once, its
    rows gathered into the DFS order of the placeholders (per modality). Empty without images."""
    if packed.image_index is None:
        return {}
    out = {}
    index, row = packed.image_index, packed.image_row
    for modality in ("image", "video"):
        chosen = [i for i, im in enumerate(packed.images) if im.modality == modality]
        if not chosen:
            continue
        enc = encode_images(outer, [packed.images[i] for i in chosen], modality)
        local = torch.full((len(packed.images),), -1, dtype=torch.long)
        local[chosen] = torch.arange(len(chosen))
        offsets = torch.tensor([0] + [im.num_tokens for im in (packed.images[i] for i in chosen)]).cumsum(0)
        at = torch.nonzero(index >= 0)[:, 0].cpu()
        at = at[local[index[at].cpu()] >= 0]  # this modality's placeholders, in DFS order
        gather = (offsets[local[index[at].cpu()]] + row[at].cpu()).to(enc.rows[0].device)
        out[modality] = _filled(enc, gather)
    return out


def _gathered(rows: list[torch.Tensor], gather: torch.Tensor, pooled_as: str):
    feats = torch.cat(rows).index_select(0, gather)
    if pooled_as == "list":
        return [feats]
    if pooled_as == "rows":
        return feats[:, None]
    return feats[None] if pooled_as == "stack" else feats


def _filled(enc: EncodedImages, gather: torch.Tensor):
    """A copy of the model's own output class holding only the gathered fields the forward reads
    (``(layer, features)`` pairs again where the model's output holds its features so)."""
    cls = type(enc.template)
    fields = {} if enc.layers is not None else {enc.field: _gathered(enc.rows, gather, enc.pooled_as)}
    for name, layers in enc.per_layer.items():
        gathered = [_gathered(layer, gather, "list") for layer in layers]
        fields[name] = gathered if enc.layers is None else list(zip(enc.layers, gathered))
    return cls(**fields)
