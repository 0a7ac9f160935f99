"""What a new user meets on the command line (issue 23), each through the real ``treetrain`` command
in a subprocess: a quick ``--help``, clear one-line errors, a quiet run, reward metrics, and
extending a finished run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "PYTHONWARNINGS": "default"}  # warnings shown as a user would see them


def treetrain(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treetrain", *argv], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def _best_seconds(cmd: list[str], repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, timeout=300)
        best = min(best, time.perf_counter() - t0)
    return best


# ---- item 6: a quick CLI -----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"], ["stats", "--help"],
                                  ["bench", "--help"]])  # fmt: skip
def test_help_imports_neither_torch_nor_transformers(argv):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "treetrain", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "treetrain.cli" in imported  # the listing is real
    assert not imported & {"torch", "transformers", "peft", "numpy.linalg.torch"}, sorted(imported)


def test_help_takes_well_under_half_of_importing_torch():
    """Best of two runs each, so that a burst of load on a shared machine does not decide it."""
    torch_s = _best_seconds([sys.executable, "-c", "import torch"])
    help_s = _best_seconds([sys.executable, "-m", "treetrain", "--help"])
    version_s = _best_seconds([sys.executable, "-m", "treetrain", "--version"])
    assert max(help_s, version_s) < 0.5 * torch_s, (help_s, version_s, torch_s)
