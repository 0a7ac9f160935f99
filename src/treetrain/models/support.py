"""Which architectures treetrain runs exactly, and a clear refusal for every other one.

A model is accepted only when (1) its model type is on :data:`EXACT`, the list the model-zoo test
(``tests/test_model_zoo.py``) verifies against per-path Hugging Face forwards in float64, log-probs
and every parameter gradient, with the scalings and attention extras set away from their defaults;
and (2) none of its modules is a state-carrying layer that treetrain does not route along the tree
(:data:`STATEFUL`), whatever its model type: a recurrence run over the packed tree as if it were
one sequence would carry state from one branch into its sibling. Everything else raises a
``ValueError`` naming the model type or the layer, and why; nothing runs silently different.

The list, with the reasons for what is refused, is ``docs/architectures.md``.
"""

from __future__ import annotations

import re
from importlib.metadata import version

from torch import nn

from treetrain.models.classes import own_class
from treetrain.models.head import unwrap
from treetrain.models.recurrent import ROUTES, route
from treetrain.models.support_vision import VISION_EXACT, VISION_OLDER, VISION_REFUSED, VISION_TYPES

__all__ = ["ADDED_IN", "EXACT", "REFUSED", "STATEFUL", "check_model", "refusal", "verified_from"]


def _words(text: str) -> list[str]:
    return text.split()


