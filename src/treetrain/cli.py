"""``treetrain`` command line: parses arguments and dispatches to each subcommand's own module.

Each subcommand's module provides ``add_parser(subparsers)``, which adds its parser with its flags
and sets ``handler`` (``handler(args) -> exit status``). Each has one section below; nothing else
lives here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


# ---- train: treetrain.train (flags in treetrain.config) ---------------------------------------


def _add_train(sub: argparse._SubParsersAction) -> None:
    from .train import add_parser

    add_parser(sub)


# ---- stats: treetrain.stats, tree statistics of a data file -------------------------------------
# (to wire: ``from .stats import add_parser; add_parser(sub)``)


def _add_stats(sub: argparse._SubParsersAction) -> None:
    from .stats import add_parser

    add_parser(sub)


# ---- bench (treetrain.bench: baseline vs tree throughput) --------------------------------------


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench import add_parser

    add_parser(sub)


# ---- dispatch ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treetrain", description="Train LLMs on tree-structured agent trajectories."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_stats(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``treetrain`` script. Bad options exit with status 2 and one message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"treetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"treetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which stops after its step)
        print(f"treetrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
