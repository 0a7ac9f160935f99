"""Tiny random-init models of every causal-LM architecture the installed transformers can build.

:func:`zoo_config` shrinks a model type's default config (2-4 layers, hidden 64, vocab 128, small
MoE) and sets every scaling and attention extra it has away from its default, so a head transform
or an attention feature that treetrain missed changes the log-probs by far more than rounding:
Cohere's ``logit_scale``, Granite's ``logits_scaling`` and multipliers, Gemma's softcaps and
``query_pre_attn_scalar``, a sliding window shorter than the paths (switched on where the config has
a switch: Qwen2's ``use_sliding_window``), partial rotary, and a rotary table that depends on the
forward's length (dynamic NTK or longrope, half the types each) with a threshold between the zoo
paths' lengths. Each distinct layer type of ``layer_types`` is kept (twice when there is room), so
hybrids keep their layer mix.
"""

from __future__ import annotations

import copy
import zlib

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    mamba_n_heads=8,  # Mamba2 mixers: heads * head dim = 2 * hidden
    mamba_d_head=16,
    mamba_d_ssm=128,
    num_heads=8,
)
# per type: what its defaults lack for a hybrid to show its layer mix
PER_TYPE = {
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # its NoPE layers are its sliding ones: one layer of two
    "smollm3": dict(no_rope_layers=None, no_rope_layer_interval=2),
    # a user-set window OLMoE passes to the attention call but never puts in its (causal) mask:
    # HF's eager and SDPA attention ignore it, so the tree must too
    "olmoe": dict(sliding_window=3),
}
# scalings and extras away from their defaults, wherever the config has them
AWAY = dict(
    logit_scale=2.5,  # Cohere: logits * 2.5
    logits_scaling=3.0,  # Granite: logits / 3; HyperCLOVA X: logits * 3; MiniCPM3: hidden / 3
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,
    final_logit_softcapping=3.0,
    attn_logit_softcapping=5.0,
    query_pre_attn_scalar=12,
    sliding_window=3,
    use_sliding_window=True,  # Qwen2, Qwen2-MoE, Qwen3, SmolLM3: the window is off by default
    max_window_layers=1,  # Qwen2, Qwen3, Dots1: layers >= 1 slide; Qwen2-MoE: even layers < 1 slide
    partial_rotary_factor=0.5,
    scale_emb=2.0,
    dim_model_base=16,
    scale_depth=1.2,
    lm_head_multiplier=0.7,
    embedding_multiplier_scale=2.0,
    attention_in_multiplier=0.8,
    attention_out_multiplier=0.9,
    ssm_multipliers=[0.5, 0.6, 0.7, 0.8, 0.9],
    ssm_in_multiplier=0.7,
    ssm_out_multiplier=0.9,
    mlp_multipliers=[0.8, 1.3],
    key_multiplier=0.6,
)


def causal_lm_types() -> dict[str, str]:
    """Every model type of transformers' causal-LM auto mapping -> its class name."""
    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def zoo_config(model_type: str):
    """The tiny config of ``model_type`` (may raise: not every type builds from its defaults)."""
    cfg = CONFIG_MAPPING[model_type]()
    amap = getattr(cfg, "attribute_map", {})
    prop = lambda k: isinstance(getattr(type(cfg), amap.get(k, k), None), property)  # noqa: E731
    settable = lambda k: hasattr(cfg, k) and not prop(k)  # noqa: E731
    over = {k: v for k, v in {**SMALL, **AWAY}.items() if settable(k)}
    if "kv_lora_rank" in over:  # multi-head latent attention: one key/value head per query head
        over["num_key_value_heads"] = over["num_attention_heads"]
    over.update(PER_TYPE.get(model_type, {}))
    base = {k: v for k, v in cfg.to_dict().items() if not prop(k)}
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and settable("layer_types") and "layer_types" not in over:
        kinds = list(dict.fromkeys(layer_types + _derived_layer_types(type(cfg), base, over)))
        over["layer_types"] = (kinds + kinds)[: max(2, len(kinds))]
    if "layer_types" in over:
        over["num_hidden_layers"] = len(over["layer_types"])
    small = type(cfg)(**{**base, **over})
    length_dependent_rope(small, rope_kind(model_type), ROPE_EXTRA.get(model_type, {}))
    return small