# model type -> what it has beyond plain decoder self-attention (RoPE or learned positions, GQA,
# dense or MoE MLPs) that treetrain handles; every entry is checked by tests/test_model_zoo.py, and
# every MoE type's routers, experts and router aux loss (HF's, where its forward has one) by
# tests/test_zoo_moe.py
_PLAIN = _words(
    """afmoe apertus apertus1p5_text arcee aria_text axk1 biogpt bitnet codegen ctrl cwm dbrx deepseek_v2
    deepseek_v3 ernie4_5 ernie4_5_moe exaone exaone4 flex_olmo gemma glm glm4 glm4_moe glm4_moe_lite
    gpt-sw3 gpt2 gpt_bigcode gpt_neox gptj helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 internlm3
    iquestcoder jais2 jetmoe kolibri1 llama minimax_m2 mixtral olmo olmo2 olmo3 opt persimmon phi phi3
    qwen3_moe sarvam_mla sarvam_moe seed_oss solar_open youtu"""
)
# DeepSeek Sparse Attention: an indexer keeps each query's index_topk top-scoring keys; in a tree each
# query's indexer scores its own path's keys and the dense backend attends the tree mask and the
# selection together (models.sparse_select, attention.selected)
_DSA = "DSA sparse attention (each query's top index_topk keys of its own path; the dense backend)"
_DSA += "; latent attention; MoE"
EXACT: dict[str, str] = {t: "" for t in _PLAIN} | {
    "cohere": "head: logits * logit_scale",
    "cohere2": "head: logits * logit_scale; sliding-window layers",
    "granite": "head: logits / logits_scaling; embedding, residual and attention multipliers",
    "granite_swa": "head: logits / logits_scaling; sliding window; attention sinks",
    "granitemoe": "head: logits / logits_scaling; multipliers; MoE",
    "granitemoe_swa": "head: logits / logits_scaling; sliding window; attention sinks; MoE",
    "granitemoeshared": "head: logits / logits_scaling; multipliers; shared-expert MoE",
    "hyperclovax": "head: logits * logits_scaling; multipliers",
    "minicpm3": "head: hidden / (hidden_size / dim_model_base); latent attention",
    "gemma2": "head: final logit softcap; attention logit softcap (dense, flex); sliding window",
    "gemma3_text": "head: final logit softcap; sliding window",
    "vaultgemma": "head: final logit softcap; attention logit softcap (dense, flex)",
    "nanochat": "head: final logit softcap",
    "gpt_oss": "attention sinks (forward and gradient, every backend); sliding window; MoE",
    "flint": "attention sinks; sliding window; MoE",
    "mistral": "sliding window",
    "ministral": "sliding window",
    "ministral3": "sliding window",
    "qwen2": "sliding window",
    "qwen2_moe": "sliding window (its mask only: the attention call never receives it); MoE",
    "qwen3": "sliding window",
    "dots1": "sliding window; MoE",
    "smollm3": "sliding window on its NoPE layers",
    "phimoe": "sliding window (its mask only: the attention call never receives it); MoE",
    "olmoe": "a sliding_window its mask ignores is ignored, as HF's eager and SDPA attention do; MoE",
    "starcoder2": "sliding window",
    "qwen3_next": "Gated DeltaNet layers routed along the tree (models.recurrent); MoE",
    "qwen3_5_text": "Gated DeltaNet layers routed along the tree (models.recurrent)",
    "qwen3_5_moe_text": "Gated DeltaNet layers routed along the tree (models.recurrent); MoE",
    "lara_mini": "Gated DeltaNet layers routed along the tree; sliding window; MoE",
    "olmo_hybrid": "Gated DeltaNet layers (beta in [0, 2]) routed along the tree",
    "kimi_linear": "KDA (per-channel decay delta rule) layers routed along the tree; latent attention; MoE",
    "bailing_hybrid": "KDA layers routed along the tree; latent attention; grouped MoE",
    "lfm2": "short convolutions along each path (models.shortconv)",
    "lfm2_moe": "short convolutions along each path; MoE",
    "lfm3": "short convolutions along each path; sliding window; attention output gate",
    "cohere2_moe": "head: logits * logit_scale; sliding-window layers; MoE",
    "cohere_compass_text": "head: logits * logit_scale; sliding-window layers (multi-axis rope at the text "
    "position); NoPE full layers",
    "beam": "head: final logit softcap; sliding window; NoPE full layers with a position-dependent query "
    "scale; attention output gate; MoE",
    "gemma3n_text": "head: final logit softcap; sliding window; KV-shared layers; AltUp, LAuReL, per-layer "
    "embeddings, activation sparsity",
    "gemma4_text": "head: final logit softcap; sliding window; proportional rope; keys as values; KV-shared "
    "layers (their masks sliced to the kept queries); per-layer embeddings; MoE",
    "gemma4_unified_text": "head: final logit softcap; sliding window; proportional rope; keys as values; "
    "KV-shared layers (their masks sliced to the kept queries)",
    "dory": "head: a learned logit scale per vocabulary entry; a looped recurrent section; sliding window",
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA + " (layers sharing a selection)",
    "axk2": _DSA,
    "hy_v4": _DSA + " (layers sharing a selection); hyper-connections",
    "dots3_note_text": _DSA + "; sliding-window latent-attention layers of their own widths",
    "minimax_m3_vl_text": "sparse-attention layers (each query's local and top index_topk_blocks blocks "
    "of its own path; the dense backend); MoE",
    "mimo_v2_flash": "attention sinks on its sliding-window layers; a value scale; MoE",
    "exaone_moe": "sliding window; MoE",
    "laguna": "sliding window; heads per layer; attention output gate; MoE",
    "mellum": "sliding window; MoE",
    "longcat_flash": "two attention and MLP sublayers per layer; latent attention; MoE with zero (identity) "
    "experts",
    "hrm_text": "H and L stacks run in cycles (its prefix-LM mask needs token_type_ids, which a tree forward "
    "never passes: causal)",
    "diffllama": "differential attention (two softmax maps, learned lambdas)",
    "ergo": "sliding window; NoPE full layers with a query/key scale; per-dimension residual gates; MoE "
    "with a norm per expert",
    "minicpm5_moe": "attention output gate; MoE",
    "param2moe": "GLM-4-MoE's model (qk norms); MoE",
}
_SSM = "routed along the tree (models.recurrent)"
EXACT |= {
    "mamba": f"Mamba (selective scan) mixers {_SSM}",
    "falcon_mamba": f"Mamba mixers with RMS norms on dt, B, C {_SSM}",
    "jamba": f"Mamba mixers with dt/B/C norms {_SSM}; attention; MoE",
    "zamba": f"multi-head Mamba mixers {_SSM}; shared attention blocks",
    "mamba2": f"Mamba2 (SSD) mixers {_SSM}; grouped B/C and norm",
    "bamba": f"Mamba2 mixers {_SSM}; attention",
    "falcon_h1": f"Mamba2 mixers {_SSM} (ssm multipliers, mup vector); parallel attention; head multiplier",
    "granitemoehybrid": f"Mamba2 mixers {_SSM}; attention; multipliers; head / logits_scaling; MoE",
    "nemotron_h": f"Mamba2 mixers {_SSM}; attention; MoE",
    "zamba2": f"Mamba2 mixers {_SSM}; shared hybrid attention blocks",
}
EXACT |= {
    "bloom": "ALiBi along each path (models.alibi: its own attention class); pretraining_tp slices",
    "mpt": "ALiBi along each path (models.alibi: its own attention class); clip_qkv, softmax_scale",
    "minimax": "lightning attention routed along the tree (models.lightning); MoE",
    "xlstm": "mLSTM layers routed along the tree (models.xlstm); head: output_logit_soft_cap",
    "rwkv": "time-mix (WKV recurrence) and channel-mix token shifts routed along the tree (models.rwkv)",
    "recurrent_gemma": "RG-LRU and its conv1d routed along the tree (models.rglru); head: logits softcap",
    "falcon": "ALiBi along each path or rotary (models.alibi: its own attention class); multi-query, GQA",
}
_INKLING = (
    "short convolutions along each path and a learned bias per query and path distance (models.inkling); "
)
EXACT |= {
    "inkling_text": _INKLING + "log scaling at path positions; sliding window; MoE; head: hidden / "
    "logits_mup_width_multiplier, unpadded vocab",
    "inkling2_text": _INKLING + "dynamic key/value convolutions; per-query sinks; L2 clips; block "
    "attention residuals; sliding window; MoE; head: final logit softcap",
    "inkling2_loop_text": _INKLING + "dynamic key/value convolutions; per-query sinks; looped layers with "
    "message gates; block attention residuals; sliding window; MoE; head: final logit softcap",
}

