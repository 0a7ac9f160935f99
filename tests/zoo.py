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
from types import SimpleNamespace

import torch
import transformers
from torch import nn
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
    # the decoders of encoder-decoder models (refused; built small all the same)
    encoder_layers=2,
    decoder_layers=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    index_head_dim=16,  # sparse attention's indexers: MiniMax-M3's one head per key/value head (DSA's
    index_n_heads=2,  # types get 16: _DSA_HEADS)
)
_GDN_SMALL = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=3,
)  # fmt: skip
# Gemma 4: full-attention layers with heads of their own width and count (global_head_dim,
# num_global_key_value_heads) and keys as values (attention_k_eq_v); the last two layers reuse the
# first two's keys and values (num_kv_shared_layers), with double-wide MLPs
_GEMMA4 = dict(
    layer_types=["sliding_attention", "full_attention"] * 2,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
)
_DSA_HEADS = dict(index_n_heads=16)
# per type: what its defaults lack for a hybrid to show its layer mix
PER_TYPE = {
    # its NoPE layers are its sliding ones: one layer of two
    "smollm3": dict(no_rope_layers=None, no_rope_layer_interval=2),
    # a user-set window OLMoE passes to the attention call but never puts in its (causal) mask:
    # HF's eager and SDPA attention ignore it, so the tree must too
    "olmoe": dict(sliding_window=3),
    # short convolutions: width 4 (default 3; LFM3 7) with a bias (default none)
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=4, conv_bias=True),
    # and a dense then a sparse (MoE) layer: its default num_dense_layers=2 would cover both
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention"], conv_L_cache=4, conv_bias=True, num_dense_layers=1
    ),
    "lfm3": dict(conv_L_cache=4, conv_bias=True),
    # Gated DeltaNet hybrids: grouped value heads (2 key, 4 value heads of 8), conv width 3 (default 4)
    "lara_mini": dict(_GDN_SMALL),
    "olmo_hybrid": dict(_GDN_SMALL, linear_a_log_min=0.05, linear_a_log_max=0.5),  # slow decays
    # Gemma 3n: sliding and full layers, the last two reusing the first two's keys and values; top-k
    # activation sparsity on the first two; small per-layer inputs and LAuReL rank
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        laurel_rank=8,
    ),
    # DSA: 16 index heads, so that a key's index score is exactly 0 (every head's ReLU at 0: a tie
    # at the top-k boundary, where torch.topk's pick is implementation-defined) stays rare
    "deepseek_v32": dict(_DSA_HEADS),
    "axk2": dict(_DSA_HEADS),
    # dots.llm3: a DSA (latent attention) and a sliding latent-attention layer with widths of its own
    # (swa_*: rotary on the head_dim - qk_nope_head_dim = 8 channels of 16)
    "dots3_note_text": dict(
        _DSA_HEADS,
        layer_types=["indexed_attention", "sliding_attention"],
        swa_num_attention_heads=8,
        swa_num_key_value_heads=8,
        swa_q_lora_rank=16,
        swa_kv_lora_rank=16,
        swa_head_dim=16,
        swa_qk_nope_head_dim=8,
        swa_v_head_dim=16,
    ),
    # Dory: an input, a recurrent (run twice) and an output section of one layer each, sliding and full
    "dory": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
    ),
    # refused (CCA: q/k convolutions and a delayed value along the packed sequence); one expert per
    # token, the only routing ZAYA supports
    "zaya": dict(num_experts_per_tok=1),
    # refused types' own widths beyond the shared names (encoders, decoders of encoder-decoders)
    "marian": dict(decoder_vocab_size=VOCAB),
    "roc_bert": dict(shape_vocab_size=VOCAB, pronunciation_vocab_size=VOCAB),
    "cpmant": dict(prompt_types=2, prompt_length=4, dim_ff=64, dim_head=16),
    "xlnet": dict(d_head=16),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_embds_dim=[32, 32]),
    # refused (its own attention): a global and a local layer, a window shorter than the paths
    "gpt_neo": dict(
        attention_types=[[["global", "local"], 1]], attention_layers=["global", "local"], window_size=3
    ),
    # its defaults cannot build a model (no rope parameters for their full-attention layers): RoPE
    # (3-axis mrope sections, all at the text position) on sliding layers, NoPE on full ones
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]),
            "full_attention": None,
        },
    ),
    # its attention reads attn_config.rope_theta, which the sub-config no longer defines (a
    # checkpoint's config still carries it); clip_qkv that binds; a small MoE of its own
    "dbrx": dict(
        d_model=64,  # by name: its experts' width is copied from it before the alias hidden_size is set
        attn_config=dict(kv_n_heads=2, clip_qkv=4.0, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    # rotary on part of each head (its default 64 is wider than the zoo's heads of 16)
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    # 2 layers (of two attention and MLP sublayers each); its own widths: dense and expert MLPs, qk
    # head (given, not derived); top-k over 4 real and 2 zero (identity) experts
    "longcat_flash": dict(
        num_layers=2,
        qk_head_dim=16,
        ffn_hidden_size=64,
        expert_ffn_hidden_size=32,
        moe_topk=2,
        zero_expert_num=2,
    ),
    # its H and L stacks of 2 layers each (the default's 16 per stack given, not derived), 2 L cycles
    # per H cycle, the first without gradient (L_bp_cycles)
    "hrm_text": dict(num_layers_per_stack=None, L_cycles=2, L_bp_cycles=[1]),
    # a dense and a sparse-attention (indexer) layer, a dense and an MoE MLP, small dense widths
    "minimax_m3_vl_text": dict(
        layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"],
        dense_intermediate_size=64,
        shared_intermediate_size=32,
    ),
    # a sliding layer beside the full one (the defaults have full layers only), Laguna's heads per
    # layer differing and its router's logit cap on
    "laguna": dict(
        layer_types=["full_attention", "sliding_attention"],
        num_attention_heads_per_layer=[4, 8],
        moe_router_logit_softcapping=2.0,
    ),
    "mellum": dict(layer_types=["full_attention", "sliding_attention"]),
    # a sparse mixer that keeps more than the top expert: its default mask (scores within a relative
    # 2 * 0.01 of the top) keeps only it, whose weight is then 1, so the router got no gradient
    "phimoe": dict(router_jitter_noise=0.5),
    # a dense and an MoE layer: their defaults make the first 3 (Beam) or 2 (Flint) layers dense
    "beam": dict(mlp_layer_types=["dense", "sparse"]),
    "flint": dict(mlp_only_layers=[0]),
    "gemma4_unified_text": _GEMMA4,
    # and Gemma 4's per-layer token embeddings (a second, narrow embedding per layer) and MoE blocks
    "gemma4_text": dict(
        _GEMMA4,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        enable_moe_block=True,
        top_k_experts=2,
    ),
    # DSA with a layer that reuses the previous layer's key selection
    "glm_moe_dsa": dict(_DSA_HEADS, indexer_types=["full", "shared"]),
    "hy_v4": dict(_DSA_HEADS, indexer_types=["full", "shared"]),
    # refused (QSA attention), built for tests/test_linear_families.py's check of its GDN layer
    "qwen4_exp_text": dict(
        _GDN_SMALL,
        layer_types=["linear_attention", "indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=4,
        indexer_compress_ratio=2,
        hc_count=2,
        hc_lowrank=8,
        eos_token_id=2,
        output_gate_type="sigmoid",
    ),
    # KDA hybrids: a dense and an MoE layer, 4 heads of 8, conv width 3 (default 4), grouped routing
    "kimi_linear": dict(
        mlp_layer_types=["dense", "sparse"],
        num_experts_per_token=2,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=3,
    ),
    # Ergo: its dense and shared-expert widths small, the full (NoPE) layers' query/key scale on
    "ergo": dict(first_dense_intermediate_size=64, shared_intermediate_size=32, global_attention_scale=1.7),
    # projection biases on (default off); Param2's full-width rotary halved (GLM-4-MoE's default)
    "minicpm5_moe": dict(attention_bias=True),
    "param2moe": dict(
        attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0, partial_rotary_factor=0.5),
    ),
    # refused (indexed attention read from a dense mask): a sliding and an indexed layer, small
    "kolibri1_1": dict(
        layer_types=["sliding_attention", "indexed_attention"],
        index_layers=[1],
        kv_source_layers=[0, 1],
        mlp_only_layers=[0],
        mlp_only_intermediate_size=64,
        index_num_heads=2,
    ),
    # Bailing: SwiGLU clips at 0.5 on the MoE layer's experts and shared expert (they bind on the zoo
    # paths), one limit per layer (the default lists have 42: transformers 5.25 refuses another length)
    "bailing_hybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        swiglu_limits=[0, 0.5],
        swiglu_limits_shared=[0, 0.5],
        num_experts_per_token=2,
        num_expert_group=2,
        kda_lower_bound=-3.0,
        short_conv_kernel_size=3,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=3,
    ),
}
# Mamba and Mamba2 mixers: small state and dt rank; every option away from its default: chunks
# shorter than the paths (the scan crosses chunk and node boundaries), conv width 3, several B/C
# groups, biases flipped, time-step clamps that bind, Falcon-H1's gated norm (norm after the gate)
_SSM = dict(time_step_limit=(0.3, 0.9))  # dt = softplus(...) clamped both ways on some tokens
_MAMBA1 = dict(time_step_rank=8, state_size=8, conv_kernel=3, use_bias=True, use_conv_bias=False)
_BAMBA = dict(
    _SSM,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_chunk_size=4,
    mamba_d_conv=3,
    mamba_proj_bias=True,
    mamba_conv_bias=False,
)
PER_TYPE |= {
    "mamba": dict(_MAMBA1, residual_in_fp32=False),
    "falcon_mamba": dict(_MAMBA1, residual_in_fp32=False, mixer_rms_eps=1e-3),
    "jamba": dict(
        mamba_dt_rank=8,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
    ),
    "zamba": dict(
        mamba_dt_rank=8,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
        n_mamba_heads=4,
        attention_hidden_size=128,
    ),
    "mamba2": dict(
        time_step_limit=(0.05, 1.5),
        state_size=16,
        n_groups=2,
        chunk_size=4,
        conv_kernel=3,
        use_bias=True,
        use_conv_bias=False,
        residual_in_fp32=False,
        time_step_rank=8,
    ),
    "bamba": dict(_BAMBA, attn_layer_indices=[1]),
    "falcon_h1": dict(_BAMBA, mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=True),
    "granitemoehybrid": dict(
        _BAMBA, layer_types=["linear_attention", "full_attention"], shared_intermediate_size=32
    ),
    "nemotron_h": dict(
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=4,
        conv_kernel=3,
        use_bias=True,
        use_conv_bias=False,
        time_step_min=0.3,
        residual_in_fp32=True,
        moe_shared_expert_intermediate_size=32,
    ),
    "zamba2": dict(
        n_mamba_heads=8,
        mamba_headdim=16,
        mamba_d_state=16,
        mamba_ngroups=2,
        chunk_size=4,
        mamba_d_conv=3,
        add_bias_linear=True,
        time_step_min=0.3,
        attention_hidden_size=128,
        kv_channels=16,
        num_query_groups=4,
        adapter_rank=8,
        hybrid_layer_ids=[1],
        use_shared_attention_adapter=True,
        use_mem_rope=True,
        head_dim=32,
        num_key_value_heads=4,  # adapters: heads * head_dim = 2 * hidden
    ),
    # ALiBi: 12 heads (not a power of 2: the extra slopes are odd powers of 2^-1/2, rounded to float32
    # / bfloat16 by the models), every other option away from its default
    "bloom": dict(
        num_attention_heads=12,
        hidden_size=96,
        pretraining_tp=2,
        slow_but_exact=True,
        apply_residual_connection_post_layernorm=True,
    ),  # fmt: skip
    "mpt": dict(
        num_attention_heads=12,
        hidden_size=96,
        attn_config=dict(alibi_bias_max=4, softmax_scale=0.3, clip_qkv=4.0),  # bias_max: unused by HF
    ),  # fmt: skip
    "falcon": dict(
        alibi=True,
        num_attention_heads=12,
        hidden_size=96,
        new_decoder_architecture=True,
        num_kv_heads=4,
        ffn_hidden_size=128,  # not intermediate_size: Falcon-7B's 18176 otherwise
    ),  # fmt: skip
    # RG-LRU: a conv width of 3 (default 4), the attention block too, a logit cap that matters
    "recurrent_gemma": dict(num_hidden_layers=3, lru_width=64, conv1d_width=3, logits_soft_cap=5.0),
    # RWKV: attention and FFN widths of their own, layers rescaled every block in eval mode
    "rwkv": dict(attention_hidden_size=48, intermediate_size=96, rescale_every=1),
    # xLSTM: gate and logit caps that matter, chunks of 4 then the step kernel (weight_mode="fused"
    # cannot be built: transformers' own init fails on it)
    "xlstm": dict(
        embedding_dim=64, num_blocks=2, gate_soft_cap=4.0, output_logit_soft_cap=6.0, chunk_size=4, eps=1e-4
    ),
    # lightning attention in blocks shorter than the paths, first (a layer's decay shrinks with depth);
    # the residual factors away from 1
    "minimax": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        block_size=3,
        linear_attn_alpha_factor=0.7,
        linear_attn_beta_factor=1.3,
        full_attn_alpha_factor=0.9,
        full_attn_beta_factor=1.1,
        mlp_alpha_factor=0.8,
        mlp_beta_factor=1.2,
    ),  # fmt: skip
}
# Inkling: a relative bias reaching 4 tokens back (shorter than the paths: farther keys get none),
# log scaling from position 2 (default off / 128000), conv width 3 (default 4), sliding layers with
# heads of their own (one key head), L2 clips and MLP softcaps that bind, block residuals every 2
# layers (Inkling2) and a loop over layers 1-2 run twice, head transforms away from 1
_INKLING = dict(
    d_rel=4, rel_extent=4, log_scaling_n_floor=2, log_scaling_alpha=0.5, conv_kernel_size=3,
    swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=8, route_scale=2.0,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
)  # fmt: skip
_INKLING2 = dict(
    _INKLING, unpadded_vocab_size=VOCAB, qk_l2_clip_threshold=3.0, rel_l2_clip_threshold=1.0,
    mlp_gate_softcap=1.0, mlp_up_softcap=2.0, n_layers_per_attn_res_block=2,
)  # fmt: skip
PER_TYPE |= {
    "inkling_text": dict(
        _INKLING,
        vocab_size=VOCAB + 16,
        unpadded_vocab_size=VOCAB,
        logits_mup_width_multiplier=0.5,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    ),  # fmt: skip
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": dict(
        _INKLING2,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=2,
        loop_gate_rank=8,
    ),  # fmt: skip
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
    # sparse attention keeps 4 keys of the zoo paths' 6-9 (DSA's top-k; MiniMax-M3's own block of 2
    # and its best other block of 2), so the selection drops keys for most queries
    index_topk=4,
    index_block_size=2,
    index_topk_blocks=2,
)


