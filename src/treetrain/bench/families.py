"""One small hybrid model per recurrent family, built from its transformers config (no download), and
its FLOP cost model: the models ``benchmarks/hybrids.py`` times, tree against the per-path baseline.

Each model mixes the family's layer with attention the way the released checkpoints do, at a small
width (``hidden`` 256 by default: 4 attention heads of 64, MLP 3x, vocab 8192, untied head):

==========  ==================  =================================================================
family      model type          layers
==========  ==================  =================================================================
gdn         qwen3_5_text        3 Gated DeltaNet (2 key / 4 value heads of 64, conv 4) + 1 attention
kda         kimi_linear         3 KDA (4 heads of 64, conv 4) + 1 MLA attention, dense MLPs
shortconv   lfm2                4 short convolutions (width 3) + 2 attention
mamba2      nemotron_h          3 Mamba2 (8 heads of 64, state 64, chunk 64) + 1 attention + 2 MLP
mamba       jamba               3 Mamba (inner 512, state 16, conv 4) + 1 attention, dense MLPs
lightning   minimax             3 lightning attention (blocks of 256) + 1 attention, one expert
rglru       recurrent_gemma     4 RG-LRU blocks (width 256, conv 4) + 2 local attention (window 2048)
rwkv        rwkv                4 RWKV-4 blocks (no attention)
mlstm       xlstm               4 mLSTM blocks, 4 heads (no attention)
alibi       bloom               4 attention layers with ALiBi (no recurrence)
==========  ==================  =================================================================

:func:`family_cost` counts the linear layers from the model's own weights (twice the matmul
parameters per token) and the attention pairs and recurrent state updates from its config
(:func:`treetrain.trees.flops.mixer_cost`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from treetrain.trees.flops import CostModel, mixer_cost

__all__ = ["FAMILIES", "family_config", "family_cost", "family_model", "linear_flops"]

_TOKENS = dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _common(h: int, vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=h, intermediate_size=3 * h, **_TOKENS)


def _gdn(t, h, vocab):
    d = h // 4
    return t.Qwen3_5TextConfig(
        **_common(h, vocab), layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=d, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=d, linear_value_head_dim=d, linear_conv_kernel_dim=4,
    )  # fmt: skip


def _kda(t, h, vocab):
    d = h // 4
    return t.KimiLinearConfig(
        **_common(h, vocab), num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] * 4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=d,
        q_lora_rank=None, qk_rope_head_dim=d // 4, qk_nope_head_dim=d - d // 4, v_head_dim=d,
        linear_num_heads=4, linear_head_dim=d, linear_conv_kernel_dim=4,
    )  # fmt: skip


def _shortconv(t, h, vocab):
    types = ["conv", "conv", "full_attention"] * 2
    return t.Lfm2Config(
        **_common(h, vocab), block_auto_adjust_ff_dim=False, num_hidden_layers=6, layer_types=types,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
    )  # fmt: skip


def _mamba2(t, h, vocab):
    return t.NemotronHConfig(
        **{**_common(h, vocab), "intermediate_size": 4 * h}, hybrid_override_pattern="M-M*M-",
        num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, mamba_num_heads=8,
        mamba_head_dim=h // 4, ssm_state_size=64, n_groups=1, chunk_size=64, conv_kernel=4,
    )  # fmt: skip


def _mamba(t, h, vocab):
    return t.JambaConfig(
        **_common(h, vocab), num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, num_experts=1,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_dt_rank=max(1, h // 16),
    )  # fmt: skip


def _lightning(t, h, vocab):
    return t.MiniMaxConfig(
        **_common(h, vocab), num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_local_experts=1, num_experts_per_tok=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=h // 4, block_size=256,
    )  # fmt: skip


def _rglru(t, h, vocab):
    return t.RecurrentGemmaConfig(
        **_common(h, vocab), num_hidden_layers=6, lru_width=h, num_attention_heads=4, num_key_value_heads=1,
        head_dim=h // 4, conv1d_width=4, attention_window_size=2048,
    )  # fmt: skip


def _rwkv(t, h, vocab):
    return t.RwkvConfig(
        vocab_size=vocab, hidden_size=h, attention_hidden_size=h, intermediate_size=4 * h,
        num_hidden_layers=4, **_TOKENS,
    )  # fmt: skip


def _mlstm(t, h, vocab):
    return t.xLSTMConfig(
        vocab_size=vocab, hidden_size=h, embedding_dim=h, num_blocks=4, num_hidden_layers=4, num_heads=4,
        chunk_size=64, **_TOKENS,
    )  # fmt: skip


def _alibi(t, h, vocab):
    return t.BloomConfig(vocab_size=vocab, hidden_size=h, n_layer=4, n_head=4, **_TOKENS)


# family -> (model type, config builder (transformers, hidden, vocab) -> config)
FAMILIES: dict[str, tuple[str, Callable]] = {
    "gdn": ("qwen3_5_text", _gdn),
    "kda": ("kimi_linear", _kda),
    "shortconv": ("lfm2", _shortconv),
    "mamba2": ("nemotron_h", _mamba2),
    "mamba": ("jamba", _mamba),
    "lightning": ("minimax", _lightning),
    "rglru": ("recurrent_gemma", _rglru),
    "rwkv": ("rwkv", _rwkv),
    "mlstm": ("xlstm", _mlstm),
    "alibi": ("bloom", _alibi),
}
_NO_SDPA = ("rwkv", "mlstm", "alibi")  # their HF classes refuse SDPA (the tree forward brings its own)


def family_config(family: str, hidden: int = 256, vocab: int = 8192):
    """The config of ``family``'s model (:data:`FAMILIES`); ``hidden`` a multiple of 16."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: choose from {', '.join(FAMILIES)}")
    if hidden % 16:
        raise ValueError(f"hidden {hidden}: must be a multiple of 16 (4 heads, head dims split in 4)")
    cfg = FAMILIES[family][1](transformers, hidden, vocab)
    cfg._attn_implementation = "eager" if family in _NO_SDPA else "sdpa"
    return cfg


