"""MkDocs hooks for the treetrain site (mkdocs.yml: ``hooks:``).

- the recorded benchmark results (``benchmarks/results/*.md``, ``*.png``) join the site under
  ``results/`` as they are, so the site shows the files the benchmarks wrote, never a stale copy;
- ``<!-- api-modules: treetrain.PKG -->`` in a page becomes one mkdocstrings block per module of
  that subpackage and of its own subpackages, found on disk (a new module shows up in the reference
  without editing the page);
- ``<!-- public-api -->`` becomes the table of ``treetrain.__init__._API`` (public name -> module);
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "treetrain"
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files, config):
    for path in sorted(RESULTS.glob("*")):
        if path.suffix in {".md", ".png"}:
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


def _modules(package: str) -> list[str]:
    """The modules of ``package`` on disk, a subpackage (``objectives.policy``) with its own after them."""
    folder = PKG.joinpath(*package.split(".")[1:])
    out = [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py")) if not p.stem.startswith("_")]
    for sub in sorted(d for d in folder.iterdir() if (d / "__init__.py").is_file()):
        out += [f"{package}.{sub.name}", *_modules(f"{package}.{sub.name}")]
    return out


def _api_table() -> str:
    tree = ast.parse((PKG / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id == "_API":
                api = ast.literal_eval(node.value)
                break
    else:
        raise ValueError("src/treetrain/__init__.py: no _API table")
    rows = [f"| `treetrain.{n}` | [`{m}.{n}`][{m}.{n}] |" for n, m in api.items()]
    return "| public name | defined in |\n|---|---|\n" + "\n".join(rows)


_API_MODULES = re.compile(r"<!-- api-modules: (treetrain\.[a-z_]+) -->")


def on_page_markdown(markdown, page, config, files):
    def modules(match: re.Match) -> str:
        blocks = [f"::: {m}\n    options:\n      heading_level: 2\n" for m in _modules(match.group(1))]
        return "\n".join(blocks)

    markdown = _API_MODULES.sub(modules, markdown)
    return markdown.replace("<!-- public-api -->", _api_table())
