"""The code in the docs runs, so the guides cannot rot.

Every ```` ```python ```` block of ``docs/**/*.md`` and the README runs as pasted unless the line
before it is ``<!-- no-run: REASON -->`` (for code that needs a GPU, several processes, a hub model
or a host framework's full set-up; the reason is required). A page's blocks run in order in one
namespace, as a reader would paste them, in a fresh empty working directory: nothing is provided, so
a block makes its own model (``treetrain.tiny_model()``) and data, or names the bundled sample. One
subprocess runs every page (one torch import for all); each page is reported as its own test.

Every ```` ```json ```` block is one or more data records, each of which must parse (a format
change that the guides do not follow fails here).

A ```` ```bash ```` block runs only when the line before it is ``<!-- run -->``: each of its
commands must be a ``treetrain ...`` command or a ``python examples/...`` script of the
repository (kept small enough to run in seconds). They run in
order, one block after another in one working directory per page, which holds the same
``data.jsonl``; one subprocess runs a page's commands (one torch import per page), each as its
command line does: ``treetrain`` through its entry point with ``sys.argv`` set, a script as
``__main__``, its exit status checked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(page: Path) -> list[tuple[str, int, str, str]]:
    """``(language, first code line, code, marker)`` of every fenced block of ``page``; ``marker``
    is the HTML comment on the line before the fence ('' if none)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            prev = lines[i - 1].strip() if i else ""
            marker = prev if prev.startswith("<!--") else ""
            marker = "<!-- no-run -->" if marker.startswith("<!-- no-run") else marker
            out.append((m.group(1), start + 1, "\n".join(lines[start:j]), marker))
            i = j + 1
            continue
        i += 1
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    return [
        (line, code)
        for lang, line, code, mark in blocks(page)
        if lang == "python" and mark != "<!-- no-run -->"
    ]


def bash_commands(page: Path) -> list[tuple[int, list[str]]]:
    out = []
    for lang, line, code, mark in blocks(page):
        if lang != "bash" or mark != "<!-- run -->":
            continue
        for cmd in code.replace("\\\n", " ").splitlines():
            argv = shlex.split(cmd, comments=True)
            if argv:
                script = argv[0] == "python" and len(argv) > 1 and argv[1].startswith("examples/")
                assert argv[0] == "treetrain" or script, (
                    f"{page}:{line}: a run block holds treetrain commands and examples/ scripts only"
                )
                out.append((line, argv))
    return out


DATA = [  # plain SFT on every token (per-path fields must be given for every tree or none)
    {"paths": [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9]]},
    {"paths": [[10, 11, 12], [10, 11, 13, 14]]},
    {
        "nodes": [
            {"id": 0, "parent": None, "tokens": [20, 21]},
            {"id": 1, "parent": 0, "tokens": [22, 23]},
            {"id": 2, "parent": 0, "tokens": [24]},
        ]
    },
    {"paths": [[30, 31, 32, 33], [30, 31, 34]]},
]


RUNNER = r"""
import json, os, sys, tempfile, traceback
import torch

results = {}
todo = json.load(sys.stdin)
for page, chunks in todo.items():
    ns = {"__name__": "__main__"}
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for line, code in chunks:
                # pad so that tracebacks give the line number in the page
                exec(compile("\n" * (line - 1) + code, page, "exec"), ns)
            results[page] = None
        except BaseException:
            results[page] = traceback.format_exc()
        os.chdir("/")
print("@@RESULTS@@" + json.dumps(results))
"""


BASH_RUNNER = r"""
import json, os, runpy, sys

for i, argv in enumerate(json.load(sys.stdin)):
    for stream in (sys.stdout, sys.stderr):
        print(f"@@COMMAND {i}@@", file=stream, flush=True)
    sys.argv = list(argv)
    try:
        if argv[0] == "treetrain":
            from treetrain.cli import main

            rc = main()
        else:  # an examples/ script, by its path, its folder first on sys.path as python gives it
            sys.path.insert(0, os.path.dirname(argv[0]))
            try:
                runpy.run_path(argv[0], run_name="__main__")
            finally:
                sys.path.pop(0)
            rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    if rc:
        print(f"@@FAILED {i} {rc}@@", flush=True)
        sys.exit(1)
"""


def _data_jsonl() -> str:
    return "".join(json.dumps(r) + "\n" for r in DATA)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


