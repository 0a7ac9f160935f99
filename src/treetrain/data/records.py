"""JSONL data: one tree sample per line, read lazily, validated with errors that name file, line, field.

Three formats, detected per line by their keys (or forced with ``format=``):

``paths``: token paths and per-path fields (all but ``paths`` optional)::

    {"paths": [[1, 2, 3], [1, 2, 4, 5]], "loss_masks": [[0, 1, 1], [0, 1, 1, 1]],
     "advantages": [1.0, -0.5], "weights": [1, 1],
     "old_logprobs": [[-0.1, -0.2], [-0.1, -0.3, -0.2]], "ref_logprobs": ...}

  ``loss_masks``: 0/1 per token; ``advantages``: a number per path, or one per token;
  ``old_logprobs``/``ref_logprobs``: one per predicted token (``len(path) - 1``); ``weights``: >= 0.

``messages``: OpenAI-style chat trajectories, one conversation per path (a single conversation may
  be given as a flat message list), rendered with a tokenizer's chat template (see
  :mod:`treetrain.data.chat`); assistant turns get loss unless they carry ``"weight": 0``::

    {"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                  [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]],
     "tools": [...], "advantages": [1.0, -1.0], "weights": [1, 1]}

  Paths that share a rendered token prefix (several samples per prompt, per-turn samples) merge into
  one tree automatically; nothing has to be declared.

``tree``: explicit nodes (any order; ``parent`` is another node's ``id`` or null), every leaf one
  path (leaves in node order); per-leaf fields as a list in leaf order or a dict keyed by leaf id::

    {"nodes": [{"id": "p", "parent": null, "tokens": [1, 2], "loss_mask": [0, 0]},
               {"id": "a", "parent": "p", "tokens": [3], "loss_mask": [1]},
               {"id": "b", "parent": "p", "tokens": [4, 5], "loss_mask": [1, 1]}],
     "advantages": {"a": 1.0, "b": -1.0}}

Every line also may carry ``"id"`` (a string or integer, reported back in :class:`SampleInfo`) and
``"meta"`` (anything, ignored). Any other key is an error, so a misspelled field never goes unused.
Nothing is dropped silently: blank lines, invalid records (``on_error="collect"``) and samples over
the token budget (``skip_oversized=True``) are counted in :class:`DataCounts`.
"""

from __future__ import annotations

import difflib
import gzip
import json
import math
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from treetrain.data import sources
from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "FORMATS",
    "DataCounts",
    "DataError",
    "SampleInfo",
    "TreeStream",
    "detect_format",
    "iter_trees",
    "list_samples",
    "parse_record",
    "prefetch",
    "sample_path",
    "validate_file",
]

FORMATS = ("paths", "messages", "tree", "preference")
_FORMAT_KEY = {"paths": "paths", "messages": "messages", "tree": "nodes", "preference": "chosen_ids"}
_META_KEYS = ("id", "meta")
_KEYS = {
    "paths": ("paths", "loss_masks", "advantages", "weights", "old_logprobs", "ref_logprobs", "rewards"),
    "messages": ("messages", "tools", "advantages", "weights", "rewards"),
    "tree": ("nodes", "advantages", "weights", "old_logprobs", "ref_logprobs", "rewards"),
}
_LOGPROB_TOLERANCE = 1e-4  # log-probabilities above this are an error (rounding can give +1e-7)
_MAX_STORED_ERRORS = 1000  # collected errors kept in memory; the count is always exact
MAX_LINE_BYTES = 256 * 2**20  # default limit on one JSONL line
_CHUNK = 1 << 16  # lines are read this much at a time


# ---- errors and bookkeeping ---------------------------------------------------------------------


def _field_str(where: tuple) -> str:
    """``("loss_masks", 2)`` -> ``"loss_masks"[2]``; ``("nodes", 3, "id")`` -> ``"nodes"[3]["id"]``."""
    head, *rest = where
    return json.dumps(head) + "".join(f"[{k}]" if isinstance(k, int) else f"[{json.dumps(k)}]" for k in rest)


