"""``treetrain stats FILE``: how much a dataset shares, and what a tree trainer can gain from it."""

from __future__ import annotations

import argparse
from pathlib import Path

from .flops import QWEN3_0_6B, CostModel, flop_bound, token_bound


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("stats", help="tree statistics of a JSONL file: tokens, POR, speedup bounds")
    p.add_argument("file", nargs="?", default=None, help="JSONL (default: the bundled sample)")
    p.add_argument("--format", dest="fmt", default=None, choices=["paths", "messages", "tree"])
    p.add_argument("--tokenizer", default=None, help='messages format: a local tokenizer dir, or "qwen"')
    p.add_argument("--capacity", type=int, default=None, help="token budget: report partition ERR")
    p.add_argument("--model", default=None, help="local model dir/config for the FLOP bound")
    p.add_argument("--show", type=int, default=0, help="draw the first N trees")
    p.set_defaults(handler=main)
    return p


def _cost(model: str | None) -> tuple[CostModel, str]:
    if model is None:
        return QWEN3_0_6B, "Qwen3-0.6B shape"
    from transformers import AutoConfig

    return CostModel.from_config(AutoConfig.from_pretrained(model)), model


def main(args: argparse.Namespace) -> int:
    from . import data

    path = args.file or data.sample_path("agent-dialogues")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such data file; pass a JSONL file of trees (or omit it for the sample)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: not a model directory (no config.json)")
    trees = [tree for tree, _ in data.iter_trees(path, format=args.fmt, tokenizer=args.tokenizer)]
    if not trees:
        raise ValueError(f"{path}: no samples")
    cost, cost_name = _cost(args.model)
    tokens = sum(t.num_tokens for t in trees)
    base = sum(t.num_path_tokens for t in trees)
    rows = [
        ("file", str(path)),
        ("trees", f"{len(trees)}"),
        ("paths", f"{sum(t.num_paths for t in trees)}"),
        ("baseline tokens (sum of paths)", f"{base:,}"),
        ("tree tokens (distinct)", f"{tokens:,}"),
        ("POR", f"{1 - tokens / base:.1%}"),
        ("token bound (baseline / tree)", f"{token_bound(trees):.2f}x"),
        (f"FLOP bound ({cost_name})", f"{flop_bound(trees, cost):.2f}x"),
        ("largest tree (distinct tokens)", f"{max(t.num_tokens for t in trees):,}"),
        ("longest path", f"{max(int(t.path_lengths.max()) for t in trees):,}"),
    ]
    if args.capacity:
        from .partition import partition, partition_stats

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
        print(t.render())
    return 0
