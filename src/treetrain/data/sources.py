"""Table data sources: Parquet and Arrow files and ``datasets.save_to_disk`` directories.

Each row becomes one record for :mod:`treetrain.data.records`'s parser, so the same validation applies and
errors name the row (``data.parquet: row 7: field "paths"[0]: ...``). Rows are read in record
batches (Parquet row groups, Arrow IPC batches, memory-mapped ``datasets`` shards): memory stays
bounded by a batch, whatever the file size.

Field names, in order of precedence:

1. ``columns``: an explicit mapping ``treetrain field -> column`` (``--columns paths=ids,loss_masks=m``);
2. treetrain's own names (``paths``, ``loss_masks``, ``advantages``, ``messages``, ``nodes``, ...);
3. TRL's dataset conventions, one sequence per row (:mod:`treetrain.data.rows`, which JSONL uses
   too; rows with an equal prompt merge into one tree):

   - conversational ``messages`` (a list of ``{"role", "content"}``): one conversation;
   - conversational ``prompt`` + ``completion`` (message lists): ``messages = prompt + completion``;
   - standard ``prompt`` + ``completion`` (text): tokenized as TRL does (needs a tokenizer);
   - tokenized ``input_ids`` (+ ``completion_mask`` or ``assistant_masks``):
     ``paths = [input_ids]``, ``loss_masks = [mask]``;
   - tokenized ``prompt_ids`` + ``completion_ids``: one path, loss on the completion.

Example, a TRL tokenized row ``{"prompt_ids": [1, 2], "completion_ids": [3, 4]}`` becomes
``{"paths": [[1, 2, 3, 4]], "loss_masks": [[0, 0, 1, 1]]}``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["TABLE_SUFFIXES", "is_table_source", "iter_rows", "parse_columns", "rename_columns"]

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")
BATCH_ROWS = 64  # rows per record batch read


def is_table_source(path: str | os.PathLike) -> bool:
    """A Parquet/Arrow file, or a directory written by ``datasets``' ``save_to_disk``."""
    p = Path(path)
    if p.is_dir():
        return any((p / name).is_file() for name in ("state.json", "dataset_dict.json"))
    return p.suffix.lower() in TABLE_SUFFIXES


def check_data_path(path: str, fix: str = "a JSONL (or Parquet/Arrow/datasets) file") -> None:
    """A ``ValueError`` naming ``--data`` when ``path`` is a plain directory or does not exist;
    ``fix``: what to pass instead."""
    if Path(path).is_dir() and not is_table_source(path):
        raise ValueError(
            f"--data {path}: is a directory, not a data file (nor a datasets.save_to_disk directory); "
            "pass a JSONL file of trees or a Parquet/Arrow file"
        )
    if not Path(path).exists():
        raise ValueError(f"--data {path}: no such data file; pass {fix}")


def parse_columns(value: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"paths=ids,loss_masks=mask"`` (or a mapping) -> ``{"paths": "ids", "loss_masks": "mask"}``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            field, eq, column = part.partition("=")
            if not eq or not field.strip() or not column.strip():
                raise ValueError(f"--columns {value!r}: expected FIELD=COLUMN pairs, e.g. paths=input_ids")
            items.append((field.strip(), column.strip()))
    out: dict[str, str] = {}
    for field, column in items:
        if not isinstance(field, str) or not isinstance(column, str):
            raise ValueError(f"--columns: expected field and column names, got {field!r}={column!r}")
        if field in out:
            raise ValueError(f"--columns: field {field!r} is mapped twice")
        out[field] = column
    return out


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"reading tables needs {module}: pip install 'treetrain[datasets]'") from None


def _batches(path: Path) -> Iterator[Any]:
    """``pyarrow.RecordBatch``es of a table source, lazily."""
    if path.is_dir():
        datasets = _require("datasets")
        ds = datasets.load_from_disk(str(path))  # memory-mapped Arrow: nothing loaded yet
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(
                    f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)}); "
                    f"pass the split's own directory, e.g. {path / next(iter(ds))}"
                )
            ds = ds["train"]
        yield from ds.with_format("arrow").iter(batch_size=BATCH_ROWS)  # pyarrow Tables
        return
    pa = _require("pyarrow")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        # pre_buffer=False: pre-buffering reads ahead whole row groups (memory grew with the file)
        yield from pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=BATCH_ROWS)
        return
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield from _slices(reader.get_batch(i))
    except pa.ArrowInvalid:  # the streaming IPC format (what datasets writes)
        source.seek(0)
        for batch in pa.ipc.open_stream(source):
            yield from _slices(batch)


def _slices(batch) -> Iterator[Any]:
    """A record batch in ``BATCH_ROWS``-row views (zero-copy over the memory map)."""
    for start in range(0, batch.num_rows, BATCH_ROWS):
        yield batch.slice(start, BATCH_ROWS)


def iter_rows(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of a table source as plain Python dicts, one record batch in memory at a time.

    Raises ``ValueError`` for a source that cannot be read (the message names it)."""
    for batch in _batches(Path(path)):
        yield from batch.to_pylist()


def rename_columns(row: dict[str, Any], columns: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A table row with ``columns`` (``treetrain field -> column``) applied and ``None`` values (a
    column absent from this row) dropped. Columns the mapping does not name keep their names, so an
    unknown one is reported by the parser like an unknown JSON key."""
    columns = dict(columns or {})
    missing = [c for c in columns.values() if c not in row]
    if missing:
        raise ValueError(f"--columns: no column {missing[0]!r} in the data; columns: {', '.join(row)}")
    renamed = set(columns.values())
    rec = {f: row[c] for f, c in columns.items()}
    rec |= {k: v for k, v in row.items() if k not in renamed and k not in rec}
    return {k: v for k, v in rec.items() if v is not None}