class DataError(ValueError):
    """An invalid sample. The message reads ``file:line: field "name"[i]: what is wrong``.

    Attributes ``file``, ``line`` (1-based; 0 when not from a file), ``field`` (a tuple path into
    the record, empty when the problem is the whole line) and ``reason`` (the message without the
    location) are there for programs.
    """

    def __init__(
        self, reason: str, *, file: str | None = None, line: int = 0, field: tuple = (), unit: str = "line"
    ):
        self.file, self.line, self.field, self.reason = file, line, tuple(field), reason
        self.errors: list[DataError] = []  # validate_file's summary: the errors it lists
        where = "" if file is None else f"{file}: " if not line else f"{file}:{line}: "
        if file is not None and line and unit != "line":  # tables: "data.parquet: row 7: ..."
            where = f"{file}: {unit} {line}: "
        what = f"field {_field_str(self.field)}: " if self.field else ""
        super().__init__(f"{where}{what}{reason}")

    def located(self, file: str, line: int) -> DataError:
        return DataError(self.reason, file=file, line=line, field=self.field)


@dataclass(frozen=True)
class SampleInfo:
    """Where a tree came from: ``file``, 1-based ``line``, its ``format`` and the record's ``id``."""

    file: str
    line: int
    format: str
    id: str | int | None = None


@dataclass
class DataCounts:
    """What a pass over a file saw. ``lines == blank_lines + samples + skipped_oversized + errors``
    for a complete pass; token counts cover the ``samples`` only."""

    file: str
    lines: int = 0  # lines read, blank ones included
    blank_lines: int = 0
    samples: int = 0  # valid trees yielded
    skipped_oversized: int = 0  # valid but a path is longer than ``capacity`` (skip_oversized=True)
    errors: int = 0  # invalid records (on_error="collect")
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
        return (
            f"{self.file}: {self.samples} trees{skipped}{errors}, {self.paths} paths, "
            f"{self.tree_tokens} tree tokens / {self.path_tokens} path tokens (POR {self.por:.1%}), "
            f"longest path {self.max_path_len}"
        )


class _Invalid(Exception):
    """Raised by the validators with a field path relative to the record; located by the reader."""

    def __init__(self, reason: str, *where):
        super().__init__(reason)
        self.reason, self.where = reason, where


# ---- value validators (plain JSON values in, numpy out) -----------------------------------------


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


# ---- the three formats ------------------------------------------------------------------------


def detect_format(record: dict) -> str:
    """The format of a parsed record, from its keys; :class:`DataError` if there is none or several.

    Example::

        >>> detect_format({"paths": [[1, 2]]})
        'paths'
    """
    try:
        return _detect_format(record)
    except _Invalid as e:
        raise DataError(e.reason, field=e.where) from None


def _detect_format(record: dict) -> str:
    found = [f for f in FORMATS if _FORMAT_KEY[f] in record]
    if len(found) == 1:
        return found[0]
    if not found:
        keys = ", ".join(json.dumps(k) for k in list(record)[:8]) or "none"
        raise _Invalid(
            f'cannot tell the format: expected one of the keys "paths", "messages" or "nodes", got {keys}'
        )
    keys = " and ".join(json.dumps(_FORMAT_KEY[f]) for f in found)
    raise _Invalid(f"ambiguous record: it has both {keys}; one format per line")


def _check_keys(rec: dict, fmt: str) -> None:
    allowed = _KEYS[fmt] + _META_KEYS
    if _FORMAT_KEY[fmt] not in rec:
        raise _Invalid(f"missing (required by the {fmt} format)", _FORMAT_KEY[fmt])
    for key in rec:
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1)
            extra = f' (did you mean "{hint[0]}"?)' if hint else ""
            if key in ("loss_masks", "old_logprobs", "ref_logprobs") and fmt == "messages":
                extra = (
                    " (the messages format derives loss masks from the chat template, so per-token fields "
                    'cannot be given; exclude a turn with "weight": 0, or use the paths format)'
                )
            raise _Invalid(
                f"unknown key for the {fmt} format{extra}; allowed: {', '.join(allowed)}",
                key,
            )
    if "id" in rec and type(rec["id"]) not in (str, int):
        raise _Invalid(f"expected a string or an integer, got {_type_name(rec['id'])}", "id")


