"""Which vision-language models treetrain runs exactly, on text trees and on trees with images, and
why the others are refused.

A type on :data:`VISION_EXACT` is checked by the VLM zoo (``tests/test_vlm_zoo.py``) as a tiny
float64 model of every class transformers maps it to (the ``...ForConditionalGeneration`` and, where
the causal-LM mapping has a text-only class for it, that one too): a text-only tree, and a tree with
an image in the shared prompt, one in a mid-tree tool result, the same image in two branches and two
different images behind identical placeholder ids. Log-probs and every parameter gradient, vision
tower included, equal each path's own unmodified Hugging Face forward with its images; and the images
act (swapping two of them moves the log-probs; every vision-side parameter that HF trains on images
gets a gradient). Each entry says what the model has beyond plain causal attention over embedded
placeholders. Videos are compared only for :data:`VIDEO_EXACT` and refused by name elsewhere.

A multimodal checkpoint is run whole: text trees go through the same forward (its language model
sees them as the per-path forward would), and saving keeps the vision tower.
"""

from __future__ import annotations

__all__ = ["VIDEO_EXACT", "VISION_EXACT", "VISION_OLDER", "VISION_REFUSED", "VISION_TYPES"]

_QWEN = "3D rotary positions (the model's compute_3d_position_ids per path)"
VISION_EXACT: dict[str, str] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN + "; windowed vision attention",
    "qwen3_vl": _QWEN + " (interleaved); deepstack features in the first decoder layers",
    "qwen3_vl_moe": _QWEN + " (interleaved); deepstack features; MoE",
    "qwen3_5": _QWEN + " (interleaved); Gated DeltaNet layers routed along the tree",
    "qwen3_5_moe": _QWEN + " (interleaved); Gated DeltaNet layers routed along the tree; MoE",
    "glm4v": _QWEN + " (GLM's)",
    "gemma3": "bidirectional attention inside each image block; sliding windows",
    "gemma4": "bidirectional attention inside each image block (use_bidirectional_attention='vision'); "
    "per-layer embeddings; sliding windows; head: final logit softcap",
    "llava": "",
    "llava_next": "anyres crops of any grid, unpadded with newline features",
    "llava_onevision": "anyres crops; a several-image sample's images untiled (batch_num_images)",
    "mistral3": "Pixtral vision tower (image sizes); patch merger",
    "idefics3": "sub-image stacks with pixel masks; pixel-shuffle connector",
    "smolvlm": "sub-image stacks with pixel masks; pixel-shuffle connector",
    "internvl": "pixel-shuffle projector",
    "llava_onevision1_5": "flattened patches with a (t, h, w) grid; a class token per frame in its tower "
    "(dropped before the merger); 1D text positions",
    "lfm2_vl": "NaFlex patches (spatial shapes, padding masks); pixel-unshuffle projector; "
    "short convolutions along each path",
}

# Types whose videos (``ImageInput(modality="video")``: ``pixel_values_videos`` and ``video_grid_thw`` of
# t > 1 temporal patches, through the model's own get_video_features and 3D positions) are compared
# too (tests/test_vlm_video.py), on transformers >= 5.24 only; every other type refuses a video by name
_FRAMES = "a video's placeholders one run, temporal positions per frame"
_TIMESTAMPED = "each frame's placeholders a run of its own after its timestamp text (frames as t = 1 grids)"
VIDEO_EXACT: dict[str, str] = {
    "qwen2_vl": _FRAMES,
    "qwen2_5_vl": _FRAMES + " spaced by second_per_grid_ts",
    "qwen3_vl": _TIMESTAMPED + "; deepstack features",
    "qwen3_vl_moe": _TIMESTAMPED + "; deepstack features",
    "qwen3_5": _TIMESTAMPED,
    "qwen3_5_moe": _TIMESTAMPED,
}

# Types also verified on an older transformers, as ``[lowest, below)``: 5.10.x (verl 0.9.1 pins
# transformers < 5.11), whose forwards take no precomputed encoder outputs and get them through
# their own feature call (treetrain.models.vision_legacy); the zoo runs them there (.ci/lowest.sh).
# Versions between these ranges and 5.24 are unverified: refused.
_VERL_PIN = ("5.10.4", "5.11")
VISION_OLDER: dict[str, tuple[str, str]] = {
    "qwen2_vl": _VERL_PIN,
    "qwen2_5_vl": _VERL_PIN,
    "qwen3_vl": _VERL_PIN,
    "qwen3_vl_moe": _VERL_PIN,
}

