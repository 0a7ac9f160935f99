"""TRL's one-completion-per-row layouts, and rows that share a prompt merged into one tree.

TRL stores several samples of a prompt (a GRPO group, best-of-n, a rollout dump) one row per
completion. Each row becomes one path:

- tokenized ``{"prompt_ids": [...], "completion_ids": [...]}``: ``prompt_ids + completion_ids``,
  loss on the completion;
- conversational ``{"prompt": [messages], "completion": [messages]}``: the conversation
  ``prompt + completion``, rendered with the chat template (needs a tokenizer);
- standard (text) ``{"prompt": "...", "completion": "..."}``: tokenized as TRL's ``SFTTrainer``
  does (``prompt + completion``, the tokenizer's EOS appended to a completion without it, loss on
  the tokens after the prompt's), needs a tokenizer;
- ``input_ids`` (+ ``completion_mask`` or ``assistant_masks``): one path; no prompt, never merged.

Per-row numbers (``advantages``, ``rewards``, ``weights``: a number or a one-entry list) follow
their completion. Rows whose prompts are equal become ONE tree, the prompt once and each
completion a branch (``group``, ``treetrain train/stats --group-rows``):

- ``"consecutive"`` (default): runs of consecutive rows with an equal prompt, as rollout dumps
  write a group. Memory: the rows of one run.
- ``"file"``: every row of the file with that prompt, trees in the order of each prompt's first row.
  Memory: every parsed row of the file until its end (8 bytes per token, plus the per-row
  fields), so use it for files that fit in memory several times over.
- ``"none"``: one tree per row.

Example: rows ``{"prompt_ids": [1, 2], "completion_ids": [3]}`` and
``{"prompt_ids": [1, 2], "completion_ids": [4, 5], "advantages": ...}`` -> one tree with paths
``[1, 2, 3]`` and ``[1, 2, 4, 5]`` (tokens ``1 2 3 4 5``, POR 3/7).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from treetrain.data.fields import _Invalid
from treetrain.data.grouping import GROUPINGS

__all__ = ["Row", "group_rows", "row_error", "trl_record"]

_PER_ROW = ("advantages", "rewards", "weights")  # one number per row in TRL's layouts


def trl_record(rec: dict[str, Any], tokenizer=None) -> tuple[dict[str, Any], Hashable | None]:
    """A record in TRL's names -> ``(treetrain record, prompt key)``; the key is None for a row
    with no prompt (``input_ids``, treetrain's own formats, preference pairs), which is never merged.

    Raises ``ValueError`` (the message names the field) for a row that cannot be mapped; the parser
    checks the token ids (:func:`row_error` names the row's own field in its error).
    """
    if any(k in rec for k in ("paths", "nodes", "chosen_ids", "rejected_ids", "chosen", "rejected")):
        return rec, None  # treetrain's own formats, or preference data (not handled here)
    if "messages" in rec:
        return rec, None
    if "prompt" in rec and "completion" in rec:
        prompt, completion = rec.pop("prompt"), rec.pop("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            ids, mask = _tokenize_text(prompt, completion, tokenizer)
            return _one_path(rec, ids, mask), ("text", prompt)
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise ValueError(
                'field "prompt"/"completion": expected both text (TRL\'s standard format) or both lists of '
                f"messages (conversational), got {type(prompt).__name__} and {type(completion).__name__}"
            )
        rec["messages"] = prompt + completion
        _wrap_per_row(rec)
        key = json.dumps([prompt, rec.get("tools")], sort_keys=True, default=str)
        return rec, ("chat", key)
    if "prompt_ids" in rec and "completion_ids" in rec:
        prompt, completion = rec.pop("prompt_ids"), rec.pop("completion_ids")
        if isinstance(prompt, list) and isinstance(completion, list):  # ids checked by the parser: row_error
            mask = [0] * len(prompt) + [1] * len(completion)
            return _one_path(rec, prompt + completion, mask), ("ids", tuple(prompt))
        rec["prompt_ids"], rec["completion_ids"] = prompt, completion  # let the parser say what's wrong
        return rec, None
    if "input_ids" in rec:
        rec["paths"] = [rec.pop("input_ids")]
        for mask in ("completion_mask", "assistant_masks"):
            if mask in rec:
                rec["loss_masks"] = [rec.pop(mask)]
                break
        attn = rec.pop("attention_mask", None)
        if attn is not None and not all(a == 1 for a in attn):
            raise ValueError(
                "attention_mask has padding (zeros): store unpadded rows (treetrain packs them itself)"
            )
        _wrap_per_row(rec)
    return rec, None


def row_error(err: _Invalid, key: Hashable | None) -> _Invalid:
    """The parser's error at token ``j`` of the path built from ``prompt_ids + completion_ids`` (row
    ``key``), renamed to the row's own field: ``prompt_ids[j]`` or ``completion_ids[j - len(prompt)]``."""
    at = err.where
    if not (isinstance(key, tuple) and key[0] == "ids" and len(at) > 2 and at[:2] == ("paths", 0)):
        return err
    n = len(key[1])
    err.where = ("prompt_ids", at[2], *at[3:]) if at[2] < n else ("completion_ids", at[2] - n, *at[3:])
    return err


def _one_path(rec: dict, ids: list, mask: list) -> dict:
    rec["paths"], rec["loss_masks"] = [ids], [mask]
    _wrap_per_row(rec)
    return rec


def _wrap_per_row(rec: dict) -> None:
    """A per-row number -> the one-entry list the parser expects for a one-path record."""
    for key in _PER_ROW:
        if key in rec and not isinstance(rec[key], list):
            rec[key] = [rec[key]]


def _tokenize_text(prompt: str, completion: str, tokenizer) -> tuple[list[int], list[int]]:
    """TRL's SFTTrainer on a standard prompt/completion row: ``[ids of prompt + completion + EOS]``,
    loss from where the prompt's own ids stop matching."""
    if tokenizer is None:
        raise ValueError(
            'field "prompt"/"completion": text (TRL\'s standard format) needs a tokenizer '
            '(--tokenizer DIR or "qwen"); or give tokenized prompt_ids/completion_ids'
        )
    eos = getattr(tokenizer, "eos_token", None)
    if eos and not completion.endswith(eos):
        completion += eos
    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + completion)["input_ids"]
    shared = 0
    while shared < min(len(prompt_ids), len(ids)) and prompt_ids[shared] == ids[shared]:
        shared += 1
    return list(ids), [0] * shared + [1] * (len(ids) - shared)


