"""``treetrain stats --data FILE``: how much a dataset shares, and what a tree trainer can gain from it.

``--data``/``--data-format`` are the names ``train`` uses; the older positional ``FILE`` and
``--format`` still work (undocumented aliases).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from treetrain.data.grouping import GROUP_ROWS_HELP, GROUPINGS
from treetrain.data.sources import check_data_path
from treetrain.train.flags import INVALID_TOOL_ARGUMENTS_HELP

if TYPE_CHECKING:
    from treetrain.trees.flops import CostModel

QWEN3_VOCAB = 151936  # Qwen3's vocabulary: that of train's default model and of the Qwen3-0.6B shape


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "stats",
        help="tree statistics of a data file: tokens, POR, speedup bounds",
        description="How much a dataset shares: distinct vs path tokens, POR, the token and FLOP "
        "speedup bounds of tree training, optionally the partition ERR and a picture of the tree.",
    )
    p.add_argument("file", nargs="?", default=None, help=argparse.SUPPRESS)  # alias of --data
    p.add_argument(
        "--data",
        default=None,
        help="JSONL (.gz), Parquet/Arrow file or datasets directory (default: the bundled sample)",
    )
    formats = ["paths", "messages", "tree", "preference"]
    p.add_argument(
        "--data-format",
        dest="fmt",
        default=None,
        choices=formats,
        help="paths | messages | tree | preference (default: detected per record)",
    )
    p.add_argument("--format", dest="fmt", choices=formats, help=argparse.SUPPRESS)  # alias
    p.add_argument(
        "--columns",
        default=None,
        metavar="FIELD=COLUMN,...",
        help="table sources: map treetrain fields to columns (default: treetrain's and TRL's names)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help='messages format: a local tokenizer dir, or "qwen"; --show prints text with it (default: '
        "--model's tokenizer if its directory has one, else none)",
    )
    p.add_argument(
        "--capacity", type=int, default=None, help="token budget: also report partition ERR (default off)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="local model dir/config for the FLOP bound, or smollm2-135m-instruct (default: Qwen3-0.6B's)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids must be below this, as train checks them (default: --model's vocabulary, else "
        f"{QWEN3_VOCAB:,}: Qwen3's, that of train's default model)",
    )
    p.add_argument("--group-rows", default="consecutive", choices=GROUPINGS, help=GROUP_ROWS_HELP)
    p.add_argument(
        "--allow-invalid-tool-arguments",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=INVALID_TOOL_ARGUMENTS_HELP,
    )
    p.add_argument(
        "--show",
        type=int,
        default=0,
        help="draw the first N trees, one node a line: decoded text with a tokenizer, else token ids "
        "(default 0)",
    )
    p.add_argument(
        "--show-chars",
        type=int,
        default=100,
        help="with a tokenizer, --show prints each node's text on one line, its middle elided past "
        "this many characters; 0: the whole text (default 100)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="write a picture of a tree (depth, branching, shared tokens) and of the sharing by "
        "position over all trees (default: no picture)",
    )
    p.add_argument("--plot-tree", type=int, default=0, help="which tree --plot draws (default 0, the first)")
    p.set_defaults(handler=main)
    return p


def _cost(model: str | None, name: str | None = None) -> tuple[CostModel, str, int]:
    """The FLOP cost model, its name and the vocabulary size: the ``model`` directory's (named
    ``name``, as ``--model`` gave it: a model known by name is shown by its name, not its cached
    directory), or Qwen3-0.6B's."""
    from treetrain.trees.flops import QWEN3_0_6B, CostModel

    if model is None:
        return QWEN3_0_6B, "Qwen3-0.6B shape", QWEN3_VOCAB
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return CostModel.from_config(config), name or model, config.get_text_config().vocab_size


def _rows_line(counts) -> list[tuple[str, str]]:
    """``rows merged by prompt`` when TRL rows were merged."""
    if not counts.grouped_rows:
        return []
    return [("rows (merged by equal prompt)", f"{counts.rows} -> {counts.samples} trees")]


def _read(path, tokenizer, args, vocab_size: int, vocab_name: str) -> tuple[list, object]:
    """Every tree of ``path`` and the pass's counts. Every bad record is listed (file:line, field), as
    ``train`` lists them; an out-of-vocabulary token id is an error, as in ``train``."""
    from treetrain.data import reader
    from treetrain.data.fields import DataError
    from treetrain.train.guards import check_read

    stream = reader.iter_trees(
        path,
        format=args.fmt,
        tokenizer=tokenizer,
        columns=args.columns,
        vocab_size=vocab_size,
        group_rows=args.group_rows,
        allow_invalid_tool_arguments=args.allow_invalid_tool_arguments,
        on_error="collect",
    )
    trees = [tree for tree, _ in stream]
    try:
        check_read(Path(path), stream)
    except DataError as e:
        if not any("outside the vocabulary" in str(x) for x in stream.errors):
            raise
        hint = f"the vocabulary checked is {vocab_name}: pass --model DIR or --vocab-size N for another's"
        if len(e.errors) == 1:  # one bad record: one line
            raise DataError(f"{e} ({hint})") from None
        raise DataError(f"{e.reason}\n  ({hint})", file=e.file) from None
    return trees, stream.counts


