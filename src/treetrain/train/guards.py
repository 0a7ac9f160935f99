"""What a training run checks so that it fails early and clearly, and resumes only what it wrote.

- :func:`validate_data`: one pass over the whole data file before the first step; every bad record
  is listed (file:line, field), an empty file is an error.
- :func:`data_fingerprint` / :func:`check_resume`: a checkpoint records the data file (size and
  sha256) and the run's options; ``--resume`` refuses a changed data file unless
  ``--allow-data-change`` and reports every changed option.
- :func:`save_or_explain`: a checkpoint that cannot be written (disk full, unwritable output)
  becomes :class:`CheckpointWriteError`, naming the previous checkpoint, which stays intact.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointWriteError",
    "check_read",
    "check_resume",
    "data_fingerprint",
    "save_or_explain",
    "validate_data",
]

# options that may change between a run and its resumption without changing what it computes (not
# steps or epochs: the LR schedule spans the run's total steps, so they are listed when they change)
RUN_CONTROL = {
    "resume", "output", "progress", "plot", "checkpoint_every", "prefetch",
    "allow_data_change", "lazy_validate", "verbose", "device", "attention",
    "keep_checkpoints", "eval_data", "eval_every",
}  # fmt: skip
_PROGRESS_BYTES = 64 * 2**20  # show a validation progress bar for files larger than this


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous one (if any) is intact."""


# ---- data file ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def data_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"path", "size", "sha256"}`` of a data file (hashed once per size and mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "sha256": _sha256(str(p), st.st_size, st.st_mtime_ns)}


def validate_data(path: Path, options: dict[str, Any], progress: bool = True):
    """Read and check every record of ``path`` before any compute (``treetrain.data.records`` reader
    ``options``); returns its ``DataCounts``. Raises ``DataError`` listing the bad records, or
    ``ValueError`` if the file holds no trees. A progress bar shows for files over 64 MiB."""
    from treetrain.data.reader import iter_trees

    size = path.stat().st_size
    stream = iter_trees(path, on_error="collect", **options)
    bar = None
    if progress and size > _PROGRESS_BYTES and path.suffix != ".gz":
        from tqdm.auto import tqdm

        bar = tqdm(total=_count_lines(path), unit=" lines", desc=f"validating {path.name}")
    try:
        for _ in stream:
            if bar is not None:  # tqdm redraws at most every 0.1 s
                bar.update(stream.counts.lines - bar.n)
    finally:
        if bar is not None:
            bar.close()
    return check_read(path, stream)


def _count_lines(path: Path) -> int:
    """Newlines in ``path`` (a raw byte scan, ~1 GB/s: the progress bar's total)."""
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
    return n


def check_read(path: Path, stream):
    """After a pass of ``stream`` (``iter_trees(path, on_error="collect")``) over ``--data path``:
    its ``DataCounts``; raises ``DataError`` listing the bad records, or ``ValueError`` if the file
    is empty or holds no trees (``train``'s and ``stats``' one check)."""
    stream.raise_errors()
    c = stream.counts
    if c.samples == 0:
        what = "is empty" if c.lines == c.blank_lines else "holds no trees"
        skipped = f" ({c.skipped_oversized} skipped by --skip-oversized)" if c.skipped_oversized else ""
        raise ValueError(f"--data {path}: the file {what}{skipped}; pass a JSONL file with one tree per line")
    return c


# ---- resume --------------------------------------------------------------------------------------


