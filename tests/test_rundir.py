"""Run directories: a re-run never loses an earlier run (refused before any work, every file left
byte-identical), ``--overwrite`` replaces only treetrain's own files, a foreign non-empty directory
is refused unless ``--overwrite``, and ``--resume`` needs something to resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treetrain.cli import main
from treetrain.train.config import TrainConfig
from treetrain.train.rundir import check_output, clear_run, run_entries

from .reference import tiny_config
from .test_train import VOCAB, write_trees


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rundir")
    write_trees(d / "trees.jsonl", n_trees=2)
    tiny_config("qwen3", vocab=VOCAB).save_pretrained(d / "tiny")
    return d


def train_argv(inputs: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", str(inputs / "trees.jsonl"), "--model", str(inputs / "tiny"), "--output", str(out)),
        *("--steps", "1", "--device", "cpu", "--prefetch", "0", "--no-progress", *extra),
    ]


def fake_run(out: Path, checkpoint: bool = False, final: bool = True) -> None:
    """The files a finished run leaves (contents as treetrain writes them)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TrainConfig(output=str(out)).to_dict()))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    if final:
        (out / "final").mkdir()
        (out / "final" / "config.json").write_text("{}")
        (out / "final" / "model.safetensors").write_bytes(b"weights")
    if checkpoint:
        ck = out / "checkpoints" / "step_1"
        (ck / "state").mkdir(parents=True)
        (ck / "meta.json").write_text("{}")
        (ck / "state" / ".metadata").write_bytes(b"m")
        (out / "checkpoints" / "latest").write_text("step_1\n")


def test_rerun_of_finished_run_is_refused_and_overwrite_keeps_foreign_files(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_argv(inputs, out, "--plot")) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert {"config.json", "metrics.jsonl", "training.png", "final/model.safetensors"} <= before.keys()

    assert main(train_argv(inputs, out, "--lr", "0.5")) == 2  # refused before any work
    err = capsys.readouterr().err
    assert f"--output {out}: holds an earlier run" in err and "--overwrite" in err
    assert "--resume" not in err and "no checkpoint to continue from" in err  # it ran without checkpoints
    assert snapshot(out) == before  # every file byte-identical, nothing added

    # a user's notes and another tool's outputs, at the top level and inside final/ and checkpoints/
    foreign = {
        "NOTES.md": b"my notes",
        "eval/scores.csv": b"a,b\n1,2\n",
        "final/README.md": b"model card",
        "checkpoints/keep.txt": b"mine",
    }
    for rel, data in foreign.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    assert main(train_argv(inputs, out, "--overwrite", "--lr", "0.5")) == 0
    after = snapshot(out)
    assert all(after[rel] == data for rel, data in foreign.items())
    assert "training.png" not in after  # the earlier run's plot was removed: this run made none
    assert json.loads(after["config.json"])["lr"] == 0.5
    assert after["final/model.safetensors"] != before["final/model.safetensors"]


def test_non_run_directory_needs_overwrite(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "data.txt").write_text("x")
    with pytest.raises(ValueError, match=r"not empty and not a treetrain run \(data.txt\); pass --overwrite"):
        check_output(out, resume=False, overwrite=False)
    with pytest.raises(ValueError, match="holds no treetrain run"):
        check_output(out, resume=True, overwrite=False)
    check_output(out, resume=False, overwrite=True)
    assert clear_run(out) == [] and (out / "data.txt").read_text() == "x"
    check_output(tmp_path / "new", resume=False, overwrite=False)  # absent or empty: fine
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", resume=True, overwrite=False)


def test_foreign_file_where_the_run_writes_is_never_replaced(tmp_path):
    """An HF model directory's config.json is not treetrain's: refused even with --overwrite."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    for flags in ({"overwrite": False}, {"overwrite": True}):
        with pytest.raises(ValueError, match="config.json, not written by treetrain"):
            check_output(out, resume=False, **flags)
    (out / "config.json").unlink()
    (out / "final").write_text("a file where the run puts a directory")
    with pytest.raises(ValueError, match="final, not written by treetrain"):
        check_output(out, resume=False, overwrite=True)


def test_resume_needs_a_checkpoint_once_the_run_finished(tmp_path):
    finished = tmp_path / "finished"
    fake_run(finished)
    with pytest.raises(ValueError, match="finished run has no checkpoint to continue from.*--overwrite"):
        check_output(finished, resume=True, overwrite=False)
    with pytest.raises(ValueError, match="not both"):
        check_output(finished, resume=True, overwrite=True)
    killed = tmp_path / "killed"  # stopped before its first checkpoint: resuming restarts it
    fake_run(killed, final=False)
    check_output(killed, resume=True, overwrite=False)
    checkpointed = tmp_path / "checkpointed"
    fake_run(checkpointed, checkpoint=True)
    check_output(checkpointed, resume=True, overwrite=False)
    with pytest.raises(ValueError, match="holds an earlier run"):
        check_output(checkpointed, resume=False, overwrite=False)


def test_clear_run_deletes_only_the_runs_entries(tmp_path):
    out = tmp_path / "run"
    fake_run(out, checkpoint=True)
    (out / "checkpoints" / "step_3.tmp").mkdir()  # debris of an interrupted save
    (out / "notes").write_text("keep")
    (out / "final" / "card.md").write_text("keep")
    ours, clashes = run_entries(out)
    assert not clashes
    assert sorted(str(p.relative_to(out)) for p in ours) == [
        "checkpoints/latest",
        "checkpoints/step_1",
        "checkpoints/step_3.tmp",
        "config.json",
        "final/config.json",
        "final/model.safetensors",
        "metrics.jsonl",
    ]
    clear_run(out)
    assert snapshot(out) == {"notes": b"keep", "final/card.md": b"keep"}
    assert not (out / "checkpoints").exists()  # emptied, so removed; final/ still holds the card


def test_run_that_never_stepped_is_replaced(tmp_path):
    """A run that failed in setup (a typo in --data) left only its config and an empty metrics
    file: fixing the typo and running again needs no flag."""
    out = tmp_path / "run"
    fake_run(out, final=False)
    (out / "metrics.jsonl").write_text("")
    check_output(out, resume=False, overwrite=False)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=r"holds an earlier run \(metrics.jsonl\)"):
        check_output(out, resume=False, overwrite=False)
