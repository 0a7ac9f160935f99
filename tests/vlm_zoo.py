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

from treetrain.models.vision_encode import scattered_features
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
# audio towers (omni models: never run on images, shrunk so they build in milliseconds)
AUDIO_SMALL = dict(
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    d_model=32,
    output_dim=64,
    num_mel_bins=16,
    downsample_hidden_size=16,
    max_source_positions=64,
)
# vision configs whose image size sets the token count: small images of few patches
FIXED_SIZE = dict(image_size=32, patch_size=8)

# model type -> config overrides (text_config / vision_config keys as nested dicts)
# SAM towers' default initializer_range is 1e-10: weights that small make the tower's output its
# biases alone (different pixels gave identical log-probs); the text models' 0.02 makes images act
_SAM_INIT = dict(initializer_range=0.02)
# a small SAM tower (16-pixel patches, two stride-2 convolutions): DeepSeek-OCR2's and Unlimited-OCR's
_SAM = dict(
    hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, patch_size=16,
    mlp_dim=64, window_size=2, global_attn_indexes=[1], downsample_channels=[16, 32], **_SAM_INIT,
)  # fmt: skip
_INKLING2_VISION = dict(mlp_ratio=2.0, posemb_grid_size=8, projection_hidden_dim=32)
PER_TYPE: dict[str, dict] = {
    # Qwen2-VL's vision hidden_size is its merger's output width: the text model's
    "qwen2_vl": {"vision_config": {"hidden_size": 64}},
    # Qwen3.5's Gated DeltaNet layers: as the text zoo's (2 key, 4 value heads of 8; conv width 3)
    "qwen3_5": {"text_config": dict(_GDN_SMALL)},
    "qwen3_5_moe": {"text_config": dict(_GDN_SMALL)},
    # Gemma 3: 16 patches pooled to 4 tokens per image
    "gemma3": {"mm_tokens_per_image": 4},
    "shieldgemma2": {"mm_tokens_per_image": 4},  # a Gemma 3 checkpoint under its own type
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
    # Gemma 4 Unified: no vision tower, an embedder of merged 4 x 4-pixel patches (2 x 2 of 2 pixels)
    "gemma4_unified": {
        "vision_config": dict(
            model_type="gemma4_unified_vision",
            patch_size=2,
            pooling_kernel_size=2,
            mm_embed_dim=32,
            mm_posemb_size=8,
            output_proj_dims=32,
        ),
        # its blockwise overlay is OR-ed after the sliding window (a block sees itself whole): equal
        # to the tree's window-and-block mask while a block is shorter than the window (6 tokens)
        "text_config": {"sliding_window": 8},
    },
    # LLaVA-NeXT / OneVision tile an image into crops of the vision tower's size: grids of 1x1 and 1x2
    "llava_next": {"image_grid_pinpoints": [[32, 32], [32, 64]]},
    "llava_onevision": {"image_grid_pinpoints": [[32, 32], [32, 64]]},
    # Granite 4 Vision: LLaVA-NeXT's crops, each a 4 x 4 patch grid, one window of 2 x 2 Q-Former queries
    # ("2/4": several queries, so the Q-Formers' self-attention acts; "1/2" had one query per window);
    # two tower layers' features and four spatial offsets added at six distinct decoder layers; a tower
    # width of 64 (its Q-Former has width / 64 heads); the Q-Former as the type's default, narrow (a dict
    # replaces the default's init keys: given again)
    "granite4_vision": dict(
        image_grid_pinpoints=[[32, 32], [32, 64]],
        downsample_rate="2/4",
        deepstack_layer_map=[[1, 0], [2, 1]],
        spatial_target_layers=[2, 3, 4, 5],
        vision_config=dict(hidden_size=64),
        text_config=dict(num_hidden_layers=6),
        qformer_config=dict(
            model_type="blip_2_qformer",
            num_hidden_layers=1,
            intermediate_size=64,
            cross_attention_frequency=1,
            use_qformer_text_input=False,
        ),
    ),
    "lfm2_vl": {"vision_config": {"num_patches": 16}, "projector_hidden_size": 32},
    "kimi_k25": dict(projection_hidden_size=32),  # the projector's pre-norm width: the tower's
    "paligemma": dict(projection_dim=64),  # the projector's output: the text hidden size
    "janus": dict(vision_config=dict(projection_dim=64)),  # the aligner's output: the text hidden size
    # its own vocabulary and width beside the text config's (lm_head, the visual embedding table) and
    # a small visual vocabulary (the tower's head is a softmax over it)
    # rotary on half of each head (partial_rotary_factor 0.5): 3D sections summing to 4
    "glm4v_moe": dict(
        text_config=dict(
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]
            )
        )
    ),
    # separate text and vision experts: one size each
    # (its rotary interleaves equal height and width sections: [h, w, t])
    "ernie4_5_vl_moe": dict(
        text_config=dict(
            moe_intermediate_size=[32, 32],
            moe_num_experts=4,
            moe_k=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2]),
        )
    ),
    # rotary (3D sections) on its sliding layers, none on its full ones, as Cohere 2's text model
    "cohere_compass": dict(
        text_config=dict(
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
                "full_attention": None,
            },
        )
    ),
    "vipllava": dict(vision_feature_layers=[0, -1]),  # layers of its 2-layer tower (default: 5 of 24)
    "llava_next_video": {
        "image_grid_pinpoints": [[32, 32], [32, 64]]
    },  # as LLaVA-NeXT's: grids of 1x1 and 1x2
    # its high-resolution SAM tower: 2 layers, images of 64 pixels in 16-pixel patches (its global
    # branch's zero-init gate re-initialised: REINIT)
    "deepseek_vl_hybrid": dict(
        high_res_vision_config=dict(
            **_SAM_INIT,
            hidden_size=32,
            output_channels=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=16,
            mlp_dim=64,
            window_size=2,
            global_attn_indexes=[1],
        )
    ),
    # GOT-OCR 2's and PP-Chart2Table's SAM-style towers: the text models' init range (_SAM_INIT); windows of
    # 2 x 2 patches over the 4 x 4 grid in the first layer (the default 16 would cover it whole), global
    # attention in the second
    "got_ocr2": dict(vision_config=dict(_SAM_INIT, window_size=2, global_attn_indexes=[1])),
    "pp_chart2table": dict(vision_config=dict(_SAM_INIT, window_size=2, global_attn_indexes=[1])),
    "ovis2": dict(vocab_size=128, hidden_size=64, vision_config=dict(vocab_size=48)),
    "fuyu": dict(patch_size=4),  # patches of 4 x 4 pixels, embedded by one linear layer
    # its projector's learned queries per patch count: the 16 patches of a 32-pixel image -> 4 rows
    "aria": dict(projector_patch_to_query_dict={16: 4}),
    # MiniCPM-V: the window-attention merger after the first tower layer (default: the 7th of 12)
    "minicpm_ocr": dict(insert_layer_id=0, vision_config=dict(insert_layer_id=0)),
    "minicpmv4_6": dict(insert_layer_id=0, vision_config=dict(insert_layer_id=0)),
    "minicpmv4_7": dict(insert_layer_id=0, vision_config=dict(insert_layer_id=0)),
    # its adapter reads the tower's pixel-shuffled output (width 32 x 2 x 2 merges) at the top level
    "muse_glimmer": dict(out_hidden_size=128, projector_hidden_size=32),
    # Muse Spark: as Muse Glimmer; a dense and an MoE MLP, its experts' inner width small; its audio
    # tower (never run) scatters its output onto the text embeddings, so that output's width is the
    # text hidden size (validated); its stages narrow
    "muse_spark": dict(
        out_hidden_size=128,
        projector_hidden_size=32,
        text_config=dict(moe_hidden_size=32, mlp_layer_types=["dense", "sparse"]),
        audio_config=dict(out_hidden_size=64, hidden_sizes=[16, 16, 16, 16], depths=[1, 1, 1, 1]),
    ),
    # a SAM tower (64-pixel images in 16-pixel patches, two stride-2 convolutions to a 1 x 1 grid) into
    # a small Qwen2-style encoder with its learned queries
    "deepseek_ocr2": dict(
        text_config=dict(mlp_layer_types=["dense", "sparse"]),  # a dense and an MoE MLP
        vision_config=dict(
            sam_config=dict(_SAM, image_size=64),
            encoder_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=16,
                layer_types=["full_attention", "full_attention"],
                max_window_layers=2,
            ),
        ),
    ),
    # a SAM tower (128-pixel images in 16-pixel patches, two stride-2 convolutions to a 2 x 2 grid) into
    # a small CLIP encoder over that grid (its positions: 28-pixel images of 14-pixel patches, 2 x 2)
    "unlimited_ocr": dict(
        # a dense and an MoE MLP; as many KV heads as heads (its text attention's eager function, shared
        # with its CLIP encoder, repeats no KV heads: grouped heads fail in HF's own forward)
        text_config=dict(mlp_layer_types=["dense", "sparse"], num_key_value_heads=4),
        vision_config=dict(
            sam_config=dict(_SAM, image_size=128),
            encoder_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
        ),
    ),
    # its tower's depth is stored as n_layers (num_hidden_layers only maps to it): 2 layers of its
    # per-patch HMLP
    "inkling_mm_model": dict(vision_config=dict(n_layers=2)),
    # Inkling 2: its vision config's mlp_ratio is a float field; a small position grid and projector
    "inkling2": dict(vision_config=_INKLING2_VISION),
    "inkling2_loop": dict(vision_config=_INKLING2_VISION),
    # Step 3.7: a float mlp_ratio; 64-pixel images (8 x 8 patches, two stride-2 convolutions: 4 tokens);
    # a sliding layer of its own head count (a per-layer config) and a full one
    "step3p7": dict(
        vision_config=dict(mlp_ratio=2.0, image_size=64),
        text_config=dict(layer_types=["sliding_attention", "full_attention"], num_sliding_attention_heads=2),
    ),
    # Molmo 2 (refused: its image tokens share one bidirectional block; built for that test): a list
    # image size, one position per patch; its pooling adapter over the tower's two layers, small
    "molmo2": dict(
        vision_config=dict(image_size=[32, 32], num_position_embeddings=16),
        adapter_config=dict(
            vision_feature_layer=[-1, -2],
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            text_hidden_size=64,
        ),
    ),
    # HY-V4-VL: learned positions for 64-pixel images (a 16 x 16 grid of 4-pixel patches, interpolated
    # to each image's grid); its DSA text model (as the text zoo's hy_v4) keeps 4 keys of the paths'
    # (image tokens among them), 16 index heads (exact 0 index scores, ties at the top-k boundary,
    # rare); 3D sections over its latent attention's rotary width (qk_rope_head_dim 8: sections
    # summing to 4)
    "hy_v4_vl": dict(
        vision_config=dict(max_image_size=64),
        text_config=dict(
            indexer_types=["full", "shared"],
            index_topk=4,
            index_n_heads=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
        ),
    ),
    # dots.llm3 note: its vision and audio adapters from the towers' widths to the text hidden size; its
    # DSA layers keep 4 keys of the image tree's paths (up to 17 tokens), 16 index heads (as hy_v4_vl)
    "dots3_note": dict(
        text_config=dict(index_topk=4, index_n_heads=16),
        vision_config=dict(
            adapter_in_dim=32,
            adapter_out_dim=64,
            moe_intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        audio_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            adapter_input_size=32,
            adapter_out_dim=64,
            feature_size=16,
        ),
    ),
    # Llama 4 (refused: built for its cause's test): a chunk of 4 positions (shorter than the zoo paths),
    # temperature tuning from position 1 on (floor_scale 2), a dense MLP beside the experts of width 64;
    # its tower's pixel shuffle (ratio 0.5) takes width 32 to 128, its adapter's input (intermediate_size)
    "llama4": dict(
        vision_config=dict(
            intermediate_size=128, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32
        ),
        text_config=dict(attention_chunk_size=4, floor_scale=2, attn_scale=0.5, intermediate_size_mlp=64),
    ),
}