VISION_REFUSED: dict[str, str] = {
    "llama4": "no multimodal ...Model to run as the tree's decoder: Llama4ForConditionalGeneration holds "
    "its vision model, projector and a whole Llama4ForCausalLM side by side (its base_model is itself, so "
    "the tree's decoder call returns logits, not hidden states); and its text model, as llama4_text: "
    "chunked attention (attention_chunk_size) the tree's layer masks cannot carry, and temperature tuning "
    "on its NoPE layers that scales each query by its index in the forward's sequence (torch.arange, not "
    "position_ids), a DFS index in a tree (forced, its text model 3e-03 off with the tuning; 2e-16 / 3e-15 "
    "without it and a chunk longer than the paths). Below transformers 5.25 its own forward failed on "
    "every call (image_outputs)",
}


VISION_EXACT |= {
    "aria": "cross-attention projector (learned queries per patch count); MoE text model",
    "aya_vision": "pixel-shuffle projector; head: logits * text_config.logit_scale where its forward "
    "applies it (transformers >= 5.25)",
    "cohere2_vision": "pixel-shuffle projector",
    "cohere_compass": "3D positions on its sliding layers, NoPE full layers; head: logits * logit_scale",
    "cosmos3_edge": "3D positions",
    "cosmos3_omni": "3D positions; deepstack",
    "deepseek_vl": "",
    "dots3_note": "its text model's DSA sparse attention (each query's top index_topk keys of its own "
    "path; the dense backend), and sliding latent-attention layers; a MoE vision tower",
    "deepseek_vl_hybrid": "a second high-resolution (SAM) tower",
    "deepseek_ocr2": "a SAM tower into a Qwen2-style encoder of learned queries (bidirectional over the "
    "patches, causal over the queries), a view separator per image (global views; the zoo passes no "
    "local crops); MoE text model",
    "ernie4_5_vl_moe": "3D positions (interleaved h, w, t); separate text and vision experts",
    "exaone4_5": "3D positions",
    "fuyu": "no vision tower: a linear embedding of flattened patches (its features in last_hidden_state)",
    "gemma4_unified": "no vision tower: an embedder of merged raw patches with 2D position embeddings; "
    "bidirectional attention inside each image block (HF ORs the block after the sliding window: exact "
    "while a block is shorter than the window, refused beyond); per-layer head widths; sliding windows; "
    "head: final logit softcap",
    "glm46v": "3D positions (GLM's)",
    "glm4v_moe": "3D positions on half the head; MoE",
    "glm_ocr": "3D positions (GLM's)",
    "glmga": "3D positions (GLM's)",
    "got_ocr2": "SAM-style tower (windowed and global layers)",
    "granite_docling": "tiles with a tile mask; head: logits / logits_scaling",
    "granite4_vision": "anyres crops; no pooled features: Q-Former-projected features of several tower "
    "layers and four spatial offsets, each added at its own decoder layer (placeholders zeroed first); "
    "head: logits / logits_scaling",
    "hunyuan_vl": "3D positions",
    "minimax_m3_vl": "its text model's block-sparse indexed attention (each query's top index_topk_blocks "
    "blocks of index_block_size positions along its own path, and its local blocks; the dense backend); "
    "MoE",
    "hy_v4_vl": "3D positions; its text model's DSA sparse attention (layers sharing a selection; each "
    "query's top index_topk keys of its own path; the dense backend); attention sinks; hyper-connections; "
    "MoE",
    "hyperclovax_vision_v2": "3D positions; head: logits * logits_scaling",
    "idefics2": "perceiver resampler; pixel masks",
    "inkling_mm_model": "a per-patch HMLP tower (space-time patch cubes folded to depth, one token each); "
    "Inkling's text model (as inkling_text: short convolutions routed along the tree); audio tower "
    "present, not run; head: hidden / logits_mup_width_multiplier",
    "inkling2": "windows of merge x merge patches, one per token, with a (t, h, w) grid; a class token per "
    "image in its tower; its text model as inkling2_text (short and dynamic convolutions routed along the "
    "tree, per-query sinks, block attention residuals; MoE); head: final logit softcap",
    "inkling2_loop": "as inkling2; its text model as inkling2_loop_text (looped layers with message gates)",
    "janus": "",
    "kimi_k25": "patch images with a (t, h, w) grid; MLA text model",
    "lfm3_vl": "3D positions; a 2D convolution in the tower (not a recurrence); short convolutions",
    "lighton_ocr": "Pixtral tower",
    "minicpm_ocr": "NaViT-packed patches with target_sizes (h, w); window-attention merger inside the tower "
    "('4x' mode: skipped)",
    "minicpmv4_6": "NaViT-packed patches with target_sizes (h, w); window-attention merger inside the "
    "tower; 2 x 2 merger",
    "minicpmv4_7": "NaViT-packed patches with target_sizes (h, w); window-attention merger inside the "
    "tower; 2 x 2 merger",
    "llava_next_video": "anyres crops (videos refused: not on VIDEO_EXACT)",
    "muse_glimmer": "flattened patches of patch_temporal frames with a (t, h, w) grid; pixel-shuffle merge;"
    " sliding and NoPE full layers, gated attention; head: logits * output_multiplier, softcap",
    "muse_spark": "as muse_glimmer (flattened patches of patch_temporal frames with a (t, h, w) grid; "
    "pixel-shuffle merge; sliding and NoPE full layers, gated attention; head: logits * output_multiplier, "
    "softcap); residual gates; MoE; audio tower present, not run",
    "ovis2": "visual vocabulary embedding",
    "paddleocr_vl": "3D positions",
    "pp_chart2table": "SAM-style tower (windowed and global layers)",
    "qianfan_ocr": "pixel-shuffle projector",
    "qwen2_5_omni_thinker": "3D positions (audio tower present, not run)",
    "qwen3_omni_moe_thinker": "3D positions; deepstack; MoE (audio tower present, not run)",
    "shieldgemma2": "a Gemma 3 checkpoint under its own type: bidirectional attention inside each image "
    "block; sliding windows",
    "step3p7": "a tower of fixed-size images downsampled by two stride-2 convolutions; sliding layers of "
    "their own head count and full layers, per-head attention gates; MoE",
    "unlimited_ocr": "a SAM tower into a CLIP encoder over its grid (features: CLIP's beside SAM's), a "
    "newline per row and a view separator per image (global views; the zoo passes no local crops); MoE "
    "text model whose reference sliding layers keep every prefill key (plain causal without a cache)",
    "video_llama_3": "flattened patches with a (t, h, w) grid and a per-image merge size (image_merge_sizes)",
    "video_llava": "",
    "vipllava": "features of several tower layers",
}
VISION_REFUSED |= {
    "apertus1p5": (
        "VQ image (and audio) tokenizer: images become discrete visual-code tokens of the extended "
        "vocabulary (image_token_offset), not features scattered into placeholders"
    ),
    "blip": (
        "cross-attention to image states: BLIP's text decoder (BERT with cross-attention layers) attends "
        "the vision encoder's outputs, no image placeholders in the sequence"
    ),
    "blip-2": (
        "no multimodal ...Model to run as the tree's decoder: Blip2ForConditionalGeneration holds the "
        "vision tower, the Q-Former and a whole ...ForCausalLM (OPT by default) whose forward returns "
        "logits, not the hidden states the tree head reads"
    ),
    "chameleon": (
        "VQ image tokenizer: images become discrete codebook tokens in the vocabulary (no differentiable "
        "image features to scatter)"
    ),
    "diffusion_gemma": (
        "not an autoregressive decoder: block diffusion (DiffusionGemmaForBlockDiffusion), tokens of a "
        "block denoised together with bidirectional attention inside the block"
    ),
    "emu3": ("VQ image tokenizer (as chameleon): images are VQ-VAE codes in the vocabulary"),
    "evolla": (
        "not images: a protein-sequence encoder (SaProt) whose features reach the text decoder through "
        "cross-attention (sequence-aligned resampler)"
    ),
    "fast_vlm": (
        "its vision tower is timm's FastViT (vision_config model_type timm_wrapper): timm imports "
        "torchvision, whose PyPI wheels for torch 2.13 are CUDA builds (gemma3n's cause), so the model "
        "cannot be built on the CPU torch this project tests on; its data flow is LLaVA's (placeholders "
        "scattered in order)"
    ),
    "florence2": (
        "encoder-decoder (DaViT image features and the prompt go through a BART encoder; the decoder "
        "cross-attends)"
    ),
    "git": (
        "images prepended to the sequence as a prefix (no placeholder tokens), one image per sample, "
        "attended bidirectionally inside GIT's own BERT-style mask"
    ),
    "glm5_next": (
        "DSA indexed attention layers (Glm5NextTextIndexer: each query attends only its own top-"
        "index_topk pooled key groups), a per-query key subset the tree mask cannot express"
    ),
    "idefics": (
        "no image placeholders: gated cross-attention layers (IdeficsGatedCrossAttentionLayer) attend the"
        " image states (Idefics 1 / Flamingo)"
    ),
    "instructblip": (
        "no multimodal ...Model (vision tower, Q-Former and a whole ...ForCausalLM side by side, as "
        "BLIP-2); and its Q-Former reads the prompt's qformer_input_ids, so an image's features depend on"
        " the text beside it"
    ),
    "instructblipvideo": (
        "as instructblip (no multimodal ...Model; Q-Former reads qformer_input_ids); video frames only "
        "through the same Q-Former path"
    ),
    "kosmos-2": (
        "no multimodal ...Model: Kosmos2ForConditionalGeneration feeds image embeddings into its own text"
        " decoder (Kosmos2TextForCausalLM) at image_embeds_position_mask, with sinusoidal positions "
        "offset by padding; no get_image_features to encode once"
    ),
    "kosmos-2.5": (
        "no multimodal ...Model: as kosmos-2 (image embeddings placed by image_embeds_position_mask "
        "inside its own text decoder), with flattened-patch (Pix2Struct) images"
    ),
    "mistral4": (
        "not a vision-language model: Mistral4ForCausalLM has no vision tower or get_image_features (a "
        "text decoder; Mistral 4's images go through the mistral3 type)"
    ),
    "mistral_large4": (
        "indexed sparse attention (DeepSeek-V3.2-style MistralLarge4TextIndexer): each query attends only"
        " its own top-index_topk keys picked by a learned indexer, a per-query key subset the tree mask "
        "(one query interval per key) cannot express"
    ),
    "mllama": (
        "no image placeholders: cross-attention layers to the image states (mllama), no get_image_features"
    ),
    "nemotron_h_omni": (
        "no multimodal ...Model to run as the tree's decoder: NemotronH_Omni_Reasoning_V3 holds its "
        "vision model, projector, sound encoder and a whole ...ForCausalLM (NemotronH) side by side"
    ),
    "ovis2_5": (
        "boundary tokens counted over the whole sequence: Ovis2_5Model._merge_visual_features requires "
        "exactly one image-start and one image-end token per image it is given, but branches that part "
        "at an image share its start token and not its end token (the zoo's image tree: 3 start and 4 "
        "end tokens for 4 image uses), so no split of the features passes HF's own forward, which raises"
        " (its boundary embeddings are per token; text-only trees never reach the check: log-probs as "
        "shipped 2e-08)"
    ),
    "paligemma": (
        "prefix-LM: token_type_ids 0 (image and prompt) form one bidirectional block (block_sequence_ids "
        "over the whole prefix), so a prefix token sees later prefix tokens; tree attention refuses that "
        "mask (text-only trees, plain causal, are exact: 1e-08 / 3e-07, f64 2e-16 / 2e-15)"
    ),
    "perception_lm": (
        "its vision tower is timm's (vision_config model_type timm_wrapper, Perception Encoder): timm "
        "imports torchvision, whose PyPI wheels for torch 2.13 are CUDA builds (gemma3n's cause), so the "
        "model cannot be built on the CPU torch this project tests on"
    ),
    "pi0": (
        "not a next-token model: a vision-language-action policy (PaliGemma prefix-LM with a flow-"
        "matching action expert), no per-token log-probs"
    ),
    "pi05": (
        "not a next-token model: a vision-language-action policy (pi0's PaliGemma prefix-LM with a "
        "flow-matching action expert of adaptive RMS norms), its logits are predicted action velocities, "
        "no per-token log-probs"
    ),
    "pix2struct": ("encoder-decoder (the image is the encoder's input; the text decoder cross-attends)"),
    "pp_formulanet": (
        "encoder-decoder (an image encoder and a cross-attending formula decoder; no get_image_features)"
    ),
    "qwen4_exp": (
        "QSA indexed attention in its text model (Qwen4ExpTextQSAIndexer: each query attends its own "
        "top-k pooled blocks), as qwen4_exp_text in models.support"
    ),
    "t5gemma2": ("encoder-decoder (images and prompt in the T5Gemma 2 encoder; the decoder cross-attends)"),
    "udop": ("encoder-decoder (T5 with layout and image patches in the encoder)"),
    "vision-encoder-decoder": ("encoder-decoder (a vision encoder and a cross-attending text decoder)"),
}

VISION_REFUSED |= {
    "gemma3n": (
        "its vision tower is timm's MobileNetV5 (vision_config gemma3n_vision, built by TimmWrapperModel "
        "through timm.create_model): timm imports torchvision, whose PyPI wheels (0.28.0 for torch 2.13) "
        "are CUDA builds whose compiled ops need libtorch_cuda, absent from the CPU torch this project "
        "tests on, so `import torchvision` fails (operator torchvision::nms does not exist) and the model "
        "cannot be built here; its text model is exact as gemma3n_text (models.support)"
    ),
    "molmo2": (
        "every image token of a sequence is in one bidirectional block (Molmo2Model.forward: "
        "block_sequence_ids 0 at each image token), so an image's states depend on the images after it "
        "in its path: a prefix shared by branches with different images has no single value (text-only "
        "trees, plain causal, are exact: 3e-08 / 5e-07, f64 1e-16 / 2e-15)"
    ),
}

VISION_TYPES = frozenset(VISION_EXACT) | frozenset(VISION_REFUSED)
