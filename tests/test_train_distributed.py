"""``treetrain train`` under ``torchrun`` (2 processes, gloo on CPU): the same per-step losses and
final weights as one process; SIGKILL mid-run and mid-checkpoint, then ``--resume``, reproduces the
uninterrupted run exactly with no corrupt checkpoint; a non-finite loss stops every rank cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from treetrain.train.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint
from treetrain.train.checkpoint_files import FAULT_ENV

from .reference import tiny_config
from .test_faults import write_trees

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
EVERY = 3  # checkpoint every 3 steps


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A config-only tiny Qwen3 (random init from --seed) and 30 trees of shared-prefix paths."""
    d = tmp_path_factory.mktemp("dist_train")
    tiny_config("qwen3").save_pretrained(d / "model")
    write_trees(d / "data.jsonl")
    return d


def train_args(workdir: Path, out: Path, *extra: str) -> list[str]:
    # capacity 40 < the largest trees: some are partitioned, their parts may land on different ranks
    return [
        "train",
        *("--model", str(workdir / "model"), "--data", str(workdir / "data.jsonl"), "--output", str(out)),
        *("--steps", str(STEPS), "--batch-trees", "3", "--capacity", "40", "--lr", "1e-2"),
        *("--device", "cpu", "--dtype", "float32", "--checkpoint-every", str(EVERY), "--no-progress"),
        *extra,
    ]


# Every training process of these comparisons runs ONE intra-op thread: torchrun's workers and the
# one-process reference alike (a subprocess, not this pytest process, whose thread count is the
# machine's or the user's OMP_NUM_THREADS). The thread count changes how a matmul splits its sums:
# a 2-thread reference drifted from the 1-thread workers by 1.1e-4 in a grad norm over 24 steps.
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def launch(
    nproc: int, args: list[str], env: dict | None = None, module: str = "treetrain.cli"
) -> subprocess.Popen:
    """``torchrun --nproc_per_node N -m MODULE ARGS`` in its own session (to SIGKILL it all);
    ``nproc=0``: one plain process (no torchrun), with the same thread settings."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in dist_vars}
    return subprocess.Popen(
        [*(cmd if nproc else [sys.executable]), "-m", module, *args],
        cwd=ROOT,
        env={**base, **THREADS_ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the training processes and torchrun. torchrun starts each rank in a session of its
    own, so the ranks are found as torchrun's children."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    for pid in map(int, children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in map(int, children):  # reaped by torchrun, or orphaned then reaped by init
        while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid):
            time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "gone"


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def assert_checkpoints_intact(out: Path) -> list[int]:
    found = list_checkpoints(out)
    for ck in found:
        verify_checkpoint(ck)
    return [int(ck.name.split("_")[1]) for ck in found]


@pytest.fixture(scope="module")
def reference(workdir, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs: one process and two (torchrun), each process with one thread."""
    runs = {n: tmp_path_factory.mktemp(f"ref{n}") / "run" for n in (1, 2)}
    two = launch(2, train_args(workdir, runs[2]))
    one = launch(0, train_args(workdir, runs[1]))
    for proc in (one, two):
        rc, err = finish(proc)
        assert rc == 0, err[-3000:]
    return runs


def test_two_processes_match_one(reference):
    one, two = metrics(reference[1]), metrics(reference[2])
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    # Same trees, same global normalizer, gradients summed over ranks. What differs is where each
    # tree runs (other micro-batch forests) and the order of the float32 sums. Step 1 (same
    # weights) agrees to an ulp; after that the rounding differences are carried and amplified
    # by AdamW (m / sqrt(v) of near-zero gradients), measured over 24 steps at lr 1e-2: losses
    # <= 2e-6 relative, grad norms <= 1.2e-5 relative, weights <= 9e-6 absolute. A real mistake
    # (a tree dropped or counted twice, gradients averaged instead of summed) moves the loss or
    # the grad norm by percents.
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-7, abs=0)
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-6, abs=0)
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=0)
        assert (b["tokens"], b["tree_tokens"], b["trees"]) == (a["tokens"], a["tree_tokens"], a["trees"])
    w1, w2 = final_weights(reference[1]), final_weights(reference[2])
    assert w1.keys() == w2.keys()
    # the run is deterministic: measured max 8.6e-6 (the drift described above), 1% of one AdamW
    # step at lr 1e-2; weights of rare tokens drift most (AdamW scales tiny gradients up)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4


