"""Faults a cluster throws at a run, with real processes: SIGTERM/SIGINT at a random step then
``--resume`` (the same per-step losses as an uninterrupted run), a second signal, a full disk during
a checkpoint, a corrupted checkpoint, truncated / empty / bad data files; every failure exits with a
clear message and status 1 or 2 (never a traceback, never SIGABRT's 134)."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treetrain.train.checkpoint import latest_checkpoint, verify_checkpoint

from .reference import tiny_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
# one intra-op thread in every run, so that runs in different processes compute bit-identical steps
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# one xdist worker for the module: its fixtures (a reference run) are made once
pytestmark = pytest.mark.xdist_group("faults")


def write_trees(path: Path, n: int = 30, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prefix = [rng.randrange(97) for _ in range(rng.randint(4, 30))]
            paths = [
                prefix + [rng.randrange(97) for _ in range(rng.randint(1, 10))]
                for _ in range(rng.randint(1, 4))
            ]
            masks = [[0] * len(prefix) + [1] * (len(p) - len(prefix)) for p in paths]
            f.write(json.dumps({"paths": paths, "loss_masks": masks}) + "\n")
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A config-only tiny Qwen3 (vocabulary 97, random init) and 30 trees."""
    d = tmp_path_factory.mktemp("faults")
    tiny_config("qwen3").save_pretrained(d / "model")
    write_trees(d / "data.jsonl")
    return d


def train_args(workdir: Path, out: Path, *extra: str, data: Path | None = None) -> list[str]:
    return [
        "train",
        *("--model", str(workdir / "model"), "--data", str(data or workdir / "data.jsonl")),
        *("--output", str(out), "--steps", str(STEPS), "--batch-trees", "2", "--capacity", "64"),
        *("--lr", "1e-2", "--device", "cpu", "--dtype", "float32", "--no-progress"),
        *("--checkpoint-every", "4"),
        *extra,
    ]


