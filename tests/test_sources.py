"""Parquet, Arrow and ``datasets`` sources: the same trees as the equivalent JSONL, column mapping,
TRL's field names, errors that name the row, and bounded memory while streaming."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees, validate_file
from treetrain.data.rows import trl_record
from treetrain.data.sources import iter_rows, parse_columns

ROWS = [
    {"paths": [[1, 2, 3], [1, 2, 4, 5]], "loss_masks": [[0, 1, 1], [0, 1, 1, 1]], "advantages": [1.0, -0.5]},
    {"paths": [[7, 8, 9, 10]], "loss_masks": [[0, 0, 1, 1]], "advantages": [2.0]},
    {
        "paths": [[3, 3], [3, 4], [3, 5, 6]],
        "loss_masks": [[1, 1], [1, 1], [0, 1, 1]],
        "advantages": [0.0, 1.0, 2.0],
    },
]


def _trees(path, **kw):
    return [(t.num_tokens, [p.tolist() for p in t.paths()], t.fields) for t, _ in iter_trees(path, **kw)]


def _same_trees(a, b):
    assert len(a) == len(b)
    for (na, pa_, fa), (nb, pb, fb) in zip(a, b):
        assert na == nb and pa_ == pb and fa.keys() == fb.keys()
        for k in fa:
            for x, y in zip(fa[k], fb[k]):
                np.testing.assert_array_equal(x, y)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "trees.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_parquet_arrow_and_datasets_read_like_jsonl(tmp_path, jsonl):
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    want = _trees(jsonl)
    assert want[0][0] == 5  # 1 2 3 4 5: the shared prefix once
    for name in ("t.parquet", "t.arrow", "s.arrow", "ds", "dd"):
        _same_trees(_trees(tmp_path / name), want)
    from treetrain.cli import main

    assert main(["stats", "--data", str(tmp_path / "ds"), "--capacity", "4"]) == 0  # stats reads them too
    counts = validate_file(tmp_path / "t.parquet")
    assert counts.samples == 3 and counts.lines == 3 and counts.tree_tokens == 5 + 4 + 5


def test_column_mapping(tmp_path, jsonl):
    renamed = [{"ids": r["paths"], "mask": r["loss_masks"], "advantages": r["advantages"]} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "r.parquet")
    _same_trees(_trees(tmp_path / "r.parquet", columns="paths=ids,loss_masks=mask"), _trees(jsonl))
    assert parse_columns({"paths": "ids"}) == {"paths": "ids"}
    with pytest.raises(ValueError, match="FIELD=COLUMN"):
        parse_columns("paths")
    with pytest.raises(ValueError, match="mapped twice"):
        parse_columns("paths=a,paths=b")
    with pytest.raises(DataError, match=r"r.parquet: row 1: --columns: no column 'nope'"):
        _trees(tmp_path / "r.parquet", columns="paths=nope")


def to_record(row: dict) -> dict:
    """A row in TRL's names -> the record the parser reads (what the reader does to every row)."""
    return trl_record(row)[0]


def test_trl_tokenized_rows():
    assert to_record({"prompt_ids": [1, 2], "completion_ids": [3, 4]}) == {
        "paths": [[1, 2, 3, 4]],
        "loss_masks": [[0, 0, 1, 1]],
    }
    assert to_record({"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1], "attention_mask": [1, 1, 1]}) == {
        "paths": [[5, 6, 7]],
        "loss_masks": [[0, 1, 1]],
    }
    assert to_record({"input_ids": [5, 6], "assistant_masks": [0, 1]}) == {
        "paths": [[5, 6]],
        "loss_masks": [[0, 1]],
    }
    with pytest.raises(ValueError, match="padding"):
        to_record({"input_ids": [5, 6], "attention_mask": [1, 0]})
    # preference rows are left alone (another reader handles them)
    pref = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}
    assert to_record(dict(pref)) == pref


def test_trl_conversational_rows():
    user = [{"role": "user", "content": "hi"}]
    reply = [{"role": "assistant", "content": "hello"}]
    assert to_record({"prompt": user, "completion": reply}) == {"messages": user + reply}
    assert to_record({"messages": user + reply}) == {"messages": user + reply}
    with pytest.raises(ValueError, match="text .* needs a tokenizer"):
        to_record({"prompt": "hi", "completion": "hello"})


def test_trl_tokenized_parquet_trains_the_completion(tmp_path):
    rows = [
        {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]},
        {"prompt_ids": [1, 2], "completion_ids": [9]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "trl.parquet")
    (n0, p0, f0), (n1, p1, f1) = _trees(tmp_path / "trl.parquet")
    assert p0 == [[1, 2, 3, 4, 5]] and f0["loss_masks"][0].tolist() == [0, 0, 0, 1, 1]
    assert p1 == [[1, 2, 9]] and f1["loss_masks"][0].tolist() == [0, 0, 1]


def test_errors_name_the_row(tmp_path):
    rows = [ROWS[1], {"paths": [[1, -2]], "loss_masks": None, "advantages": [1.0]}, ROWS[1]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DataError) as e:
        validate_file(tmp_path / "bad.parquet")
    (err,) = e.value.errors
    assert str(err).startswith(f'{tmp_path / "bad.parquet"}: row 2: field "paths"[0][1]'), str(err)
    # a misspelled column is an unknown key, as in JSONL, with the hint
    pq.write_table(pa.table({"paths": [[[1, 2]]], "loss_mask": [[[0, 1]]]}), tmp_path / "typo.parquet")
    with pytest.raises(
        DataError, match=r'typo.parquet: row 1: field "loss_mask": .*did you mean "loss_masks"'
    ):
        _trees(tmp_path / "typo.parquet")


def test_streaming_memory_is_bounded_by_a_batch(tmp_path):
    """A 16 MB Parquet file in 64-row groups: Arrow never holds more than a few row groups."""
    rng = np.random.default_rng(0)
    n, length = 512, 8192
    table = pa.table({"paths": [[rng.integers(0, 1000, length, dtype=np.int32).tolist()] for _ in range(n)]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=64)
    total = table.nbytes
    del table
    base, peak, rows = pa.total_allocated_bytes(), 0, 0
    for row in iter_rows(tmp_path / "big.parquet"):
        rows += 1
        peak = max(peak, pa.total_allocated_bytes() - base)
        assert len(row["paths"][0]) == length
    assert rows == n
    assert peak < total / 4, (peak, total)  # measured: about one row group (~2 MB of 16 MB)


def test_train_reads_parquet(tmp_path):
    from treetrain.train.config import TrainConfig
    from treetrain.train.loop import train

    from .reference import tiny_config

    tiny_config("qwen3", vocab=97).save_pretrained(tmp_path / "tiny")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    cfg = TrainConfig(
        data=str(tmp_path / "t.parquet"), model=str(tmp_path / "tiny"), output=str(tmp_path / "run"),
        steps=1, batch_trees=3, progress=False, prefetch=0,
    )  # fmt: skip
    res = train(cfg, quiet=True)
    assert res.records[0]["tree_tokens"] == 14 and res.records[0]["tokens"] == 3 + 4 + 4 + 2 + 2 + 3