# per-layer lists a config derives from its layer count when not given (MoE layer kinds from
# first_k_dense_replace, heads per layer, indexer kinds)
PER_LAYER = ("mlp_layer_types", "num_attention_heads_per_layer", "indexer_types")


def causal_lm_types() -> dict[str, str]:
    """Every model type of transformers' causal-LM auto mapping -> its class name."""
    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _has(cfg, name: str) -> bool:
    """``hasattr``, true for an attribute a heterogeneous config sets per layer (reading it raises)."""
    try:
        return hasattr(cfg, name)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError: a per-layer value, settable globally
        return True


def _global(cfg, name: str) -> bool:
    """Whether ``name`` has one value for every layer (a heterogeneous config sets some per layer)."""
    try:
        getattr(cfg, name, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        return False
    return True


def zoo_config(model_type: str, revert: str | None = None):
    """The tiny config of ``model_type`` (may raise: not every type builds from its defaults).

    ``revert``: one option the zoo sets (a key of :func:`zoo_options`, or ``"rope"`` for the
    length-dependent rotary table) put back to the type's default, all else as the zoo has it: the
    config of an ablation that shows whether the option acts.
    """
    cfg = CONFIG_MAPPING[model_type]()
    amap = getattr(cfg, "attribute_map", {})
    prop = lambda k: isinstance(getattr(type(cfg), amap.get(k, k), None), property)  # noqa: E731
    settable = lambda k: _has(cfg, k) and not prop(k)  # noqa: E731
    over = {k: v for k, v in {**SMALL, **AWAY}.items() if settable(k)}
    if "kv_lora_rank" in over:  # multi-head latent attention: one key/value head per query head, and
        over["num_key_value_heads"] = over["num_attention_heads"]  # the rotary table as wide as its
        over["head_dim"] = over["qk_rope_head_dim"]  # rotary part (DeepSeek-V3 keeps a head_dim given)
    over.update(PER_TYPE.get(model_type, {}))
    # a heterogeneous config's per-layer overrides are the default's layers': PER_TYPE sets its own
    base = {k: v for k, v in cfg.to_dict().items() if not prop(k) and k != "per_layer_config"}
    if revert is not None and revert != "rope":
        assert revert in over, (model_type, revert)
        default = None if revert in PER_LAYER else base.get(revert, getattr(cfg, revert, None))
        over[revert] = copy.deepcopy(default)  # a per-layer list: derived again for the small depth
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and settable("layer_types") and "layer_types" not in over:
        kinds = list(dict.fromkeys(layer_types + _derived_layer_types(type(cfg), base, over)))
        over["layer_types"] = (kinds + kinds)[: max(2, len(kinds))]
    if "layer_types" in over:
        over["num_hidden_layers"] = len(over["layer_types"])
    for k in PER_LAYER:  # the default's per-layer lists: derived again for the small layer count
        if settable(k) and k not in over and getattr(cfg, k, None) is not None:
            over[k] = None
    small = type(cfg)(**{**base, **over})
    if revert != "rope":
        length_dependent_rope(small, rope_kind(model_type), ROPE_EXTRA.get(model_type, {}))
    return small


def zoo_options(model_type: str) -> list[str]:
    """The options the zoo sets away from ``model_type``'s defaults (the scalings and attention extras
    of ``AWAY``, the type's own ``PER_TYPE`` entries) that the config has, each a candidate for
    :func:`zoo_config`'s ``revert``."""
    cfg = CONFIG_MAPPING[model_type]()
    amap = getattr(cfg, "attribute_map", {})
    prop = lambda k: isinstance(getattr(type(cfg), amap.get(k, k), None), property)  # noqa: E731
    away = [k for k in AWAY if _has(cfg, k) and not prop(k)]
    return list(dict.fromkeys(away + list(PER_TYPE.get(model_type, {}))))


# the zoo paths have 6, 6, 8 and 9 tokens: a threshold of 7 puts them on both sides
ROPE_THRESHOLD = 7
_KEEP = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta")
# what a type's rotary code reads besides the rope type's own parameters
ROPE_EXTRA = {
    "phimoe": dict(short_mscale=1.1, long_mscale=1.3, original_max_position_embeddings=ROPE_THRESHOLD),
}


# types whose HF rotary code cannot run a length-dependent table at all: RecurrentGemma's rotary
# raises for any rope type but the default; LFM3's partial rotary (its factor only in the full
# attention layers' rope parameters) gets a full-width dynamic or longrope table from HF (a shape
# error in HF's own forward, transformers 5.24); transformers 5.10's Gemma 3 longrope raises in HF's
# own code (an unbound local)
ROPE_KIND = {"recurrent_gemma": None, "lfm3": None, "gemma3_text": "dynamic"}


# rope types a layer's code relies on that depend on positions only: Gemma 4's full-attention layers
# rotate part of a head with a table as wide as the head ("proportional"), which no length-dependent
# type gives (their other layers switch)
POSITION_ONLY_ROPE = ("proportional",)


def rope_kind(model_type: str) -> str | None:
    """``dynamic`` or ``longrope``, half the types each (a hash of the name: stable across versions);
    None where the type's rotary code cannot run either (``ROPE_KIND``)."""
    if model_type in ROPE_KIND:
        return ROPE_KIND[model_type]
    return "longrope" if zlib.crc32(model_type.encode()) % 2 else "dynamic"


def _head_dim(cfg, layer_type: str | None) -> int:
    """The head width of ``layer_type``'s layers (a heterogeneous config's first such layer's)."""
    if not (_global(cfg, "head_dim") and _global(cfg, "num_attention_heads")):
        cfg = cfg.per_layer_config[cfg.layer_types.index(layer_type)]
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def length_dependent_rope(cfg, kind: str | None, extra: dict | None = None) -> None:
    """Switch every rope parameter set of ``cfg`` (per layer type where it has several) to a table
    that depends on the forward's length, with the threshold between the zoo paths' lengths:
    dynamic NTK (factor 2, from ``max_position_embeddings = 7``) or longrope (short and long factors,
    from ``original_max_position_embeddings = 7``; ``max_position_embeddings`` 512, so its attention
    scaling is on too). Configs without rope parameters (learned positions) stay as they are."""
    params = getattr(cfg, "rope_parameters", None)
    if kind is None or not isinstance(params, dict) or not params:
        return
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}  # per layer type (Gemma 3)
    new = {}
    for key, p in per_type.items() if per_type else [(None, params)]:
        if p.get("rope_type") in POSITION_ONLY_ROPE:  # kept: the layer's head needs its table
            new[key] = p
            continue
        q = {k: v for k, v in p.items() if k in _KEEP}
        if isinstance(getattr(cfg, "partial_rotary_factor", None), float):  # older versions copy it in
            q["partial_rotary_factor"] = cfg.partial_rotary_factor
        if kind == "dynamic":
            q.update(rope_type="dynamic", factor=2.0)
        else:
            half = int(_head_dim(cfg, key) * q.get("partial_rotary_factor", 1.0)) // 2
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