@cache
def python_results() -> dict[str, str | None]:
    todo = {str(p.relative_to(ROOT)): python_blocks(p) for p in pages()}
    todo = {k: v for k, v in todo.items() if v}
    r = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(todo),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    out = r.stdout.rpartition("@@RESULTS@@")[2]
    assert r.returncode == 0 and out, f"docs runner failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(out)


RUNNABLE = [p for p in pages() if python_blocks(p)]


# one xdist worker takes every page: python_results() runs all pages in one subprocess (cached per
# worker), so pages spread over two workers ran that whole subprocess twice
@pytest.mark.xdist_group("docs-python-blocks")
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page):
    error = python_results()[str(page.relative_to(ROOT))]
    assert error is None, error


COMMAND_PAGES = [p for p in pages() if bash_commands(p)]


@pytest.mark.slow  # each command starts a process and trains a few steps: ~5-10 s of CPU per page
@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_commands_run(page, tmp_path):
    (tmp_path / "data.jsonl").write_text(_data_jsonl())
    commands = bash_commands(page)
    todo = [[str(ROOT / argv[1]), *argv[2:]] if argv[0] == "python" else argv for _, argv in commands]
    r = subprocess.run([sys.executable, "-c", BASH_RUNNER], input=json.dumps(todo), capture_output=True,
                       text=True, cwd=tmp_path, env=_env(), timeout=300)  # fmt: skip
    ran = r.stdout.count("@@COMMAND ")
    i = max(ran - 1, 0)
    line, argv = commands[i]
    where = f"{page.relative_to(ROOT)}:{line}: {shlex.join(argv)}"
    out, err = (x.rpartition(f"@@COMMAND {i}@@")[2] for x in (r.stdout, r.stderr))
    assert r.returncode == 0 and ran == len(commands), f"{where}\n{out[-2000:]}\n{err[-2000:]}"


JSON_PAGES = [p for p in pages() if any(lang == "json" for lang, *_ in blocks(p))]


@pytest.mark.parametrize("page", JSON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_json_records_parse(page):
    from treetrain.data.chat import load_tokenizer
    from treetrain.data.records import parse_record

    tokenizer = load_tokenizer("qwen")  # the offline Qwen tokenizer, for chat-message records
    decoder = json.JSONDecoder()
    for lang, line, code, _ in blocks(page):
        if lang != "json":
            continue
        i = 0
        while code[i:].strip():
            i += len(code[i:]) - len(code[i:].lstrip())
            record, i = decoder.raw_decode(code, i)
            tree, _ = parse_record(record, tokenizer=tokenizer)
            assert tree.num_paths >= 1, f"{page.relative_to(ROOT)}:{line}"


def _setup_commands(page: Path) -> list[str]:
    """The set-up block's commands: the first ``bash`` block holding ``pip install``."""
    code = next(code for lang, _, code, _ in blocks(page) if lang == "bash" and "pip install" in code)
    return [line.strip() for line in code.splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command():
    """README: two commands, the main job's install and run, then the test extra and the tests; CI
    ends with exactly the second, and the getting-started page shows the same two."""
    install, tests = _setup_commands(ROOT / "README.md")
    assert install.startswith("pip install torch==") and "[test]" not in install, install
    assert tests.startswith('pip install -e ".[test]"') and tests.endswith("python -m pytest"), tests
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == tests, ci[-1]
    assert _setup_commands(DOCS / "getting-started.md") == [install, tests]


def test_no_python_block_is_skipped_without_a_reason():
    """``<!-- no-run: REASON -->``: a reader (and a reviewer) sees why a block is not run."""
    for page in pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines[1:], start=1):
            if line.strip() == "```python" and lines[i - 1].strip().startswith("<!-- no-run"):
                reason = lines[i - 1].strip().removeprefix("<!-- no-run").removesuffix("-->").strip(" :")
                assert reason, f"{page.relative_to(ROOT)}:{i}: a no-run python block needs a reason"


def test_docs_have_runnable_code():
    """The harness finds what it should: the README and the guides' examples are not all skipped."""
    assert len(RUNNABLE) >= 5, [str(p) for p in RUNNABLE]
    runnable = {str(p.relative_to(ROOT)) for p in RUNNABLE}
    assert {"README.md", "docs/getting-started.md", "docs/guides/data.md", "docs/guides/train.md"} <= runnable
    assert COMMAND_PAGES
    assert {p.name for p in JSON_PAGES} >= {"data.md", "objectives.md"}
