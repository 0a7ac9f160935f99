"""Resumable checkpoints (model, optimizer, LR schedule, data position, RNG) written atomically.

Layout under the checkpoints directory (``RUN/checkpoints``)::

    latest                  text: the name of the newest complete checkpoint ("step_120")
    step_120/
      state/                torch.distributed.checkpoint: model + optimizer, sharded per rank
      rng/rank_0.json ...   each rank's RNG states (torch, CUDA, numpy, python), JSON
      scheduler.json        the LR scheduler's state_dict, JSON
      meta.json             step, world size, data state, every file's size and sha256; written last

A checkpoint is written into ``step_N.tmp``; every file is fsynced, then ``meta.json``, then the
directory is renamed to ``step_N`` and ``latest`` is replaced (write ``latest.tmp``, fsync, rename).
Renames are atomic, so a crash at any point leaves the previous checkpoint and ``latest`` as they
were; a leftover ``*.tmp`` directory is never read and is removed by the next save. The last
``keep`` checkpoints are kept.

Model and optimizer go through ``torch.distributed.checkpoint`` with ``get_state_dict`` /
``set_state_dict``, so FSDP2-sharded state is saved shard by shard (no gather) and can be loaded
at another world size. The same code runs in a single process.

Loading runs no code from the checkpoint (:mod:`treetrain.train.safe_state`): RNG, scheduler, data state
and manifest are JSON; DCP's tensors and non-tensor values are read with
``torch.load(weights_only=True)`` and its ``.metadata`` pickle with an unpickler that accepts only
DCP's metadata classes. Before anything is loaded every file's sha256 is checked against
``meta.json``; a mismatch names the file and the previous checkpoint that verifies. The durable
file writes and the manifest's hashing across ranks: :mod:`treetrain.train.checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from treetrain.train.checkpoint_files import (
    LATEST,
    META,
    STATE,
    _barrier,
    _fault,
    _fsync_dir,
    _manifest,
    _rank,
    _replace_atomic,
    _root,
    _single_process_quiet,
    _step_of,
    _world,
    _write_durable,
)
from treetrain.train.safe_state import (
    SafePlanner,
    SafeReader,
    UnsafeStateError,
    rng_from_json,
    rng_to_json,
    scheduler_from_json,
    scheduler_to_json,
)

__all__ = [
    "CheckpointError",
    "export_pretrained",
    "export_processor_files",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 2  # 1: sizes only, RNG and scheduler pickled (refused on load)
SCHEDULER = "scheduler.json"


# one optimizer, or several over the model's parameters (e.g. a policy's and a critic's under one
# ModuleDict, treetrain.train.kit.checkpoint_state): DCP's get_state_dict/set_state_dict take either
Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match what it is loaded into."""


# ---- model + optimizer state -------------------------------------------------------------------


def _state_dicts(model: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
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
        with open(pointer, "rb") as f:  # a step name; anything else is a stale or garbled pointer
            raw = f.read(64)
        named = root / raw.decode("ascii", errors="replace").strip()
        if named.parent == root and _step_of(named) is not None and _is_complete(named):
            return named
    found = list_checkpoints(root)
    return found[-1] if found else None


def _read_meta(path: Path) -> dict[str, Any]:
    """``meta.json``, checked to be the manifest this version writes."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: {META} is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        hint = (
            " (format 1 stored RNG and scheduler state as pickles, which can run code when loaded; "
            "it is not loaded)"
            if found == 1
            else ""
        )
        raise CheckpointError(
            f"{path}: {META} is checkpoint format {found!r}; this treetrain reads format "
            f"{FORMAT_VERSION}{hint}"
        )
    files, data_state = meta.get("files"), meta.get("data_state")
    if not (
        isinstance(files, dict)
        and all(
            isinstance(v, dict) and type(v.get("bytes")) is int and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
        and isinstance(data_state, dict)
        and type(meta.get("step")) is int
        and type(meta.get("world_size")) is int
    ):
        raise CheckpointError(f"{path}: {META} is malformed (expected step, world_size, data_state, files)")
    for rel in files:  # only files inside the checkpoint are ever opened
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise CheckpointError(f"{path}: {META} lists {rel!r}, a path outside the checkpoint")
    return meta


def _mismatches(path: Path, meta: dict[str, Any]) -> list[str]:
    """What differs between the files and the manifest (collective: hashes are shared out)."""
    problems = []
    for rel, want in meta["files"].items():
        if not (path / rel).is_file():
            problems.append(f"{rel} is missing")
        elif (path / rel).stat().st_size != want["bytes"]:
            problems.append(f"{rel} has {(path / rel).stat().st_size} bytes, expected {want['bytes']}")
    if problems:
        return problems
    got = _manifest(path, list(meta["files"]))
    return [
        f"{rel} does not match its sha256 in {META} (corrupted or modified)"
        for rel, want in meta["files"].items()
        if got[rel] is None or got[rel]["sha256"] != want["sha256"]
    ]


def _previous_good(path: Path) -> Path | None:
    """The newest checkpoint older than ``path`` (a ``step_N``) that verifies, or None."""
    step = _step_of(path)
    for older in reversed(list_checkpoints(path.parent)):
        if step is not None and _step_of(older) < step:
            with contextlib.suppress(CheckpointError):
                if not _mismatches(older, _read_meta(older)):
                    return older
    return None


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check that a checkpoint is whole: every file ``meta.json`` lists exists with its size and
    sha256. Returns the metadata; raises :class:`CheckpointError` naming the bad file and the
    previous checkpoint that verifies. Collective when a process group is initialized (each rank
    hashes a share of the files)."""
    path = Path(path)
    if not (path / META).is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {META})")
    meta = _read_meta(path)
    problems = _mismatches(path, meta)
    if problems:
        prev = _previous_good(path)
        where = (
            f"the previous good checkpoint is {prev}: move {path} out of {path.parent} to resume from it"
            if prev is not None
            else "no earlier checkpoint verifies"
        )
        raise CheckpointError(f"{path}: {'; '.join(problems)}; {where}")
    return meta