_ENCODER = "an encoder (BERT family) run as a decoder: its attention and mask are its own, not the tree's"
_ENC_DEC = "the decoder of an encoder-decoder model (cross-attention, its own mask handling)"
_MULTIMODAL = "a multimodal model: load its text-only causal LM instead"
# model type -> why it is refused (a type on neither list, e.g. from a newer transformers, is refused
# as not verified)
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        _words(
            """bert bert-generation big_bird camembert data2vec-text electra ernie megatron-bert rembert
            roc_bert roformer roberta roberta-prelayernorm xlm-roberta xlm-roberta-xl xmod xlm xlnet
            reformer modernbert-decoder"""
        ),
        _ENCODER,
    ),
    **dict.fromkeys(
        _words(
            """bart bigbird_pegasus blenderbot blenderbot-small marian mbart mvp pegasus plbart prophetnet
            trocr whisper"""
        ),
        _ENC_DEC,
    ),
    **dict.fromkeys(
        _words(
            """gemma3n gemma4_unified got_ocr2 fuyu mllama emu3 git moss_transcribe_diarize musicgen
            musicgen_melody moshi phi4_multimodal qwen4_exp dots3_note"""
        ),
        _MULTIMODAL,
    ),
    "qwen4_exp_text": "QSA indexed attention: each query attends its own top-k pooled blocks of "
    "indexer_compress_ratio consecutive path positions plus the incomplete tail, a per-query key subset "
    "the tree mask (one query interval per key) cannot express and that HF's indexer reads only from a "
    "dense [T, T] mask (well defined along paths: a block is fixed by its last token, so one straddling a "
    "branch point is a distinct block per branch; not implemented)",
    "kolibri1_1": "indexed sparse attention (Kolibri1_1Indexer): each query attends its own top-index_topk "
    "keys of a pool of top-scoring blocks, plus sink and local tokens counted in the packed sequence's "
    "positions, a per-query key subset the tree mask cannot express, which HF's indexer reads from and "
    "writes into a dense [T, T] mask (a forced tree forward fails in its code: torch.finfo of the tree's "
    "layer mask)",
    "openai-gpt": "its own attention, outside transformers' attention interface: a causal mask from its "
    "own buffer over the packed sequence, so sibling branches see each other (log-probs differ by 8e-3)",
    "gpt_neo": "its own attention, outside transformers' attention interface: causal and local-window masks "
    "from its own buffers over the packed sequence, the tree's layer mask added as a bias (log-probs differ "
    "by 9e-2)",
    "llama4_text": "chunked attention: each token attends only the keys in its own chunk of "
    "attention_chunk_size path positions, a window that varies per query ((position mod chunk) + 1) where "
    "the tree's layer masks carry one per layer (refused when the model builds the mask); temperature "
    "tuning on its NoPE layers scales each query by its index in the forward's sequence (torch.arange, not "
    "position_ids), a DFS index in a tree (log-probs 3e-03 off, floor_scale 2); and its class names a base "
    "model (language_model) it does not have, its decoder being .model",
    "deepseek_v4": "compressed sparse attention (CSA/HCA): keys and values pooled over windows of "
    "compress_rates consecutive tokens of the packed sequence, a bias for the pooled keys concatenated to "
    "the mask (the model's own mask: a forced tree forward fails in its code)",
    "zaya": "CCA attention: query/key convolutions over the previous tokens and a value delayed by one "
    "token, along the packed sequence (log-probs differ by 0.16)",
    "blt": "a byte latent transformer: hash n-gram embeddings of the preceding bytes, entropy-based patches "
    "of consecutive bytes and byte-patch cross-attention with masks of its own, all over the packed "
    "sequence",
    "gemma4_assistant": "a drafter for assisted decoding: its forward takes the target model's embeddings "
    "and key/value states, not token ids, and scores no paths of its own",
    "gemma4_unified_assistant": "a drafter for assisted decoding: its forward takes the target model's "
    "embeddings and key/value states, not token ids, and scores no paths of its own",
    "doge": "dynamic mask attention (a value-dependent mask of its own; log-probs differ by 0.12)",
    "gpt_neox_japanese": "its own attention path (log-probs differ by 0.9)",
    "cpmant": "its own attention and position bias (log-probs differ by 45)",
    "nemotron": "its own attention call receives the tree mask as a tensor it cannot read",
    "stablelm": "its own attention call receives the tree mask as a tensor it cannot read",
    "xglm": "builds its own 4-D mask and rejects the tree's",
}

