"""Which memory allocator a CPU benchmark runs under, and switching to a better one.

glibc's malloc serves every buffer above 32 MiB with a fresh ``mmap`` and gives it back on free, so
each large activation is page-faulted (and zeroed by the kernel) again on every step. On a 2-core
CPU that made elementwise ops 2-10x slower per element than under tcmalloc (``aten::sub`` in the LM
head: 295-613 ms vs 28-34 ms per step, hidden 1024, 4k tokens) and, worse for a comparison, by a
different factor in each mode: their buffers differ in size and count (Jamba's Mamba scan, group
tree: the per-path baseline 1.37 s vs 0.79 s, the tree 0.54 s vs 0.38 s, so the tree read 1.30 of
its FLOP bound on plain glibc and 1.03 with its heap kept). FLOPs cannot price that, so CPU
benchmarks run under tcmalloc (or jemalloc) when one is installed (Debian:
``apt-get install libtcmalloc-minimal4``), else under ``glibc-cached``: glibc's own malloc told by
``mallopt`` never to ``mmap`` (``M_MMAP_MAX = 0``) nor to give the heap's top back
(``M_TRIM_THRESHOLD``), so freed buffers are reused like a caching allocator's. Nothing to install
and no re-execution: it takes effect at once, and the same settings go to child processes through
glibc's ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_``. Every result records the allocator.

Example: ``use("auto")`` in a process on glibc malloc, with tcmalloc installed, replaces the process
by the same command with ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4``; in the
new process ``active()`` returns ``"tcmalloc"`` and ``use("auto")`` returns it at once. Without
tcmalloc or jemalloc, ``use("auto")`` returns ``"glibc-cached"`` in the same process.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys

__all__ = ["CHOICES", "active", "add_flag", "find", "glibc_cached", "use"]

CHOICES = ("auto", "tcmalloc", "jemalloc", "glibc-cached", "system")
_LIBS = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
_MARK = "TREETRAIN_ALLOCATOR_REEXEC"  # set in the re-executed process: never re-execute twice
# glibc's mallopt parameters, and the environment variables that set them in a new process
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_TRIM = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before any is given back
_CACHED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(_TRIM)}


def active() -> str:
    """``"tcmalloc"``, ``"jemalloc"``, ``"glibc-cached"`` or ``"system"``: the allocator of this
    process (a preloaded library, else glibc with or without :func:`glibc_cached`'s settings)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # not Linux: nothing is preloaded by us
        return "system"
    lib = next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in maps), None)
    if lib:
        return lib
    cached = all(os.environ.get(k) == v for k, v in _CACHED_ENV.items())
    return "glibc-cached" if cached else "system"


def glibc_cached() -> bool:
    """Keep glibc malloc's freed memory for reuse in this process and its children (no ``mmap`` per
    large buffer, no trimming of the heap). False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM) == 1
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return False
    if ok:
        os.environ.update(_CACHED_ENV)
    return ok


def find(name: str) -> str | None:
    """The path of an installed ``name`` library (``tcmalloc`` | ``jemalloc``), or None."""
    for lib in _LIBS[name]:
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
            hits = sorted(glob.glob(f"{d}/lib{lib}.so*"))
            if hits:
                return hits[0]
        so = ctypes.util.find_library(lib)
        if so:
            return so
    return None


def add_flag(parser) -> None:
    """``--allocator`` on an ``argparse`` parser, for a program's ``main`` to pass to :func:`use`."""
    parser.add_argument(
        "--allocator",
        choices=CHOICES,
        default="auto",
        help="CPU memory allocator: auto re-runs the command under tcmalloc (else jemalloc) when "
        "installed, else keeps glibc malloc's freed buffers for reuse (glibc-cached), since plain glibc "
        "malloc page-faults every buffer over 32 MiB on each step and skews CPU timings; system: plain "
        "glibc; recorded with the results",
    )


def _command() -> list[str]:
    """This process's command line, runnable again (``python -m pkg`` comes back as such)."""
    if sys.argv[0].endswith("__main__.py"):
        return [sys.executable, "-m", os.path.basename(os.path.dirname(sys.argv[0])), *sys.argv[1:]]
    return [sys.executable, *sys.argv]


def use(choice: str = "auto", quiet: bool = False) -> str:
    """Make sure this process runs under ``choice``; returns the allocator in use.

    ``auto``: tcmalloc, else jemalloc, when installed, else ``glibc-cached`` (else the system's, with
    a note how to get tcmalloc). ``tcmalloc`` / ``jemalloc``: that one, or ``ValueError`` if it is not
    installed. ``glibc-cached``: :func:`glibc_cached`. ``system``: whatever runs now. Switching to a
    library re-executes the process (``os.execve``) with it in ``LD_PRELOAD``: call this first thing
    in a program's ``main``, never in a library call.
    """
    if choice not in CHOICES:
        raise ValueError(f"--allocator {choice!r}: choose one of {', '.join(CHOICES)}")
    now = active()
    if choice == "system" or now in ("tcmalloc", "jemalloc") or os.environ.get(_MARK):
        if choice not in ("auto", "system", now):
            raise ValueError(f"--allocator {choice}: preloading it did not take effect (running: {now})")
        return now
    wanted = {"auto": ("tcmalloc", "jemalloc"), "glibc-cached": ()}.get(choice, (choice,))
    path = next((p for p in map(find, wanted) if p), None)
    if path is None:
        if choice in ("tcmalloc", "jemalloc"):
            package = "libtcmalloc-minimal4" if choice == "tcmalloc" else "libjemalloc2"
            raise ValueError(
                f"--allocator {choice}: no lib{_LIBS[choice][0]} found (Debian/Ubuntu: apt-get install "
                f"{package}), or --allocator glibc-cached"
            )
        if glibc_cached():
            return "glibc-cached"
        if choice == "glibc-cached":
            raise ValueError(
                "--allocator glibc-cached: this C library has no glibc mallopt; use --allocator system"
            )
        if not quiet:
            print(
                "note: running on the system malloc, which may page-fault every large buffer again on "
                "each step and skew CPU timings; install tcmalloc (apt-get install "
                "libtcmalloc-minimal4) and run again, or pass --allocator system to silence this",
                file=sys.stderr,
                flush=True,
            )
        return now
    env = dict(os.environ, **{_MARK: "1"})
    env["LD_PRELOAD"] = ":".join(filter(None, [path, env.get("LD_PRELOAD", "")]))
    if not quiet:
        print(f"re-running under {os.path.basename(path)} (--allocator system keeps glibc malloc)")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, _command(), env)
    raise AssertionError("unreachable")  # pragma: no cover