def zoo_model(
    model_type: str, dtype=torch.float64, seed: int = 0, attn: str = "eager", revert: str | None = None
):
    """A tiny random-init ``...ForCausalLM`` of ``model_type``, its init widened so log-probs are far
    from uniform; built in float32, then cast (HF's init draws differ per dtype). ``revert``: as
    :func:`zoo_config`'s."""
    torch.manual_seed(seed)
    cfg = zoo_config(model_type, revert)
    cfg._attn_implementation = attn  # HF's literal definition of every attention extra
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    cls = getattr(transformers, causal_lm_types()[model_type])
    model = cls._from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # recurrences: slow decays, a node's state reaches its children
                p.copy_((torch.rand(p.shape, generator=g) * 0.45 + 0.05).log())
            elif name.endswith(("dt_bias", "dt_proj.bias", "dt_proj_bias")):  # and small steps
                p.copy_(-torch.rand(p.shape, generator=g))
            elif name.endswith(("static_weight", ".query")) and not p.any():  # Inkling2's zero inits:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)  # dynamic conv taps, depth-attention queries
            elif name.endswith("lm_head.logit_scale"):  # Dory's per-token logit scale: 1 at init
                p.mul_(torch.rand(p.shape, generator=g) * 1.5 + 0.5)
            elif not p.any():  # a zero init silences its branch (xLSTM's gate and FFN projections,
                # Gemma 3n's AltUp output scales: constant gates, zero gradients): random, to act
                p.copy_(torch.randn(p.shape, generator=g) * (0.06 if p.ndim >= 2 else 0.3))
            elif p.ndim >= 2:
                p.mul_(3.0)
            elif name.endswith("sinks"):  # GPT-OSS: sinks comparable to the scores, so they matter
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    model = model.to(dtype).eval()
    if dtype == torch.float64:
        float64_buffers(model)
    return model