def family_model(
    family: str, hidden: int = 256, vocab: int = 8192, device="cpu", dtype=torch.float32, seed: int = 0
) -> nn.Module:
    """A random-init ``...ForCausalLM`` of ``family`` (the same weights for the same arguments)."""
    import transformers

    torch.manual_seed(seed)
    cfg = family_config(family, hidden, vocab)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)


def linear_flops(model: nn.Module, within: nn.Module | None = None) -> float:
    """Forward FLOPs per token of the decoder's weight matmuls: twice every ``nn.Linear`` weight and
    every other parameter used as a matrix (its last two dims > 1: RG-LRU's block-diagonal gates,
    MoE expert stacks, scaled by ``experts_per_token / experts``), without the embeddings, the LM head
    and the convolutions (counted with the recurrences, :func:`treetrain.trees.flops.mixer_cost`).
    ``within``: only that submodule's weights (one decoder layer, one mixer).

    Example: one ``nn.Linear(8, 16)`` and one ``nn.Linear(16, 8)`` between embedding and head: 512.
    """
    cfg = getattr(model.config, "text_config", None) or model.config
    first = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), 1)  # noqa: E731
    experts = first("num_local_experts", "num_experts")
    active = first("num_experts_per_tok", "num_experts_per_token")
    outside = [model.get_input_embeddings(), model.get_output_embeddings()]
    outside += [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    skip = {id(p) for m in outside for p in m.parameters()}
    total = 0.0
    for name, p in (within or model).named_parameters():
        if id(p) in skip or p.ndim < 2 or min(p.shape[-2:]) < 2:
            continue
        share = min(1.0, active / experts) if "experts" in name and experts > 1 else 1.0
        total += 2.0 * p.numel() * share
    return total


def family_cost(model: nn.Module) -> CostModel:
    """The :class:`~treetrain.trees.flops.CostModel` of a model: linear FLOPs from its weights
    (:func:`linear_flops`), attention pairs and recurrent state updates from its config, the head
    ``2 * hidden * vocab``."""
    recurrent, per_pair = mixer_cost(model.config)
    head = 2.0 * model.get_output_embeddings().weight.numel()
    return CostModel(linear=linear_flops(model), per_pair=per_pair, head=head, recurrent=recurrent)