# Each parser returns (paths, per-path fields, where[p]: the field that holds path p, for errors).


def _parse_paths(rec: dict, vocab_size: int | None) -> tuple[list[np.ndarray], dict, list[tuple]]:
    raw = _list(rec["paths"], ("paths",), "a list of paths (lists of token ids)")
    if not raw:
        raise _Invalid("expected at least one path", "paths")
    paths = [_token_ids(p, ("paths", i), vocab_size) for i, p in enumerate(raw)]
    where = [("paths", i) for i in range(len(paths))]
    return paths, _path_fields(rec, [p.size for p in paths], _KEYS["paths"][1:]), where


def _parse_tree(rec: dict, vocab_size: int | None) -> tuple[list[np.ndarray], dict, list[tuple]]:
    nodes = _list(rec["nodes"], ("nodes",), "a list of nodes")
    if not nodes:
        raise _Invalid("expected at least one node", "nodes")
    index: dict[str | int, int] = {}
    labels: dict[str, int] = {}  # ids as strings: the keys of per-leaf dicts
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise _Invalid(f"expected an object with id, parent, tokens, got {_type_name(node)}", "nodes", i)
        for k in node:
            if k not in ("id", "parent", "tokens", "loss_mask"):
                raise _Invalid(
                    'unknown node key; allowed: "id", "parent", "tokens", "loss_mask"', "nodes", i, k
                )
        for k in ("id", "parent", "tokens"):
            if k not in node:
                raise _Invalid("missing", "nodes", i, k)
        nid = node["id"]
        if type(nid) not in (str, int):
            raise _Invalid(f"expected a string or an integer, got {_type_name(nid)}", "nodes", i, "id")
        if str(nid) in labels:
            raise _Invalid(
                f"duplicate id {json.dumps(nid)} (also nodes[{labels[str(nid)]}])", "nodes", i, "id"
            )
        index[nid], labels[str(nid)] = i, i
    has_mask = ["loss_mask" in n for n in nodes]
    if any(has_mask) and not all(has_mask):
        i = has_mask.index(False)
        raise _Invalid("missing (loss_mask is given on some nodes, so every node needs one)", "nodes", i)
    parent = []
    for i, node in enumerate(nodes):
        p = node["parent"]
        if p is not None and (type(p) not in (str, int) or p not in index):
            raise _Invalid(f"no node has id {json.dumps(p)[:40]}", "nodes", i, "parent")
        parent.append(-1 if p is None else index[p])
    tokens = [
        _token_ids(n["tokens"], ("nodes", i, "tokens"), vocab_size, allow_empty=True)
        for i, n in enumerate(nodes)
    ]
    masks = None
    if has_mask[0]:
        masks = [
            _loss_mask(n["loss_mask"], ("nodes", i, "loss_mask"), tokens[i].size) for i, n in enumerate(nodes)
        ]
    _check_acyclic(parent, nodes)
    is_parent = np.zeros(len(nodes), dtype=bool)
    is_parent[[p for p in parent if p >= 0]] = True
    leaves = np.flatnonzero(~is_parent).tolist()
    paths, path_masks = [], []
    for leaf in leaves:  # root-to-leaf concatenation: work proportional to the path lengths
        chain, n = [], leaf
        while n >= 0:
            chain.append(n)
            n = parent[n]
        chain.reverse()
        path = np.concatenate([tokens[n] for n in chain])
        if path.size == 0:
            raise _Invalid("empty path: this leaf and its ancestors hold no tokens", "nodes", leaf, "tokens")
        paths.append(path)
        if masks is not None:
            path_masks.append(np.concatenate([masks[n] for n in chain]))
    leaf_ids = [str(nodes[i]["id"]) for i in leaves]
    fields = _path_fields(rec, [p.size for p in paths], _KEYS["tree"][1:], unit="leaf", labels=leaf_ids)
    if masks is not None:
        fields["loss_masks"] = path_masks
    return paths, fields, [("nodes", i) for i in leaves]


