"""CPU benchmarks re-run themselves under tcmalloc/jemalloc when one is installed (real processes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from treetrain.bench import allocator

SCRIPT = """
import sys
from treetrain.bench import allocator
print("start", flush=True)
print("use", allocator.use(sys.argv[1], quiet=True), "active", allocator.active())
"""


def _expected_auto() -> str:
    return next((n for n in ("tcmalloc", "jemalloc") if allocator.find(n)), "system")


def _run(tmp_path, choice: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), choice], capture_output=True, text=True, timeout=120)


def test_auto_reexecutes_under_an_installed_allocator(tmp_path):
    run = _run(tmp_path, "auto")
    assert run.returncode == 0, run.stderr
    want = _expected_auto()
    assert run.stdout.splitlines()[-1] == f"use {want} active {want}"
    # a re-executed program starts again from the top: "start" twice exactly when it switched
    assert run.stdout.count("start") == (1 if want == "system" else 2)
    if want == "system":
        assert "install tcmalloc" not in run.stderr  # quiet=True


def test_system_keeps_the_running_allocator(tmp_path):
    run = _run(tmp_path, "system")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["start", "use system active system"]


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc"])
def test_named_allocator_runs_or_says_how_to_install(tmp_path, name):
    run = _run(tmp_path, name)
    if allocator.find(name):
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[-1] == f"use {name} active {name}"
    else:
        assert run.returncode == 1
        assert f"--allocator {name}: no lib" in run.stderr and "apt-get install" in run.stderr


def test_unknown_choice_is_a_value_error():
    with pytest.raises(ValueError, match="choose one of auto, tcmalloc, jemalloc, system"):
        allocator.use("mimalloc")


def test_missing_library_names_the_package(monkeypatch):
    monkeypatch.setattr(allocator, "find", lambda name: None)
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.delenv("TREETRAIN_ALLOCATOR_REEXEC", raising=False)
    with pytest.raises(ValueError, match="apt-get install libtcmalloc-minimal4"):
        allocator.use("tcmalloc")
    assert allocator.use("auto", quiet=True) == "system"  # auto falls back, with a note unless quiet
