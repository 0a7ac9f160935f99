"""Shared helpers for the benchmark scripts: hardware description and result files."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

from treetrain.bench import allocator

RESULTS = Path(__file__).parent / "results"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def hardware() -> str:
    return (
        f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"allocator {allocator.active()}"
    )


def add_allocator_flag(parser) -> None:
    """``--allocator`` (``treetrain.bench.allocator``): CPU runs re-execute under tcmalloc when installed."""
    allocator.add_flag(parser)


def use_allocator(args, device: str = "cpu") -> str:
    """Switch to ``args.allocator`` on CPU (may re-execute the script); the allocator in use."""
    return allocator.use(args.allocator) if device == "cpu" else allocator.active()


def result_path(name: str, device: str = "cpu") -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in cpu_name()).strip("-").lower()[:40]
    date = datetime.date.today().isoformat()
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}_{device}-{os.cpu_count()}core-{slug}_{date}.md"