def _check_acyclic(parent: list[int], nodes: list[dict]) -> None:
    """Every node must be reachable from a root; one that is not is in a cycle."""
    kids: list[list[int]] = [[] for _ in parent]
    for i, p in enumerate(parent):
        if p >= 0:
            kids[p].append(i)
    stack = [i for i, p in enumerate(parent) if p < 0]
    if not stack:
        raise _Invalid("no root node (a node with parent null)", "nodes")
    seen = np.zeros(len(parent), dtype=bool)
    while stack:
        i = stack.pop()
        seen[i] = True
        stack.extend(kids[i])
    if not seen.all():
        i = int(np.argmin(seen))
        raise _Invalid(
            f"cycle: node {json.dumps(nodes[i]['id'])} is not reachable from a root (its parents loop)",
            "nodes",
            i,
            "parent",
        )


def _parse_messages(
    rec: dict, vocab_size: int | None, tokenizer
) -> tuple[list[np.ndarray], dict, list[tuple]]:
    from treetrain.data.chat import ChatError, render_chat

    raw = rec["messages"]
    _list(raw, ("messages",), "a list of conversations (lists of messages)")
    if not raw:
        raise _Invalid("expected at least one conversation", "messages")
    if all(isinstance(m, dict) for m in raw):  # one conversation, given flat
        convs, prefix = [raw], ("messages",)
    else:
        convs, prefix = raw, None
    tools = rec.get("tools")
    if tools is not None:
        tools = _list(tools, ("tools",), "a list of tool (function) schemas")
        for j, t in enumerate(tools):
            if not isinstance(t, dict):
                raise _Invalid(f"expected a tool schema object, got {_type_name(t)}", "tools", j)
    if tokenizer is None:
        raise _Invalid("the messages format needs a tokenizer (tokenizer=<local dir> or 'qwen')", "messages")
    paths, masks, wheres = [], [], []
    for p, conv in enumerate(convs):
        where = prefix or ("messages", p)
        wheres.append(where)
        conv = _list(conv, where, "a conversation (a list of message objects)")
        if not conv:
            raise _Invalid("empty conversation", *where)
        msgs = [_message(m, (*where, i)) for i, m in enumerate(conv)]
        try:
            r = render_chat(tokenizer, msgs, tools=tools)
        except ChatError as e:
            loc = (*where, *e.where) if not (e.where and e.where[0] == "tools") else e.where
            raise _Invalid(str(e), *loc) from None
        ids = np.asarray(r.ids, dtype=np.int64)
        if vocab_size is not None and ids.max() >= vocab_size:  # a model's vocabulary may be smaller
            j = int(np.argmax(ids >= vocab_size))
            raise _Invalid(
                f"renders to token id {ids[j]} (token {j}), outside the vocabulary "
                f"(vocab_size={vocab_size}); "
                f"the tokenizer has {len(tokenizer)} tokens",
                *where,
            )
        paths.append(ids)
        masks.append(np.asarray(r.loss_mask, dtype=np.float64))
    adv = rec.get("advantages")
    if isinstance(adv, list) and any(isinstance(a, list) for a in adv):
        raise _Invalid(
            "per-token advantages need the paths format; give one number per conversation", "advantages"
        )
    fields = _path_fields(rec, [p.size for p in paths], ("advantages", "weights", "rewards"))
    fields["loss_masks"] = masks
    return paths, fields, wheres


