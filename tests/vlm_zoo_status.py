"""What each image-text-to-text type handled in ``tests/vlm_zoo.py`` gives against per-path Hugging
Face forwards (``tests/vlm_zoo``'s tree: an image in the prompt, one in a tool result, the same image in
two branches, two images behind identical placeholder ids; and a text-only tree).

``("exact", "<logp> / <grad>, f64 <logp> / <grad>")``: the worst relative log-prob and per-parameter
gradient error (vision tower included) over both trees, as shipped (a float64 model; HF's own float32
casts) and inside ``tests.hybrid_models.float64_everywhere`` (those casts lifted). A vision attention
``k_proj.bias`` whose true gradient is 0 (a key bias shifts every score of a query alike) measures
rounding noise against its floor of 1e-3 of the largest gradient: named where it is the worst.
``("refused", cause)``: why a tree cannot run it exactly, or why it is not a decoder of images.
"""

STATUS: dict[str, tuple[str, str]] = {
    "apertus1p5": (
        "refused",
        "VQ image (and audio) tokenizer: images become discrete visual-code tokens of the extended "
        "vocabulary (image_token_offset), not features scattered into placeholders",
    ),
    "aya_vision": (
        "exact",
        "4e-08 / 1e-05, f64 3e-16 / 8e-14 (as-shipped gradient worst at the SigLIP tower k_proj.bias "
        "(true gradient 0); next 2e-06)",
    ),
    "blip": (
        "refused",
        "cross-attention to image states: BLIP's text decoder (BERT with cross-attention layers) attends "
        "the vision encoder's outputs, no image placeholders in the sequence",
    ),
    "blip-2": (
        "refused",
        "no multimodal ...Model to run as the tree's decoder: Blip2ForConditionalGeneration holds the "
        "vision tower, the Q-Former and a whole ...ForCausalLM (OPT by default) whose forward returns "
        "logits, not the hidden states the tree head reads",
    ),
    "chameleon": (
        "refused",
        "VQ image tokenizer: images become discrete codebook tokens in the vocabulary (no differentiable "
        "image features to scatter)",
    ),
    "cohere2_vision": (
        "exact",
        "6e-08 / 9e-05, f64 7e-16 / 2e-13 (as-shipped gradient worst at the SigLIP tower k_proj.bias "
        "(true gradient 0); next 6e-06)",
    ),
    "cohere_compass": (
        "exact",
        "7e-08 / 5e-07, f64 3e-16 / 2e-15 (head: logits * logit_scale (models.head); sliding layers with "
        "3D rotary, NoPE full layers)",
    ),
    "cosmos3_edge": ("exact", "2e-08 / 3e-07, f64 3e-16 / 2e-15"),
    "cosmos3_omni": ("exact", "3e-08 / 5e-07, f64 2e-16 / 4e-15"),
    "deepseek_ocr2": ("exact", "3e-08 / 6e-07, f64 3e-16 / 3e-15"),
    "deepseek_vl": (
        "exact",
        "3e-08 / 3e-05, f64 3e-16 / 1e-13 (as-shipped gradient worst at the SigLIP tower k_proj.bias "
        "(true gradient 0); next 3e-06)",
    ),
    "deepseek_vl_hybrid": (
        "exact",
        "4e-08 / 2e-05, f64 3e-16 / 9e-14 (as-shipped gradient worst at the SigLIP tower k_proj.bias "
        "(true gradient 0); next 3e-06)",
    ),
    "diffusion_gemma": (
        "refused",
        "not an autoregressive decoder: block diffusion (DiffusionGemmaForBlockDiffusion), tokens of a "
        "block denoised together with bidirectional attention inside the block",
    ),
    "emu3": ("refused", "VQ image tokenizer (as chameleon): images are VQ-VAE codes in the vocabulary"),
    "ernie4_5_vl_moe": ("exact", "2e-08 / 9e-07, f64 3e-16 / 6e-15"),
    "evolla": (
        "refused",
        "not images: a protein-sequence encoder (SaProt) whose features reach the text decoder through "
        "cross-attention (sequence-aligned resampler)",
    ),
    "exaone4_5": ("exact", "5e-08 / 4e-07, f64 4e-16 / 4e-15"),
    "fast_vlm": (
        "refused",
        "its vision tower is timm's FastViT (vision_config model_type timm_wrapper): timm (and "
        "torchvision) are not installed in this environment, so the model cannot be built here; its data "
        "flow is LLaVA's (placeholders scattered in order)",
    ),
    "florence2": (
        "refused",
        "encoder-decoder (DaViT image features and the prompt go through a BART encoder; the decoder "
        "cross-attends)",
    ),
    "git": (
        "refused",
        "images prepended to the sequence as a prefix (no placeholder tokens), one image per sample, "
        "attended bidirectionally inside GIT's own BERT-style mask",
    ),
    "glm46v": ("exact", "5e-08 / 8e-07, f64 3e-16 / 4e-15"),
    "glm4v_moe": ("exact", "2e-08 / 6e-07, f64 2e-16 / 3e-15"),
    "glm5_next": (
        "refused",
        "DSA indexed attention layers (Glm5NextTextIndexer: each query attends only its own top-"
        "index_topk pooled key groups), a per-query key subset the tree mask cannot express",
    ),
    "glm_ocr": ("exact", "2e-08 / 3e-07, f64 3e-16 / 4e-15"),
    "glmga": ("exact", "5e-08 / 8e-07, f64 3e-16 / 4e-15"),
    "got_ocr2": ("exact", "2e-08 / 5e-07, f64 3e-16 / 3e-15"),
    "granite4_vision": (
        "refused",
        "its encoder output has no pooler_output: get_image_features returns deepstack_features as "
        "(decoder layer, per-image features) pairs, which its decoder adds at those layers (placeholders "
        "zeroed first); treetrain's vision_encode gathers pooler_output and per-layer deepstack lists "
        "only (not implemented)",
    ),
    "granite_docling": (
        "exact",
        "6e-09 / 4e-07, f64 2e-16 / 2e-15 (head: logits / logits_scaling (models.head))",
    ),
    "hunyuan_vl": ("exact", "3e-08 / 5e-07, f64 2e-16 / 3e-15"),
    "hyperclovax_vision_v2": (
        "exact",
        "9e-08 / 5e-07, f64 7e-16 / 3e-15 (head: logits * logits_scaling (models.head))",
    ),
    "idefics": (
        "refused",
        "no image placeholders: gated cross-attention layers (IdeficsGatedCrossAttentionLayer) attend the"
        " image states (Idefics 1 / Flamingo)",
    ),
    "idefics2": ("exact", "3e-08 / 5e-07, f64 3e-16 / 7e-15"),
    "inkling_mm_model": ("exact", "9e-09 / 3e-06, f64 2e-16 / 1e-14"),
    "instructblip": (
        "refused",
        "no multimodal ...Model (vision tower, Q-Former and a whole ...ForCausalLM side by side, as "
        "BLIP-2); and its Q-Former reads the prompt's qformer_input_ids, so an image's features depend on"
        " the text beside it",
    ),
    "instructblipvideo": (
        "refused",
        "as instructblip (no multimodal ...Model; Q-Former reads qformer_input_ids); video frames only "
        "through the same Q-Former path",
    ),
    "janus": ("exact", "2e-08 / 4e-07, f64 3e-16 / 3e-15"),
    "kimi_k25": ("exact", "2e-08 / 5e-07, f64 2e-16 / 2e-15"),
    "kosmos-2": (
        "refused",
        "no multimodal ...Model: Kosmos2ForConditionalGeneration feeds image embeddings into its own text"
        " decoder (Kosmos2TextForCausalLM) at image_embeds_position_mask, with sinusoidal positions "
        "offset by padding; no get_image_features to encode once",
    ),
    "kosmos-2.5": (
        "refused",
        "no multimodal ...Model: as kosmos-2 (image embeddings placed by image_embeds_position_mask "
        "inside its own text decoder), with flattened-patch (Pix2Struct) images",
    ),
    "lfm3_vl": (
        "exact",
        "3e-08 / 5e-07, f64 5e-16 / 8e-15 (its vision tower's Lfm3VlVisionShortConv (2D conv over one "
        "image's patch grid) is not a sequence recurrence (support.NOT_STATEFUL))",
    ),
    "lighton_ocr": ("exact", "4e-08 / 6e-07, f64 2e-16 / 3e-15"),
    "llava_next_video": ("exact", "3e-08 / 4e-06, f64 3e-16 / 3e-14"),
    "minicpmv4_6": ("exact", "7e-08 / 8e-06, f64 3e-16 / 4e-14"),
    "minicpm_ocr": ("exact", "5e-08 / 7e-06, f64 2e-16 / 4e-14"),
    "minicpmv4_7": ("exact", "6e-08 / 6e-06, f64 3e-16 / 4e-14"),
    "minimax_m3_vl": (
        "refused",
        "block-sparse indexed attention (MiniMaxM3VLIndexer): each query keeps its own top-"
        "index_topk_blocks blocks of index_block_size keys, a per-query key subset the tree mask cannot "
        "express",
    ),
    "mistral4": (
        "refused",
        "not a vision-language model: Mistral4ForCausalLM has no vision tower or get_image_features (a "
        "text decoder; Mistral 4's images go through the mistral3 type)",
    ),
    "mistral_large4": (
        "refused",
        "indexed sparse attention (DeepSeek-V3.2-style MistralLarge4TextIndexer): each query attends only"
        " its own top-index_topk keys picked by a learned indexer, a per-query key subset the tree mask "
        "(one query interval per key) cannot express",
    ),
    "mllama": (
        "refused",
        "no image placeholders: cross-attention layers to the image states (mllama), no get_image_features",
    ),
    "muse_glimmer": ("exact", "2e-08 / 9e-07, f64 2e-16 / 5e-15"),
    "nemotron_h_omni": (
        "refused",
        "no multimodal ...Model to run as the tree's decoder: NemotronH_Omni_Reasoning_V3 holds its "
        "vision model, projector, sound encoder and a whole ...ForCausalLM (NemotronH) side by side",
    ),
    "ovis2": ("exact", "3e-08 / 1e-06, f64 3e-16 / 6e-15"),
    "paddleocr_vl": ("exact", "2e-08 / 3e-07, f64 3e-16 / 2e-15"),
    "paligemma": (
        "refused",
        "prefix-LM: token_type_ids 0 (image and prompt) form one bidirectional block (block_sequence_ids "
        "over the whole prefix), so a prefix token sees later prefix tokens; tree attention refuses that "
        "mask (text-only trees, plain causal, are exact: 1e-08 / 3e-07, f64 2e-16 / 2e-15)",
    ),
    "perception_lm": (
        "refused",
        "its vision tower is timm's (vision_config model_type timm_wrapper, Perception Encoder): timm "
        "(and torchvision) are not installed in this environment, so the model cannot be built here",
    ),
    "pi0": (
        "refused",
        "not a next-token model: a vision-language-action policy (PaliGemma prefix-LM with a flow-"
        "matching action expert), no per-token log-probs",
    ),
    "pix2struct": (
        "refused",
        "encoder-decoder (the image is the encoder's input; the text decoder cross-attends)",
    ),
    "pp_chart2table": ("exact", "2e-08 / 5e-07, f64 3e-16 / 3e-15"),
    "pp_formulanet": (
        "refused",
        "encoder-decoder (an image encoder and a cross-attending formula decoder; no get_image_features)",
    ),
    "qianfan_ocr": ("exact", "2e-08 / 4e-07, f64 2e-16 / 2e-15"),
    "qwen2_5_omni_thinker": ("exact", "3e-08 / 6e-07, f64 2e-16 / 2e-15"),
    "qwen3_omni_moe_thinker": ("exact", "3e-08 / 5e-07, f64 3e-16 / 3e-15"),
    "qwen4_exp": (
        "refused",
        "QSA indexed attention in its text model (Qwen4ExpTextQSAIndexer: each query attends its own "
        "top-k pooled blocks), as qwen4_exp_text in models.support",
    ),
    "t5gemma2": (
        "refused",
        "encoder-decoder (images and prompt in the T5Gemma 2 encoder; the decoder cross-attends)",
    ),
    "udop": ("refused", "encoder-decoder (T5 with layout and image patches in the encoder)"),
    "unlimited_ocr": ("exact", "3e-08 / 5e-07, f64 2e-16 / 2e-15"),
    "video_llama_3": ("exact", "2e-08 / 3e-07, f64 2e-16 / 2e-15"),
    "video_llava": (
        "exact",
        "3e-08 / 1e-05, f64 3e-16 / 6e-14 (as-shipped gradient worst at the CLIP tower k_proj.bias (true "
        "gradient 0); next 4e-07)",
    ),
    "vipllava": (
        "exact",
        "2e-08 / 1e-05, f64 3e-16 / 6e-14 (as-shipped gradient worst at the CLIP tower k_proj.bias (true "
        "gradient 0); next 6e-07)",
    ),
    "vision-encoder-decoder": (
        "refused",
        "encoder-decoder (a vision encoder and a cross-attending text decoder)",
    ),
}