# model type -> {parameter name: std}: parameters HF initialises to zero whose zero makes images inert
# in a random model (redrawn from N(0, std) before vlm_model widens the init): Gemma 3's projection
# (zero: every image feature is 0, every tower gradient 0) and DeepSeek-VL-Hybrid's high-resolution
# global-branch gate (zero: its neck never reaches the output)
_GEMMA3_PROJ = {"model.multi_modal_projector.mm_input_projection_weight": 0.02}
REINIT: dict[str, dict[str, float]] = {
    "gemma3": _GEMMA3_PROJ,
    "shieldgemma2": _GEMMA3_PROJ,
    "deepseek_vl_hybrid": {"model.high_res_vision_alpha": 0.5},
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


def _shrunk(cfg, over: dict, own: dict | None = None):
    """``type(cfg)`` rebuilt with every settable key of ``over`` set and every key of ``own`` (a type's
    own overrides, passed as they are: init-only keys such as dots3's ``swa_*`` widths included). A
    heterogeneous config's per-layer overrides are the default's layers': dropped, derived again for
    the small layer count (as the text zoo builds them)."""
    base = {
        k: v
        for k, v in cfg.to_dict().items()
        if not isinstance(getattr(type(cfg), k, None), property) and k != "per_layer_config"
    }
    over = {k: v for k, v in over.items() if _settable(cfg, k)}
    return type(cfg)(**{**base, **over, **(own or {})})


def _text_over(text_cfg, own: dict) -> dict:
    """The shrinking keys of a text config; ``own``: the type's own overrides (their layer kinds, if
    given, set the depth)."""
    over = {**SMALL, **AWAY, **SPECIAL}
    # windows shorter than the paths where the model has sliding layers (Gemma 3's), none switched on
    # where it has a switch (Qwen2-VL's use_sliding_window: its mRoPE layers never slide in practice)
    over["sliding_window"] = 5
    for k in ("use_sliding_window", "max_window_layers"):
        over.pop(k)
    if "kv_lora_rank" in over and _settable(text_cfg, "kv_lora_rank"):
        over["num_key_value_heads"] = over["num_attention_heads"]
        over["head_dim"] = over["qk_rope_head_dim"]  # latent attention's rotary width (DeepSeek-V3)
    rope = getattr(text_cfg, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" in rope:  # 3D rotary sections (read by mRoPE models only)
        over["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3]}  # sum: head_dim / 2 = 8
    layer_types = own.get("layer_types") or getattr(text_cfg, "layer_types", None)
    if layer_types:
        kinds = list(dict.fromkeys(layer_types))
        over["layer_types"] = own.get("layer_types") or (kinds + kinds)[: max(2, len(kinds))]
        over["num_hidden_layers"] = len(over["layer_types"])
    return {**over, **_per_layer(text_cfg, {**over, **own})}


def _per_layer(cfg, over: dict) -> dict:
    """``cfg``'s per-layer lists (layer and MLP kinds, NoPE flags, KV sources) cut to the new depth:
    each kind once, in order, repeated."""
    n, deep = over.get("num_hidden_layers"), getattr(cfg, "num_hidden_layers", 0)
    if not isinstance(n, int) or not isinstance(deep, int):
        return {}
    return {
        k: (list(dict.fromkeys(v)) * n)[:n]
        for k, v in cfg.to_dict().items()
        if k not in over and isinstance(v, list) and deep > n and len(v) == deep
    }


def vlm_config(model_type: str):
    """The tiny config of ``model_type`` (may raise: not every type builds from its defaults)."""
    cfg = CONFIG_MAPPING[model_type]()
    per = PER_TYPE.get(model_type, {})
    subs = {}
    text = getattr(cfg, "text_config", None)
    if text is not None:
        own = {**TEXT_PER_TYPE.get(text.model_type, {}), **per.get("text_config", {})}
        subs["text_config"] = _shrunk(text, _text_over(text, own), own)
    vision = getattr(cfg, "vision_config", None)
    vision_over = dict(per.get("vision_config", {}))
    if vision is None and "model_type" in vision_over:  # no default vision config: build one
        vision = CONFIG_MAPPING[vision_over.pop("model_type")]()
    if vision is not None:
        fixed = FIXED_SIZE if hasattr(vision, "image_size") else {"patch_size": 4}
        over = {**VISION_SMALL, **fixed, **vision_over}
        subs["vision_config"] = _shrunk(vision, {**over, **_per_layer(vision, over)}, vision_over)
    audio = getattr(cfg, "audio_config", None)
    if audio is not None:
        subs["audio_config"] = _shrunk(audio, AUDIO_SMALL, per.get("audio_config"))
    top = {k: v for k, v in {**SPECIAL, "tie_word_embeddings": False}.items() if _settable(cfg, k)}
    top.update({k: v for k, v in per.items() if k not in ("text_config", "vision_config", "audio_config")})
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
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, std in REINIT.get(model_type, {}).items():
            params[name].normal_(0.0, std)
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    # complex buffers (Llama 4's vision rotary) stay complex: Module.to(float64) keeps their real part
    cplx = {}
    for name, b in list(model.named_buffers()):
        if b.is_complex():
            owner, _, leaf = name.rpartition(".")
            cplx[owner, leaf] = b.to(torch.complex128 if dtype == torch.float64 else b.dtype)
            delattr(model.get_submodule(owner), leaf)
    model = model.to(dtype)
    for (owner, leaf), b in cplx.items():
        model.get_submodule(owner).register_buffer(leaf, b, persistent=False)
    return model.eval()


def multimodal_model(model):
    """The module holding the feature function: the multimodal ``...Model`` (``model.base_model``, as
    treetrain reads it; Llama 4 has none: its ``...ForConditionalGeneration`` itself)."""
    return model.base_model


def _feature_params(model) -> list[str]:
    fn = multimodal_model(model).get_image_features
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "kwargs")]


def _channels_patch(vc) -> tuple[int, int]:
    C = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3)
    P = vc.patch_size if isinstance(vc.patch_size, int) else vc.patch_size[0]
    return C, P


