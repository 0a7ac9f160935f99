"""Reading data files lazily: JSONL (``.gz`` too) and tables, one record at a time, into trees.

:func:`iter_trees` yields ``(tree, SampleInfo)``; :func:`validate_file` reads a whole file and lists every
bad record; :class:`prefetch` reads ahead in a thread; :func:`sample_path` finds the bundled samples.
Nothing is dropped silently: blank lines, invalid records and oversized samples are counted in
:class:`DataCounts`.
"""

from __future__ import annotations

import gzip
import json
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from treetrain.data import rows, sources
from treetrain.data.fields import DataError, _Invalid
from treetrain.data.grouping import GROUPINGS
from treetrain.data.images import BASE_DIR
from treetrain.data.records import FORMATS, _build, _parts
from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "DataCounts",
    "SampleInfo",
    "TreeStream",
    "iter_trees",
    "list_samples",
    "prefetch",
    "sample_path",
    "validate_file",
]


_MAX_STORED_ERRORS = 1000  # collected errors kept in memory; the count is always exact
MAX_LINE_BYTES = 256 * 2**20  # default limit on one JSONL line
_CHUNK = 1 << 16  # lines are read this much at a time


@dataclass(frozen=True)
class SampleInfo:
    """Where a tree came from: ``file``, 1-based ``line``, its ``format`` and the record's ``id``."""

    file: str
    line: int
    format: str
    id: str | int | None = None
    rows: int = 1  # table rows / JSONL lines merged into this tree (rows with an equal prompt)


@dataclass
class DataCounts:
    """What a pass over a file saw. ``lines == blank_lines + samples + grouped_rows +
    skipped_oversized + errors`` for a complete pass; token counts cover the ``samples`` only."""

    file: str
    lines: int = 0  # lines read, blank ones included
    blank_lines: int = 0
    samples: int = 0  # valid trees yielded
    skipped_oversized: int = 0  # valid but a path is longer than ``capacity`` (skip_oversized=True)
    errors: int = 0  # invalid records (on_error="collect")
    grouped_rows: int = 0  # rows merged into the tree of an earlier row with the same prompt
    paths: int = 0
    tree_tokens: int = 0  # distinct tokens: what tree training computes
    path_tokens: int = 0  # sum of path lengths: what the per-path baseline computes
    loss_tokens: int = 0  # path tokens with loss (all of them when a sample has no loss_masks)
    max_path_len: int = 0
    formats: dict[str, int] = field(default_factory=dict)

    @property
    def por(self) -> float:
        """Potential overlap ratio over the valid samples, ``1 - tree_tokens / path_tokens``."""
        return 1.0 - self.tree_tokens / self.path_tokens if self.path_tokens else 0.0

    @property
    def rows(self) -> int:
        """Rows (lines) that made the valid and the skipped trees: more than the trees where rows
        with an equal prompt merged."""
        return self.samples + self.skipped_oversized + self.grouped_rows

    def add(self, tree: TrajectoryTree, fmt: str) -> None:
        self.samples += 1
        self.paths += tree.num_paths
        self.tree_tokens += tree.num_tokens
        self.path_tokens += tree.num_path_tokens
        masks = tree.fields.get("loss_masks")
        self.loss_tokens += int(sum(m.sum() for m in masks)) if masks is not None else tree.num_path_tokens
        self.max_path_len = max(self.max_path_len, int(tree.path_lengths.max()))
        self.formats[fmt] = self.formats.get(fmt, 0) + 1

    def summary(self) -> str:
        skipped = f", {self.skipped_oversized} skipped (oversized)" if self.skipped_oversized else ""
        errors = f", {self.errors} invalid" if self.errors else ""
        if self.grouped_rows:
            errors += f" (from {self.rows} rows merged by prompt)"
        return (
            f"{self.file}: {self.samples} trees{skipped}{errors}, {self.paths} paths, "
            f"{self.tree_tokens} tree tokens / {self.path_tokens} path tokens (POR {self.por:.1%}), "
            f"longest path {self.max_path_len}"
        )


class _TooLong(bytes):
    """Stands for a line longer than the limit (its bytes were read and dropped)."""

    limit: int


