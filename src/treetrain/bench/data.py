"""``treetrain bench --data FILE``: the user's own data as one case, read as ``train`` and ``stats`` read
it (paths, messages, trees, preference records; chat records with images through a vision-language
``--model``'s processor, :mod:`treetrain.data.images`).

The case is every tree of the file, timed as the synthetic cases are (tree vs the per-path baseline,
:func:`treetrain.bench.cases.run_case`). Its FLOP bound is the one ``treetrain stats --data FILE
--model DIR`` reports (vision tower counted): the budget ``--capacity`` defaults to the largest
tree's distinct tokens (at least the preset's), so no tree is partitioned. Without ``--model`` the
preset's random model runs the data, its token ids renumbered onto the model's vocabulary (a
bijection: the trees keep their shape; text data only).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from treetrain.data.grouping import GROUP_ROWS_HELP, GROUPINGS

if TYPE_CHECKING:
    from treetrain.trees.flops import CostModel
    from treetrain.trees.tree import TrajectoryTree

__all__ = ["add_flags", "data_line", "read_case", "resolve_capacity"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """``--data`` and the reader's options, named as ``train`` and ``stats`` name them."""
    p.add_argument(
        "--data",
        default=None,
        help="bench on this data instead of the synthetic cases: a JSONL (.gz), Parquet/Arrow file or "
        "datasets directory, read as train and stats read it (chat records with images need a "
        "vision-language --model with its processor); one case of all its trees, its FLOP bound the "
        "one treetrain stats --data FILE --model DIR reports (the vision tower's FLOPs counted)",
    )
    formats = ["paths", "messages", "tree", "preference"]
    p.add_argument(
        "--data-format",
        dest="fmt",
        default=None,
        choices=formats,
        help="with --data: paths | messages | tree | preference (default: detected per record)",
    )
    p.add_argument(
        "--columns",
        default=None,
        metavar="FIELD=COLUMN,...",
        help="with --data, table sources: map treetrain fields to columns",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help='with --data, messages records: a local tokenizer dir, or "qwen" (default: --model\'s own)',
    )
    p.add_argument("--group-rows", default="consecutive", choices=GROUPINGS, help=GROUP_ROWS_HELP)
    p.set_defaults(allow_invalid_tool_arguments=False)


def read_case(args: argparse.Namespace, model_dir: str | None) -> tuple[str, list[TrajectoryTree]]:
    """``(case name, trees)`` of ``--data``: read with ``model_dir``'s tokenizer (its processor for
    images) and vocabulary check, as ``stats --model`` reads it; without a model, renumbered onto
    ``args.vocab`` (raised to the data's distinct ids when fewer: ``args.vocab`` is updated)."""
    from treetrain.bench.stats import _read
    from treetrain.data.chat import load_tokenizer
    from treetrain.data.sources import check_data_path
    from treetrain.train.build import model_tokenizer

    check_data_path(args.data)
    name = model_dir or args.tokenizer
    tokenizer = model_tokenizer(model_dir, args.tokenizer)
    tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
    vocab = args.vocab if model_dir else None
    trees, _ = _read(args.data, tokenizer, args, vocab, f"--model {name}'s" if model_dir else "none")
    label = f"data {Path(args.data).name} ({len(trees)} trees)"
    if model_dir is None:
        if any(t.image_table is not None for t in trees):
            raise ValueError(f"--data {args.data}: has images; pass a vision-language --model DIR")
        args.vocab = max(args.vocab, distinct_ids(trees))
        trees = renumber(trees, args.vocab)
    return label, trees


def distinct_ids(trees: list[TrajectoryTree]) -> int:
    """How many distinct token ids ``trees`` use."""
    import numpy as np

    return int(np.unique(np.concatenate([t.tokens for t in trees])).size)


def resolve_capacity(capacity: int | None, preset_capacity: int, trees: list[TrajectoryTree]) -> int:
    """``--capacity`` as given, else the preset's or the largest tree's distinct tokens, whichever is
    more: every tree one forward, so the bound is ``stats``' (no partition's recomputed prefixes).

    >>> from treetrain.trees.tree import TrajectoryTree
    >>> resolve_capacity(None, 4, [TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4, 5]])])
    5
    """
    return capacity if capacity is not None else max(preset_capacity, max(t.num_tokens for t in trees))


def data_line(path: str, trees: list[TrajectoryTree], cost: CostModel) -> str:
    """What the case holds: trees, paths, tokens, images and the FLOP bound ``stats`` reports."""
    from treetrain.trees.flops import baseline_work, flop_bound, tree_work

    base, tree = sum(t.num_path_tokens for t in trees), sum(t.num_tokens for t in trees)
    line = (
        f"data {path}: {len(trees)} trees, {sum(t.num_paths for t in trees)} paths, {base:,} baseline / "
        f"{tree:,} tree tokens"
    )
    if any(t.image_table is not None for t in trees):
        b, t = baseline_work(trees, cost.vision_patch), tree_work(trees, cost.vision_patch)
        line += (
            f", images {b.images:,} / {t.images:,}, vision patches {b.vision_tokens:,} / {t.vision_tokens:,}"
        )
    tower = " (the vision tower's FLOPs counted)" if cost.vision_linear else ""
    return f"{line}; FLOP bound {flop_bound(trees, cost):.2f}x{tower}, as treetrain stats reports it"


def renumber(trees: list[TrajectoryTree], vocab: int) -> list[TrajectoryTree]:
    """Map the distinct token ids used to ``0..n-1`` (a bijection: the trees keep their shape)."""
    import numpy as np

    from treetrain.trees.tree import TrajectoryTree

    used = np.unique(np.concatenate([t.tokens for t in trees]))
    if used.size > vocab:
        raise ValueError(f"--sample uses {used.size} distinct token ids; use --vocab {used.size} or more")
    return [
        TrajectoryTree.from_paths([np.searchsorted(used, p) for p in t.paths()], **t.fields) for t in trees
    ]