# the zoo paths have 6, 6, 8 and 9 tokens: a threshold of 7 puts them on both sides
ROPE_THRESHOLD = 7
_KEEP = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta")
# what a type's rotary code reads besides the rope type's own parameters
ROPE_EXTRA = {
    "phimoe": dict(short_mscale=1.1, long_mscale=1.3, original_max_position_embeddings=ROPE_THRESHOLD),
}


def rope_kind(model_type: str) -> str:
    """``dynamic`` or ``longrope``, half the types each (a hash of the name: stable across versions)."""
    return "longrope" if zlib.crc32(model_type.encode()) % 2 else "dynamic"


def length_dependent_rope(cfg, kind: str, extra: dict | None = None) -> None:
    """Switch every rope parameter set of ``cfg`` (per layer type where it has several) to a table
    that depends on the forward's length, with the threshold between the zoo paths' lengths:
    dynamic NTK (factor 2, from ``max_position_embeddings = 7``) or longrope (short and long factors,
    from ``original_max_position_embeddings = 7``; ``max_position_embeddings`` 512, so its attention
    scaling is on too). Configs without rope parameters (learned positions) stay as they are."""
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}  # per layer type (Gemma 3)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    new = {}
    for key, p in (per_type.items() if per_type else [(None, params)]):
        q = {k: v for k, v in p.items() if k in _KEEP}
        if isinstance(getattr(cfg, "partial_rotary_factor", None), float):  # older versions copy it in
            q["partial_rotary_factor"] = cfg.partial_rotary_factor
        if kind == "dynamic":
            q.update(rope_type="dynamic", factor=2.0)
        else:
            half = int(head_dim * q.get("partial_rotary_factor", 1.0)) // 2
            q.update(
                rope_type="longrope",
                original_max_position_embeddings=ROPE_THRESHOLD,
                short_factor=[1.0 + 0.1 * i for i in range(half)],
                long_factor=[1.0 + 0.5 * i for i in range(half)],
            )
        new[key] = {**q, **(extra or {})}
    cfg.rope_parameters = {**params, **new} if per_type else new[None]
    if kind == "dynamic":
        cfg.max_position_embeddings = ROPE_THRESHOLD
    elif hasattr(cfg, "original_max_position_embeddings"):  # Phi-3 copies it into the parameters
        cfg.original_max_position_embeddings = ROPE_THRESHOLD


def _derived_layer_types(cls, base: dict, over: dict) -> list[str]:
    """The layer types the config class derives itself for the small config (windows switched on:
    Qwen2's ``use_sliding_window`` and ``max_window_layers``), so each kind it has is kept."""
    try:
        return list(cls(**{**base, **over, "layer_types": None}).layer_types or [])
    except Exception:  # a config that needs its layer types given: its defaults already hold them
        return []


def zoo_model(model_type: str, dtype=torch.float64, seed: int = 0, attn: str = "eager"):
    """A tiny random-init ``...ForCausalLM`` of ``model_type``, its init widened so log-probs are far
    from uniform; built in float32, then cast (HF's init draws differ per dtype)."""
    torch.manual_seed(seed)
    cfg = zoo_config(model_type)
    cfg._attn_implementation = attn  # HF's literal definition of every attention extra
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    cls = getattr(transformers, causal_lm_types()[model_type])
    model = cls._from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
            elif name.endswith("sinks"):  # GPT-OSS: sinks comparable to the scores, so they matter
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    return model.to(dtype).eval()


def zoo_paths(vocab: int = VOCAB, seed: int = 1) -> list[list[int]]:
    """Four paths sharing a 5-token prefix (one branching inside it), lengths 6-9, tokens >= 3."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: (torch.randint(3, vocab, (n,), generator=g)).tolist()  # noqa: E731
    base = draw(5)
    return [base + draw(3), base + draw(4), base + draw(2)[:1], base[:3] + draw(3)]


def reference_copy(model):
    return copy.deepcopy(model)
