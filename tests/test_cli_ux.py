"""What a new user meets on the command line (issue 23), each through the real ``treetrain`` command
in a subprocess: a quick ``--help``, clear one-line errors, a quiet run, reward metrics, and
extending a finished run. (A check a test has already made through a subprocess is repeated
in-process, ``cli`` below, for its variants: other values, other vocabularies, another listing of
invalid records; the same argv, stderr and status, without ~4 s of imports each.)"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "PYTHONWARNINGS": "default"}  # warnings shown as a user would see them


def treetrain(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treetrain", *argv], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def _best_seconds(cmd: list[str], repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, timeout=300)
        best = min(best, time.perf_counter() - t0)
    return best


def cli(capsys, *argv: str) -> subprocess.CompletedProcess:
    """``treetrain ARGV`` in-process (``main(argv)``): status, stdout and stderr as a subprocess gives."""
    from treetrain.cli import main

    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["treetrain", *argv], rc, out, err)


# ---- item 6: a quick CLI -----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"], ["stats", "--help"],
                                  ["bench", "--help"]])  # fmt: skip
def test_help_imports_no_torch_transformers_or_numpy(argv):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "treetrain", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "treetrain.cli" in imported  # the listing is real
    assert not imported & {"torch", "transformers", "peft", "numpy"}, sorted(imported)


def test_help_takes_well_under_half_of_importing_torch():
    """Best of two runs each, so that a burst of load on a shared machine does not decide it."""
    torch_s = _best_seconds([sys.executable, "-c", "import torch"])
    help_s = _best_seconds([sys.executable, "-m", "treetrain", "--help"])
    version_s = _best_seconds([sys.executable, "-m", "treetrain", "--version"])
    assert max(help_s, version_s) < 0.5 * torch_s, (help_s, version_s, torch_s)


# ---- item 4: errors that say what is wrong, in one line ----------------------------------------


@pytest.fixture
def paths_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"paths": [[1, 2, 3], [1, 2, 4]]}\n{"paths": [[5, 6], [5, 7]]}\n')
    return path


def _one_line_error(proc: subprocess.CompletedProcess, command: str) -> str:
    """Exit status 2, stderr one line ``treetrain COMMAND: error: ...``, no usage, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"treetrain {command}: error: "), lines
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


def test_option_errors_name_the_option_and_every_choice(tmp_path, capsys):
    line = _one_line_error(treetrain("train", "--objective", "foo", "--output", str(tmp_path)), "train")
    assert "--objective" in line and "'foo'" in line
    for name in ("sft", "reinforce", "grpo", "ppo", "gspo", "dpo", "reward", "ppo_critic"):
        assert f" {name}," in line or f" {name};" in line
    for value in ("-1e-3", "-2"):  # read as a value, then refused as one (in-process: ~4 s a process)
        line = _one_line_error(cli(capsys, "train", "--lr", value, "--output", str(tmp_path)), "train")
        assert line.endswith(f"--lr: must be a positive number, got {float(value)}"), line
    line = _one_line_error(treetrain("train", "--lrr", "1e-4"), "train")  # argparse's own errors too
    assert line.endswith(
        "unrecognized arguments: --lrr 1e-4; did you mean --lr? (see treetrain train --help)"
    )
    line = _one_line_error(cli(capsys, "stats", "--capacity", "many"), "stats")
    assert "argument --capacity: invalid int value: 'many'" in line
    assert "paths | messages | tree | preference" in cli(capsys, "train", "--help").stdout
    assert "paths | messages | tree | preference" in cli(capsys, "stats", "--help").stdout


def test_a_directory_as_data(tmp_path):
    (tmp_path / "dir").mkdir()
    for command in ("train", "stats"):
        argv = [command, "--data", str(tmp_path / "dir")]
        line = _one_line_error(
            treetrain(*argv, *(["--output", str(tmp_path / "o")] * (command == "train"))), command
        )
        assert f"--data {tmp_path / 'dir'}: is a directory, not a data file" in line
        assert "no such file" not in line


def test_dpo_on_a_paths_file_names_file_and_line(paths_file, tmp_path):
    proc = treetrain("train", "--objective", "dpo", "--data", str(paths_file), "--steps", "1",
                     "--output", str(tmp_path / "o"), "--no-progress")  # fmt: skip
    err = _listing_error(proc, "train")  # checked in the validation pass: every such record listed
    for line in (1, 2):
        assert (
            f"{paths_file}:{line}: --objective dpo trains on preference pairs" in err and "paths data" in err
        )