def test_sigkill_mid_run_and_mid_checkpoint_then_resume(workdir, reference, tmp_path):
    out = tmp_path / "run"
    args = train_args(workdir, out, "--resume")
    # 1. SIGKILL both ranks (and torchrun) as soon as the first checkpoint is there
    proc = launch(2, args)
    deadline = time.monotonic() + 180
    while latest_checkpoint(out) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_job(proc)
    rc, err = finish(proc)
    assert rc == -signal.SIGKILL, err[-3000:]
    assert not (out / "final").exists()  # really killed in the middle of the run
    done = assert_checkpoints_intact(out)
    last = max(done)
    assert last + EVERY < STEPS, f"killed too late (checkpoints {done}); the test needs a later save"

    # 2. resume; SIGKILL rank 0 between writing checkpoint last+EVERY and renaming it into place
    proc = launch(2, args, env={FAULT_ENV: f"before_rename@{last + EVERY}"})
    rc, err = finish(proc)
    assert rc != 0, "the fault hook did not fire"
    assert latest_checkpoint(out).name == f"step_{last}"  # the pointer never moved
    assert (out / "checkpoints" / f"step_{last + EVERY}.tmp").is_dir()  # the interrupted write
    assert assert_checkpoints_intact(out)[-1] == last

    # 3. resume again, to the end
    rc, err = finish(launch(2, args))
    assert rc == 0, err[-3000:]

    ref, got = metrics(reference[2]), metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step logged once
    # model, optimizer, schedule, data position and RNG all come back from the checkpoint, and the
    # run is deterministic on CPU: the resumed steps are the uninterrupted ones, bit for bit
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    w_ref, w_got = final_weights(reference[2]), final_weights(out)
    assert all(torch.equal(w_ref[k], w_got[k]) for k in w_ref)
    assert not list((out / "checkpoints").glob("*.tmp"))  # the next save cleared the debris
    assert assert_checkpoints_intact(out) == [STEPS - EVERY, STEPS]  # keep=2; the final step too


def test_non_finite_loss_stops_every_rank(workdir, tmp_path):
    data = tmp_path / "data.jsonl"
    lines = (workdir / "data.jsonl").read_text().splitlines()[:9]
    records = [json.loads(line) for line in lines]
    for i, rec in enumerate(records):  # tree 7 (step 3) has an advantage that overflows float32
        rec["advantages"] = [1e39 if i == 7 else 1.0] * len(rec["paths"])
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    args = train_args(
        workdir, out, "--objective", "reinforce", "--checkpoint-every", "1", "--data", str(data)
    )
    rc, err = finish(launch(2, args), timeout=180)
    assert rc != 0
    assert "step 3: non-finite loss" in err and "the last good checkpoint is" in err, err[-3000:]
    assert "step_2" in err
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert latest_checkpoint(out).name == "step_2"
    assert assert_checkpoints_intact(out) == [1, 2]
    assert not (out / "final").exists()


def test_sequence_packing_two_processes_match_one(workdir, tmp_path):
    """The per-path baseline runs one forward per path: ranks must still run equally many forwards
    (FSDP's collectives are per forward), or the job hangs."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--packing", "sequence", "--steps", "3", "--checkpoint-every", "0")
    procs = [launch(2, train_args(workdir, two, *extra)), launch(0, train_args(workdir, one, *extra))]
    for proc in procs:
        rc, err = finish(proc, timeout=180)
        assert rc == 0, err[-3000:]
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=0)