_ROLES = ("system", "user", "assistant", "tool")


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
    if isinstance(content, list):  # OpenAI content parts: text only
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _Invalid(
                    'only {"type": "text", "text": ...} content parts are supported', *where, "content", j
                )
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
    fn, at = (call["function"], (*where, "function")) if "function" in call else (call, where)
    if not isinstance(fn, dict):
        raise _Invalid(f"expected an object with name and arguments, got {_type_name(fn)}", *at)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _Invalid("expected a non-empty string", *at, "name")
    args = fn.get("arguments", {})
    if not isinstance(args, (dict, str)):
        raise _Invalid(f"expected an object or a JSON string, got {_type_name(args)}", *at, "arguments")


def parse_record(
    record: Any,
    *,
    format: str | None = None,
    vocab_size: int | None = None,
    tokenizer=None,
) -> tuple[TrajectoryTree, str]:
    """Validate one parsed JSON record and build its tree; returns ``(tree, format)``.

    Raises :class:`DataError` (without file and line; :func:`iter_trees` adds them).

    Example::

        >>> tree, fmt = parse_record({"paths": [[1, 2, 3], [1, 2, 4]]})
        >>> tree.num_tokens, fmt
        (4, 'paths')
    """
    try:
        tree, fmt, _ = _parse(record, format, vocab_size, tokenizer)
        return tree, fmt
    except _Invalid as e:
        raise DataError(e.reason, field=e.where) from None


def _parse(
    record: Any, fmt: str | None, vocab_size: int | None, tokenizer
) -> tuple[TrajectoryTree, str, list]:
    try:
        return _parse_unguarded(record, fmt, vocab_size, tokenizer)
    except RecursionError:  # JSON nested just below the parser's limit, deeper in a validator
        raise _Invalid("nested too deeply") from None


def _parse_unguarded(
    record: Any, fmt: str | None, vocab_size: int | None, tokenizer
) -> tuple[TrajectoryTree, str, list]:
    if not isinstance(record, dict):
        raise _Invalid(f"expected a JSON object, got {_type_name(record)}")
    from treetrain.data.preference import is_preference_record, parse_preference

    if fmt is None:
        fmt = "preference" if is_preference_record(record) else _detect_format(record)
    elif fmt not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS} or None, got {fmt!r}")
    if fmt != "preference":
        _check_keys(record, fmt)
    if fmt == "preference":  # DPO / reward pairs, see treetrain.data.preference
        paths, fields, where = parse_preference(record, vocab_size, tokenizer)
    elif fmt == "paths":
        paths, fields, where = _parse_paths(record, vocab_size)
    elif fmt == "tree":
        paths, fields, where = _parse_tree(record, vocab_size)
    else:
        paths, fields, where = _parse_messages(record, vocab_size, tokenizer)
    try:
        return TrajectoryTree.from_paths(paths, **fields), fmt, where
    except ValueError as e:  # already validated above; kept so nothing escapes as a bare ValueError
        raise _Invalid(f"cannot build the tree: {e}") from None


# ---- files --------------------------------------------------------------------------------------


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
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise _Invalid(f"invalid JSON: {e.msg} (column {e.colno})") from None
    except ValueError as e:
        raise _Invalid(f"invalid JSON: {e}") from None
    except RecursionError:
        raise _Invalid("invalid JSON: nested too deeply") from None