# layer class name pattern (searched in the class name, so FSDP2's FSDP<Name> matches) -> what it carries
STATEFUL: dict[str, str] = {
    r"Mamba\w*Mixer|MambaLayer|BambaMixer|FalconH1Mixer": "a Mamba/Mamba2 state-space recurrence",
    r"GatedDeltaNet|DeltaAttention": "a Gated DeltaNet recurrence",
    r"LinearAttention|LightningAttention": "a linear-attention recurrence",
    r"ShortConv": "a short causal convolution over the previous tokens",
    r"Rwkv(SelfAttention|FeedForward)": "an RWKV recurrence (time-mix) or token shift (channel-mix)",
    r"xLSTMLayer|xLSTMBackend|mLSTM|sLSTM": "an xLSTM (mLSTM) recurrence",
    r"Rglru|RecurrentBlock": "an RG-LRU recurrence",
    r"CCAProjection": "query/key convolutions over the previous tokens and a value delayed by one token",
}
_STATEFUL = [(re.compile(p), what) for p, what in STATEFUL.items()]
# classes a pattern above matches by name that carry no state along the sequence
NOT_STATEFUL = {
    "OlmoHybridLinearAttentionDecoderLayer": "a decoder layer; its OlmoHybridGatedDeltaNet is checked itself",
    "KimiLinearAttention": "Kimi Linear's full (latent) softmax attention",
    "Lfm3VlVisionShortConv": "LFM3-VL's vision tower: a 2D convolution over one image's patch grid",
}

_DOCS = "docs/architectures.md lists what runs exactly and why the rest is refused"


def _stateful_layer(model: nn.Module) -> tuple[str, str] | None:
    """``(class name, what it carries)`` of the first state-carrying layer without tree routing (a
    layer inside a routed one, e.g. RecurrentGemma's RG-LRU in its recurrent block, is routed with it)."""
    inside_routed = {id(m) for r in model.modules() if route(r) is not None for m in r.modules()}
    for module in model.modules():
        if id(module) in inside_routed:
            continue
        if own_class(module, NOT_STATEFUL) is not None:
            continue
        name = type(module).__name__
        for pattern, what in _STATEFUL:
            if pattern.search(name):
                return name, what
    return None


