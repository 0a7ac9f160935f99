"""The command line's surface: help with defaults on every option, ``--version``, ``python -m
treetrain``, the ``stats`` spellings shared with ``train``, ``stats --plot``, the README example."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import treetrain
from treetrain import TrajectoryTree
from treetrain.bench.treeplot import layout, tree_shape
from treetrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if not isinstance(a, skip) and a.help != argparse.SUPPRESS and "default" not in (a.help or "").lower()
    ]


@pytest.mark.parametrize("command", ["train", "stats"])
def test_every_option_has_help_with_its_default(command):
    assert _undocumented(_subparsers(build_parser())[command]) == []


def test_top_level_parser():
    parser = build_parser()
    assert _undocumented(parser) == []
    subs = _subparsers(parser)
    assert parser.description and subs["train"].description and subs["stats"].description


def test_version_and_python_m(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "treetrain", "--version"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"treetrain {treetrain.__version__}"


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"paths": [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]}, {"paths": [[9, 8], [9, 7, 6]]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_stats_accepts_both_spellings(data_file, capsys):
    outputs = []
    for argv in (
        ["stats", str(data_file), "--format", "paths"],
        ["stats", "--data", str(data_file), "--data-format", "paths"],
    ):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "POR" in outputs[0]
    assert main(["stats", str(data_file), "--data", str(data_file) + ".other"]) == 2
    assert "two data files" in capsys.readouterr().err
    help_text = _subparsers(build_parser())["stats"].format_help()
    assert "--data-format" in help_text and "--format" not in help_text.replace("--data-format", "")


def test_stats_plot(data_file, tmp_path, capsys):
    out = tmp_path / "pics" / "tree.png"
    assert main(["stats", "--data", str(data_file), "--plot", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["stats", "--data", str(data_file), "--plot", str(out), "--plot-tree", "5"]) == 2
    assert "--plot-tree 5: the data has 2 trees" in capsys.readouterr().err


def test_tree_shape_and_layout():
    tree = TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]])
    # nodes in DFS order: [1 2], [3], [4], [5 6], [7]
    assert layout(tree).tolist() == [1.25, 0.5, 0.0, 1.0, 2.0]
    assert tree_shape(tree) == {
        "depth": 5,
        "levels": 3,
        "max_branching": 2,
        "mean_branching": 2.0,
        "shared_tokens": 3,  # 1, 2 (three paths) and 3 (two paths)
        "por": 1 - 7 / 12,
    }


def test_readme_python_example_counts_right():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"paths = (\[\[.*?\]\])\s.*?one forward over (\d+) distinct tokens", text, re.S)
    paths, stated = json.loads(m.group(1)), int(m.group(2))
    assert TrajectoryTree.from_paths(paths).num_tokens == stated


@pytest.mark.parametrize(
    "argv, hint",
    [
        (
            ["train", "--learning-rate", "1e-4"],
            "unrecognized arguments: --learning-rate 1e-4; did you mean --lr?",
        ),
        (["train", "--max_steps=3"], "did you mean --steps?"),
        (["train", "--kl-coef", "0.1"], "did you mean --set loss.kl_coef=... (an objective option)?"),
        (["train", "--peft-config", "a.json"], "did you mean --set peft_config=...?"),
        (["train", "--batch_trees", "2"], "did you mean --batch-trees?"),
        (["train", "--lrr", "1"], "did you mean --lr?"),
        (["stats", "--dta", "x"], "did you mean --data?"),
        (["trian"], "invalid choice: 'trian' (choose from 'train', 'stats', 'bench'); did you mean train?"),
        (["stats", "--data-format", "path"], "did you mean paths?"),
    ],
)
def test_mistyped_flags_get_did_you_mean(argv, hint, capsys):
    """As config keys do (issue 45): other trainers' names, options set with --set, the nearest flag,
    subcommand and choice; one line, exit 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and hint in err, err


def test_a_mistyped_value_and_a_missing_model_directory(tmp_path, capsys):
    assert main(["train", "--objective", "sftt", "--output", str(tmp_path / "o")]) == 2
    assert "got 'sftt' (did you mean sft?)" in capsys.readouterr().err
    for command in ("train", "stats"):
        missing = tmp_path / "no-such-dir"
        assert (
            main(
                [
                    command,
                    "--model",
                    str(missing),
                    *(["--output", str(tmp_path / "o")] * (command == "train")),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert err.startswith(
            f"treetrain {command}: error: --model {missing}: does not exist; pass a local"
        ), err
        assert "no config.json" not in err and len(err.splitlines()) == 1
    assert main(["train", "--model", "smollm2-135m", "--output", str(tmp_path / "o")]) == 2
    assert (
        "--model smollm2-135m: does not exist (did you mean smollm2-135m-instruct?)"
        in capsys.readouterr().err
    )
