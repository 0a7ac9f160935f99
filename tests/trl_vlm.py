"""An offline TRL image setup: tiny random vision-language policies (``tests/vlm_zoo.py``) saved to a
folder with a processor built from a PIL image processor and a character tokenizer (no torchvision,
no hub), TRL-style image datasets (PIL images in an ``image`` / ``images`` column, conversational
prompts that TRL turns into ``{"type": "image"}`` content parts), a toy reward and a deterministic
rollout that tokenizes the prompts with the processor (both trainers see the same completions).

The processors expand an image marker of the chat template into the model's placeholders exactly as
the hub processors do: Qwen2-VL ``<|vision_start|><|image_pad|>...<|vision_end|>`` (grid / merge^2
pads), Gemma 3 ``<start_of_image>`` -> ``mm_tokens_per_image`` soft tokens between begin/end tokens
(with ``token_type_ids``), LLaVA ``<image>`` -> one token per patch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from datasets import Dataset
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .vlm_zoo import vlm_model

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?.,:!'\n"
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}IMAGE{% elif c.type == 'text' %}{{ c.text }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
QUESTIONS = ["what is this?", "describe it.", "what color?", "count the dots."]


def char_tokenizer(specials: dict[str, int], named: dict[str, str]) -> PreTrainedTokenizerFast:
    """One token per character (ids 3..49), ``<pad>`` 0, ``<eos>`` 1, and the model's special tokens at
    the zoo's ids (``specials``); ``named``: the tokenizer's multimodal token attributes."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}, **specials}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        extra_special_tokens=named,
        padding_side="left", truncation_side="left",  # as TRL loads a processor: prompts left-padded
    )  # fmt: skip


class _ImageOnlyQwen2VLProcessor(transformers.Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor (which needs torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template)


def _qwen(model):
    vc = model.config.vision_config
    specials = {"<|image_pad|>": 100, "<|video_pad|>": 101, "<|vision_start|>": 102, "<|vision_end|>": 103}
    tok = char_tokenizer(specials, {})
    ip = transformers.Qwen2VLImageProcessorPil(
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size, min_pixels=8 * 8, max_pixels=32 * 32,
    )  # fmt: skip
    template = TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
    return _ImageOnlyQwen2VLProcessor(image_processor=ip, tokenizer=tok, chat_template=template)


def _gemma3(model):
    names = dict(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>")
    tok = char_tokenizer({"<image_soft_token>": 100, "<start_of_image>": 104, "<end_of_image>": 105}, names)
    S = model.config.vision_config.image_size
    ip = transformers.Gemma3ImageProcessorPil(size={"height": S, "width": S})
    return transformers.Gemma3Processor(
        image_processor=ip, tokenizer=tok, chat_template=TEMPLATE.replace("IMAGE", "<start_of_image>"),
        image_seq_length=model.config.mm_tokens_per_image,
    )  # fmt: skip


def _llava(model):
    vc = model.config.vision_config
    tok = char_tokenizer({"<image>": 100}, {"image_token": "<image>"})
    S = vc.image_size
    ip = transformers.LlavaImageProcessorPil(size={"shortest_edge": S}, crop_size={"height": S, "width": S})
    return transformers.LlavaProcessor(
        image_processor=ip, tokenizer=tok, chat_template=TEMPLATE.replace("IMAGE", "<image>"),
        patch_size=vc.patch_size, vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the default feature strategy
    )  # fmt: skip


PROCESSORS = {"qwen2_vl": _qwen, "qwen2_5_vl": _qwen, "gemma3": _gemma3, "llava": _llava}


def save_vlm_policy(model_type: str, path: Path, dtype=torch.float32, seed: int = 0):
    """A tiny ``model_type`` policy (its init halved: well-conditioned in float32; the zoo's, so Gemma 3's
    image projection is random) saved under ``path``; returns ``(path, processor)``. ``<eos>`` 1, ``<pad>``
    0."""
    model = vlm_model(model_type, dtype=dtype, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(0.5)
    text = model.config.get_text_config()
    text.eos_token_id, text.pad_token_id = 1, 0
    if model_type == "gemma3":
        # Gemma 3 checkpoints have no final logit cap, and HF's Gemma3ForConditionalGeneration ignores one
        # (only its text-only class applies it), while TRL's fused head applies the config's: with the
        # zoo's cap of 3.0 TRL itself would differ from the model by 6e-3 nats (measured)
        text.final_logit_softcapping = None
        # nor a SigLIP pooling head (Gemma 3 reads the patch states): unused weights would get no gradient
        model.config.vision_config.vision_use_head = False
        tower = model.model.vision_tower
        tower.use_head = False
        del tower.head
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    model.save_pretrained(path)
    return str(path), PROCESSORS[model_type](model)


def pil_image(seed: int, size=(16, 16)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def image_prompts(n: int = 4, multi: bool = False) -> Dataset:
    """Conversational prompts with one image each (``image`` column; sizes 16x16 and 16x24), or two
    (``images``) with ``multi``."""
    prompts = [[{"role": "user", "content": QUESTIONS[i % 4]}] for i in range(n)]
    if multi:
        images = [[pil_image(i, (16, 16 + 8 * (i % 2))), pil_image(100 + i)] for i in range(n)]
        return Dataset.from_dict({"prompt": prompts, "images": images})
    images = [pil_image(i, (16, 16 + 8 * (i % 2))) for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def image_pairs(n: int = 4, multi: bool = False) -> Dataset:
    """Conversational preference pairs with one image each (``image``), or two (``images``)."""
    chosen = ["a cat.", "red", "two dots", "it is blue"]
    rejected = ["a dog", "blue.", "three", "no idea"]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": QUESTIONS[i % 4]}] for i in range(n)],
        "chosen": [[{"role": "assistant", "content": chosen[i % 4]}] for i in range(n)],
        "rejected": [[{"role": "assistant", "content": rejected[i % 4]}] for i in range(n)],
    } | (
        {"images": [[pil_image(i, (16, 16 + 8 * (i % 2))), pil_image(100 + i)] for i in range(n)]}
        if multi
        else {"image": [pil_image(i, (16, 16 + 8 * (i % 2))) for i in range(n)]}
    ))  # fmt: skip


def reward_len(completions, **kwargs) -> list[float]:
    """Toy reward: longer answers, and the letter 'a', score higher."""
    return [len(c[0]["content"]) + 2.0 * c[0]["content"].count("a") for c in completions]


def image_rollout(max_len: int):
    """``rollout_func`` for image prompts: the prompt tokenized by the trainer's processor with its
    images (as TRL tokenizes it for scoring), a deterministic completion of 1..max_len text tokens per
    row (some end in ``<eos>``, some are truncated), depending on the step."""
    from trl.data_utils import apply_chat_template

    def rollout(prompts, trainer):
        proc = trainer.processing_class
        step = trainer.state.global_step
        prompt_ids, completion_ids = [], []
        for i, prompt in enumerate(prompts):
            images = [c["image"] for m in prompt for c in m["content"] if c.get("type") == "image"]
            text = apply_chat_template({"prompt": prompt}, proc)["prompt"]
            ids = proc(images=[images], text=[text], return_tensors="pt")["input_ids"][0]
            prompt_ids.append(ids.tolist())
            g = torch.Generator().manual_seed(1000 * step + 17 * i)
            n = 1 + (i * 3 + step) % max_len
            body = torch.randint(3, 3 + len(CHARS), (n,), generator=g).tolist()
            completion_ids.append((body if n == max_len else body + [1])[:max_len])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout
