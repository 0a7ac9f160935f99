"""``treetrain`` command line: parses arguments and dispatches to each subcommand's own module.

Each subcommand's module provides ``add_parser(subparsers)``, which adds its parser with its flags
and sets ``handler`` (``handler(args) -> exit status``). Each has one section below; nothing else
lives here.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


# ---- train: treetrain.train.flags (the run: treetrain.train.loop) ---------------------------------------


def _add_train(sub: argparse._SubParsersAction) -> None:
    from treetrain.train.flags import add_parser

    add_parser(sub)


# ---- stats: treetrain.bench.stats, tree statistics of a data file -------------------------------------


def _add_stats(sub: argparse._SubParsersAction) -> None:
    from treetrain.bench.stats import add_parser

    add_parser(sub)


# ---- bench (treetrain.bench.command: baseline vs tree throughput) --------------------------------------


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from treetrain.bench.command import add_parser

    add_parser(sub)


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose errors are one line, no usage: the option and
    what is wrong with it, and where the help is."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}{_near_choice(message)} (see {self.prog} --help)\n")


def _near_choice(message: str) -> str:
    """``; did you mean train?`` for argparse's ``invalid choice: 'trian' (choose from ...)``."""
    import difflib

    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if m is None:
        return ""
    near = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=1)
    return f"; did you mean {near[0]}?" if near else ""


# ---- dispatch ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from treetrain import __version__

    parser = _Parser(prog="treetrain", description="Train LLMs on tree-structured agent trajectories.")
    parser.add_argument("--version", action="version", version=f"treetrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="run treetrain COMMAND --help")
    _add_train(sub)
    _add_stats(sub)
    _add_bench(sub)
    for p in (parser, *sub.choices.values()):
        p._negative_number_matcher = _NEGATIVE_NUMBER  # noqa: SLF001
    return parser


# argparse takes "-1e-3" (an exponent) for a flag and then reports "expected one argument"; with this,
# any number is a value (``--lr -1e-3``), and the option's own check says what is wrong with it
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


# the library's messages name Python arguments; on the command line they are flags
_CLI_WORDS = {
    "pass skip_oversized=True": "pass --skip-oversized",
    "skip_oversized=True": "--skip-oversized",
    "tokenizer=<local dir> or 'qwen'": "--tokenizer DIR or --tokenizer qwen",
    "token budget capacity=": "token budget --capacity ",
    "pass allow_invalid_tool_arguments=True": "pass --allow-invalid-tool-arguments",
}


def cli_wording(message: str) -> str:
    """``message`` with Python argument names replaced by the command line's flags."""
    for py, flag in _CLI_WORDS.items():
        message = message.replace(py, flag)
    return message


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit 2 naming the command, the unknown arguments and the nearest option (``--lrr``: ``--lr``),
    or the subcommand's own hint (``flag_hint(arg, flags)``: ``train``'s knows other trainers' names
    and the options set with ``--set``)."""
    import difflib

    sub = _subparsers(parser).get(args.command, parser)
    shown = [a for a in sub._actions if a.help != argparse.SUPPRESS]  # noqa: SLF001
    flags = [s for a in shown for s in a.option_strings]
    flag_hint = getattr(args, "flag_hint", None)
    if flag_hint is not None:
        near = flag_hint(unknown[0], flags)
    else:
        near = next(iter(difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1)), None)
    hint = f"; did you mean {near}?" if near else ""
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return actions[0].choices if actions else {}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``treetrain`` script. Bad options exit with status 2 and one message."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(parser, args, unknown)
    args.from_command_line = argv is None  # the process is this command: it may re-execute itself
    if args.command is None:
        parser.print_help()
        return 2
    try:
        rc = args.handler(args)
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"treetrain {args.command}: error: {cli_wording(str(e))}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which stops after its step)
        print(f"treetrain {args.command}: interrupted", file=sys.stderr)
        rc = 130
    if args.from_command_line and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from treetrain.parallel.fsdp import exit_rank

        exit_rank(rc)  # no interpreter teardown: see exit_rank
    return rc


if __name__ == "__main__":
    sys.exit(main())
