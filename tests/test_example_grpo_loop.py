"""The README's custom GRPO loop runs as shipped (short settings)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_grpo_loop.py"


def test_custom_grpo_loop_runs(capsys):
    spec = importlib.util.spec_from_file_location("custom_grpo_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gain = module.main(
        ["--steps", "2", "--prompts", "2", "--group", "4", "--prompt-len", "12", "--max-new", "5"]
    )
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [["step", "0"], ["step", "1"]]
    assert isinstance(gain, float)