def _side(vc) -> int:
    return vc.image_size if isinstance(vc.image_size, int) else vc.image_size[0]


def _grid(vc, size: int) -> tuple[int, int]:
    """A ``(h, w)`` patch grid of whole merge windows; wider with ``size``."""
    merge = getattr(vc, "spatial_merge_size", None) or getattr(vc, "merge_kernel_size", [1])[0]
    return 2 * merge, (2 + size) * merge


def _flat_patches(vc, g, size, dtype):
    """Qwen-style: ``[h * w, C * t * P * P]`` flattened patches and their ``(t, h, w)`` grid."""
    C, P = _channels_patch(vc)
    h, w = _grid(vc, size)
    tps = getattr(vc, "temporal_patch_size", 1)
    pv = torch.randn(h * w, C * tps * P * P, generator=g, dtype=dtype)
    return {"pixel_values": pv, "image_grid_thw": torch.tensor([[1, h, w]])}


def _patch_images(vc, g, size, dtype):
    """``[h * w, C, P, P]`` patches as small images and their ``(t, h, w)`` grid (Kimi-K2.5)."""
    C, P = _channels_patch(vc)
    h, w = _grid(vc, size)
    pv = torch.randn(h * w, C, P, P, generator=g, dtype=dtype)
    return {"pixel_values": pv, "image_grid_thw": torch.tensor([[1, h, w]])}


