"""Resumable checkpoints (model, optimizer, LR schedule, data position, RNG) written atomically.

Layout under the checkpoints directory (``RUN/checkpoints``)::

    latest                  text: the name of the newest complete checkpoint ("step_120")
    step_120/
      state/                torch.distributed.checkpoint: model + optimizer, sharded per rank
      rng/rank_0.pt ...     each rank's RNG states (torch, CUDA, numpy, python)
      scheduler.pt          the LR scheduler's state_dict
      meta.json             step, world size, data state, every file's size; written last

A checkpoint is written into ``step_N.tmp``; every file is fsynced, then ``meta.json``, then the
directory is renamed to ``step_N`` and ``latest`` is replaced (write ``latest.tmp``, fsync, rename).
Renames are atomic, so a crash at any point leaves the previous checkpoint and ``latest`` as they
were; a leftover ``*.tmp`` directory is never read and is removed by the next save. The last
``keep`` checkpoints are kept.

Model and optimizer go through ``torch.distributed.checkpoint`` with ``get_state_dict`` /
``set_state_dict``, so FSDP2-sharded state is saved shard by shard (no gather) and can be loaded
at another world size. The same code runs in a single process.

Checkpoints hold pickled Python objects (RNG, scheduler): load only checkpoints you wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CheckpointError",
    "export_pretrained",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
LATEST = "latest"
META = "meta.json"
STATE = "state"
_STEP_RE = re.compile(r"^step_(\d+)$")
FAULT_ENV = "TREETRAIN_CHECKPOINT_FAULT"  # tests: "STAGE" or "STAGE@STEP" -> SIGKILL at that point


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match what it is loaded into."""


# ---- small helpers -----------------------------------------------------------------------------


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


def _file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != META
    }


# ---- RNG ---------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- model + optimizer state -------------------------------------------------------------------


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


# ---- listing -----------------------------------------------------------------------------------


def _is_complete(path: Path) -> bool:
    return (path / META).is_file() and (path / STATE / ".metadata").is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``directory`` (a run or checkpoints directory), oldest first."""
    root = _root(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None and _is_complete(p)]
    return sorted(found, key=_step_of)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint: the one ``latest`` names, or, if that pointer is missing or
    names no complete checkpoint, the complete ``step_N`` with the largest ``N``. None if none."""
    root = _root(directory)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.parent == root and _step_of(named) is not None and _is_complete(named):
            return named
    found = list_checkpoints(root)
    return found[-1] if found else None


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check that a checkpoint is complete (every file ``meta.json`` lists exists with its size).
    Returns the metadata; raises :class:`CheckpointError` otherwise."""
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {META})")
    meta = json.loads((path / META).read_text())
    for rel, size in meta["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {rel}")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {rel} has {f.stat().st_size} bytes, expected {size}")
    return meta


# ---- save --------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    data_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically into the checkpoints directory and keep the last ``keep``.

    Collective: every rank calls it. ``directory`` is the run's output directory (checkpoints go to
    ``directory/checkpoints``) or the ``checkpoints`` directory itself. ``data_state`` must be
    JSON-serializable (e.g. ``{"trees_consumed": 1200}``). Returns the checkpoint's path.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    try:
        data_json = json.dumps(data_state)
    except TypeError as e:
        raise ValueError(f"data_state must be JSON-serializable: {e}") from None
    import torch.distributed.checkpoint as dcp

    root = _root(directory)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):  # debris of an interrupted save
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        tmp.mkdir()
    _barrier()

    with _single_process_quiet():
        dcp.save(_state_dicts(model, optimizer), checkpoint_id=tmp / STATE, no_dist=not dist.is_initialized())
    _write_durable(tmp / "rng" / f"rank_{rank}.pt", lambda f: torch.save(_rng_state(), f))
    _fault("state_written", step)
    _barrier()

    if rank == 0:
        if scheduler is not None:
            _write_durable(tmp / "scheduler.pt", lambda f: torch.save(scheduler.state_dict(), f))
        for d in (tmp / STATE, tmp / "rng", tmp):
            _fsync_dir(d)
        meta = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "world_size": _world(),
            "data_state": json.loads(data_json),
            "files": _file_sizes(tmp),
        }
        _write_durable(tmp / META, lambda f: f.write((json.dumps(meta, indent=1) + "\n").encode()))
        _fsync_dir(tmp)
        _fault("before_rename", step)
        if final.exists():  # re-saving a step (after resuming from an older one): swap it out
            old = root / f"step_{step}.replaced.tmp"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        _fault("before_latest", step)
        _replace_atomic(root / LATEST, final.name)
        _prune(root, keep, protect=final)
    _barrier()
    return final


def _prune(root: Path, keep: int, protect: Path) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (renamed to ``*.tmp`` first, so a
    half-deleted directory never looks like a checkpoint)."""
    done = list_checkpoints(root)
    for old in done[:-keep]:
        if old == protect:
            continue
        doomed = old.with_name(old.name + ".deleting.tmp")
        os.rename(old, doomed)
        shutil.rmtree(doomed)


# ---- load --------------------------------------------------------------------------------------


def _resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from a checkpoint, checkpoints or run directory."""
    p = Path(path)
    if p.name.endswith(".tmp"):
        raise CheckpointError(f"{p}: an unfinished (or abandoned) checkpoint write; it is never loaded")
    if (p / META).is_file():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise CheckpointError(f"{p}: no complete checkpoint here (looked in {_root(p)})")
    return found


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer, scheduler and this rank's RNG. Returns ``(step, data_state)``.

    Collective: every rank calls it, after ``shard_model`` and building the optimizer. ``path`` is a
    checkpoint (``.../step_N``), a checkpoints directory or a run directory (then the latest
    checkpoint is loaded). The world size may differ from the saving run's (the sharded state is
    resharded on load; ranks without a saved RNG state keep theirs, with a warning).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    ckpt = _resolve(path)
    meta = verify_checkpoint(ckpt)
    state = _state_dicts(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=ckpt / STATE, no_dist=not dist.is_initialized())
    except Exception as e:  # DCP reports missing keys / shape mismatches as a generic error
        raise CheckpointError(f"{ckpt}: cannot load into this model/optimizer: {e}") from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if scheduler is not None:
        if not (ckpt / "scheduler.pt").is_file():
            raise CheckpointError(f"{ckpt}: holds no scheduler state")
        scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng_file = ckpt / "rng" / f"rank_{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        warnings.warn(
            f"{ckpt}: saved with {meta['world_size']} ranks, no RNG state for rank {_rank()}; keeping this "
            "process's RNG state",
            stacklevel=2,
        )
    return int(meta["step"]), dict(meta["data_state"])


# ---- final export ------------------------------------------------------------------------------


def _plain_class(model: nn.Module) -> type:
    """The model's own class under FSDP's dynamic ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def export_pretrained(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """``save_pretrained`` (safetensors) of the full model, gathered from the shards onto rank 0.

    Collective. The config's attention implementation is written as ``sdpa`` and its
    ``architectures`` names the plain class, so ``AutoModelForCausalLM.from_pretrained(out_dir)``
    loads it with stock transformers.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(out_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        config = model.config
        attn = config._attn_implementation
        config._attn_implementation = "sdpa"
        try:
            model.save_pretrained(out, state_dict=full)
            config.architectures = [_plain_class(model).__name__]
            config.save_pretrained(out)
        finally:
            config._attn_implementation = attn
    _barrier()
    return out
