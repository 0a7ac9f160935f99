"""A griffe extension (mkdocs.yml: mkdocstrings ``extensions``) that lets the docstrings, written
for reading in the source, render as Markdown: doctest blocks (``>>>`` lines and their output)
become ``pycon`` code blocks, and Sphinx roles (``:func:`~a.b```) become inline code."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):`~?\.?([^`]+)`")


def fence_doctests(text: str) -> str:
    """Wrap each run of lines from a ``>>>`` line to the next blank line in a ``pycon`` fence."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += [f"{indent}```pycon", *block, f"{indent}```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DocstringsAsMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(_ROLE.sub(r"`\1`", obj.docstring.value))
