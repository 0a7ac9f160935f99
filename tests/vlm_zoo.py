"""Tiny random-init vision-language models of every image-text-to-text type transformers can build,
and images in the format each one's ``get_image_features`` reads.

:func:`vlm_config` shrinks a type's default config: its text config as the text zoo does
(``tests/zoo.py``: 2 layers, hidden 64, vocab 128, scalings away from their defaults, windows of 3
tokens), its vision config to 2 layers of width 32 with small patches, and its special token ids
(image, video, vision start/end, ...) into the small vocabulary. :func:`zoo_image` draws random
pixels in the layout the type's feature function takes (Qwen-style flattened patches with a
``(t, h, w)`` grid, fixed-size images, tiled images with sizes, sub-image stacks with masks, ...) and
counts the placeholder tokens it fills by encoding it once.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from treetrain.trees.images import ImageInput

from .zoo import _GDN_SMALL, AWAY, SMALL
from .zoo import PER_TYPE as TEXT_PER_TYPE

# special token ids inside the tiny vocabulary (text tokens of the zoo paths are drawn from 3..99)
IMAGE, VIDEO = 100, 101
SPECIAL = dict(
    image_token_id=IMAGE,
    image_token_index=IMAGE,
    video_token_id=VIDEO,
    vision_start_token_id=102,
    vision_end_token_id=103,
    image_start_token_id=104,
    image_end_token_id=105,
    boi_token_id=104,
    eoi_token_id=105,
    boi_token_index=104,
    eoi_token_index=105,
    video_start_token_id=106,
    video_end_token_id=107,
    image_break_token_id=108,
    image_end_token_index=105,
    image_newline_token_id=109,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION_SMALL = dict(
    hidden_size=32,
    embed_dim=32,
    intermediate_size=64,
    num_hidden_layers=2,
    depth=2,
    num_attention_heads=2,
    num_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    mlp_ratio=2,
    projection_dim=32,
    out_hidden_size=64,  # the merger's output: the text hidden size
    text_hidden_size=64,
    deepstack_visual_indexes=[0, 1],
    fullatt_block_indexes=[1],
    window_size=16,
    num_position_embeddings=64,
)
# vision configs whose image size sets the token count: small images of few patches
FIXED_SIZE = dict(image_size=32, patch_size=8)

# model type -> config overrides (text_config / vision_config keys as nested dicts)
PER_TYPE: dict[str, dict] = {
    # Qwen2-VL's vision hidden_size is its merger's output width: the text model's
    "qwen2_vl": {"vision_config": {"hidden_size": 64}},
    # Qwen3.5's Gated DeltaNet layers: as the text zoo's (2 key, 4 value heads of 8; conv width 3)
    "qwen3_5": {"text_config": dict(_GDN_SMALL)},
    "qwen3_5_moe": {"text_config": dict(_GDN_SMALL)},
    # Gemma 3: 16 patches pooled to 4 tokens per image
    "gemma3": {"mm_tokens_per_image": 4},
    # Gemma 4 has no default vision config: a small one, 2x2 patches pooled per token
    # (and its image blocks attend bidirectionally: "vision", off by default)
    "gemma4": {
        "vision_config": {"model_type": "gemma4_vision", "pooling_kernel_size": 2, "patch_size": 4},
        "text_config": {
            "use_bidirectional_attention": "vision",
            "vocab_size_per_layer_input": 128,  # per-layer embeddings: small
            "hidden_size_per_layer_input": 16,
        },
    },
    # LLaVA-NeXT / OneVision tile an image into crops of the vision tower's size: grids of 1x1 and 1x2
    "llava_next": {"image_grid_pinpoints": [[32, 32], [32, 64]]},
    "llava_onevision": {"image_grid_pinpoints": [[32, 32], [32, 64]]},
    "lfm2_vl": {"vision_config": {"num_patches": 16}, "projector_hidden_size": 32},
}
# model type -> how its feature function takes an image (image_tensors): flattened patches with a
# (t, h, w) grid (Qwen-style, the default where get_image_features takes image_grid_thw), one crop
# (the default), crops of an anyres grid with the image's size ("tiles"), patch sequences padded to
# a fixed count with their shapes or positions ("naflex", "positions"), sub-image stacks with a
# pixel mask ("stack")
SAMPLE_COUNTED = {"llava_onevision"}  # its images' features depend on how many share their sample
LAYOUT = {
    "llava_next": "tiles",
    "llava_onevision": "tiles",
    "lfm2_vl": "naflex",
    "gemma4": "positions",
}


def vlm_types() -> dict[str, str]:
    """Every model type of transformers' image-text-to-text mapping -> its class name."""
    return dict(sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()))