@dataclass
class Row:
    """One parsed row: its paths and per-path fields (the record parser's output), where each path
    came from (``where``), its 1-based ``line``, ``format``, record ``id`` and prompt ``key``."""

    line: int
    key: Hashable | None
    paths: list[np.ndarray]
    fields: dict[str, Any]
    where: list[tuple]
    format: str
    id: Any = None


def group_rows(rows: Iterator[Row | _Invalid], group: str = "consecutive") -> Iterator[list[Row] | _Invalid]:
    """Merge rows with an equal prompt key (see the module docstring); yields groups of rows (one
    tree each) in order. An ``_Invalid`` in the input (a bad row, its ``line`` set) passes through
    in place; a row whose fields do not match its group's (one has ``advantages``, one not) is
    turned into one."""
    if group not in GROUPINGS:
        raise ValueError(f"group_rows: expected one of {', '.join(GROUPINGS)}, got {group!r}")
    if group == "file":
        yield from _group_file(rows)
        return
    run: list[Row] = []
    for row in rows:
        if isinstance(row, _Invalid):
            yield row
            continue
        if group == "consecutive" and run and row.key is not None and row.key == run[0].key:
            bad = _mismatch(run[0], row)
            if bad is None:
                run.append(row)
            else:
                yield bad
            continue
        if run:
            yield run
        run = [row]
        if row.key is None:  # nothing can join it: out now (the reader stays one row ahead at most)
            yield run
            run = []
    if run:
        yield run


def _group_file(rows: Iterator[Row | _Invalid]) -> Iterator[list[Row] | _Invalid]:
    groups: dict[Any, list[Row]] = {}  # insertion-ordered: trees in order of first appearance
    for i, row in enumerate(rows):
        if isinstance(row, _Invalid):
            yield row  # errors as they come: every row is kept until the end anyway
            continue
        key = ("row", i) if row.key is None else row.key
        if key in groups:
            bad = _mismatch(groups[key][0], row)
            if bad is not None:
                yield bad
                continue
            groups[key].append(row)
        else:
            groups[key] = [row]
    yield from groups.values()


def _mismatch(first: Row, row: Row) -> _Invalid | None:
    """An error for ``row`` if its fields differ from its group's first row's, else None."""
    extra = sorted((set(row.fields) ^ set(first.fields)) - {"images"})  # text-only rows have none
    if not extra and first.format == row.format:
        return None
    field = extra[0] if extra else "format"
    has = "has" if field in row.fields else "lacks"
    err = _Invalid(
        f"this row {has} {field!r} but row {first.line}, with the same prompt, does not; rows merged "
        "into one tree need the same fields (give it on every row of the prompt, or none)",
        field,
    )
    err.line = row.line
    return err


def merge(rows: list[Row]) -> tuple[list[np.ndarray], dict[str, Any], list[tuple[int, tuple]]]:
    """The paths and fields of a group's rows, in row order, for ``TrajectoryTree.from_paths``, and
    each path's ``(line, where)``."""
    paths = [p for r in rows for p in r.paths]
    where = [(r.line, w) for r in rows for w in r.where]
    if len(rows) == 1:
        return paths, rows[0].fields, where
    fields: dict[str, Any] = {}
    if any("images" in r.fields for r in rows):  # a row without images: none on its paths
        for r in rows:
            r.fields.setdefault("images", [[] for _ in r.paths])
    for key in rows[0].fields:
        values = [r.fields[key] for r in rows]
        if all(isinstance(v, np.ndarray) for v in values):  # one number per path
            fields[key] = np.concatenate(values)
        else:  # per-token lists; per-path numbers (advantages) broadcast over their paths
            fields[key] = [
                item
                for r, v in zip(rows, values)
                for item in (v if isinstance(v, list) else [np.full(len(p), x) for p, x in zip(r.paths, v)])
            ]
    return paths, fields, where
