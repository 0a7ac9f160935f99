"""Field validators for data records: plain JSON values in, numpy out, errors that name the field.

:class:`DataError` is what a user sees (``file:line: field "name"[i]: what is wrong``); the validators
raise :class:`_Invalid` with a field path relative to the record, which the reader locates.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

__all__ = [
    "DataError",
]


_LOGPROB_TOLERANCE = 1e-4  # log-probabilities above this are an error (rounding can give +1e-7)


def _field_str(where: tuple) -> str:
    """``("loss_masks", 2)`` -> ``"loss_masks"[2]``; ``("nodes", 3, "id")`` -> ``"nodes"[3]["id"]``."""
    head, *rest = where
    return json.dumps(head) + "".join(f"[{k}]" if isinstance(k, int) else f"[{json.dumps(k)}]" for k in rest)


class DataError(ValueError):
    """An invalid sample. The message reads ``file:line: field "name"[i]: what is wrong``, or
    ``file:line (id "x"): field ...`` for a record with an ``id``.

    Attributes ``file``, ``line`` (1-based; 0 when not from a file), ``record`` (the record's
    ``id``, None when it has none), ``field`` (a tuple path into the record, empty when the problem
    is the whole line) and ``reason`` (the message without the location) are there for programs.
    """

    def __init__(
        self,
        reason: str,
        *,
        file: str | None = None,
        line: int = 0,
        field: tuple = (),
        unit: str = "line",
        record: str | int | None = None,
    ):
        self.file, self.line, self.field, self.reason = file, line, tuple(field), reason
        self.record = record
        self.errors: list[DataError] = []  # validate_file's summary: the errors it lists
        where = "" if file is None else f"{file}: " if not line else f"{file}:{line}: "
        if file is not None and line and unit != "line":  # tables: "data.parquet: row 7: ..."
            where = f"{file}: {unit} {line}: "
        if record is not None and where:
            where = f"{where[:-2]} (id {json.dumps(record)[:60]}): "
        what = f"field {_field_str(self.field)}: " if self.field else ""
        super().__init__(f"{where}{what}{reason}")

    def located(self, file: str, line: int) -> DataError:
        return DataError(self.reason, file=file, line=line, field=self.field, record=self.record)


class _Invalid(Exception):
    """Raised by the validators with a field path relative to the record; located by the reader
    (``line``: the 1-based line or row, once known; ``record``: the record's ``id``, if it has one)."""

    line: int | None = None
    record: str | int | None = None

    def __init__(self, reason: str, *where):
        super().__init__(reason)
        self.reason, self.where = reason, where


def _type_name(x: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(x), type(x).__name__
    )


def _list(x: Any, where: tuple, what: str) -> list:
    if not isinstance(x, list):
        raise _Invalid(f"expected {what}, got {_type_name(x)}", *where)
    return x


def _per_path(x: Any, where: tuple, n: int, unit: str = "path") -> list:
    x = _list(x, where, f"a list with one entry per {unit}")
    if len(x) != n:
        raise _Invalid(f"expected one entry per {unit} ({n}), got {len(x)}", *where)
    return x


def _token_ids(x: Any, where: tuple, vocab_size: int | None, allow_empty: bool = False) -> np.ndarray:
    x = _list(x, where, "a list of token ids")
    if not x and not allow_empty:
        raise _Invalid("empty path; every path needs at least one token", *where)
    if not set(map(type, x)) <= {int}:  # map(type) runs in C: the fast check of a long path
        j, v = next((j, v) for j, v in enumerate(x) if type(v) is not int)
        raise _Invalid(f"token ids must be integers, got {json.dumps(v)[:40]} ({_type_name(v)})", *where, j)
    try:
        arr = np.array(x, dtype=np.int64)
    except OverflowError:
        j = next(j for j, v in enumerate(x) if not -(2**63) <= v < 2**63)
        raise _Invalid(f"token id {x[j]} is out of range", *where, j) from None
    if arr.size and arr.min() < 0:
        j = int(np.argmin(arr))
        raise _Invalid(f"token ids must be >= 0, got {arr[j]}", *where, j)
    if vocab_size is not None and arr.size and arr.max() >= vocab_size:
        j = int(np.argmax(arr >= vocab_size))
        raise _Invalid(f"token id {arr[j]} is outside the vocabulary (vocab_size={vocab_size})", *where, j)
    return arr


def _numbers(x: Any, where: tuple, n: int, rule: str) -> np.ndarray:
    x = _list(x, where, f"a list of {n} numbers ({rule})")
    if len(x) != n:
        raise _Invalid(f"expected {n} values ({rule}), got {len(x)}", *where)
    if not set(map(type, x)) <= {int, float}:
        for j, v in enumerate(x):
            if type(v) not in (int, float):
                raise _Invalid(f"expected a number, got {json.dumps(v)[:40]} ({_type_name(v)})", *where, j)
    try:
        arr = np.array(x, dtype=np.float64) if x else np.zeros(0)
    except OverflowError:  # an integer beyond float range
        j = next(j for j, v in enumerate(x) if abs(v) >= 2**1024)
        raise _Invalid("expected a finite number, got an integer beyond float range", *where, j) from None
    if not np.isfinite(arr).all():
        j = int(np.argmin(np.isfinite(arr)))
        raise _Invalid(f"expected a finite number, got {x[j]}", *where, j)
    return arr


def _scalar(v: Any, where: tuple) -> float:
    if type(v) is int and abs(v) >= 2**1024:
        raise _Invalid("expected a finite number, got an integer beyond float range", *where)
    if type(v) not in (int, float) or not math.isfinite(v):
        raise _Invalid(f"expected a finite number, got {json.dumps(v)[:40]} ({_type_name(v)})", *where)
    return float(v)


def _loss_mask(x: Any, where: tuple, n: int) -> np.ndarray:
    arr = _numbers_or_bools(x, where, n, "one per token")
    bad = ~np.isin(arr, (0.0, 1.0))
    if bad.any():
        j = int(np.argmax(bad))
        raise _Invalid(f"loss mask values must be 0 or 1, got {x[j]}", *where, j)
    return arr


def _numbers_or_bools(x: Any, where: tuple, n: int, rule: str) -> np.ndarray:
    if isinstance(x, list) and bool in set(map(type, x)):
        x = [int(v) if type(v) is bool else v for v in x]
    return _numbers(x, where, n, rule)


def _logprobs(x: Any, where: tuple, n: int) -> np.ndarray:
    arr = _numbers(x, where, n, "one per predicted token: len(path) - 1")
    if arr.size and arr.max() > _LOGPROB_TOLERANCE:
        j = int(np.argmax(arr))
        raise _Invalid(
            f"log-probabilities must be <= 0, got {arr[j]} (negative log-likelihoods passed by mistake?)",
            *where,
            j,
        )
    return arr


def _path_fields(
    rec: dict, lengths: list[int], keys: tuple[str, ...], unit: str = "path", labels=None
) -> dict:
    """Validate the per-path fields named in ``keys`` against the path lengths.

    ``labels`` (tree format) are the leaf ids: a field may then be a dict keyed by leaf id too.
    """
    out = {}
    n = len(lengths)
    for key in keys:
        if key not in rec:
            continue
        value = rec[key]
        if labels is not None and isinstance(value, dict):
            value = _by_label(value, key, labels)
        value = _per_path(value, (key,), n, unit)
        if key == "loss_masks":
            out[key] = [_loss_mask(v, (key, i), L) for i, (v, L) in enumerate(zip(value, lengths))]
        elif key in ("old_logprobs", "ref_logprobs"):
            out[key] = [_logprobs(v, (key, i), L - 1) for i, (v, L) in enumerate(zip(value, lengths))]
        elif key == "rewards":  # PPO with a critic: one scalar reward per path (treetrain.objectives.value)
            out[key] = np.array([_scalar(v, (key, i)) for i, v in enumerate(value)])
        elif key == "weights":
            w = np.array([_scalar(v, (key, i)) for i, v in enumerate(value)])
            if (w < 0).any():
                j = int(np.argmax(w < 0))
                raise _Invalid(f"weights must be >= 0, got {value[j]}", key, j)
            out[key] = w
        elif key == "rewards":  # one number per path (GRPO advantages: train --advantages)
            out[key] = np.array([_scalar(v, (key, i)) for i, v in enumerate(value)])
        elif key == "advantages":
            if all(not isinstance(v, list) for v in value):
                out[key] = np.array([_scalar(v, (key, i)) for i, v in enumerate(value)])
            else:  # per-token; a scalar entry is broadcast over its path
                out[key] = [
                    _numbers(v, (key, i), L, "one per token")
                    if isinstance(v, list)
                    else np.full(L, _scalar(v, (key, i)))
                    for i, (v, L) in enumerate(zip(value, lengths))
                ]
    return out


def _by_label(value: dict, key: str, labels: list[str]) -> list:
    known = set(labels)
    for k in value:
        if k not in known:
            raise _Invalid(f"not a leaf id (leaves: {', '.join(map(json.dumps, labels[:8]))})", key, k)
    missing = [lab for lab in labels if lab not in value]
    if missing:
        raise _Invalid(f"no entry for leaf {json.dumps(missing[0])}", key)
    return [value[lab] for lab in labels]


_ROLES = ("system", "user", "assistant", "tool")


_IMAGE_PARTS = ("image", "image_url")


def _message(m: Any, where: tuple) -> dict:
    """Check one chat message's shape (the template sees only checked values)."""
    if not isinstance(m, dict):
        raise _Invalid(f"expected a message object, got {_type_name(m)}", *where)
    role = m.get("role")
    if role not in _ROLES:
        got = "missing" if "role" not in m else json.dumps(role)[:40]
        raise _Invalid(f"expected one of {', '.join(_ROLES)}, got {got}", *where, "role")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # OpenAI / HF content parts: text, and images (data.images)
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
                continue
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _Invalid(
                    'only {"type": "text", "text": ...} and image ({"type": "image_url" | "image"}) content '
                    "parts are supported",
                    *where,
                    "content",
                    j,
                )
        if not any(part["type"] in _IMAGE_PARTS for part in content):  # text only: one string
            out["content"] = "".join(part["text"] for part in content)
    elif content is not None and not isinstance(content, str):
        raise _Invalid(f"expected a string or null, got {_type_name(content)}", *where, "content")
    for key in ("reasoning_content", "name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise _Invalid(f"expected a string or null, got {_type_name(m[key])}", *where, key)
    if "weight" in m:
        if role != "assistant":
            raise _Invalid("weight applies to assistant messages only", *where, "weight")
        if type(m["weight"]) not in (int, float, bool) or m["weight"] not in (0, 1):
            raise _Invalid(f"expected 0 or 1, got {json.dumps(m['weight'])[:40]}", *where, "weight")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _Invalid("tool calls belong to assistant messages", *where, "tool_calls")
        for j, call in enumerate(_list(calls, (*where, "tool_calls"), "a list of tool calls")):
            _tool_call(call, (*where, "tool_calls", j))
    return out


def _tool_call(call: Any, where: tuple) -> None:
    if not isinstance(call, dict):
        raise _Invalid(f"expected a tool call object, got {_type_name(call)}", *where)
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise _Invalid(f"expected a string or null, got {_type_name(call['id'])}", *where, "id")
    fn, at = (call["function"], (*where, "function")) if "function" in call else (call, where)
    if not isinstance(fn, dict):
        raise _Invalid(f"expected an object with name and arguments, got {_type_name(fn)}", *at)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _Invalid("expected a non-empty string", *at, "name")
    args = fn.get("arguments", {})
    if not isinstance(args, (dict, str)):
        raise _Invalid(f"expected an object or a JSON string, got {_type_name(args)}", *at, "arguments")
