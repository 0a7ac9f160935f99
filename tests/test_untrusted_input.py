"""Untrusted inputs: a model or tokenizer directory's own Python code runs only with
``--trust-remote-code``; a JSONL line over ``--max-line-bytes`` is an error naming file and line,
found in bounded memory; a tampered checkpoint stops ``train --resume`` with exit status 1."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from treetrain.cli import build_parser, main
from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees, validate_file

from .reference import tiny_config
from .test_train import VOCAB, write_trees

ROOT = Path(__file__).resolve().parents[1]


def code_dir(d: Path, kind: str) -> Path:
    """A model (``kind="model"``) or tokenizer directory whose auto_map names a Python module that
    creates ``d/pwned`` when imported."""
    d.mkdir()
    payload = f"import os\nos.mkdir({str(d / 'pwned')!r})\n"
    if kind == "model":
        auto = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
        (d / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": auto}))
    else:
        (d / "tokenizer_config.json").write_text(
            json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}})
        )
    (d / "evil.py").write_text(payload)
    return d


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("untrusted")
    write_trees(d / "trees.jsonl", n_trees=2)
    tiny_config("qwen3", vocab=VOCAB).save_pretrained(d / "tiny")
    return d


def test_help_says_remote_code_is_off():
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    text = " ".join(sub.format_help().split())
    assert "--trust-remote-code" in text and "off by default" in text
    assert "--overwrite" in text and "--max-line-bytes" in text


@pytest.mark.parametrize("kind", ["model", "tokenizer"])
def test_remote_code_is_refused_by_default(tmp_path, inputs, capsys, kind):
    d = code_dir(tmp_path / kind, kind)
    flag = (
        ["--model", str(d)] if kind == "model" else ["--tokenizer", str(d), "--model", str(inputs / "tiny")]
    )
    argv = ["train", "--data", str(inputs / "trees.jsonl"), *flag, "--output", str(tmp_path / "out")]
    assert main([*argv, "--steps", "1", "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--{kind} {d}: loading it runs Python code" in err and "--trust-remote-code" in err
    assert not (d / "pwned").exists()


@pytest.mark.slow
def test_trust_remote_code_runs_it(tmp_path, inputs):
    """Positive control, in a process of its own (transformers caches imported modules): with
    the flag the directory's code does run."""
    d = code_dir(tmp_path / "model", "model")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": str(ROOT / "src")}
    argv = ["--data", str(inputs / "trees.jsonl"), "--model", str(d), "--output", str(tmp_path / "out")]
    cmd = [sys.executable, "-m", "treetrain.cli", "train", *argv, "--steps", "1", "--trust-remote-code"]
    subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    assert (d / "pwned").is_dir()


# ---- bounded lines ------------------------------------------------------------------------------


def test_long_line_is_an_error_with_file_and_line(tmp_path):
    good = json.dumps({"paths": [[1, 2, 3]]})
    huge = json.dumps({"paths": [[1] * 600_000]})  # ~1.8 MB
    path = tmp_path / "d.jsonl"
    path.write_text(f"{good}\n{huge}\n{good}\n")
    with pytest.raises(
        DataError, match=rf"^{path}:2: the line is longer than max_line_bytes=1,048,576 bytes"
    ):
        list(iter_trees(path, max_line_bytes=2**20))
    stream = iter_trees(path, max_line_bytes=2**20, on_error="collect")
    assert len(list(stream)) == 2 and [e.line for e in stream.errors] == [2]  # line 3 still read
    assert len(list(iter_trees(path))) == 3  # the default (256 MiB) takes it
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(DataError, match=r"d.jsonl.gz:2: the line is longer"):
        validate_file(gz, max_line_bytes=2**20)
    # exactly at the limit (newline included) is fine; one byte over is not
    n = len(huge) + 1
    assert len(list(iter_trees(path, max_line_bytes=n))) == 3
    with pytest.raises(DataError, match=":2:"):
        list(iter_trees(path, max_line_bytes=n - 1))


def test_long_line_is_read_in_bounded_memory(tmp_path):
    """A 64 MiB line without a newline, limit 1 MiB: the peak Python allocation is the limit plus
    a few 64 KiB read chunks, not the line."""
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"paths": [[' + b"1," * (32 * 2**20))
    tracemalloc.start()
    try:
        stream = iter_trees(path, max_line_bytes=2**20, on_error="collect")
        assert list(stream) == [] and stream.errors[0].line == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20 + 2**19, peak


def test_max_line_bytes_flag(tmp_path, inputs, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text((inputs / "trees.jsonl").read_text())
    argv = ["train", "--data", str(data), "--model", str(inputs / "tiny"), "--output", str(tmp_path / "o")]
    assert main([*argv, "--max-line-bytes", "100", "--no-progress", "--device", "cpu"]) == 2
    assert f"{data}:1: the line is longer than max_line_bytes=100 bytes" in capsys.readouterr().err
    assert main([*argv, "--max-line-bytes", "0"]) == 2
    assert "--max-line-bytes: must be a positive number" in capsys.readouterr().err


# ---- a tampered checkpoint through the CLI ------------------------------------------------------


def test_tampered_checkpoint_stops_resume_with_status_1(tmp_path, inputs, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(inputs / "trees.jsonl"),
        "--model",
        str(inputs / "tiny"),
        "--output",
        str(out),
    ]
    argv += ["--device", "cpu", "--prefetch", "0", "--no-progress", "--checkpoint-every", "1"]
    assert main([*argv, "--steps", "3"]) == 0
    capsys.readouterr()
    ck = out / "checkpoints" / "step_3"  # the final step's checkpoint, the one --resume reads
    (ck / "scheduler.json").write_text((ck / "scheduler.json").read_text().replace("3", "7"))
    assert main([*argv, "--steps", "4", "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("treetrain train: error: ") and "Traceback" not in err
    assert "scheduler.json does not match its sha256" in err
    assert f"the previous good checkpoint is {out / 'checkpoints' / 'step_2'}" in err