def _stacked(vc, g, size, dtype):
    """A stack of ``1 + size`` sub-images with their pixel masks (Idefics-style: an image split into
    crops, each its own run of features)."""
    C, S = _channels_patch(vc)[0], _side(vc)
    pv = torch.randn(1, 1 + size, C, S, S, generator=g, dtype=dtype)
    return {"pixel_values": pv, "pixel_attention_mask": torch.ones(1, 1 + size, S, S, dtype=torch.long)}


def _tiles(vc, g, size, dtype):
    """A stack of one tile with its tile mask (Granite Docling: ``[1, 1]`` bool, real tiles true)."""
    C, S = _channels_patch(vc)[0], _side(vc)
    pv = torch.randn(1, 1, C, S, S, generator=g, dtype=dtype)
    return {"pixel_values": pv, "pixel_attention_mask": torch.ones(1, 1, dtype=torch.bool)}


def _sized(vc, g, size, dtype):
    """A fixed-size image with its ``image_sizes`` (Pixtral towers)."""
    C, S = _channels_patch(vc)[0], _side(vc)
    pv = torch.randn(1, C, S, S, generator=g, dtype=dtype)
    return {"pixel_values": pv, "image_sizes": torch.tensor([[S, S]])}


def _dual(vc, g, size, dtype):
    """A low-resolution image and its high-resolution copy for a second (SAM) tower, twice the side."""
    C, S = _channels_patch(vc)[0], _side(vc)
    return {
        "pixel_values": torch.randn(1, C, S, S, generator=g, dtype=dtype),
        "high_res_pixel_values": torch.randn(1, C, 2 * S, 2 * S, generator=g, dtype=dtype),
    }


