"""Which vision-language models treetrain runs exactly, on text trees and on trees with images, and
why the others are refused.

A type on :data:`VISION_EXACT` is checked by the VLM zoo (``tests/test_vlm_zoo.py``) as a tiny
float64 model of every class transformers maps it to (the ``...ForConditionalGeneration`` and, where
the causal-LM mapping has a text-only class for it, that one too): a text-only tree, and a tree with
an image in the shared prompt, one in a mid-tree tool result, the same image in two branches and two
different images behind identical placeholder ids. Log-probs and every parameter gradient, vision
tower included, equal each path's own unmodified Hugging Face forward with its images. Each entry
says what the model has beyond plain causal attention over embedded placeholders.

A multimodal checkpoint is run whole: text trees go through the same forward (its language model
sees them as the per-path forward would), and saving keeps the vision tower.
"""

from __future__ import annotations

__all__ = ["VISION_EXACT", "VISION_OLDER", "VISION_REFUSED", "VISION_TYPES"]

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
    "lfm2_vl": "NaFlex patches (spatial shapes, padding masks); pixel-unshuffle projector; "
    "short convolutions along each path",
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
    "llama4": "transformers' own Llama4ForConditionalGeneration.forward fails on every call (it reads "
    "image_outputs from its language model's output, which has none; transformers 5.24); its text "
    "model's chunked attention and NoPE layers are not built either",
}

VISION_TYPES = frozenset(VISION_EXACT) | frozenset(VISION_REFUSED)