def float64_buffers(model) -> None:
    """Recompute in float64 the buffers HF derives at init in the default dtype (float32), so a
    float64 comparison measures the algorithm: MiniMax's lightning-attention slopes and decays."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for m in model.modules():
            if type(m).__name__ == "MiniMaxLightningAttention":
                slope = m.get_slope_rate(m.slope_rate.device)
                q, k, diagonal = m.decay_factors(slope)
                bufs = (m.slope_rate, m.query_decay, m.key_decay, m.diagonal_decay)
                for buf, value in zip(bufs, (slope, q, k, diagonal)):
                    buf.copy_(value)
    finally:
        torch.set_default_dtype(default)


def zoo_paths(vocab: int = VOCAB, seed: int = 1) -> list[list[int]]:
    """Four paths sharing a 5-token prefix (one branching inside it), lengths 6-9, tokens >= 3."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: (torch.randint(3, vocab, (n,), generator=g)).tolist()  # noqa: E731
    base = draw(5)
    return [base + draw(3), base + draw(4), base + draw(2)[:1], base[:3] + draw(3)]


def reference_copy(model):
    return copy.deepcopy(model)


def bare_model(model_type: str) -> nn.Module:
    """A module that only carries ``model_type``'s default config (all the support checks read)."""
    m = nn.Module()
    try:
        m.config = CONFIG_MAPPING[model_type]()
    except Exception:  # a few defaults fail their own validation: the type is all the check reads
        m.config = SimpleNamespace(model_type=model_type)
    return m
