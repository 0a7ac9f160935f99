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
import json
import os
from typing import Any

import numpy as np

from treetrain.data.fields import (
    DataError,
    _Invalid,
    _list,
    _loss_mask,
    _message,
    _path_fields,
    _token_ids,
    _type_name,
)
from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "FORMATS",
    "detect_format",
    "parse_record",
]


FORMATS = ("paths", "messages", "tree", "preference")
_FORMAT_KEY = {"paths": "paths", "messages": "messages", "tree": "nodes", "preference": "chosen_ids"}
_META_KEYS = ("id", "meta")
_KEYS = {
    "paths": ("paths", "loss_masks", "advantages", "weights", "old_logprobs", "ref_logprobs", "rewards"),
    "messages": ("messages", "tools", "images", "advantages", "weights", "rewards"),
    "tree": ("nodes", "advantages", "weights", "old_logprobs", "ref_logprobs", "rewards"),
}


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
    rec: dict, vocab_size: int | None, tokenizer, allow_invalid_tool_arguments: bool = False
) -> tuple[list[np.ndarray], dict, list[tuple]]:
    from treetrain.data.chat import ChatError, render_chat
    from treetrain.data.toolcalls import check_tool_calls

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
    from treetrain.data.images import ImageError, expand_images, extract_images, vision_info

    vision = vision_info(tokenizer)
    paths, masks, wheres, images = [], [], [], []
    for p, conv in enumerate(convs):
        where = prefix or ("messages", p)
        wheres.append(where)
        conv = _list(conv, where, "a conversation (a list of message objects)")
        if not conv:
            raise _Invalid("empty conversation", *where)
        msgs = [_message(m, (*where, i)) for i, m in enumerate(conv)]
        check_tool_calls([(m, (*where, i)) for i, m in enumerate(msgs)], allow_invalid_tool_arguments)
        try:
            msgs, pil, image_at = extract_images(msgs, rec.get("images") if len(convs) == 1 else None)
            if pil and vision is None:
                raise ImageError(
                    "an image part, but the model is text-only (its directory has no image processor "
                    "and image token); use a vision-language model or remove the image",
                    image_at[0],
                )
            r = render_chat(tokenizer, msgs, tools=tools)
            if vision is not None:
                ids, mask, imgs = expand_images(vision, r.ids, r.loss_mask, pil, image_at)
                images.append(imgs)
            else:
                ids, mask = np.asarray(r.ids, dtype=np.int64), np.asarray(r.loss_mask, dtype=np.float64)
        except (ChatError, ImageError) as e:
            loc = (*where, *e.where) if not (e.where and e.where[0] == "tools") else e.where
            raise _Invalid(str(e), *loc) from None
        if vocab_size is not None and ids.max() >= vocab_size:  # a model's vocabulary may be smaller
            j = int(np.argmax(ids >= vocab_size))
            raise _Invalid(
                f"renders to token id {ids[j]} (token {j}), outside the vocabulary "
                f"(vocab_size={vocab_size}); "
                f"the tokenizer has {len(tokenizer)} tokens",
                *where,
            )
        paths.append(ids)
        masks.append(mask)
    adv = rec.get("advantages")
    if isinstance(adv, list) and any(isinstance(a, list) for a in adv):
        raise _Invalid(
            "per-token advantages need the paths format; give one number per conversation", "advantages"
        )
    fields = _path_fields(rec, [p.size for p in paths], ("advantages", "weights", "rewards"))
    fields["loss_masks"] = masks
    if vision is not None:
        fields["images"] = images
    return paths, fields, wheres


def parse_record(
    record: Any,
    *,
    format: str | None = None,
    vocab_size: int | None = None,
    tokenizer=None,
    allow_invalid_tool_arguments: bool = False,
) -> tuple[TrajectoryTree, str]:
    """Validate one parsed JSON record and build its tree; returns ``(tree, format)``.

    Raises :class:`DataError` (without file and line; :func:`iter_trees` adds them). ``tokenizer``
    (messages records): as :func:`iter_trees` takes it, a Hugging Face tokenizer, a local
    directory, or ``"qwen"``. ``allow_invalid_tool_arguments``: accept tool-call ``arguments``
    strings that are not a JSON object (:mod:`treetrain.data.toolcalls`).

    Example::

        >>> tree, fmt = parse_record({"paths": [[1, 2, 3], [1, 2, 4]]})
        >>> tree.num_tokens, fmt
        (4, 'paths')
    """
    if isinstance(tokenizer, str | os.PathLike):
        from treetrain.data.chat import load_tokenizer  # transformers: only when a name is given

        tokenizer = load_tokenizer(tokenizer)
    try:
        paths, fields, _, fmt = _parts(record, format, vocab_size, tokenizer, allow_invalid_tool_arguments)
        return _build(paths, fields), fmt
    except _Invalid as e:
        raise DataError(e.reason, field=e.where) from None


def _parts(
    record: Any,
    fmt: str | None,
    vocab_size: int | None,
    tokenizer,
    allow_invalid_tool_arguments: bool = False,
) -> tuple[list[np.ndarray], dict, list, str]:
    """A record's validated ``(paths, per-path fields, where each path came from, format)``; raises
    _Invalid."""
    try:
        return _parse_parts(record, fmt, vocab_size, tokenizer, allow_invalid_tool_arguments)
    except RecursionError:  # JSON nested just below the parser's limit, deeper in a validator
        raise _Invalid("nested too deeply") from None


def _build(paths: list, fields: dict) -> TrajectoryTree:
    try:
        return TrajectoryTree.from_paths(paths, **fields)
    except ValueError as e:  # already validated above; kept so nothing escapes as a bare ValueError
        raise _Invalid(f"cannot build the tree: {e}") from None


def _parse_parts(
    record: Any, fmt: str | None, vocab_size: int | None, tokenizer, allow_invalid_tool_arguments: bool
) -> tuple[list[np.ndarray], dict, list, str]:
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
        paths, fields, where = parse_preference(record, vocab_size, tokenizer, allow_invalid_tool_arguments)
    elif fmt == "paths":
        paths, fields, where = _parse_paths(record, vocab_size)
    elif fmt == "tree":
        paths, fields, where = _parse_tree(record, vocab_size)
    else:
        paths, fields, where = _parse_messages(record, vocab_size, tokenizer, allow_invalid_tool_arguments)
    return paths, fields, where, fmt