def _settable(cfg, key: str) -> bool:
    amap = getattr(cfg, "attribute_map", {})
    if isinstance(getattr(type(cfg), amap.get(key, key), None), property):
        return False
    try:
        return hasattr(cfg, key)
    except Exception:  # a per-layer attribute read globally (Gemma 4): settable, it is a field
        return key in type(cfg).__dataclass_fields__ if hasattr(type(cfg), "__dataclass_fields__") else False


def _shrunk(cfg, over: dict):
    """``type(cfg)`` rebuilt with every settable key of ``over`` set."""
    base = {k: v for k, v in cfg.to_dict().items() if not isinstance(getattr(type(cfg), k, None), property)}
    return type(cfg)(**{**base, **{k: v for k, v in over.items() if _settable(cfg, k)}})


def _text_over(text_cfg) -> dict:
    over = {**SMALL, **AWAY, **SPECIAL, **TEXT_PER_TYPE.get(text_cfg.model_type, {})}
    # windows shorter than the paths where the model has sliding layers (Gemma 3's), none switched on
    # where it has a switch (Qwen2-VL's use_sliding_window: its mRoPE layers never slide in practice)
    over["sliding_window"] = 5
    for k in ("use_sliding_window", "max_window_layers"):
        over.pop(k)
    if "kv_lora_rank" in over and _settable(text_cfg, "kv_lora_rank"):
        over["num_key_value_heads"] = over["num_attention_heads"]
    rope = getattr(text_cfg, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" in rope:  # 3D rotary sections (read by mRoPE models only)
        over["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3]}  # sum: head_dim / 2 = 8
    layer_types = getattr(text_cfg, "layer_types", None)
    if layer_types:
        kinds = list(dict.fromkeys(layer_types))
        over["layer_types"] = (kinds + kinds)[: max(2, len(kinds))]
        over["num_hidden_layers"] = len(over["layer_types"])
    return over


def vlm_config(model_type: str):
    """The tiny config of ``model_type`` (may raise: not every type builds from its defaults)."""
    cfg = CONFIG_MAPPING[model_type]()
    per = PER_TYPE.get(model_type, {})
    subs = {}
    text = getattr(cfg, "text_config", None)
    if text is not None:
        subs["text_config"] = _shrunk(text, {**_text_over(text), **per.get("text_config", {})})
    vision = getattr(cfg, "vision_config", None)
    vision_over = dict(per.get("vision_config", {}))
    if vision is None and "model_type" in vision_over:  # no default vision config: build one
        vision = CONFIG_MAPPING[vision_over.pop("model_type")]()
    if vision is not None:
        fixed = FIXED_SIZE if hasattr(vision, "image_size") else {"patch_size": 4}
        subs["vision_config"] = _shrunk(vision, {**VISION_SMALL, **fixed, **vision_over})
    top = {k: v for k, v in {**SPECIAL, "tie_word_embeddings": False}.items() if _settable(cfg, k)}
    top.update({k: v for k, v in per.items() if k not in ("text_config", "vision_config")})
    base = {k: v for k, v in cfg.to_dict().items() if k not in subs}
    return type(cfg)(**{**base, **subs, **top})


def vlm_model(model_type: str, dtype=torch.float64, seed: int = 0, attn: str = "eager"):
    """A tiny random-init ``...ForConditionalGeneration`` of ``model_type``, its init widened (weights
    x3) so log-probs are far from uniform; built in float32, then cast."""
    torch.manual_seed(seed)
    cfg = vlm_config(model_type)
    cfg._attn_implementation = attn
    for sub in ("text_config", "vision_config"):
        if getattr(cfg, sub, None) is not None:
            getattr(cfg, sub)._attn_implementation = attn
    cfg._experts_implementation = "eager"
    cls = getattr(transformers, vlm_types()[model_type])
    model = cls._from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    return model.to(dtype).eval()


def _feature_params(model) -> list[str]:
    fn = model.model.get_image_features
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "kwargs")]


