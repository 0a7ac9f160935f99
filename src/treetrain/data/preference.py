"""Preference records (DPO, reward models) as trees: one pair per line, prompt shared.

Two forms, TRL's (detected by their keys, or forced with ``format="preference"``):

tokenized (``prompt_ids`` optional; a reward model's data often has the prompt inside the responses)::

    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "margin": 0.5}

conversational (rendered with the tokenizer's chat template, see :mod:`treetrain.data.chat`)::

    {"prompt": [{"role": "user", "content": "hi"}],
     "chosen": [{"role": "assistant", "content": "hello"}],
     "rejected": [{"role": "assistant", "content": "go away"}], "tools": [...]}

Each record becomes one tree of two paths, in this order: ``prompt + chosen`` (path 0) and
``prompt + rejected`` (path 1). The loss mask is 1 on the response tokens only (for the
conversational form: the assistant turns of ``chosen``/``rejected``; the prompt's own assistant
turns get no loss). Every tree carries ``margins`` (the record's ``margin`` on both paths, 0 when
absent): the objectives in :mod:`treetrain.objectives.preference` read it and refuse trees that
lack it, so a file of unpaired paths is never mistaken for pairs. A response that is a prefix of
the other, or equal to it, is kept as its own path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treetrain.data.fields import _Invalid, _list, _message, _scalar, _token_ids, _type_name

__all__ = ["PREFERENCE_KEYS", "is_preference_record", "parse_preference"]

_TOKENIZED = ("prompt_ids", "chosen_ids", "rejected_ids")
_CONVERSATIONAL = ("prompt", "chosen", "rejected")
PREFERENCE_KEYS = (*_TOKENIZED, *_CONVERSATIONAL, "margin", "tools", "images", "id", "meta")


def is_preference_record(record: dict) -> bool:
    """True if any preference key is present (so a record missing one gets a preference error)."""
    return any(k in record for k in (*_TOKENIZED, *_CONVERSATIONAL))


def parse_preference(
    rec: dict, vocab_size: int | None, tokenizer, allow_invalid_tool_arguments: bool = False
) -> tuple[list[np.ndarray], dict, list[tuple]]:
    """Validate one preference record: ``(paths, fields, where)`` as ``treetrain.data.records``'s parsers
    (``allow_invalid_tool_arguments``: see :mod:`treetrain.data.toolcalls`).

    >>> paths, fields, _ = parse_preference({"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]},
    ...                                     None, None)
    >>> [p.tolist() for p in paths], [m.tolist() for m in fields["loss_masks"]]
    ([[1, 2, 3], [1, 2, 4]], [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    """
    for key in rec:
        if key not in PREFERENCE_KEYS:
            raise _Invalid(f"unknown key for a preference record; allowed: {', '.join(PREFERENCE_KEYS)}", key)
    tokenized = [k for k in _TOKENIZED if k in rec]
    conversational = [k for k in _CONVERSATIONAL if k in rec]
    if tokenized and conversational:
        raise _Invalid(
            f"mixes the tokenized form ({', '.join(tokenized)}) with the conversational one "
            f"({', '.join(conversational)}); use prompt_ids/chosen_ids/rejected_ids or "
            "prompt/chosen/rejected",
            conversational[0],
        )
    keys = _TOKENIZED if tokenized else _CONVERSATIONAL
    for key in keys[1:]:
        if key not in rec:
            raise _Invalid(
                f"missing: a preference record needs {keys[1]} and {keys[2]} ({keys[0]} optional)", key
            )
    if tokenized:
        if "tools" in rec:
            raise _Invalid("tools apply to the conversational form (prompt/chosen/rejected) only", "tools")
        (paths, masks), images = _tokenized(rec, vocab_size), None
    else:
        paths, masks, images = _conversational(rec, vocab_size, tokenizer, allow_invalid_tool_arguments)
    margin = _scalar(rec["margin"], ("margin",)) if "margin" in rec else 0.0
    fields = {"loss_masks": masks, "margins": np.full(2, margin)}
    if images is not None:  # conversational, with a vision-language model: each path's images
        fields["images"] = images
    return paths, fields, [(keys[1],), (keys[2],)]


def _tokenized(rec: dict, vocab_size: int | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    prompt = _token_ids(rec.get("prompt_ids", []), ("prompt_ids",), vocab_size, allow_empty=True)
    paths, masks = [], []
    for key in ("chosen_ids", "rejected_ids"):
        value = rec[key]
        if isinstance(value, list) and not value:
            raise _Invalid("empty response: give at least one token", key)
        resp = _token_ids(value, (key,), vocab_size)
        paths.append(np.concatenate([prompt, resp]))
        masks.append(np.concatenate([np.zeros(prompt.size), np.ones(resp.size)]))
    return paths, masks


def _conversation(value: Any, key: str) -> list[dict]:
    if isinstance(value, str):
        raise _Invalid(
            "plain-text preference records are not supported: give a list of chat messages, or token ids "
            "(prompt_ids/chosen_ids/rejected_ids)",
            key,
        )
    value = _list(value, (key,), "a list of chat messages")
    return [_message(m, (key, i)) for i, m in enumerate(value)]


def _conversational(
    rec: dict, vocab_size: int | None, tokenizer, allow_invalid_tool_arguments: bool
) -> tuple[list[np.ndarray], list[np.ndarray], list | None]:
    """Paths, loss masks and (a vision-language model's tokenizer) each path's ImageInputs."""
    from treetrain.data.chat import ChatError, render_chat
    from treetrain.data.images import ImageError, expand_images, extract_images, vision_info
    from treetrain.data.toolcalls import check_tool_calls

    prompt = _conversation(rec.get("prompt", []), "prompt")
    responses = {key: _conversation(rec[key], key) for key in ("chosen", "rejected")}
    if tokenizer is None:
        raise _Invalid(
            "the conversational preference form needs a tokenizer (--tokenizer DIR or qwen)", "chosen"
        )
    # the prompt's own assistant turns are context, not the response being preferred
    prompt = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in prompt]
    tools = rec.get("tools")
    if tools is not None:
        for j, t in enumerate(_list(tools, ("tools",), "a list of tool (function) schemas")):
            if not isinstance(t, dict):
                raise _Invalid(f"expected a tool schema object, got {_type_name(t)}", "tools", j)
    vision = vision_info(tokenizer)
    paths, masks, images = [], [], []
    for key in ("chosen", "rejected"):
        resp = responses[key]
        if not any(m["role"] == "assistant" for m in resp):
            raise _Invalid("empty response: needs at least one assistant message", key)
        located = [(m, ("prompt", i)) for i, m in enumerate(prompt)]
        check_tool_calls(located + [(m, (key, i)) for i, m in enumerate(resp)], allow_invalid_tool_arguments)
        try:
            msgs, pil, image_at = extract_images([*prompt, *resp], rec.get("images"))
            if pil and vision is None:
                msg = "an image part, but the model is text-only (no image processor and image token)"
                raise ImageError(msg, image_at[0])
            r = render_chat(tokenizer, msgs, tools=tools)
            ids, mask = np.asarray(r.ids, dtype=np.int64), np.asarray(r.loss_mask, dtype=np.float64)
            if vision is not None:
                ids, mask, imgs = expand_images(vision, r.ids, r.loss_mask, pil, image_at)
                images.append(imgs)
        except (ChatError, ImageError) as e:
            where = e.where[1:] if e.where and isinstance(e.where[0], int) else ()
            i = e.where[0] if e.where and isinstance(e.where[0], int) else None
            loc = ("prompt", i) if i is not None and i < len(prompt) else (key,)
            if i is not None and i >= len(prompt):
                loc = (key, i - len(prompt))
            raise _Invalid(str(e), *loc, *where) from None
        if vocab_size is not None and ids.max() >= vocab_size:
            raise _Invalid(
                f"renders to token id {ids.max()}, outside the vocabulary (vocab_size={vocab_size})", key
            )
        if mask.sum() == 0:
            raise _Invalid("empty response: its assistant turns render to no trainable token", key)
        paths.append(ids)
        masks.append(mask)
    return paths, masks, (images if vision is not None else None)