def _open_lines(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The file's lines, each read in chunks of at most 64 KiB: a line over ``max_line_bytes`` is
    yielded as a :class:`_TooLong` marker, so memory stays under the limit plus one chunk."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        while chunk := f.readline(min(_CHUNK, max_line_bytes + 1)):
            parts, size = [chunk], len(chunk)
            while not parts[-1].endswith(b"\n") and size <= max_line_bytes:
                more = f.readline(min(_CHUNK, max_line_bytes + 1 - size))
                if not more:
                    break
                parts.append(more)
                size += len(more)
            if size > max_line_bytes:
                tail = parts.pop()
                parts.clear()
                while not tail.endswith(b"\n") and (tail := f.readline(_CHUNK)):  # skip the rest
                    pass
                too_long = _TooLong(b"-")
                too_long.limit = max_line_bytes
                yield too_long
            else:
                yield b"".join(parts)


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name} (NaN and Infinity are not allowed)")


def _decode(raw: bytes, lineno: int) -> Any:
    """Bytes of one line -> JSON value; raises _Invalid."""
    if isinstance(raw, _TooLong):
        raise _Invalid(
            f"the line is longer than max_line_bytes={raw.limit:,} bytes; "
            "raise the limit (--max-line-bytes) if the record is meant to be this large"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid(f"not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    if lineno == 1:
        text = text.removeprefix("\ufeff")
    text = text.rstrip("\r\n")  # the line's end is no part of the record: columns count within it
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        cut = " (the line ends before the record does: cut short?)" if e.pos >= len(text) and text else ""
        raise _Invalid(f"invalid JSON: {e.msg} (column {e.colno}){cut}") from None
    except ValueError as e:
        raise _Invalid(f"invalid JSON: {e}") from None
    except RecursionError:
        raise _Invalid("invalid JSON: nested too deeply") from None


def _row_record(row: dict, columns: dict[str, str]) -> dict:
    """A table row -> a record (``treetrain.data.sources``); raises _Invalid."""
    try:
        return sources.rename_columns(row, columns)
    except ValueError as e:
        raise _Invalid(str(e)) from None


class TreeStream(Iterator[tuple[TrajectoryTree, SampleInfo]]):
    """The lazy reader behind :func:`iter_trees`: iterate it for ``(tree, info)``; ``counts`` and
    ``errors`` fill in as it goes (complete once it is exhausted)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        format: str | None = None,
        vocab_size: int | None = None,
        capacity: int | None = None,
        skip_oversized: bool = False,
        tokenizer=None,
        on_error: str = "raise",
        max_line_bytes: int = MAX_LINE_BYTES,
        columns: dict[str, str] | str | None = None,
        group_rows: str = "consecutive",
        allow_invalid_tool_arguments: bool = False,
        check: Callable[[TrajectoryTree, SampleInfo], None] | None = None,
    ):
        if format is not None and format not in FORMATS:
            raise ValueError(f"format: expected one of {FORMATS} or None, got {format!r}")
        if on_error not in ("raise", "collect"):
            raise ValueError(f"on_error: expected 'raise' or 'collect', got {on_error!r}")
        for name, v in (("vocab_size", vocab_size), ("capacity", capacity)):
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name}: expected a positive integer or None, got {v!r}")
        self.path = Path(path)
        self.table = sources.is_table_source(self.path)  # Parquet, Arrow, a datasets directory
        self.columns = sources.parse_columns(columns)
        if self.columns and not self.table:
            raise ValueError(f"columns: only for Parquet/Arrow/datasets sources, not {path}")
        if not (self.path.is_file() or self.table):
            raise FileNotFoundError(f"{path}: no such data file")
        if tokenizer is not None:
            from treetrain.data.chat import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.format, self.vocab_size, self.capacity = format, vocab_size, capacity
        self.skip_oversized, self.tokenizer, self.on_error = skip_oversized, tokenizer, on_error
        if not isinstance(max_line_bytes, int) or max_line_bytes <= 0:
            raise ValueError(f"max_line_bytes: expected a positive integer, got {max_line_bytes!r}")
        self.counts = DataCounts(file=str(path))
        self.max_line_bytes = max_line_bytes
        if group_rows not in GROUPINGS:
            raise ValueError(f"group_rows: expected one of {', '.join(GROUPINGS)}, got {group_rows!r}")
        self.group = group_rows
        self.allow_invalid_tool_arguments, self.check = bool(allow_invalid_tool_arguments), check
        self.errors: list[DataError] = []
        self._gen = self._run()

    def __next__(self) -> tuple[TrajectoryTree, SampleInfo]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def raise_errors(self, max_errors: int = 20) -> None:
        """Raise one :class:`DataError` listing the first ``max_errors`` invalid records (and how many
        there are), if the pass collected any (``on_error="collect"``); a lone one: its own error."""
        c = self.counts
        if not c.errors:
            return
        if c.errors == 1 and len(self.errors) == 1:
            self.errors[0].errors = self.errors[:1]
            raise self.errors[0]
        shown = self.errors[:max_errors]
        more = f"\n  ... and {c.errors - len(shown)} more" if c.errors > len(shown) else ""
        listing = "\n  ".join(map(str, shown))
        reason = f"{c.errors} of {c.lines - c.blank_lines} records are invalid:\n  {listing}{more}"
        err = DataError(reason, file=c.file)
        err.errors = list(self.errors)
        raise err

    def _rows(self) -> Iterator[rows.Row | _Invalid]:
        """Each non-blank line or row, parsed (an ``_Invalid`` with its ``line`` for a bad one)."""
        c = self.counts
        raws = sources.iter_rows(self.path) if self.table else _open_lines(self.path, self.max_line_bytes)
        BASE_DIR.set(self.path.resolve().parent if not self.path.is_dir() else self.path.resolve())
        for lineno, raw in enumerate(raws, start=1):
            c.lines += 1
            if not self.table and not raw.strip():
                c.blank_lines += 1
                continue
            key = None
            try:
                ident = None
                record = _row_record(raw, self.columns) if self.table else _decode(raw, lineno)
                ident = record.get("id") if isinstance(record, dict) else None
                if isinstance(record, dict):  # TRL's names (JSONL and tables), see treetrain.data.rows
                    try:
                        record, key = rows.trl_record(record, self.tokenizer)
                    except ValueError as e:
                        raise _Invalid(str(e)) from None
                paths, fields, where, fmt = _parts(
                    record, self.format, self.vocab_size, self.tokenizer, self.allow_invalid_tool_arguments
                )
            except _Invalid as e:
                e = rows.row_error(e, key)
                e.line = lineno
                e.record = ident if type(ident) in (str, int) else None
                yield e
                continue
            yield rows.Row(lineno, key if self.group != "none" else None, paths, fields, where, fmt, ident)

    def _run(self) -> Iterator[tuple[TrajectoryTree, SampleInfo]]:
        file, c = str(self.path), self.counts
        for group in rows.group_rows(self._rows(), self.group):
            try:
                if isinstance(group, _Invalid):
                    raise group
                tree = self._tree(group)
                if tree is None:  # skipped as oversized, counted
                    continue
                first = group[0]
                info = SampleInfo(
                    file=file, line=first.line, format=first.format, id=first.id, rows=len(group)
                )
                if self.check is not None:
                    self.check(tree, info)
            except _Invalid as e:  # from _build: the tree's first row
                line, unit = e.line if e.line is not None else group[0].line, "row" if self.table else "line"
                record = e.record if isinstance(group, _Invalid) else group[0].id
                self._fail(DataError(e.reason, file=file, line=line, field=e.where, unit=unit, record=record))
                continue
            except ValueError as e:  # the caller's check: its message names the record
                self._fail(e if isinstance(e, DataError) else DataError(str(e)))
                continue
            c.add(tree, group[0].format)
            c.grouped_rows += len(group) - 1
            yield tree, info

    def _tree(self, group: list[rows.Row]) -> TrajectoryTree | None:
        """The group's tree; None for one skipped as oversized (``skip_oversized``, counted)."""
        paths, fields, where = rows.merge(group)
        tree = _build(paths, fields)
        longest = int(tree.path_lengths.max())
        if self.capacity is None or longest <= self.capacity:
            return tree
        if self.skip_oversized:
            self.counts.skipped_oversized += 1
            self.counts.grouped_rows += len(group) - 1
            return None
        line, at = where[int(tree.path_lengths.argmax())]
        err = _Invalid(
            f"a path of {longest} tokens is longer than the token budget "
            f"capacity={self.capacity} (raise the capacity, or pass skip_oversized=True to skip "
            f"and count such samples)",
            *at,
        )
        err.line = line
        raise err

    def _fail(self, err: DataError) -> None:
        """An invalid record: raised (``on_error="raise"``), or counted and kept for the listing."""
        if self.on_error == "raise":
            raise err from None
        self.counts.errors += 1
        if len(self.errors) < _MAX_STORED_ERRORS:
            self.errors.append(err)


def iter_trees(path: str | os.PathLike, **options: Any) -> TreeStream:
    """Read a JSONL file (``.gz`` too) or a table lazily, one record at a time, and yield
    ``(tree, SampleInfo)`` (a :class:`TreeStream`).

    ``options``: ``format``: force one format instead of detecting it per line. ``vocab_size``: token
    ids must be below it. ``capacity``: a sample whose longest path exceeds it is an error, or with
    ``skip_oversized=True`` skipped and counted. ``tokenizer``: for ``messages`` lines, a Hugging
    Face tokenizer, a local directory, or ``"qwen"``. ``on_error="collect"`` skips invalid records
    into ``stream.errors`` instead of raising at the first one. A line longer than
    ``max_line_bytes`` is an invalid record (checked while reading, in bounded memory).
    ``columns``: table sources' ``field=column`` mapping. ``group_rows``: rows in TRL's
    one-completion-per-row layouts whose prompts are equal become one tree: ``"consecutive"`` runs
    of rows (bounded memory), ``"file"`` (every row held until the end) or ``"none"`` (see
    :mod:`treetrain.data.rows`). ``allow_invalid_tool_arguments=True`` accepts tool-call
    ``arguments`` strings that are not a JSON object (by default an error: the model would learn to
    emit them). ``check(tree, info)``: the caller's own record check (a training objective's
    needs), run on each valid tree before it counts; a ``ValueError`` it raises makes the record
    invalid like any other (raised, or collected with ``on_error="collect"``).

    Example::

        >>> stream = iter_trees("data.jsonl", vocab_size=151936, capacity=8192)
        >>> for tree, info in stream:
        ...     ...
        >>> stream.counts.por
    """
    return TreeStream(path, **options)


def validate_file(path: str | os.PathLike, *, max_errors: int = 20, **options: Any) -> DataCounts:
    """One full streaming pass (every tree built, then dropped) before any compute; ``options``:
    those of :func:`iter_trees` but ``on_error``.

    Returns the :class:`DataCounts`; raises one :class:`DataError` listing the first
    ``max_errors`` problems (and how many there are) if any record is invalid.

    Example::

        >>> counts = validate_file("data.jsonl", vocab_size=151936, capacity=8192)
        >>> counts.samples, f"{counts.por:.0%}"
        (120, '71%')
    """
    stream = iter_trees(path, on_error="collect", **options)
    for _ in stream:
        pass
    stream.raise_errors(max_errors)
    return stream.counts


_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _prefetch_worker(it: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    # module-level, holding no reference to the prefetch object, so dropping that object stops us
    try:
        for item in it:
            if not _put(q, stop, item):
                return
    except BaseException as e:  # delivered to the consumer, raised there
        _put(q, stop, _Failure(e))
        return
    _put(q, stop, _END)


class prefetch(Iterator):  # noqa: N801 - used like a function
    """Run ``iterable`` in a background thread, ``depth`` items ahead, so building trees (JSON,
    tokenization, packing) overlaps compute. Exceptions reach the consumer at the item where they
    happened; ``close()`` (or leaving a ``with`` block, or dropping the iterator) stops the thread.

    Example::

        >>> for tree, info in prefetch(iter_trees("data.jsonl"), depth=4):
        ...     train_step(tree)
    """

    def __init__(self, iterable: Iterable, depth: int = 2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth: expected a positive integer, got {depth!r}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_prefetch_worker,
            args=(iter(iterable), self._queue, self._stop),
            name="treetrain-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self._done = True
            self._thread.join()
            if item is _END:
                raise StopIteration
            raise item.exc
        return item

    def close(self) -> None:
        self._done = True
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_stop"):  # __init__ may have failed before creating it
            self._stop.set()


_SAMPLE_SUFFIXES = (".jsonl", ".jsonl.gz")


def list_samples() -> list[str]:
    """Names of the bundled samples (for :func:`sample_path`)."""
    root = resources.files("treetrain").joinpath("samples")
    names = []
    for entry in root.iterdir():
        for suffix in _SAMPLE_SUFFIXES:
            if entry.name.endswith(suffix):
                names.append(entry.name[: -len(suffix)])
    return sorted(names)


def sample_path(name: str) -> Path:
    """Path of a bundled sample file, by name with or without extension.

    Example::

        >>> sample_path("agent-dialogues")
        PosixPath('.../treetrain/samples/agent-dialogues.jsonl.gz')
    """
    root = resources.files("treetrain").joinpath("samples")
    for candidate in (name, *(name + s for s in _SAMPLE_SUFFIXES)):
        entry = root.joinpath(candidate)
        if entry.is_file():
            if not isinstance(entry, Path):  # zipped install: samples must be on disk to stream them
                raise RuntimeError(f"sample {name}: the package is not installed as files ({entry})")
            return entry
    raise FileNotFoundError(f"no bundled sample {name!r}; available: {', '.join(list_samples())}")