def _row_record(row: dict, columns: dict[str, str]) -> dict:
    """A table row -> a record (``treetrain.data.sources``); raises _Invalid."""
    try:
        return sources.to_record(row, columns)
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
        self.errors: list[DataError] = []
        self._gen = self._run()

    def __next__(self) -> tuple[TrajectoryTree, SampleInfo]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def _run(self) -> Iterator[tuple[TrajectoryTree, SampleInfo]]:
        file, c = str(self.path), self.counts
        raws = sources.iter_rows(self.path) if self.table else _open_lines(self.path, self.max_line_bytes)
        for lineno, raw in enumerate(raws, start=1):
            c.lines += 1
            if not self.table and not raw.strip():
                c.blank_lines += 1
                continue
            try:
                record = _row_record(raw, self.columns) if self.table else _decode(raw, lineno)
                tree, fmt, where = _parse(record, self.format, self.vocab_size, self.tokenizer)
                longest = int(tree.path_lengths.max())
                if self.capacity is not None and longest > self.capacity:
                    if self.skip_oversized:
                        c.skipped_oversized += 1
                        continue
                    p = int(tree.path_lengths.argmax())
                    raise _Invalid(
                        f"a path of {longest} tokens is longer than the token budget "
                        f"capacity={self.capacity} (raise the capacity, or pass skip_oversized=True to skip "
                        f"and count such samples)",
                        *where[p],
                    )
            except _Invalid as e:
                err = DataError(
                    e.reason, file=file, line=lineno, field=e.where, unit="row" if self.table else "line"
                )
                if self.on_error == "raise":
                    raise err from None
                c.errors += 1
                if len(self.errors) < _MAX_STORED_ERRORS:
                    self.errors.append(err)
                continue
            c.add(tree, fmt)
            ident = record.get("id")
            yield tree, SampleInfo(file=file, line=lineno, format=fmt, id=ident)


def iter_trees(
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
) -> TreeStream:
    """Read a JSONL file (``.gz`` too) lazily, one line at a time, and yield ``(tree, SampleInfo)``.

    ``format``: force one format instead of detecting it per line. ``vocab_size``: token ids must be
    below it. ``capacity``: a sample whose longest path exceeds it is an error, or with
    ``skip_oversized=True`` skipped and counted. ``tokenizer``: for ``messages`` lines, a Hugging
    Face tokenizer, a local directory, or ``"qwen"``. ``on_error="collect"`` skips invalid records
    into ``stream.errors`` instead of raising at the first one. A line longer than
    ``max_line_bytes`` is an invalid record (checked while reading, in bounded memory).

    Example::

        >>> stream = iter_trees("data.jsonl", vocab_size=151936, capacity=8192)
        >>> for tree, info in stream:
        ...     ...
        >>> stream.counts.por
    """
    return TreeStream(
        path,
        format=format,
        vocab_size=vocab_size,
        capacity=capacity,
        skip_oversized=skip_oversized,
        tokenizer=tokenizer,
        on_error=on_error,
        max_line_bytes=max_line_bytes,
        columns=columns,
    )


def validate_file(
    path: str | os.PathLike,
    *,
    format: str | None = None,
    vocab_size: int | None = None,
    capacity: int | None = None,
    skip_oversized: bool = False,
    tokenizer=None,
    max_errors: int = 20,
    max_line_bytes: int = MAX_LINE_BYTES,
    columns: dict[str, str] | str | None = None,
) -> DataCounts:
    """One full streaming pass (every tree built, then dropped) before any compute.

    Returns the :class:`DataCounts`; raises one :class:`DataError` listing the first
    ``max_errors`` problems (and how many there are) if any record is invalid.

    Example::

        >>> counts = validate_file("data.jsonl", vocab_size=151936, capacity=8192)
        >>> counts.samples, f"{counts.por:.0%}"
        (120, '71%')
    """
    stream = iter_trees(
        path,
        format=format,
        vocab_size=vocab_size,
        capacity=capacity,
        skip_oversized=skip_oversized,
        tokenizer=tokenizer,
        on_error="collect",
        max_line_bytes=max_line_bytes,
        columns=columns,
    )
    for _ in stream:
        pass
    c = stream.counts
    if c.errors:
        shown = stream.errors[:max_errors]
        more = f"\n  ... and {c.errors - len(shown)} more" if c.errors > len(shown) else ""
        listing = "\n  ".join(map(str, shown))
        reason = f"{c.errors} of {c.lines - c.blank_lines} records are invalid:\n  {listing}{more}"
        err = DataError(reason, file=str(path))
        err.errors = list(stream.errors)
        raise err
    return c


# ---- background prefetch ------------------------------------------------------------------------

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


# ---- bundled samples ----------------------------------------------------------------------------

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
