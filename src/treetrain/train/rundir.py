"""Run directories: ``treetrain train --output D`` never loses an earlier run and never touches
files it did not write.

A run writes only these entries of ``D`` (:data:`RUN_FILES`, :data:`RUN_DIRS`)::

    config.json  metrics.jsonl  training.png   files
    checkpoints/latest, checkpoints/step_N/    its checkpoints (checkpoint.py)
    final/config.json, final/*.safetensors ... the exported model (save_pretrained), its tokenizer
                                               (tokenizer.json, chat template, ...) or a LoRA adapter

:func:`check_output` decides, before any work, whether a run may write into ``D``::

    D holds             no flag   --resume                        --overwrite
    nothing / absent    run       run from step 0                 run
    an earlier run      refused   continue from its checkpoint    replace the run's files
    other files only    refused   refused                         run beside them

``--resume`` on a run that finished without checkpoints is refused (it would redo the run and
replace its final model). A run that stopped before its first step left only ``config.json`` (and
an empty ``metrics.jsonl``): a new run replaces them without ``--overwrite``. :func:`clear_run`
(``--overwrite``) deletes only the run's own entries; a file of another program where the run
writes one (say an HF ``config.json``) is always refused.

Without ``--output`` (:func:`default_output`) a run never meets an earlier one: it writes to
``runs/train``, or to ``runs/train-N`` one past the newest of them that holds a run; ``--resume``
without ``--output`` continues the newest.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

__all__ = [
    "DEFAULT_OUTPUT",
    "RUN_DIRS",
    "RUN_FILES",
    "check_output",
    "clear_run",
    "default_output",
    "run_entries",
]

DEFAULT_OUTPUT = Path("runs/train")

RUN_FILES = ("config.json", "metrics.jsonl", "metrics.jsonl.tmp", "training.png")
RUN_DIRS = ("checkpoints", "final")
_CHECKPOINT_RE = re.compile(r"^(latest|latest\.tmp|step_\d+|step_\d+\..*tmp)$")
_FINAL_RE = re.compile(
    r"^(config\.json|generation_config\.json|.*\.safetensors(\.index\.json)?|adapter_config\.json"
    r"|tokenizer\.json|tokenizer_config\.json|chat_template\.(jinja|json)|special_tokens_map\.json"
    r"|added_tokens\.json|vocab\.json|merges\.txt|tokenizer\.model)$"
)
_CONFIG_KEYS = {"objective", "packing", "batch_trees", "output"}  # treetrain's config.json has these


def _first_line(path: Path, limit: int = 1 << 20) -> bytes:
    with open(path, "rb") as f:
        return f.readline(limit)


def _is_ours(path: Path) -> bool:
    """Whether a file at one of :data:`RUN_FILES` was written by treetrain (by its content)."""
    try:
        if path.name == "config.json":
            if path.stat().st_size > 1 << 20:
                return False
            value = json.loads(path.read_bytes())
            return isinstance(value, dict) and value.keys() >= _CONFIG_KEYS
        if path.name.startswith("metrics.jsonl"):
            line = _first_line(path)
            return not line.strip() or (isinstance(rec := json.loads(line), dict) and "step" in rec)
        return path.name == "training.png" and _first_line(path, 8).startswith(b"\x89PNG")
    except (OSError, ValueError, TypeError, RecursionError):
        return False


def run_entries(out: Path) -> tuple[list[Path], list[Path]]:
    """``(the run's own files and directories, foreign files at paths the run writes)`` in ``out``.

    Inside ``checkpoints/`` and ``final/`` only the names treetrain writes count as the run's."""
    ours: list[Path] = []
    clashes: list[Path] = []
    for name in RUN_FILES:
        p = out / name
        if p.is_file() or p.is_symlink():
            (ours if p.is_file() and not p.is_symlink() and _is_ours(p) else clashes).append(p)
        elif p.exists():
            clashes.append(p)
    for name, pattern in (("checkpoints", _CHECKPOINT_RE), ("final", _FINAL_RE)):
        d = out / name
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            clashes.append(d)
        elif d.is_dir():
            ours += sorted(p for p in d.iterdir() if pattern.match(p.name) and not p.is_symlink())
    return ours, clashes


def _listing(paths: list[Path], out: Path, n: int = 5) -> str:
    names = [str(p.relative_to(out)) for p in paths]
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _numbered(base: Path) -> list[tuple[int, Path]]:
    """``base`` (as 1) and its siblings ``base-N`` that exist, by N."""
    found = [(1, base)] if base.exists() else []
    if base.parent.is_dir():
        pattern = re.compile(rf"^{re.escape(base.name)}-(\d+)$")
        found += [(int(m[1]), p) for p in base.parent.iterdir() if (m := pattern.match(p.name))]
    return sorted(found)


def default_output(resume: bool, base: Path = DEFAULT_OUTPUT) -> Path:
    """The output directory of a run given no ``--output``: ``base`` (``runs/train``) if it holds
    no run, else ``base-N`` one past the newest (highest N) of them, or that newest one itself when it
    holds no results (a run that stopped before its first step). ``resume``: the newest that exists.
    Reads only; every rank computes the same directory.

    Example: with ``runs/train`` and ``runs/train-2`` holding runs, a new run writes to
    ``runs/train-3`` and ``--resume`` continues ``runs/train-2``.
    """
    found = _numbered(base)
    if not found:
        return base
    n, newest = found[-1]
    if resume:
        return newest
    try:
        check_output(newest, resume=False, overwrite=False)
        return newest  # empty, or a run that never stepped: replaced, as with --output
    except ValueError:
        return base.with_name(f"{base.name}-{n + 1}")


def check_output(out: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Raise ``ValueError`` (naming ``--resume`` / ``--overwrite``) unless a run may write into
    ``out`` (see the module's table). Reads only; every rank may call it."""
    from treetrain.train.checkpoint import latest_checkpoint

    out = Path(out)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite: continue the run or replace it, not both")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out}: exists and is not a directory")
    if not out.is_dir():
        return
    ours, clashes = run_entries(out)
    if clashes:
        raise ValueError(
            f"--output {out}: holds {_listing(clashes, out)}, not written by treetrain, where a run writes "
            "its own files; they are never replaced (not even with --overwrite): choose another --output"
        )
    holding_ours = {p.parent for p in ours}  # checkpoints/, final/ with the run's entries in them
    others = [p for p in out.iterdir() if p not in ours and p not in holding_ours]
    if resume:
        if not ours and others:
            raise ValueError(
                f"--output {out}: --resume, but it holds no treetrain run ({_listing(others, out)}); "
                "choose the run's directory, or an empty or new one"
            )
        if latest_checkpoint(out) is None and any(p.parent.name == "final" for p in ours):
            raise ValueError(
                f"--output {out}: --resume, but this finished run has no checkpoint to continue from "
                "(it ran without --checkpoint-every); pass --overwrite to run it again from the start "
                "(its files are replaced, others kept), or choose another --output"
            )
        return
    # a run that stopped before its first step (bad data, a typo) left only its config: replaced
    results = [p for p in ours if p != out / "config.json" and not (p.is_file() and p.stat().st_size == 0)]
    if results and not overwrite:
        last = latest_checkpoint(out)
        resume_hint = (
            f"pass --resume to continue it from its latest checkpoint ({last.name}), "
            if last is not None
            else "it has no checkpoint to continue from (it ran without --checkpoint-every); "
        )
        raise ValueError(
            f"--output {out}: holds an earlier run ({_listing(results, out)}); {resume_hint}pass --overwrite "
            "to replace its files (other files there are kept), or choose another --output (without "
            "--output each run gets a new directory: runs/train, runs/train-2, ...)"
        )
    if others and not overwrite:
        raise ValueError(
            f"--output {out}: not empty and not a treetrain run ({_listing(others, out)}); pass --overwrite "
            "to write the run beside these files (they are never touched), or choose an empty or new --output"
        )


def clear_run(out: str | Path) -> list[Path]:
    """Delete the earlier run's own entries in ``out`` (``--overwrite``); nothing else. Returns
    what was deleted. Call on one rank, after :func:`check_output`."""
    out = Path(out)
    if not out.is_dir():
        return []
    ours, clashes = run_entries(out)
    assert not clashes, clashes  # check_output refused those
    for p in ours:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name in RUN_DIRS:  # remove checkpoints/ and final/ if nothing foreign is left in them
        d = out / name
        if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()
    return ours