def _square(vc, g, size, dtype):
    """One ``[1, C, S, S]`` image of the tower's fixed size."""
    C, S = _channels_patch(vc)[0], _side(vc)
    return {"pixel_values": torch.randn(1, C, S, S, generator=g, dtype=dtype)}


def _anyres_grid(vc, g, size, dtype):
    """LLaVA-NeXT / OneVision tiles of an anyres grid (pinpoints ``[[S, S], [S, 2S]]``): the base crop
    and ``1 + size`` grid crops as ``[1, crops, C, S, S]`` with the image's size."""
    C, S = _channels_patch(vc)[0], _side(vc)
    pv = torch.randn(1, 2 + size, C, S, S, generator=g, dtype=dtype)
    return {"pixel_values": pv, "image_sizes": torch.tensor([[S, S * (1 + size)]])}


def _naflex(vc, g, size, dtype):
    """Patches padded to the tower's count with the image's ``(h, w)`` in patches and the valid
    patches' mask (LFM2-VL's Siglip2)."""
    C, P = _channels_patch(vc)
    n, (h, w) = vc.num_patches, (2, 2 + 2 * size)
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, : h * w] = True
    pv = torch.randn(1, n, C * P * P, generator=g, dtype=dtype)
    return {"pixel_values": pv, "spatial_shapes": torch.tensor([[h, w]]), "pixel_attention_mask": mask}