def launch(args: list[str], nproc: int = 0, preexec=None) -> subprocess.Popen:
    """``python -m treetrain.cli ARGS`` (``nproc`` > 0: under torchrun) in a session of its own."""
    cmd = [sys.executable]
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars} | THREADS_ENV
    return subprocess.Popen(
        [*cmd, "-m", "treetrain.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=preexec,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"no exit within {timeout} s:\n{err[-3000:]}")
    return proc.returncode, err


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> None:
    """Until ``metrics.jsonl`` has ``step`` lines (the run is inside its loop, handlers installed)."""
    deadline = time.monotonic() + timeout
    while len(metrics(out)) < step:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach its step in time"
        time.sleep(0.02)


def assert_clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc in (1, 2), (rc, err[-3000:])
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    for n in needles:
        assert n in err, err[-3000:]


@pytest.fixture(scope="module")
def reference(workdir, tmp_path_factory) -> list[dict]:
    """The uninterrupted run's per-step records."""
    out = tmp_path_factory.mktemp("ref") / "run"
    rc, err = finish(launch(train_args(workdir, out)))
    assert rc == 0, err[-3000:]
    assert latest_checkpoint(out).name == f"step_{STEPS}"  # the final step is checkpointed
    return metrics(out)


# ---- preemption -----------------------------------------------------------------------------------


def _preempt_and_resume(workdir, reference, tmp_path, signum: int, at: int) -> None:
    out = tmp_path / "run"
    proc = launch(train_args(workdir, out))
    wait_for_step(proc, out, at)
    t0 = time.monotonic()
    os.kill(proc.pid, signum)
    rc, err = finish(proc, timeout=60)  # finishes its step, checkpoints, exits within 60 s
    assert time.monotonic() - t0 < 60
    name = signal.Signals(signum).name
    assert rc == 128 + signum, (rc, err[-3000:])
    assert f"stopped by {name} after step" in err and "Traceback" not in err, err[-3000:]
    done = len(metrics(out))
    assert at <= done < STEPS
    ck = latest_checkpoint(out)
    assert ck.name == f"step_{done}" and f"checkpoint {ck} written" in err  # the step reached
    verify_checkpoint(ck)
    assert not list((out / "checkpoints").glob("*.tmp"))

    rc, err = finish(launch(train_args(workdir, out, "--resume")))
    assert rc == 0, err[-3000:]
    got = metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # model, optimizer, schedule, data position and RNG come back: the same steps, bit for bit
    assert [r["loss"] for r in got] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in reference]


def test_sigterm_at_a_random_step_then_resume_gives_the_same_losses(workdir, reference, tmp_path):
    _preempt_and_resume(workdir, reference, tmp_path, signal.SIGTERM, random.Random().randint(1, 5))


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_then_resumes(workdir, reference, tmp_path):
    _preempt_and_resume(workdir, reference, tmp_path, signal.SIGINT, random.Random().randint(1, 5))


@pytest.mark.slow
def test_second_signal_exits_at_once(workdir, tmp_path):
    """Two signals delivered together (queued while the process is stopped, then SIGCONT): the
    first asks for a clean stop, the second exits at once, with no checkpoint of the current step."""
    out = tmp_path / "run"
    proc = launch(train_args(workdir, out, "--steps", "1000"))
    wait_for_step(proc, out, 1)
    os.kill(proc.pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    rc, err = finish(proc, timeout=60)
    assert rc == 128 + signal.SIGTERM, (rc, err[-3000:])  # SIGINT is handled first, SIGTERM second
    assert "second signal (SIGTERM): exiting now" in err and "Traceback" not in err, err[-3000:]
    assert latest_checkpoint(out) is None  # exited before the step ended: nothing half-written named


# ---- checkpoints that cannot be written or read ---------------------------------------------------


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_checkpoint_write_failure_keeps_the_previous_one(workdir, tmp_path):
    """A real write failure (RLIMIT_FSIZE: the state file cannot grow past 100 kB, as on a full
    disk) while saving step 4: step 2 stays intact and ``latest`` names it."""
    out = tmp_path / "run"
    rc, err = finish(launch(train_args(workdir, out, "--steps", "2", "--checkpoint-every", "2")))
    assert rc == 0, err[-3000:]
    before = {p: p.read_bytes() for p in (out / "checkpoints" / "step_2").rglob("*") if p.is_file()}
    args = train_args(workdir, out, "--steps", "4", "--checkpoint-every", "2", "--resume")
    rc, err = finish(launch(args, preexec=_limit_file_size(100_000)))
    assert_clean_error(rc, err, "step 4: writing the checkpoint failed: File too large", "step_2 is intact")
    assert latest_checkpoint(out) == out / "checkpoints" / "step_2"
    verify_checkpoint(out / "checkpoints" / "step_2")
    assert {p: p.read_bytes() for p in before} == before
    # and the run continues from it once the disk has room again
    rc, err = finish(launch(args))
    assert rc == 0, err[-3000:]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_disk_full_during_checkpoint_keeps_the_previous_one(workdir, tmp_path):
    """A real full disk: the run's output on a 1.2 MB tmpfs, where one checkpoint fits (0.5 MB) but
    not two. Needs mount permission (root in a container with CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        why = r.stderr.decode().strip()
        pytest.skip(f"cannot mount a tmpfs here ({why}); the RLIMIT_FSIZE test covers the failure")
    try:
        out = mnt / "run"
        rc, err = finish(launch(train_args(workdir, out, "--steps", "6", "--checkpoint-every", "2")))
        assert_clean_error(rc, err, "writing the checkpoint failed: No space left on device")
        last = latest_checkpoint(out)
        assert last is not None and f"{last} is intact" in err
        verify_checkpoint(last)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_corrupted_checkpoint_is_a_clear_error(workdir, tmp_path, capsys):
    from treetrain.cli import main

    out = tmp_path / "run"
    assert main(train_args(workdir, out, "--steps", "2", "--checkpoint-every", "2")) == 0
    shard = next((out / "checkpoints" / "step_2" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated on disk
    capsys.readouterr()
    assert main(train_args(workdir, out, "--steps", "4", "--resume")) == 1
    assert_clean_error(1, capsys.readouterr().err, "step_2")


# ---- data ------------------------------------------------------------------------------------------


def test_resume_refuses_a_changed_data_file_and_reports_changed_options(workdir, tmp_path, capsys):
    from treetrain.cli import main

    out = tmp_path / "run"
    data = write_trees(tmp_path / "data.jsonl")
    assert main(train_args(workdir, out, "--steps", "2", "--checkpoint-every", "2", data=data)) == 0
    write_trees(data, seed=1)  # other trees under the same name
    args = train_args(workdir, out, "--steps", "3", "--resume", "--lr", "3e-3", data=data)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert_clean_error(2, err, "--resume: the data file changed since", "--allow-data-change")
    assert main([*args, "--allow-data-change"]) == 0
    err = capsys.readouterr().err
    assert "resuming step_2 with changed options: --lr 0.01 -> 0.003" in err, err[-3000:]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_resume_without_a_checkpoint_says_it_starts_fresh(workdir, tmp_path, capsys):
    from treetrain.cli import main

    out = tmp_path / "run"
    args = train_args(workdir, out, "--steps", "1", "--resume", "--prefetch", "0")
    assert main(args) == 0
    said = capsys.readouterr().out
    assert f"--resume: no checkpoint under {out / 'checkpoints'}; starting from step 0" in said
    assert [r["step"] for r in metrics(out)] == [1]


def _bad_files(d: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """name -> (data file, what the error must say)."""
    good = (d / "good.jsonl").read_text().splitlines()
    files = {
        "empty": ("", ("the file is empty",)),
        "blank lines": ("\n  \n\n", ("the file is empty",)),
        "broken JSON on line 2": (good[0] + "\n{\"paths\": [[1, 2\n" + "\n".join(good[2:]) + "\n",
                                  (":2", "invalid JSON")),
        "truncated last line": ("\n".join(good) + "\n" + good[0][: len(good[0]) // 2],
                                (f":{len(good) + 1}", "invalid JSON")),
        "three bad tokens": (
            "\n".join(json.dumps({"paths": [[1, 2, 500]]}) if i in (4, 9, 13) else line
                      for i, line in enumerate(good)) + "\n",
            ("3 of 30 records are invalid", ":5", ":10", ":14", "vocab_size=97"),
        ),
        "NaN advantage": (good[0] + '\n{"paths": [[1, 2]], "advantages": [NaN]}\n', (":2", "NaN")),
        "infinite reward": (good[0] + "\n" + '{"paths": [[1, 2]], "advantages": [1e999]}\n',
                            (":2", "finite")),
    }  # fmt: skip
    out = {}
    for i, (name, (text, needles)) in enumerate(files.items()):
        path = d / f"bad{i}.jsonl"
        path.write_text(text)
        out[name] = (path, needles)
    return out


@pytest.fixture(scope="module")
def bad_files(workdir):
    write_trees(workdir / "good.jsonl")
    return _bad_files(workdir)


BAD = ["empty", "blank lines", "broken JSON on line 2", "truncated last line", "three bad tokens",
       "NaN advantage", "infinite reward"]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_data_fails_before_any_step(workdir, bad_files, tmp_path, case, capsys):
    from treetrain.cli import main

    path, needles = bad_files[case]
    out = tmp_path / "run"
    assert main(train_args(workdir, out, "--steps", "6", data=path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("treetrain train: error:"), err
    for n in needles:
        assert n in err, err
    assert metrics(out) == []  # no optimizer step ran


def test_empty_file_with_lazy_validation_is_an_error_not_a_spin(workdir, bad_files, tmp_path, capsys):
    from treetrain.cli import main

    path, _ = bad_files["blank lines"]
    assert main(train_args(workdir, tmp_path / "run", "--lazy-validate", data=path)) == 2
    assert "holds no trees" in capsys.readouterr().err


LAZY = {  # cases whose error --lazy-validate meets within the first steps, raised in the prefetch thread
    "empty": "holds no trees",
    "blank lines": "holds no trees",
    "broken JSON on line 2": "invalid JSON",
    "three bad tokens": "vocab_size=97",
    "NaN advantage": "NaN",
}


@pytest.mark.slow
def test_bad_data_lazily_five_times_never_aborts(workdir, bad_files, tmp_path, capsys):
    """Every bad-input case whose error --lazy-validate meets within the first steps, 5 times
    in-process (the error is raised inside the prefetch thread: the part that can race), and three
    cases twice as real processes: always status 2 and the message, no prefetch thread left, never
    SIGABRT (134) from a thread outliving the error at interpreter exit. (Without --lazy-validate the
    error comes from validation before any thread starts: one run each,
    test_bad_data_fails_before_any_step, covers it.)"""
    import threading

    from treetrain.cli import main

    for case in LAZY:
        path, _ = bad_files[case]
        for i in range(5):
            run = tmp_path / f"{BAD.index(case)}-run{i}"
            rc = main(train_args(workdir, run, "--steps", "6", "--lazy-validate", data=path))
            err = capsys.readouterr().err
            assert rc == 2 and LAZY[case] in err, (case, i, err)
            assert [t.name for t in threading.enumerate() if t.name == "treetrain-prefetch"] == []
    for case in ("empty", "broken JSON on line 2", "three bad tokens"):
        path, needles = bad_files[case]
        for i in range(2):
            extra = ("--lazy-validate",) if i % 2 else ()
            rc, err = finish(
                launch(train_args(workdir, tmp_path / f"{BAD.index(case)}-proc{i}", *extra, data=path))
            )
            assert_clean_error(rc, err, LAZY[case] if extra else needles[-1])


# ---- the Python API and the CLI say the same, in their own words ------------------------------------


def test_api_errors_are_value_errors(workdir):
    import torch

    from treetrain import path_logprobs
    from treetrain.train.loop import train

    from .reference import tiny_model

    model = tiny_model("qwen3", dtype=torch.float32)
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(
        ValueError, match=rf"token id {vocab} is outside the model's vocabulary \(vocab_size={vocab}\)"
    ):
        path_logprobs(model, [[1, 2, vocab]])
    with pytest.raises(
        ValueError, match="train\\(config\\): unknown option 'stepz' \\(did you mean 'steps'\\?\\)"
    ):
        train({"stepz": 1})
    with pytest.raises(ValueError, match="expected a TrainConfig or a dict"):
        train(["steps", 1])


def test_cli_errors_name_flags(workdir, tmp_path, capsys):
    from treetrain.cli import main

    long_path = tmp_path / "long.jsonl"
    long_path.write_text(json.dumps({"paths": [list(range(90))]}) + "\n")
    assert main(train_args(workdir, tmp_path / "run", "--capacity", "16", data=long_path)) == 2
    err = capsys.readouterr().err
    assert "--skip-oversized" in err and "--capacity 16" in err and "skip_oversized" not in err, err
    assert main(["train", "--set", "loss.clip_lo=0.2", "--output", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "unknown option clip_lo; valid loss options: agg_mode," in err and "clip_low" in err, err
    assert main(["stats", str(tmp_path / "nosuchfile.jsonl")]) == 2
    assert "nosuchfile.jsonl: no such data file" in capsys.readouterr().err
    assert main(["stats", "--model", "/nonexistent"]) == 2
    assert "--model /nonexistent: does not exist; pass a local directory" in capsys.readouterr().err
