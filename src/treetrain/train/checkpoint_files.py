"""The files and ranks under :mod:`treetrain.train.checkpoint`: the layout's names, durable writes
(fsync, atomic replace), the manifest of a checkpoint's files hashed across ranks, rank 0's value
on every rank, and the test hook that kills a save at a chosen stage (:data:`FAULT_ENV`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from treetrain.train.safe_state import sha256_file

__all__ = ["FAULT_ENV"]

LATEST = "latest"
META = "meta.json"
STATE = "state"
_STEP_RE = re.compile(r"^step_(\d+)$")
FAULT_ENV = "TREETRAIN_CHECKPOINT_FAULT"  # tests: "STAGE" or "STAGE@STEP" -> SIGKILL at that point


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's warning that it runs without a process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*assuming the intent is to (save|load) in a single process"
        )
        yield


def _root(directory: str | os.PathLike) -> Path:
    """The checkpoints directory: ``directory`` itself if it is named ``checkpoints`` (or already
    holds a ``latest`` pointer), else ``directory/checkpoints`` (a run's output directory)."""
    d = Path(directory)
    return d if d.name == "checkpoints" or (d / LATEST).is_file() else d / "checkpoints"


def _step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, write) -> None:
    """Create ``path`` with ``write(fileobj)``, flushed and fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _replace_atomic(path: Path, text: str) -> None:
    """Replace a small file atomically: write a sibling ``.tmp``, fsync, rename, fsync the dir."""
    tmp = path.with_name(path.name + ".tmp")
    _write_durable(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fault(stage: str, step: int) -> None:
    """Test hook: ``TREETRAIN_CHECKPOINT_FAULT=STAGE[@STEP]`` kills this process with SIGKILL at
    ``STAGE`` (``state_written``, ``before_rename``, ``before_latest``) of the save of ``STEP``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, at = spec.partition("@")
    if want == stage and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` in one process)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _manifest(directory: Path, names: list[str] | None = None) -> dict[str, dict[str, Any] | None]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` (None: no such file) of ``names``, or of
    every file under ``directory`` but ``meta.json``. Collective: each rank hashes a share."""
    if names is None:
        listing = [str(p.relative_to(directory)) for p in sorted(directory.rglob("*")) if p.is_file()]
        names = _broadcast([rel for rel in listing if rel != META])
    mine: dict[str, dict[str, Any] | None] = {}
    for rel in names[_rank() :: _world()]:
        f = directory / rel
        mine[rel] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)} if f.is_file() else None
    merged: dict[str, Any] = {}
    for part in _gather(mine):
        merged.update(part)
    return {rel: merged[rel] for rel in names}