# The model zoo runs on the newest transformers and, in CI, on the lowest supported (pyproject's
# bound, the verl venv's 5.10.4). These types are exact on the newest but not on the lowest (their
# layers changed: Mamba2 scans, lightning slopes, mask and rope code), so older versions refuse them
# rather than run them unverified.
VERIFIED_FROM = "5.24.0"
NEWEST_ONLY = frozenset(
    _words(
        """bamba ctrl falcon_h1 falcon_mamba lfm2 lfm2_moe mamba2 minimax nemotron_h
        olmo_hybrid recurrent_gemma solar_open zamba zamba2"""
    )
) | frozenset(  # verified on the newest only so far (issue 45): refused below it until the lowest runs them
    _words(
        """axk1 axk2 beam codegen cohere2_moe cohere_compass_text dbrx deepseek_v2 deepseek_v3 deepseek_v32
        diffllama dory dots3_note_text exaone_moe gemma3n_text gemma4_text gemma4_unified_text glm4_moe_lite
        glm_moe_dsa gptj hrm_text hy_v4 laguna longcat_flash mellum mimo_v2_flash minimax_m3_vl_text youtu"""
    )
)


# types (text and multimodal) a transformers after VERIFIED_FROM added -> the version that added them:
# those on EXACT / VISION_EXACT are verified from it (an older transformers, or a remote-code model of
# the same name, is refused by name); the others are refused by their cause on every version
ADDED_IN = dict.fromkeys(
    _words("ergo kolibri1_1 minicpm5_moe param2moe llava_onevision1_5 ovis2_5 pi05"), "5.25.0"
)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def verified_from(model_type: str) -> str | None:
    """The lowest transformers ``model_type`` is verified exact with (None: the lowest supported)."""
    if model_type in ADDED_IN and (model_type in EXACT or model_type in VISION_EXACT):
        return ADDED_IN[model_type]
    return VERIFIED_FROM if model_type in NEWEST_ONLY else None


def refusal(model: nn.Module) -> str | None:
    """Why treetrain refuses ``model``, or None when it runs it exactly."""
    model = unwrap(model)
    layer = _stateful_layer(model)
    if layer is not None:
        name, what = layer
        return (
            f"recurrent layer {name} ({what}) has no tree routing: its state would leak across "
            f"branches of the tree. Routed: {', '.join(sorted(ROUTES))}; {_DOCS}"
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    installed = version("transformers")
    lowest = verified_from(model_type)
    if lowest is not None and _version(installed) < _version(lowest):
        return (
            f"model type {model_type!r} is verified exact only with transformers >= {lowest} "
            f"(installed: {installed}): upgrade transformers; {_DOCS}"
        )
    if model_type in VISION_TYPES:
        return _vision_refusal(model, model_type, installed)
    if model_type in EXACT:
        return None
    why = REFUSED.get(model_type, "not verified exact by treetrain's model-zoo test")
    return f"model type {model_type!r} ({type(model).__name__}) is not supported: {why}; {_DOCS}"


def vision_verified(model_type: str, installed: str) -> bool:
    """Whether the multimodal ``model_type`` is verified exact on transformers ``installed``: every
    type of ``VISION_EXACT`` from 5.24 on (from the version that added it: ``ADDED_IN``), a few
    (``VISION_OLDER``) on an older range too."""
    if model_type not in VISION_EXACT:
        return False
    if _version(installed) >= _version(verified_from(model_type) or VERIFIED_FROM):
        return True
    lowest, below = VISION_OLDER.get(model_type, (VERIFIED_FROM, VERIFIED_FROM))
    return _version(lowest) <= _version(installed) < _version(below)


def _vision_refusal(model: nn.Module, model_type: str, installed: str) -> str | None:
    """The multimodal types (:mod:`treetrain.models.support_vision`): verified on transformers 5.24,
    whose vision-language forwards take precomputed encoder outputs (``mm_encoder_outputs``), and a
    few Qwen types on 5.10.x too (``VISION_OLDER``: the features through the forward's own call)."""
    if vision_verified(model_type, installed):
        return None
    why = VISION_REFUSED.get(model_type)
    if why is None:
        older = VISION_OLDER.get(model_type)
        also = f" or >= {older[0]}, < {older[1]}" if older else ""
        why = (
            "its vision-language forward is verified exact only with transformers >= "
            f"{verified_from(model_type) or VERIFIED_FROM}"
            f"{also} (installed: {installed}): upgrade transformers"
        )
    return f"model type {model_type!r} ({type(model).__name__}) is not supported: {why}; {_DOCS}"


def check_model(model: nn.Module) -> None:
    """Raise ``ValueError`` unless treetrain runs ``model`` exactly (see the module docstring)."""
    why = refusal(model)
    if why is not None:
        raise ValueError(why)