def _flag(name: str) -> str:
    return name if name.startswith("loss.") else "--" + name.replace("_", "-")


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["--lr 0.001 -> 0.01", ...]``: options that differ, run-control ones (steps, output, ...)
    left out. ``loss`` options compare key by key."""
    flat_old = {k: v for k, v in old.items() if k != "loss"} | {
        f"loss.{k}": v for k, v in old.get("loss", {}).items()
    }
    flat_new = {k: v for k, v in new.items() if k != "loss"} | {
        f"loss.{k}": v for k, v in new.get("loss", {}).items()
    }
    out = []
    for k in sorted(flat_old.keys() | flat_new.keys()):
        if k in RUN_CONTROL or k == "data":
            continue
        a, b = flat_old.get(k), flat_new.get(k)
        if isinstance(a, tuple | list) and isinstance(b, tuple | list):
            a, b = list(a), list(b)
        if a != b:
            out.append(f"{_flag(k)} {a} -> {b}")
    return out


def check_resume(checkpoint: Path, data_state: dict[str, Any], data: Path, cfg, announce: bool) -> None:
    """Refuse to resume on another data file (unless ``--allow-data-change``); report changed options."""
    saved = data_state.get("data")
    if saved is not None:
        now = data_fingerprint(data)
        if (saved.get("size"), saved.get("sha256")) != (now["size"], now["sha256"]):
            if not getattr(cfg, "allow_data_change", False):
                raise ValueError(
                    f"--resume: the data file changed since {checkpoint} was written (then {saved['path']}, "
                    f"{saved['size']:,} bytes, sha256 {saved['sha256'][:12]}; now {now['path']}, "
                    f"{now['size']:,} bytes, sha256 {now['sha256'][:12]}): the data position would point "
                    "into other trees. Pass the original --data, or --allow-data-change to continue anyway"
                )
            if announce:
                print(
                    f"treetrain train: warning: resuming on a changed data file ({now['path']})",
                    file=sys.stderr,
                )
    old_cfg = data_state.get("config")
    if old_cfg is not None and announce:
        changes = config_changes(old_cfg, cfg.to_dict())
        if changes:
            print(
                f"treetrain train: resuming {checkpoint.name} with changed options: {'; '.join(changes)}",
                file=sys.stderr,
            )


# ---- checkpoint writing ---------------------------------------------------------------------------


def _os_error(exc: BaseException, out: Path | None = None) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, or one a rank hit inside ``torch.distributed.checkpoint``.

    torch's zip writer reports a failed write (a full disk included) as a ``RuntimeError``
    (``PytorchStreamWriter failed writing file`` / ``unexpected pos``); that becomes ``ENOSPC`` when
    ``out``'s file system has (almost) no space left, else ``EIO``.
    """
    inner = [exc, *(e for e, _trace in getattr(exc, "failures", {}).values())]
    for e in inner:
        if isinstance(e, OSError):
            return e
    for e in inner:
        if isinstance(e, RuntimeError) and any(
            s in str(e) for s in ("PytorchStreamWriter failed", "unexpected pos")
        ):
            full = out is not None and shutil.disk_usage(out).free < 2**20
            code = errno.ENOSPC if full else errno.EIO
            return OSError(code, os.strerror(code))
    return None


def save_or_explain(out: Path, step: int, model, optimizer, scheduler, trees_consumed: int, cfg) -> Path:
    """``checkpoint.save_checkpoint`` with the data file's fingerprint and the options in the data
    state; an OS error (disk full, unwritable directory) becomes :class:`CheckpointWriteError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    from treetrain.train import checkpoint
    from treetrain.train.batches import data_path

    state = {
        "trees_consumed": trees_consumed,
        "data": data_fingerprint(data_path(cfg)),
        "config": cfg.to_dict(),
    }
    try:
        keep = getattr(cfg, "keep_checkpoints", 2)
        return checkpoint.save_checkpoint(out, step, model, optimizer, scheduler, state, keep=keep)
    except (OSError, CheckpointException, RuntimeError) as exc:
        e = _os_error(exc, out)
        if e is None:
            raise
        last = checkpoint.latest_checkpoint(out)
        kept = (
            f"the previous checkpoint {last} is intact and 'latest' still points to it"
            if last
            else "no earlier checkpoint exists"
        )
        what = e.strerror or str(e)
        where = f" ({e.filename})" if e.filename else ""
        raise CheckpointWriteError(
            f"step {step}: writing the checkpoint failed: {what}{where}; {kept}. Free space or choose "
            "another --output, then continue with --resume"
        ) from None