def _positions(vc, g, size, dtype):
    """Patches padded to 16 with their ``(x, y)`` grid positions, -1 for padding (Gemma 4)."""
    C, P = _channels_patch(vc)
    k = vc.pooling_kernel_size
    h, w = 2 * k, (1 + size) * k
    pos = torch.full((1, 16, 2), -1, dtype=torch.long)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos[0, : h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
    return {
        "pixel_values": torch.randn(1, 16, C * P * P, generator=g, dtype=dtype),
        "image_position_ids": pos,
    }


def _patch_rows(vc, g, size, dtype):
    """``[1, h * w, P * P * C]`` flattened patches of one image, no tower (Fuyu: a linear patch
    embedding; its processor's newline tokens between patch rows are text)."""
    C, P = _channels_patch(vc)
    pv = torch.randn(1, 2 * (2 + size), P * P * C, generator=g, dtype=dtype)
    return {"pixel_values": pv}


def _merged_positions(vc, g, size, dtype):
    """Merged patches (``patch_size * pooling_kernel_size`` pixels a side) padded to 8 with their
    ``(x, y)`` grid positions, -1 for padding: one token each (Gemma 4 Unified's encoder-free
    embedder)."""
    C, P = _channels_patch(vc)
    side = P * vc.pooling_kernel_size
    h, w = 2, 2 + size
    pos = torch.full((1, 8, 2), -1, dtype=torch.long)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos[0, : h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
    return {
        "pixel_values": torch.randn(1, 8, side * side * C, generator=g, dtype=dtype),
        "image_position_ids": pos,
    }


def _packed(vc, g, size, dtype):
    """NaViT-packed patches of one image as one row, ``[1, C, P, h * w * P]``, with its ``(h, w)``
    patch grid as ``target_sizes`` (MiniCPM-V: whole 2 x 2 windows of 2 x 2 merges, one slice)."""
    C, P = _channels_patch(vc)
    h, w = 4, 4 * (2 + size)
    pv = torch.randn(1, C, P, h * w * P, generator=g, dtype=dtype)
    return {"pixel_values": pv, "target_sizes": torch.tensor([[h, w]])}


def _merge_sized(vc, g, size, dtype):
    """Qwen-style flattened patches with their grid and the image's ``image_merge_sizes``
    (VideoLLaMA 3: the merge size is per image)."""
    C, P = _channels_patch(vc)
    h, w = 4, 2 * (2 + size)  # whole 2 x 2 merge windows
    pv = torch.randn(h * w, C * P * P, generator=g, dtype=dtype)
    return {
        "pixel_values": pv,
        "image_grid_thw": torch.tensor([[1, h, w]]),
        "image_merge_sizes": torch.tensor([2]),
    }


def _temporal_patches(vc, g, size, dtype):
    """Qwen-style flattened patches of ``patch_temporal`` frames each (``[h * w, C * T * P * P]``) over
    whole ``merge_size`` windows, with their ``(t, h, w)`` grid (Muse Glimmer's own key names)."""
    C, P = _channels_patch(vc)
    m = vc.merge_size
    h, w = 2 * m, (2 + size) * m
    pv = torch.randn(h * w, C * vc.patch_temporal * P * P, generator=g, dtype=dtype)
    return {"pixel_values": pv, "image_grid_thw": torch.tensor([[1, h, w]])}


def _sam_square(vc, g, size, dtype):
    """One ``[1, C, S, S]`` image of the size of the vision config's SAM tower (DeepSeek-OCR 2)."""
    S = vc.sam_config.image_size
    return {"pixel_values": torch.randn(1, vc.sam_config.num_channels, S, S, generator=g, dtype=dtype)}


def _patch_cubes(vc, g, size, dtype):
    """``[patches, T, P, P, C]`` space-time patch cubes, one token each (Inkling's per-patch HMLP
    tower, no image size: the patch count is the image's)."""
    C, P = _channels_patch(vc)
    pv = torch.randn(2 * (2 + size), vc.temporal_patch_size, P, P, C, generator=g, dtype=dtype)
    return {"pixel_values": pv}


def _merge_windows(vc, g, size, dtype):
    """``[h * w, M * P, M * P, C]`` windows of ``M x M`` patches, one per language-model token, in
    raster order, with their ``(t, h, w)`` grid counted in tokens (Inkling 2)."""
    C, P = _channels_patch(vc)
    side = P * vc.spatial_merge_size
    h, w = 2, 2 + size
    pv = torch.randn(h * w, side, side, C, generator=g, dtype=dtype)
    return {"pixel_values": pv, "image_grid_thw": torch.tensor([[1, h, w]])}


# layout name -> random pixels of one image: (vision config, generator, size, dtype) -> tensors
LAYOUTS = {
    "anyres_grid": _anyres_grid,
    "naflex": _naflex,
    "positions": _positions,
    "flat_patches": _flat_patches,
    "patch_images": _patch_images,
    "stacked": _stacked,
    "sized": _sized,
    "tiles": _tiles,
    "dual": _dual,
    "square": _square,
    "patch_rows": _patch_rows,
    "merged_positions": _merged_positions,
    "packed": _packed,
    "merge_sized": _merge_sized,
    "temporal_patches": _temporal_patches,
    "sam_square": _sam_square,
    "patch_cubes": _patch_cubes,
    "merge_windows": _merge_windows,
}
SAMPLE_COUNTED = {"llava_onevision"}  # its images' features depend on how many share their sample
# model type -> its layout, where the feature function's parameters do not tell it
IMAGE_LAYOUT: dict[str, str] = {
    "llava_next": "anyres_grid",
    "llava_onevision": "anyres_grid",
    "granite4_vision": "anyres_grid",
    "lfm2_vl": "naflex",
    "gemma4": "positions",
    "kimi_k25": "patch_images",
    "paddleocr_vl": "patch_images",
    "llava_next_video": "anyres_grid",
    "granite_docling": "tiles",
    "deepseek_vl_hybrid": "dual",
    "fuyu": "patch_rows",
    "gemma4_unified": "merged_positions",
    "minicpm_ocr": "packed",
    "minicpmv4_6": "packed",
    "minicpmv4_7": "packed",
    "video_llama_3": "merge_sized",
    "muse_glimmer": "temporal_patches",
    "muse_spark": "temporal_patches",
    "deepseek_ocr2": "sam_square",
    "unlimited_ocr": "sam_square",
    "inkling_mm_model": "patch_cubes",
    "inkling2": "merge_windows",
    "inkling2_loop": "merge_windows",
}


def image_layout(model) -> str:
    """The layout name of ``model``'s images: :data:`IMAGE_LAYOUT`, else read from its feature
    function's parameters."""
    if model.config.model_type in IMAGE_LAYOUT:
        return IMAGE_LAYOUT[model.config.model_type]
    params = _feature_params(model)
    if "image_grid_thw" in params:
        return "flat_patches"
    if "pixel_attention_mask" in params:
        return "stacked"
    if "image_sizes" in params and type(model.config.vision_config).__name__ == "PixtralVisionConfig":
        return "sized"
    return "square"


def image_tensors(model, seed: int, size: int = 0) -> dict[str, torch.Tensor]:
    """Random pixels of one image in the layout ``model``'s feature function reads; ``size`` (0, 1, 2)
    picks one of a few shapes (so images of different shapes batch separately)."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    cfg = getattr(model.config, "vision_config", None) or model.config  # Fuyu: patches on the top config
    return LAYOUTS[image_layout(model)](cfg, g, size, dtype)


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
        out = scattered_features(multimodal_model(model).get_image_features(**kwargs, return_dict=True))
    feats = out if isinstance(out, torch.Tensor) else torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
    rows = feats.numel() // feats.shape[-1]
    return ImageInput(tensors, num_tokens=rows, token_id=IMAGE)


def path_inputs(model, images) -> dict[str, torch.Tensor]:
    """A path's image tensors as its processor batches them for one sample: concatenated along the
    image dimension (the sub-image dimension for stacked layouts, the patch dimension for Fuyu's
    patch rows, crops padded to the most)."""
    out: dict[str, torch.Tensor] = {}
    layout = image_layout(model) if images else None
    for name in dict.fromkeys(k for im in images for k in im.tensors):  # a path's videos' names too
        parts = [im.tensors[name] for im in images if name in im.tensors]
        if name == "batch_num_images":
            out[name] = torch.tensor([len(images)])
            continue
        if layout == "anyres_grid" and name == "pixel_values":
            most = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
        if layout == "packed" and name == "pixel_values":  # one row of all the sample's patches
            out[name] = torch.cat(parts, dim=-1)
            continue
        stacked = layout == "patch_rows" or (  # Fuyu: one sample's patches in one row
            name in ("pixel_values", "pixel_attention_mask")
            and ("pixel_attention_mask" in images[0].tensors)
            and images[0].tensors["pixel_values"].dim() == 5
        )
        out[name] = torch.cat(parts, dim=1 if stacked else 0)
    return out


def forward_token_types(model, ids: torch.Tensor, images) -> dict[str, torch.Tensor]:
    """The token types a path's processor passes beside its ids: ``mm_token_type_ids`` (Qwen-style
    positions, Gemma 4's masks) or ``token_type_ids`` (Gemma 3's bidirectional image blocks)."""
    from treetrain.models.vision_positions import mm_token_types

    params = inspect.signature(multimodal_model(model).forward).parameters
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


# Qwen3-VL-style types: a video's frames each after their timestamp text (get_rope_index splits the
# video's grid into t = 1 frames, one per run of placeholders); Qwen2-VL-style: one run per video
TIMESTAMPED = {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}


def zoo_video(model, seed: int, frames: int) -> ImageInput:
    """A random video for a Qwen-style ``model``: ``frames`` temporal patches (``frames *
    temporal_patch_size`` input frames) of a 2 x 2-merge-window grid, as ``pixel_values_videos [t * h *
    w, C * T * P * P]`` (rows frame-major) and ``video_grid_thw [[t, h, w]]``; Qwen2.5-VL's
    ``second_per_grid_ts`` too (0.5 s per temporal patch: its temporal positions are spaced by it)."""
    vc = model.config.vision_config
    g = torch.Generator().manual_seed(seed)
    C, P = _channels_patch(vc)
    m, T = vc.spatial_merge_size, vc.temporal_patch_size
    h, w = 2 * m, 2 * m
    pv = torch.randn(frames * h * w, C * T * P * P, generator=g, dtype=next(model.parameters()).dtype)
    tensors = {"pixel_values_videos": pv, "video_grid_thw": torch.tensor([[frames, h, w]])}
    if "second_per_grid_ts" in inspect.signature(model.model.forward).parameters:
        tensors["second_per_grid_ts"] = torch.tensor([0.5])
    return ImageInput(tensors, num_tokens=frames * h * w // m**2, token_id=VIDEO, modality="video")


def video_tokens(model, video: ImageInput, stamps: list[int]) -> list[int]:
    """The tokens of ``video`` in a path, as its processor lays them out: vision start, placeholders,
    vision end; per frame after that frame's timestamp token (``stamps[i]``) for :data:`TIMESTAMPED`
    types, else one run."""
    t = int(video.tensors["video_grid_thw"][0, 0])
    start, end = SPECIAL["vision_start_token_id"], SPECIAL["vision_end_token_id"]
    if model.config.model_type not in TIMESTAMPED:
        return [start] + [VIDEO] * video.num_tokens + [end]
    per = video.num_tokens // t
    return [tok for i in range(t) for tok in [stamps[i], start] + [VIDEO] * per + [end]]


def video_tree(model, seed: int = 0):
    """Paths with videos of 2 and 3 temporal patches (frames varying over time) and an image::

    prompt = t t [V1] t                                  (V1 in the root: every path)
    path 0 = prompt t [V2] t t                           (V2 in a tool result)
    path 1 = prompt t [V3] t                             (V3: V2's shape and ids, other frames:
                                                          the paths part at the video)
    path 2 = prompt t [A] t t                            (an image after the video)
    path 3 = prompt t t                                  (text only after the prompt)
    """
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()  # noqa: E731
    V1, V2, V3 = zoo_video(model, seed + 1, 2), zoo_video(model, seed + 2, 3), zoo_video(model, seed + 3, 3)
    A = zoo_image(model, seed + 4)
    vid = lambda v: video_tokens(model, v, [50, 51, 52])  # noqa: E731  (timestamps: one per frame)
    head, tool = draw(2) + vid(V1) + draw(1), draw(1)
    paths = [
        head + tool + vid(V2) + draw(2),
        head + tool + vid(V3) + draw(1),
        head + draw(1) + [IMAGE] * A.num_tokens + draw(2),
        head + draw(2),
    ]
    return paths, [[V1, V2], [V1, V3], [V1, A], [V1]]
