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
    "aya_vision": (
        "exact",
        "4e-08 / 1e-05, f64 3e-16 / 8e-14 (as-shipped gradient worst at the SigLIP tower k_proj.bias "
        "(true gradient 0); next 2e-06)",
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
    "deepseek_vl": (
        "exact",
        "3e-08 / 3e-05, f64 3e-16 / 1e-13 (as-shipped gradient worst at the SigLIP tower k_proj.bias "
        "(true gradient 0); next 3e-06)",
    ),
    "ernie4_5_vl_moe": ("exact", "2e-08 / 9e-07, f64 3e-16 / 6e-15"),
    "exaone4_5": ("exact", "5e-08 / 4e-07, f64 4e-16 / 4e-15"),
    "glm46v": ("exact", "5e-08 / 8e-07, f64 3e-16 / 4e-15"),
    "glm4v_moe": ("exact", "2e-08 / 6e-07, f64 2e-16 / 3e-15"),
    "glm_ocr": ("exact", "2e-08 / 3e-07, f64 3e-16 / 4e-15"),
    "glmga": ("exact", "5e-08 / 8e-07, f64 3e-16 / 4e-15"),
    "got_ocr2": ("exact", "2e-08 / 5e-07, f64 3e-16 / 3e-15"),
    "hunyuan_vl": ("exact", "3e-08 / 5e-07, f64 2e-16 / 3e-15"),
    "hyperclovax_vision_v2": (
        "exact",
        "9e-08 / 5e-07, f64 7e-16 / 3e-15 (head: logits * logits_scaling (models.head))",
    ),
    "idefics2": ("exact", "3e-08 / 5e-07, f64 3e-16 / 7e-15"),
    "janus": ("exact", "2e-08 / 4e-07, f64 3e-16 / 3e-15"),
    "kimi_k25": ("exact", "2e-08 / 5e-07, f64 2e-16 / 2e-15"),
    "lighton_ocr": ("exact", "4e-08 / 6e-07, f64 2e-16 / 3e-15"),
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
    "ovis2": ("exact", "3e-08 / 1e-06, f64 3e-16 / 6e-15"),
    "paddleocr_vl": ("exact", "2e-08 / 3e-07, f64 3e-16 / 2e-15"),
    "paligemma": (
        "refused",
        "prefix-LM: token_type_ids 0 (image and prompt) form one bidirectional block (block_sequence_ids "
        "over the whole prefix), so a prefix token sees later prefix tokens; tree attention refuses that "
        "mask (text-only trees, plain causal, are exact: 1e-08 / 3e-07, f64 2e-16 / 2e-15)",
    ),
    "pp_chart2table": ("exact", "2e-08 / 5e-07, f64 3e-16 / 3e-15"),
    "qianfan_ocr": ("exact", "2e-08 / 4e-07, f64 2e-16 / 2e-15"),
    "qwen2_5_omni_thinker": ("exact", "3e-08 / 6e-07, f64 2e-16 / 2e-15"),
    "qwen3_omni_moe_thinker": ("exact", "3e-08 / 5e-07, f64 3e-16 / 3e-15"),
    "video_llava": (
        "exact",
        "3e-08 / 1e-05, f64 3e-16 / 6e-14 (as-shipped gradient worst at the CLIP tower k_proj.bias (true "
        "gradient 0); next 4e-07)",
    ),
}
