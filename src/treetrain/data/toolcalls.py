"""Tool calls in a conversation, checked in order before it is rendered: every tool result answers
a call made before it, and every call's ``arguments`` are a JSON object.

A ``tool`` message answers the call its ``tool_call_id`` names, else the oldest call still without
a result (data that gives no ids pairs them by position). An error names the message and the field:

- a tool result when no assistant message before it has made a call;
- a ``tool_call_id`` that matches no call before it (or a call already answered);
- a tool result when every call before it has its result already (no call left open);
- ``arguments`` given as a string that is not a JSON object: the template copies the string into
  the rendered call verbatim, so the model would learn to emit it. ``allow_invalid_tool_arguments``
  accepts it, for data that means it (calls a model got wrong, kept to train on).

A call left without a result (the conversation ends on it) is fine: that is where a model's turn
ends. Shapes (a call's ``name``, ``arguments`` an object or a string) are
:func:`treetrain.data.fields._message`'s checks, which run first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from treetrain.data.fields import _field_str, _Invalid, _type_name

__all__ = ["check_tool_calls"]

_OPT_IN = "pass allow_invalid_tool_arguments=True if the data means it"


@dataclass
class _Call:
    id: str | None
    where: tuple  # the call's field path, e.g. ("messages", 0, 2, "tool_calls", 0)
    answered_by: tuple | None = None  # the field path of the tool message that answered it


def check_tool_calls(messages: Sequence[tuple[dict, tuple]], allow_invalid_arguments: bool = False) -> None:
    """Check the tool calls and results of one conversation, given as ``(message, where)`` pairs in
    order (``where``: the message's field path in the record, as errors name it). Raises
    ``_Invalid`` naming the message's field."""
    calls: list[_Call] = []
    for message, where in messages:
        if message["role"] == "assistant":
            for j, call in enumerate(message.get("tool_calls") or []):
                at = (*where, "tool_calls", j)
                if not allow_invalid_arguments:
                    _check_arguments(call, at)
                calls.append(_Call(call.get("id"), at))
        elif message["role"] == "tool":
            _answer(calls, message.get("tool_call_id"), where).answered_by = where


def _answer(calls: list[_Call], call_id: str | None, where: tuple) -> _Call:
    """The call a tool message at ``where`` answers; ``_Invalid`` when there is none."""
    if not calls:
        raise _Invalid(
            "a tool result with no tool call before it (no earlier assistant message has tool_calls); "
            "put the assistant message that makes the call before it, or give this message another role",
            *where,
            "role",
        )
    if call_id is None:
        call = next((c for c in calls if c.answered_by is None), None)
        if call is None:
            raise _Invalid(
                f"a tool result with no tool call left open: {_each(calls)} before it has its result "
                f"already ({_list_where(c.answered_by for c in calls)}); remove this result, or add the "
                "call it answers",
                *where,
                "role",
            )
        return call
    same = [c for c in calls if c.id == call_id]
    call = next((c for c in same if c.answered_by is None), None)
    if call is not None:
        return call
    if same:
        raise _Invalid(
            f"answers call {json.dumps(call_id)}, which {_field_str(same[0].answered_by)} answered "
            "already; give the id of the call this result answers",
            *where,
            "tool_call_id",
        )
    ids = [c.id for c in calls if c.id is not None]
    known = f"their ids: {', '.join(map(json.dumps, ids[:8]))}" if ids else "they have no ids"
    raise _Invalid(
        f"{json.dumps(call_id)[:60]} matches no tool call before it ({known}); give "
        'the id of the call this result answers (the call\'s "id"), or leave tool_call_id out to '
        "pair results with calls in order",
        *where,
        "tool_call_id",
    )


def _check_arguments(call: dict, where: tuple) -> None:
    """A call's ``arguments`` string must hold a JSON object (an object given as such is one)."""
    fn, at = (call["function"], (*where, "function")) if "function" in call else (call, where)
    args = fn.get("arguments")
    if not isinstance(args, str):
        return
    try:
        value = json.loads(args, parse_constant=_no_constant)
    except ValueError as e:
        msg = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        what = f"not valid JSON ({msg})"
    else:
        if isinstance(value, dict):
            return
        what = f"JSON {_type_name(value)}, not an object"
    raise _Invalid(
        f"{what}: {json.dumps(args)[:60]}; the template copies it into the call as is, so the model "
        f"would learn to emit it. Give the arguments as a JSON object (or a string holding one), or "
        f"{_OPT_IN}",
        *at,
        "arguments",
    )


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _each(calls: list[_Call]) -> str:
    return "the one tool call" if len(calls) == 1 else f"each of the {len(calls)} tool calls"


def _list_where(places) -> str:
    """``answered by "messages"[2], "messages"[3]``: the first few field paths."""
    shown = [_field_str(w) for w in places]
    return "answered by " + ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")
