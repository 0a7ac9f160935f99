"""A tiny offline GRPO setup for TRL tests: a character-level tokenizer, a random-init Qwen3 saved
to a folder (TRL loads the policy and the reference from a path), a toy dataset, a toy reward and a
deterministic rollout through TRL's ``rollout_func`` hook (both trainers see the same completions)."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .reference import tiny_model

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?."
PROMPTS = ["what is 1+2?", "spell cat.", "count to 3", "abc"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ``<pad>`` = 0, ``<eos>`` = 1."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def save_tiny_policy(path: Path, dtype=torch.float32, seed: int = 0) -> str:
    """A 2-layer Qwen3 over the char vocabulary, with its tokenizer, saved under ``path``."""
    tok = char_tokenizer()
    model = tiny_model("qwen3", dtype=dtype, seed=seed, vocab=len(tok))
    with torch.no_grad():  # tiny_model's 3x-wide init: halve it, so float32 stays well-conditioned
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(0.5)
    model.config.eos_token_id, model.config.pad_token_id = 1, 0
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def dataset(n: int = 4) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def reward_len_and_a(completions, **kwargs) -> list[float]:
    """Toy reward: letters 'a' count double, long answers lose a little."""
    return [2.0 * c.count("a") - 0.1 * len(c) for c in completions]


def fixed_rollout(max_len: int, env_mask: bool = False):
    """``rollout_func`` giving each repeated prompt its own completion: lengths 1..max_len, some ending in
    ``<eos>`` (id 1), some truncated at ``max_len`` (no eos), one that is only ``<eos>`` (an empty answer).
    Every other completion starts with the same two tokens as the one before it (a shared first turn:
    the tree branches inside the completions too); with ``env_mask`` those two tokens are marked as
    environment output (TRL's ``env_mask``: in the context, out of the loss). Depends on the step, so
    every generation differs, identically for both trainers."""

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        step = trainer.state.global_step
        prompt_ids, completion_ids, masks = [], [], []
        for i, p in enumerate(prompts):
            ids = tok(p, add_special_tokens=False)["input_ids"]
            g = torch.Generator().manual_seed(1000 * step + 17 * i + len(p))
            n = (i * 3 + step) % (max_len + 1)  # 0 .. max_len content tokens
            body = torch.randint(3, len(tok), (n,), generator=g).tolist()
            shared = i % 2 == 1 and n >= 2 and len(completion_ids[-1]) >= 2
            if shared:
                body[:2] = completion_ids[-1][:2]
            comp = (body if n == max_len else body + [1])[:max_len]  # n == max_len: truncated, no eos
            prompt_ids.append(ids)
            completion_ids.append(comp)
            masks.append([0, 0] + [1] * (len(comp) - 2) if shared else [1] * len(comp))
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if env_mask:
            out["env_mask"] = masks
        return out

    return rollout


def save_tiny_nemotron_h(path: Path, seed: int = 0) -> str:
    """A 3-layer Nemotron-H (Mamba2 mixer, attention, MLP) over the char vocabulary, saved under
    ``path``: chunks of 4 (shorter than a prompt), 2 B/C groups, slow decays (the state matters)."""
    import transformers

    tok = char_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        vocab_size=len(tok), hidden_size=32, layers_block_type=["linear_attention", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=4, conv_kernel=4, eos_token_id=1,
        pad_token_id=0, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_((torch.rand(p.shape, generator=g) * 0.45 + 0.05).log())
            elif name.endswith("dt_bias"):
                p.copy_(-torch.rand(p.shape, generator=g))
            elif p.ndim >= 2:
                p.mul_(1.5)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
