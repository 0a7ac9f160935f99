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
    return next((n for n in ("tcmalloc", "jemalloc") if allocator.find(n)), "glibc-cached")


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
    # libraries (glibc-cached switches in place)
    assert run.stdout.count("start") == (1 if want == "glibc-cached" else 2)


def test_system_keeps_the_running_allocator(tmp_path):
    run = _run(tmp_path, "system")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["start", "use system active system"]


GLIBC_CACHED = """
import ctypes, subprocess, sys
from treetrain.bench import allocator
print("use", allocator.use("glibc-cached"), "active", allocator.active())
# mallinfo2's hblks: chunks served by mmap now. Plain glibc maps a 64 MiB buffer; cached, it does not.
names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
Info = type("Info", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_size_t) for n in names]})
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblks
buf = libc.malloc(64 << 20)
print("mmapped", libc.mallinfo2().hblks - before)
libc.free(buf)
child = "from treetrain.bench import allocator; print(allocator.active())"
print("child", subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt and mallinfo2: Linux only")
def test_glibc_cached_maps_no_large_buffer_and_reaches_children(tmp_path):
    script = tmp_path / "cached.py"
    script.write_text(GLIBC_CACHED)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "use glibc-cached active glibc-cached",
        "mmapped 0",
        "child glibc-cached",
    ]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallinfo2: Linux only")
def test_plain_glibc_maps_large_buffers(tmp_path):
    """The control: the same 64 MiB malloc under plain glibc is mmapped (what glibc-cached avoids)."""
    script = tmp_path / "plain.py"
    script.write_text(GLIBC_CACHED.replace('allocator.use("glibc-cached")', 'allocator.use("system")'))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["use system active system", "mmapped 1", "child system"]


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
    with pytest.raises(ValueError, match="choose one of auto, tcmalloc, jemalloc, glibc-cached, system"):
        allocator.use("mimalloc")


def test_missing_library_names_the_package(monkeypatch):
    monkeypatch.setattr(allocator, "find", lambda name: None)
    monkeypatch.setattr(allocator, "active", lambda: "system")
    monkeypatch.delenv("TREETRAIN_ALLOCATOR_REEXEC", raising=False)
    with pytest.raises(ValueError, match="apt-get install libtcmalloc-minimal4"):
        allocator.use("tcmalloc")
    monkeypatch.setattr(allocator, "glibc_cached", lambda: False)  # not glibc
    assert allocator.use("auto", quiet=True) == "system"  # auto falls back, with a note unless quiet