# ---- save --------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: Optimizers | None,
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
    sched_json = scheduler_to_json(scheduler) if scheduler is not None else None
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
    rng = rng_to_json(cuda=torch.cuda.is_available() and torch.cuda.is_initialized())
    _write_durable(tmp / "rng" / f"rank_{rank}.json", lambda f: f.write(rng.encode()))
    if rank == 0 and scheduler is not None:
        _write_durable(tmp / SCHEDULER, lambda f: f.write(sched_json.encode()))
    _fault("state_written", step)
    _barrier()
    files = _manifest(tmp)

    if rank == 0:
        for d in (tmp / STATE, tmp / "rng", tmp):
            _fsync_dir(d)
        meta = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "world_size": _world(),
            "data_state": json.loads(data_json),
            "files": files,
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
    optimizer: Optimizers | None,
    scheduler: Any | None,
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer, scheduler and this rank's RNG. Returns ``(step, data_state)``.

    Collective: every rank calls it, after ``shard_model`` and building the optimizer. ``path`` is a
    checkpoint (``.../step_N``), a checkpoints directory or a run directory (then the latest
    checkpoint is loaded). The world size may differ from the saving run's (the sharded state is
    resharded on load; ranks without a saved RNG state keep theirs, with a warning).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    ckpt = _resolve(path)
    meta = verify_checkpoint(ckpt)
    reader = SafeReader(ckpt / STATE)
    try:
        reader.read_metadata()  # checked here for a clear error; DCP reads it again, as safely
    except UnsafeStateError as e:
        raise CheckpointError(f"{ckpt / STATE}: refused: {e}") from None
    state = _state_dicts(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP: missing keys, shape mismatches, reader errors
        unsafe = _unsafe_cause(e)
        if unsafe is not None:
            raise CheckpointError(f"{ckpt / STATE}: refused: {unsafe}") from None
        raise CheckpointError(f"{ckpt}: cannot load into this model/optimizer: {e}") from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if scheduler is not None:
        if SCHEDULER not in meta["files"]:
            raise CheckpointError(f"{ckpt}: holds no scheduler state")
        try:
            scheduler_from_json(scheduler, (ckpt / SCHEDULER).read_bytes())
        except (UnsafeStateError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / SCHEDULER}: refused: {e}") from None
    rng_file = ckpt / "rng" / f"rank_{_rank()}.json"
    if f"rng/{rng_file.name}" in meta["files"]:
        try:
            rng_from_json(rng_file.read_bytes())
        except UnsafeStateError as e:
            raise CheckpointError(f"{rng_file}: refused: {e}") from None
    else:
        warnings.warn(
            f"{ckpt}: saved with {meta['world_size']} ranks, no RNG state for rank {_rank()}; keeping this "
            "process's RNG state",
            stacklevel=2,
        )
    return int(meta["step"]), dict(meta["data_state"])


def _unsafe_cause(e: BaseException) -> UnsafeStateError | None:
    """The :class:`UnsafeStateError` behind ``e`` (DCP wraps errors of its readers; in a process
    group each rank's exception is kept in a ``CheckpointException``'s ``failures``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, UnsafeStateError):
            return x
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, stack summary)
            for f in failures.values():
                todo += [y for y in (f if isinstance(f, tuple) else (f,)) if isinstance(y, BaseException)]
    return None


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


# what a model directory's processor is saved as, besides the tokenizer's own files: the image (and
# video) processor's settings, the processor's, its chat template; transformers >= 5 writes the first
# three into processor_config.json, older checkpoints (and the hub's) keep preprocessor_config.json
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def export_processor_files(model_dir: str | os.PathLike | None, out_dir: str | os.PathLike) -> list[str]:
    """Copy ``model_dir``'s processor files (image processor, processor, chat template:
    ``PROCESSOR_FILES``) that ``out_dir`` does not already hold into it, so a vision-language model's
    ``final/`` loads with ``AutoProcessor.from_pretrained`` as its source directory does. Files the
    tokenizer's ``save_pretrained`` wrote stay. Returns the names copied (none when ``model_dir`` is
    None or holds none). Rank 0 only; a plain copy, nothing is loaded or run.

    Example: after ``export_pretrained(model, "run/final")`` and the tokenizer's ``save_pretrained``,
    ``export_processor_files("./Qwen2.5-VL-3B", "run/final")`` copies ``preprocessor_config.json``
    (and whichever other processor files the directory has).
    """
    if model_dir is None or _rank() != 0:
        return []
    src, out = Path(model_dir), Path(out_dir)
    if not src.is_dir():
        return []
    copied = []
    for name in PROCESSOR_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    if (src / "additional_chat_templates").is_dir() and not (out / "additional_chat_templates").exists():
        shutil.copytree(src / "additional_chat_templates", out / "additional_chat_templates")
        copied.append("additional_chat_templates")
    return copied