def image_tensors(model, seed: int, size: int = 0) -> dict[str, torch.Tensor]:
    """Random pixels of one image in the layout ``model``'s feature function reads; ``size`` (0, 1, 2)
    picks one of a few shapes (so images of different shapes batch separately)."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    vc = model.config.vision_config
    params = _feature_params(model)
    C = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3)
    P = vc.patch_size if isinstance(vc.patch_size, int) else vc.patch_size[0]
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    layout = LAYOUT.get(model.config.model_type)
    if layout is None and "image_grid_thw" in params:
        merge = getattr(vc, "spatial_merge_size", 1)
        tps = getattr(vc, "temporal_patch_size", 1)
        h, w = 2 * merge, (2 + size) * merge
        return {"pixel_values": rand(h * w, C * tps * P * P), "image_grid_thw": torch.tensor([[1, h, w]])}
    if layout == "naflex":  # patches padded to the tower's count, the image's (h, w) in patches
        n, (h, w) = vc.num_patches, (2, 2 + 2 * size)
        mask = torch.zeros(1, n, dtype=torch.bool)
        mask[0, : h * w] = True
        return {"pixel_values": rand(1, n, C * P * P), "spatial_shapes": torch.tensor([[h, w]]),
                "pixel_attention_mask": mask}  # fmt: skip
    if layout == "positions":  # patches padded to 16, their (x, y) grid positions, -1 for padding
        k = vc.pooling_kernel_size
        h, w = 2 * k, (1 + size) * k
        pos = torch.full((1, 16, 2), -1, dtype=torch.long)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pos[0, : h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
        return {"pixel_values": rand(1, 16, C * P * P), "image_position_ids": pos}
    S = vc.image_size if isinstance(vc.image_size, int) else vc.image_size[0]
    if layout == "tiles":  # the base crop and the grid's crops, the image's size
        H, W = S, S * (1 + size)
        tiles = 1 + (1 + size)
        return {"pixel_values": rand(1, tiles, C, S, S), "image_sizes": torch.tensor([[H, W]])}
    if "pixel_attention_mask" in params:
        return {
            "pixel_values": rand(1, 1, C, S, S),
            "pixel_attention_mask": torch.ones(1, 1, S, S, dtype=torch.long),
        }
    if "image_sizes" in params and type(vc).__name__ == "PixtralVisionConfig":
        return {"pixel_values": rand(1, C, S, S), "image_sizes": torch.tensor([[S, S]])}
    return {"pixel_values": rand(1, C, S, S)}


def zoo_image(model, seed: int, size: int = 0, sample_images: int = 1) -> ImageInput:
    """One random image for ``model`` as an ``ImageInput``, its placeholder count from one encode.
    ``sample_images``: how many images the path it goes in has (LLaVA-OneVision tiles only the image
    of a one-image sample: its ``batch_num_images``)."""
    tensors = image_tensors(model, seed, size)
    if model.config.model_type in SAMPLE_COUNTED:
        tensors["batch_num_images"] = torch.tensor([sample_images])
    with torch.no_grad():
        kwargs = dict(tensors)
        if "batch_num_images" in kwargs and sample_images > 1:
            kwargs["batch_num_images"] = torch.tensor([2])  # one untiled image (see vision_encode)
        out = model.model.get_image_features(**kwargs, return_dict=True).pooler_output
    feats = out if isinstance(out, torch.Tensor) else torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
    rows = feats.numel() // feats.shape[-1]
    return ImageInput(tensors, num_tokens=rows, token_id=IMAGE)


def path_inputs(model, images) -> dict[str, torch.Tensor]:
    """A path's image tensors as its processor batches them for one sample: concatenated along the
    image dimension (the sub-image dimension for stacked layouts, crops padded to the most)."""
    out: dict[str, torch.Tensor] = {}
    layout = LAYOUT.get(model.config.model_type)
    for name in images[0].tensors if images else ():
        parts = [im.tensors[name] for im in images]
        if name == "batch_num_images":
            out[name] = torch.tensor([len(images)])
            continue
        if layout == "tiles" and name == "pixel_values":
            most = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
        stacked = (
            name in ("pixel_values", "pixel_attention_mask") and "pixel_attention_mask" in images[0].tensors
        )
        out[name] = torch.cat(parts, dim=1 if stacked and parts[0].dim() >= 4 else 0)
    return out


def forward_token_types(model, ids: torch.Tensor, images) -> dict[str, torch.Tensor]:
    """The token types a path's processor passes beside its ids: ``mm_token_type_ids`` (Qwen-style
    positions, Gemma 4's masks) or ``token_type_ids`` (Gemma 3's bidirectional image blocks)."""
    from treetrain.models.vision_positions import mm_token_types

    params = inspect.signature(model.model.forward).parameters
    if not images:
        return {}
    types = mm_token_types(ids, images)[None]
    if "mm_token_type_ids" in params:
        return {"mm_token_type_ids": types}
    return {"token_type_ids": types} if "token_type_ids" in params else {}


def reference_vlm_logprobs(model, paths, images) -> list[torch.Tensor]:
    """``[len(p) - 1]`` log-probs per path, each path alone through the unmodified HF model with its
    own images (as its processor would batch them)."""
    out = []
    for p, ims in zip(paths, images):
        ids = torch.as_tensor(p)[None]
        kwargs = {**path_inputs(model, ims), **forward_token_types(model, ids[0], ims)}
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0, :-1]
        out.append(torch.log_softmax(logits.double(), -1).gather(1, ids[0, 1:, None])[:, 0])
    return out


def vlm_tree(model, seed: int = 0):
    """Paths and their images covering every place an image goes (text tokens 3..99): an image in the
    shared prompt, one in a mid-tree tool result, the same image in two branches, two different
    images behind identical placeholder ids (they part at the image), and a text-only branch::

        prompt = t t [A] t                                   (A in the root: every path)
        path 0 = prompt t t [B] t t                          (B in a tool result)
        path 1 = prompt t t [C] t                            (C: B's shape and ids, other pixels)
        path 2 = prompt t [B] t                              (B again, in another branch)
        path 3 = prompt t t                                  (text only after the prompt)
    """
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()  # noqa: E731
    A = zoo_image(model, seed + 1, size=0, sample_images=2)
    A1 = zoo_image(model, seed + 1, size=0, sample_images=1)  # A in a one-image path (A itself but
    B = zoo_image(model, seed + 2, size=1, sample_images=2)  # for LLaVA-OneVision's tiling)
    C = zoo_image(model, seed + 3, size=1, sample_images=2)
    img = lambda im: [IMAGE] * im.num_tokens  # noqa: E731
    head, tail = draw(2), draw(1)
    tool = draw(2)
    paths = [
        head + img(A) + tail + tool + img(B) + draw(2),
        head + img(A) + tail + tool + img(C) + draw(1),
        head + img(A) + tail + draw(1) + img(B) + draw(1),
        head + img(A1) + tail + draw(2),
    ]
    return paths, [[A, B], [A, C], [A, B], [A1]]
