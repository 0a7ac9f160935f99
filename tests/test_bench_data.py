"""``treetrain bench --data FILE`` through the command line: the user's data (text, and the GUI-agent
sample's screenshots through a tiny Qwen2-VL), tree vs per-path baseline in one run, its FLOP bound
the one ``treetrain stats`` reports (the vision tower counted). The reported fields are checked for
consistency, never the timings."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from .reference import tiny_config

ROOT = Path(__file__).resolve().parents[1]
GUI = ROOT / "examples" / "data" / "gui_agent" / "gui_agent.jsonl"
QUICK = ["--repeats", "1", "--no-baseline-search", "--matmul-size", "128"]  # a check, not a measurement


def treetrain(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treetrain", *argv], capture_output=True, text=True, timeout=900
    )


def _stats(*argv: str) -> dict[str, str]:
    proc = treetrain("stats", *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        k.strip(): v.strip()
        for k, v in (re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.splitlines())
    }


def _bench(tmp_path, *argv: str) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    proc = treetrain("bench", *argv, *QUICK, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    return proc.stdout, result


def _consistent(stdout: str, result: dict, stats: dict[str, str], bound_key: str) -> None:
    """Bench's case is stats' data: the same tokens and paths, the same FLOP bound (printed and in the
    results), fewer tree tokens than baseline ones, and one speedup with the bound beside it."""
    assert f"{result['baseline_tokens']:,}" == stats["baseline tokens (sum of paths)"]
    assert f"{result['tree_tokens']:,}" == stats["tree tokens (distinct)"] and result["paths"] == int(
        stats["paths"]
    )
    assert (
        result["tree_tokens"] < result["baseline_tokens"]
        and result["computed_tokens"] == result["tree_tokens"]
    )
    assert f"{result['flop_bound']:.2f}x" == stats[bound_key]
    assert f"FLOP bound {stats[bound_key]}" in stdout and f"bound {stats[bound_key]}," in stdout
    assert result["speedup"] == pytest.approx(result["baseline_s"] / result["tree_s"])
    assert result["efficiency"] == pytest.approx(result["speedup"] / result["flop_bound"])
    assert result["hf_s"] is None and result["max_logprob_diff"] < 1e-3


@pytest.mark.slow
def test_bench_data_gui_sample_with_a_tiny_vlm(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "gui_agent_sample", ROOT / "examples" / "gui_agent_sample.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.write_tiny_model(tmp_path / "vlm")
    stdout, result = _bench(tmp_path, "--model", str(model), "--data", str(GUI))
    stats = _stats("--model", str(model), "--data", str(GUI))
    _consistent(stdout, result, stats, f"FLOP bound ({model})")
    baseline_images, tree_images = (
        stats["images (sum over paths)"],
        stats["distinct images (encoded by the tree)"],
    )
    assert f"images {baseline_images} / {tree_images}" in stdout and int(tree_images) < int(baseline_images)
    assert "(the vision tower's FLOPs counted)" in stdout


def test_bench_data_text(tmp_path):
    model = tmp_path / "text"
    transformers.Qwen3ForCausalLM(tiny_config("qwen3", vocab=64)).save_pretrained(model)
    data = tmp_path / "paths.jsonl"
    data.write_text(
        '{"paths": [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9], [1, 2, 10]]}\n'
        '{"paths": [[11, 12, 13], [11, 12, 14]]}\n'
    )
    stdout, result = _bench(tmp_path, "--model", str(model), "--data", str(data))
    _consistent(stdout, result, _stats("--model", str(model), "--data", str(data)), f"FLOP bound ({model})")
    assert "vision" not in stdout and result["paths"] == 5
    proc = treetrain("bench", "--model", str(model), "--data", str(data), "--estimate")
    assert proc.returncode == 0 and f"estimate: `treetrain bench --data {data}`" in proc.stdout, proc.stderr


def test_bench_data_errors_are_one_line(tmp_path):
    """No such file, one bad record: exit 2, one stderr line; the GUI sample's screenshots with no
    vision-language model: every record listed."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"paths": [[1, 2, 3], [1, 2, -4]]}\n')
    cases = {
        str(tmp_path / "nope.jsonl"): "no such data file",
        str(bad): f'{bad}:1: field "paths"[1][2]: token ids must be >= 0',
    }
    for path, message in cases.items():
        proc = treetrain("bench", "--preset", "tiny", "--data", path, "--tokenizer", "qwen")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("treetrain bench: error: ") and message in lines[0], lines
    proc = treetrain("bench", "--preset", "tiny", "--data", str(GUI), "--tokenizer", "qwen")
    first, *listed = proc.stderr.splitlines()
    assert proc.returncode == 2 and first.endswith("4 of 4 records are invalid:"), proc.stderr[-3000:]
    assert len(listed) == 4 and all("an image part, but the model is text-only" in x for x in listed)
