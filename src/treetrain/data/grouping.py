"""How TRL-layout rows (one completion per row) group into trees: the choices and their help.

Import-light (no numpy): the command-line parsers read it for ``--help``.
"""

__all__ = ["GROUPINGS", "GROUP_ROWS_HELP"]

GROUPINGS = ("consecutive", "file", "none")
GROUP_ROWS_HELP = (
    "TRL rows, one completion per row (prompt/completion, prompt_ids/completion_ids): merge rows with an "
    "equal prompt into one tree. consecutive: runs of adjacent rows, as rollout dumps write them (memory: "
    "one run); file: across the whole file (memory: every row until the end of the file); none: one tree "
    "per row (default consecutive)"
)