def render_text(tree, tokenizer, chars: int = 100) -> str:
    """``tree`` drawn as decoded text, one node a line (its token count, the text quoted with
    newlines as ``\\n``, the middle elided past ``chars`` characters); ``chars=0``: every node's whole
    text on the lines below it, each prefixed with ``|``. Paths ending at a node are named.

    Example (``chars=0``)::

        - 7 tokens
          | <|im_start|>user\\nhi<|im_end|>
          - 3 tokens  [path 0]
            | hello
    """
    import json

    ends: dict[int, list[int]] = {}
    for p, leaf in enumerate(tree.path_leaf):
        ends.setdefault(int(leaf), []).append(p)
    lines = [repr(tree)]
    for n in range(tree.num_nodes):
        ids = tree.tokens[tree.node_start[n] : tree.node_end[n]].tolist()
        text, pad = tokenizer.decode(ids), "  " * int(tree.node_depth[n])
        tail = f"  [path {', '.join(map(str, ends[n]))}]" if n in ends else ""
        if chars:
            quoted = json.dumps(text, ensure_ascii=False)
            if len(quoted) > chars:
                quoted = f"{quoted[: chars * 2 // 3]} ... {quoted[-(chars // 3) :]}"
            lines.append(f"{pad}- {len(ids)} tokens: {quoted}{tail}")
        else:
            lines.append(f"{pad}- {len(ids)} tokens{tail}")
            lines += [f"{pad}  | {line}".rstrip() for line in text.removesuffix("\n").split("\n")]
    return "\n".join(lines)


def _image_rows(trees, cost) -> list[tuple[str, str]]:
    """Images (each path's, and distinct per tree: what the tree encodes), the vision tower's patches,
    and the share of its FLOPs the tree saves; none for text-only data."""
    from treetrain.trees.flops import CostModel, baseline_work, tree_work

    if all(t.image_table is None for t in trees):
        return []
    base, tree = baseline_work(trees, cost.vision_patch), tree_work(trees, cost.vision_patch)
    vision = CostModel(0.0, 0.0, vision_linear=cost.vision_linear, vision_pair=cost.vision_pair)
    rows = [
        ("images (sum over paths)", f"{base.images:,}"),
        ("distinct images (encoded by the tree)", f"{tree.images:,}"),
        ("vision patches (baseline / tree)", f"{base.vision_tokens:,} / {tree.vision_tokens:,}"),
    ]
    if cost.vision_linear:
        saved = 1 - tree.flops(vision) / base.flops(vision)
        share = base.flops(vision) / base.flops(cost)
        rows.append(("vision FLOPs saved", f"{saved:.1%} (the tower: {share:.1%} of the baseline's FLOPs)"))
    return rows


def main(args: argparse.Namespace) -> int:
    from treetrain.trees.flops import flop_bound, token_bound

    if args.file and args.data and args.file != args.data:
        raise ValueError(f"two data files: {args.file} and --data {args.data}; give one (--data)")
    path = args.data or args.file
    if path is None:  # the sample train would use: the messages one for a model known by name
        from treetrain.train.batches import default_sample

        path = str(default_sample(args.model))
    check_data_path(path, "a JSONL (or Parquet/Arrow/datasets) file of trees, or omit it for the sample")
    name = args.model  # as given: a model known by name is shown by its name
    if args.model is not None:  # a name of a known pretrained model: its cached directory, as train
        from treetrain.models.pretrained import resolve_model

        args.model = resolve_model(args.model)
    if args.model is not None:
        from treetrain.train.build import check_model_dir

        check_model_dir(args.model)
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(f"--vocab-size: must be a positive integer, got {args.vocab_size}")
    cost, cost_name, vocab_size = _cost(args.model, name)
    if args.vocab_size is not None:
        vocab_name = f"--vocab-size {args.vocab_size}"
    else:
        vocab_name = f"--model {name}'s" if args.model else "Qwen3's (train's default model)"
    from treetrain.train.build import model_tokenizer

    tokenizer = model_tokenizer(args.model, args.tokenizer)  # --model DIR's own, as train uses it
    if tokenizer is not None:
        from treetrain.data.chat import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    trees, counts = _read(path, tokenizer, args, args.vocab_size or vocab_size, vocab_name)
    tokens, base = counts.tree_tokens, counts.path_tokens
    rows = [
        ("file", str(path)),
        ("trees", f"{len(trees)}"),
        *_rows_line(counts),
        ("paths", f"{counts.paths}"),
        ("baseline tokens (sum of paths)", f"{base:,}"),
        ("tree tokens (distinct)", f"{tokens:,}"),
        ("POR", f"{counts.por:.1%}"),
        ("token bound (baseline / tree)", f"{token_bound(trees):.2f}x"),
        (f"FLOP bound ({cost_name})", f"{flop_bound(trees, cost):.2f}x"),
        ("largest tree (distinct tokens)", f"{max(t.num_tokens for t in trees):,}"),
        ("longest path", f"{counts.max_path_len:,}"),
        *_image_rows(trees, cost),
    ]
    if args.capacity:
        from treetrain.trees.partition import partition, partition_stats

        parts_tokens, n_parts = 0, 0
        for t in trees:
            parts = partition(t, args.capacity)
            st = partition_stats(t, parts)
            parts_tokens += st["partitioned_tokens"]
            n_parts += len(parts)
        err = (base - parts_tokens) / (base - tokens) if base > tokens else 1.0
        rows += [
            (f"parts at capacity {args.capacity:,}", f"{n_parts}"),
            ("partitioned tokens", f"{parts_tokens:,}"),
            ("ERR (realized / potential reuse)", f"{err:.1%}"),
        ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for t in trees[: args.show]:
        print()
        print(render_text(t, tokenizer, args.show_chars) if tokenizer is not None else t.render())
    if args.plot:
        from treetrain.bench.treeplot import plot_trees

        print(f"plot: {plot_trees(trees, args.plot, args.plot_tree).resolve()}")
    return 0