def _listing_error(proc: subprocess.CompletedProcess, command: str) -> str:
    """Exit status 2, ``treetrain COMMAND: error: FILE: N of M records are invalid:`` and one line per
    bad record (as ``train`` lists them, issue 35), no usage, no traceback; several bad records (one
    is one line: :func:`_one_line_error`)."""
    assert proc.returncode == 2 and proc.stderr.startswith(f"treetrain {command}: error: "), proc.stderr
    assert "records are invalid:" in proc.stderr.splitlines()[0]
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr
    return proc.stderr


def test_stats_rejects_token_ids_that_train_rejects(tmp_path, capsys):
    oov = tmp_path / "oov.jsonl"
    oov.write_text('{"paths": [[1, 2, 151936], [1, 2, 4]]}\n')  # 151936: one past Qwen3's vocabulary
    message = f'{oov}:1: field "paths"[0][2]: token id 151936 is outside the vocabulary (vocab_size=151936)'
    assert message in _one_line_error(treetrain("stats", "--data", str(oov)), "stats")  # one record: one line
    proc = treetrain("train", "--data", str(oov), "--output", str(tmp_path / "o"), "--no-progress")
    assert proc.returncode == 2 and message in proc.stderr  # train lists every invalid record
    # the same check under other vocabularies: in-process (one process each was ~5 s of imports)
    assert cli(capsys, "stats", "--data", str(oov), "--vocab-size", "151937").returncode == 0
    err = _one_line_error(cli(capsys, "stats", "--data", str(oov), "--vocab-size", "100"), "stats")
    assert "token id 151936 is outside the vocabulary (vocab_size=100)" in err and "--vocab-size 100" in err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 1000}')  # defaults otherwise
    err = _one_line_error(cli(capsys, "stats", "--data", str(oov), "--model", str(model)), "stats")
    assert "(vocab_size=1000)" in err and f"--model {model}'s" in err


# ---- item 1: extending a finished run ----------------------------------------------------------


def _lrs(out) -> dict[int, float]:
    import json

    return {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow  # three training processes (about 30 s on a quiet 2-core machine)
def test_extending_a_finished_run_follows_the_schedule_of_the_new_total(paths_file, tmp_path):
    """2 steps, then ``--resume --steps 4``: steps 3 and 4 run at the lr of an uninterrupted 4-step
    run (warmup 1, cosine to 0.1 of the peak), not at the finished schedule's 0 and a restarted decay."""
    common = ["--data", str(paths_file), "--no-progress", "--warmup-steps", "1", "--min-lr-ratio", "0.1"]
    extended, straight = tmp_path / "extended", tmp_path / "straight"
    first = treetrain("train", *common, "--steps", "2", "--checkpoint-every", "2", "--output", str(extended))
    assert first.returncode == 0, first.stderr[-3000:]
    proc = treetrain("train", *common, "--steps", "4", "--resume", "--output", str(extended))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming step_2 with changed options: --steps 2 -> 4" in proc.stderr
    assert "the cosine schedule (warmup 1) now spans 4 steps; step 3 runs at lr 0.000775" in proc.stderr
    proc = treetrain("train", *common, "--steps", "4", "--output", str(straight))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _lrs(extended), _lrs(straight)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert got[3] == want[3] and got[4] == want[4]  # the same float computation: exactly equal
    assert want[3] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3))), rel=1e-12)


# ---- item 2: GRPO reward metrics in every sink -------------------------------------------------


