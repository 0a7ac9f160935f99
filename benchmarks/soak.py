"""Soak: ``treetrain train`` for 1,000 steps on the bundled sample, watched from outside.

The training process is sampled every ``--every`` seconds through ``/proc``: resident memory
(VmRSS), threads and open file descriptors, tagged with the step it has logged. The run must keep
RSS flat after warm-up (growth < 5% from ``--warmup`` steps to the end) and end with as many threads
and files as it had at the warm-up step. Checkpoints every ``--checkpoint-every`` steps and the
prefetch thread are on, as in a real run.

The sample's token ids are renumbered to ``0..n-1`` (``treetrain.bench.data.renumber``: the trees keep
their shape) so a tiny random-init Qwen3 with an ``n``-token vocabulary runs on the CPU in reasonable
time; the LM head of the full Qwen vocabulary would dominate every step.

    python benchmarks/soak.py                      # 1000 steps, writes benchmarks/results/soak_*.md
    python benchmarks/soak.py --steps 50 --out /tmp/soak.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_sample(d: Path) -> int:
    """The bundled sample with renumbered ids as a paths-format JSONL; returns the vocabulary size."""
    import numpy as np

    from treetrain.bench.data import renumber
    from treetrain.data import reader as data

    trees = [t for t, _ in data.iter_trees(data.sample_path("agent-dialogues"))]
    vocab = int(np.unique(np.concatenate([t.tokens for t in trees])).size)
    with open(d / "sample.jsonl", "w") as f:
        for t in renumber(trees, vocab):
            rec = {"paths": [p.tolist() for p in t.paths()]}
            for k, v in t.fields.items():
                rec[k] = [x.tolist() if hasattr(x, "tolist") else x for x in v]
            f.write(json.dumps(rec) + "\n")
    return vocab


def write_model(d: Path, vocab: int) -> None:
    """``treetrain train``'s embedded tiny Qwen3, with the renumbered sample's vocabulary."""
    from treetrain.train.build import default_model_config

    default_model_config(vocab).save_pretrained(d / "model")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def proc_sample(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # exited (a zombie until reaped)
        return None
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": fds,
    }


def steps_logged(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def soak(args) -> tuple[list[dict], dict]:
    work = Path(tempfile.mkdtemp(prefix="treetrain-soak-"))
    vocab = write_sample(work)
    write_model(work, vocab)
    out = work / "run"
    cmd = [
        *(sys.executable, "-m", "treetrain.cli", "train", "--model", str(work / "model")),
        *("--data", str(work / "sample.jsonl"), "--output", str(out), "--steps", str(args.steps)),
        *("--checkpoint-every", str(args.checkpoint_every), "--device", "cpu", "--dtype", "float32"),
        *("--capacity", "8192", "--no-progress"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    stop = []  # SIGTERM to this script: preempt the run (it checkpoints and exits 143), then report
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while proc.poll() is None:
        if stop and len(stop) == 1:
            proc.send_signal(signal.SIGTERM)
            stop.append(1)
        s = proc_sample(proc.pid)
        if s is not None:
            samples.append({"t": time.monotonic() - t0, "step": steps_logged(out / "metrics.jsonl"), **s})
        time.sleep(args.every)
    err = proc.stderr.read()
    if proc.returncode not in (0, 128 + signal.SIGTERM):
        raise SystemExit(f"the run failed ({proc.returncode}):\n{err[-3000:]}")
    info = {"vocab": vocab, "wall_s": time.monotonic() - t0, "work": str(work), "preempted": bool(stop)}
    return samples, info


def at_step(samples: list[dict], step: int) -> dict:
    return next(s for s in samples if s["step"] >= step)


def _median(xs: list[int]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def report(samples: list[dict], info: dict, args) -> str:
    """Compare the first ``span`` steps after warm-up with the last ``span`` steps (medians of the
    samples: RSS moves by tens of MiB within a step, as batches of different sizes come and go)."""
    span = max(1, args.steps // 10)
    end = max(s["step"] for s in samples)
    early = [s for s in samples if args.warmup <= s["step"] < args.warmup + span]
    late = [s for s in samples if end - span <= s["step"] < end] or [s for s in samples if s["step"] == end]
    rss0, rss1 = _median([s["rss_kib"] for s in early]), _median([s["rss_kib"] for s in late])
    growth = (rss1 - rss0) / rss0
    threads0, threads1 = max(s["threads"] for s in early), max(s["threads"] for s in late)
    fds0, fds1 = max(s["fds"] for s in early), max(s["fds"] for s in late)
    peak = max(s["rss_kib"] for s in samples if s["step"] >= args.warmup)
    marks = sorted({max(args.warmup, k) for k in range(0, end + 1, span)})
    rows = [at_step(samples, k) for k in marks]
    ok = growth < 0.05 and threads1 <= threads0 and fds1 <= fds0
    stopped = f"; stopped early by SIGTERM at step {end} (the time ran out)" if info.get("preempted") else ""
    lines = [
        f"# Soak: {args.steps} steps of `treetrain train` on the bundled sample",
        "",
        f"- date: {dt.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} cores; "
        f"OMP_NUM_THREADS={args.threads}; {args.note}",
        f"- model: tiny Qwen3 (hidden 64, 2 layers), vocabulary {info['vocab']} (sample ids renumbered); "
        f"checkpoint every {args.checkpoint_every} steps; prefetch on",
        f"- wall time {info['wall_s']:.0f} s; sampled every {args.every} s from /proc{stopped}",
        "",
        f"**Median RSS, steps {args.warmup}-{args.warmup + span - 1} vs steps {end - span}-{end - 1}: "
        f"{rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB ({growth:+.2%})**; peak {peak / 1024:.1f} MiB. "
        f"Threads (max) {threads0} -> {threads1}, open files (max) {fds0} -> {fds1}; after the loop "
        f"(prefetch thread joined): {samples[-1]['threads']} thread(s), {samples[-1]['fds']} files. "
        f"{'PASS' if ok else 'FAIL'} (growth < 5%, no leaked threads or files)",
        "",
        "| step | RSS MiB | threads | open fds |",
        "|---:|---:|---:|---:|",
        *(f"| {r['step']} | {r['rss_kib'] / 1024:.1f} | {r['threads']} | {r['fds']} |" for r in rows),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100, help="steps before RSS is expected to be flat")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--note", default="", help="e.g. 'contended: 7 other jobs on the 2 cores'")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, help="re-render the report of a recorded run")
    args = ap.parse_args()
    args.warmup = min(args.warmup, args.steps)
    if args.from_json:
        rec = json.loads(args.from_json.read_text())
        samples, info = rec["samples"], rec["info"]
    else:
        samples, info = soak(args)
    text = report(samples, info, args)
    cpu = "".join(c if c.isalnum() else "-" for c in cpu_name().lower())
    out = (
        args.out or ROOT / "benchmarks" / "results" / f"soak_{cpu}-{os.cpu_count()}core_{dt.date.today()}.md"
    )
    out.write_text(text)
    (out.with_suffix(".json")).write_text(json.dumps({"info": info, "samples": samples}) + "\n")
    print(text)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