def test_grpo_logs_reward_statistics_in_every_sink(tmp_path):
    """Two steps of two groups: [1, 0] and [1, 1] (all equal: zero advantage), then [0.5, 0.5, 2]
    and [1, 0] again (the file's next epoch)."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, out = tmp_path / "groups.jsonl", tmp_path / "run"
    groups = [
        ([[1, 2, 3], [1, 2, 4]], [1, 0]),
        ([[5, 6], [5, 7]], [1, 1]),
        ([[8, 9], [8, 10], [11]], [0.5, 0.5, 2]),
    ]
    data.write_text("".join(json.dumps({"paths": p, "rewards": r}) + "\n" for p, r in groups))
    proc = treetrain("train", "--data", str(data), "--objective", "grpo", "--advantages", "group",
                     "--batch-trees", "2", "--steps", "2", "--output", str(out), "--no-progress",
                     "--report-to", "tensorboard")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {
        1: dict(
            reward_mean=0.75, reward_std=0.75**0.5 / 2, reward_min=0.0, reward_max=1.0, zero_adv_groups=0.5
        ),
        2: dict(reward_mean=0.8, reward_std=0.46**0.5, reward_min=0.0, reward_max=2.0, zero_adv_groups=0.0),
    }
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    for step, metrics in want.items():
        for name, value in metrics.items():
            assert records[step][name] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, name)
            (event,) = [e for e in acc.Scalars(name) if e.step == step]
            assert event.value == pytest.approx(value, rel=1e-6, abs=1e-7)  # TensorBoard stores float32
    for row in (r"reward mean +0\.75 \(step 1\) -> 0\.8 \(step 2\)\n", r"reward min / max +0 / 2\n",
                r"zero-advantage groups +25\.0% of groups"):  # fmt: skip
        assert re.search(row, proc.stdout), proc.stdout  # the summary table


# ---- item 5: quiet runs ------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--lora-r", "2"]], ids=["full", "lora"])
def test_no_progress_runs_print_nothing_on_stderr(paths_file, tmp_path, extra):
    """No progress bar (transformers' "Writing model shards" of the final save included) and no
    warning (PEFT's read of transformers' deprecated ``is_gradient_checkpointing``) with warnings shown
    as Python shows them by default."""
    proc = treetrain("train", "--data", str(paths_file), "--steps", "1", "--output", str(tmp_path / "o"),
                     "--no-progress", *extra)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]
    assert "treetrain train: done" in proc.stdout and "Writing model shards" not in proc.stdout


# ---- issue 45: records checked before step 1, bars only on a terminal ---------------------------


def test_a_late_record_without_rewards_fails_validation_by_name(tmp_path, capsys):
    """``--advantages group`` needs every record's rewards: the third record's absence is found by the
    validation before step 1 (it used to stop the run at step 3 as "tree 0 of the batch"), named by
    file, line and id; with ``--lazy-validate`` the run stops when that record is read, named alike."""
    data = tmp_path / "r.jsonl"
    rows = [{"id": "a", "paths": [[1, 2, 3], [1, 2, 4]], "rewards": [1, 0]},
            {"id": "b", "paths": [[5, 6], [5, 7]], "rewards": [0, 1]},
            {"id": "late", "paths": [[8, 9], [8, 10]]}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["train", "--data", str(data), "--objective", "grpo", "--advantages", "group", "--steps", "3",
            "--no-progress"]  # fmt: skip
    named = f'{data}:3 (id "late"): field "rewards": missing; --advantages group computes each path'
    proc = treetrain(*argv, "--output", str(tmp_path / "o"))
    assert named in _one_line_error(proc, "train") and "step 1" not in proc.stdout, proc.stdout
    assert not (tmp_path / "o" / "metrics.jsonl").exists()
    proc = treetrain(*argv, "--output", str(tmp_path / "lazy"), "--lazy-validate", "--prefetch", "0")
    line = _one_line_error(proc, "train")
    assert named in line and "step 2/3" in proc.stdout and "step 3/3" not in proc.stdout, proc.stdout
    rows[2]["rewards"], rows[2]["advantages"] = [1, 0], [0.5, -0.5]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _one_line_error(cli(capsys, *argv, "--output", str(tmp_path / "both")), "train")
    assert f'{data}:3 (id "late"): field "advantages": --advantages group computes them from "rewards"' in err


def test_progress_bar_only_on_a_terminal(paths_file, tmp_path):
    """Into a pipe (as into a file), the step lines alone, no bar redraws mixed in; on a terminal
    (a pseudo-terminal here) the bar draws on stderr."""
    import fcntl
    import pty
    import struct
    import termios

    argv = ["train", "--data", str(paths_file), "--steps", "2"]
    proc = treetrain(*argv, "--output", str(tmp_path / "pipe"))
    assert proc.returncode == 0 and "\r" not in proc.stderr and "step/s" not in proc.stderr, proc.stderr
    assert re.search(r"^step 1/2  loss .*\nstep 2/2  loss ", proc.stdout, re.M), proc.stdout
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # else 0 columns wide
    cmd = [sys.executable, "-m", "treetrain", *argv, "--output", str(tmp_path / "tty")]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=follower, env=ENV) as child:
        os.close(follower)
        drawn = b""
        while True:  # read as it draws (the terminal's buffer is small); EIO once the child is gone
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    os.close(leader)
    assert child.returncode == 0 and b"\r" in drawn and b"2/2" in drawn, drawn[-2000:]
