"""Every figure issue #37 asks for, in one sequence for a quiet window on the 2-core CPU machine.

Each step is one benchmark command with ``--write`` (results under ``benchmarks/results/``), in
priority order: if the window ends early, the most needed figures are already written. Estimated
wall times are each command's ``--estimate`` (FLOPs at the quiet machine's recorded rates) plus its
fixed costs; benchmarks/QUIET_RUNS.md lists them and says what each figure is for.

Usage::

    python benchmarks/quiet_runs.py --list            # the commands and their estimated times
    python benchmarks/quiet_runs.py                   # run them all (about 2.5 hours quiet)
    python benchmarks/quiet_runs.py --only verl-small trl-trainers-small
    python benchmarks/quiet_runs.py --check           # each command's quick variant into a scratch
                                                      # folder, checking it writes a well-formed result

verl's steps run under ``--verl-python`` (default: ``$VERL_PYTHON``, else ``.venv-verl`` or
``/work/venv-verl``); the others under this interpreter. Both need ``PYTHONPATH`` to reach this
checkout's ``src`` (set here). Each step's output goes to ``<results>/quiet_runs_<date>/<step>.log``
and a summary (command, wall time, exit status, files written) to ``<results>/quiet_runs_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B = "benchmarks/"


@dataclass
class Step:
    name: str
    command: list[str]  # after the interpreter; {results} is the results folder
    minutes: int  # estimated wall minutes on the quiet 2-core EPYC
    check: list[str]  # the quick variant --check runs (seconds to minutes, any machine)
    verl: bool = False  # runs under the verl venv
    why: str = ""


STEPS = [
    Step("attention-sweep", [B + "attention_cpu.py", "--sweep", "--repeats", "3", "--write"], 8,
         [B + "attention_cpu.py", "--sweep", "--quick", "--repeats", "1", "--write"],
         why="the block / fanout rule's thresholds (blockrule.BLOCK_RULE) and its before/after"),
    Step("verl-small", [B + "verl_engine.py", "--preset", "small", "--write"], 40,
         [B + "verl_engine.py", "--quick", "--model", "tiny", "--repeats", "1", "--write"], verl=True,
         why="verl's grid: the fastest verl configuration per case, its default, several prompts, memory"),
    Step("trl-trainers-small", [B + "trl_trainers.py", "--preset", "small", "--write"], 7,
         [B + "trl_trainers.py", "--quick", "--model", "tiny", "--repeats", "1", "--write"],
         why="RLOO, DPO, reward vs TRL's best configuration, at or below their bounds"),
    Step("trl-grpo-small", [B + "trl_grpo.py", "--preset", "small", "--write"], 16,
         [B + "trl_grpo.py", "--quick", "--model", "tiny", "--repeats", "1", "--write"],
         why="GRPO scoring vs TRL's best configuration and as shipped, several prompts"),
    Step("bench-qwen3", ["-m", "treetrain", "bench", "--preset", "qwen3-0.6b", "--out", "{results}"], 11,
         ["-m", "treetrain", "bench", "--preset", "tiny", "--out", "{results}"],
         why="treetrain bench on Qwen3-0.6B's shape (vocab 151,936, 28 layers)"),
    Step("bench-smollm2", ["-m", "treetrain", "bench", "--preset", "smollm2-135m", "--out", "{results}"], 8,
         ["-m", "treetrain", "bench", "--preset", "tiny", "--out", "{results}"],
         why="treetrain bench on SmolLM2-135M's shape (vocab 49,152, 30 layers)"),
    Step("verl-smollm2", [B + "verl_engine.py", "--preset", "smollm2-135m", "--write"], 15,
         [B + "verl_engine.py", "--quick", "--model", "tiny", "--repeats", "1", "--no-default", "--write"],
         verl=True, why="verl on SmolLM2-135M's shape"),
    Step("trl-grpo-qwen3", [B + "trl_grpo.py", "--preset", "qwen3-0.6b", "--write"], 7,
         [B + "trl_grpo.py", "--quick", "--model", "tiny", "--repeats", "1", "--no-shipped", "--write"],
         why="GRPO scoring on Qwen3-0.6B's shape"),
    Step("trl-grpo-smollm2", [B + "trl_grpo.py", "--preset", "smollm2-135m", "--write"], 5,
         [B + "trl_grpo.py", "--quick", "--model", "tiny", "--repeats", "1", "--no-memory", "--write"],
         why="GRPO scoring on SmolLM2-135M's shape"),
    Step("trl-trainers-smollm2", [B + "trl_trainers.py", "--preset", "smollm2-135m", "--write"], 17,
         [B + "trl_trainers.py", "--quick", "--model", "tiny", "--repeats", "1", "--no-shipped", "--write"],
         why="RLOO, DPO, reward on SmolLM2-135M's shape"),
    Step("attention-sweep-qwen3-heads",
         [B + "attention_cpu.py", "--sweep", "--heads", "16", "--kv-heads", "8", "--dim", "128",
          "--configs", "64:4", "128:8", "256:8", "--repeats", "2", "--write"], 10,
         [B + "attention_cpu.py", "--sweep", "--quick", "--heads", "16", "--kv-heads", "8", "--dim", "128",
          "--repeats", "1", "--write"],
         why="the block rule with Qwen3-0.6B's attention heads (16 / 8 of 128)"),
    Step("dpo", [B + "dpo.py", "--write"], 2,
         [B + "dpo.py", "--pairs", "2", "--prompt-len", "64", "--response-len", "8", "--hidden", "64",
          "--layers", "1", "--vocab", "512", "--repeats", "1", "--write"],
         why="the DPO step vs the per-path baseline, with peak memory"),
    Step("train-tree-vs-sequence", [B + "train_tree_vs_sequence.py", "--write"], 2,
         [B + "train_tree_vs_sequence.py", "--vocab", "compact", "--lines", "1", "--repeats", "1", "--write"],
         why="the SFT step on the bundled sample vs the per-path baseline, with peak memory"),
]  # fmt: skip


def verl_python() -> str:
    for candidate in (
        os.environ.get("VERL_PYTHON"),
        ROOT / ".venv-verl/bin/python",
        "/work/venv-verl/bin/python",
    ):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit("no verl interpreter: set VERL_PYTHON or pass --verl-python (verl's venv, .ci/verl.sh)")


def run(step: Step, args, results: Path, log_dir: Path, quick: bool) -> dict:
    python = args.verl_python if step.verl else args.python
    cmd = [python] + [a.format(results=results) for a in (step.check if quick else step.command)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["TREETRAIN_RESULTS"] = str(results)
    before = {p: p.stat().st_mtime_ns for p in results.glob("*") if p.is_file()}  # a rerun overwrites
    log = log_dir / f"{step.name}.log"
    print(f"[{step.name}] {' '.join(cmd[1:])} (~{step.minutes} min quiet)", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    written = sorted(p for p in results.glob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns)
    problems = [] if rc == 0 else [f"exit status {rc} (see {log})"]
    problems += well_formed(written)
    print(f"[{step.name}] {'ok' if not problems else 'FAILED: ' + '; '.join(problems)}, {wall:.0f} s, "
          f"wrote {', '.join(p.name for p in written) or 'nothing'}", flush=True)  # fmt: skip
    if problems and quick:  # --check's scratch folder (the log with it) is removed at the end
        print("".join(log.read_text().splitlines(keepends=True)[-30:]), flush=True)
    return {"step": step, "rc": rc, "wall": wall, "written": written, "problems": problems}


def well_formed(written: list[Path]) -> list[str]:
    """Why the files a step wrote are not a result (empty: they are): a markdown file with a table,
    the date and hardware, and the machine's load or the noise verdict."""
    mds = [p for p in written if p.suffix == ".md"]
    if not mds:
        return ["no result file written"]
    problems = []
    for md in mds:
        text = md.read_text()
        if "|---" not in text:
            problems.append(f"{md.name}: no table")
        if not any(k in text for k in ("UTC", time.strftime("%Y-%m-%d"))):
            problems.append(f"{md.name}: no date")
        if not any(
            k in text.lower() for k in ("machine before the run", "no sign of noise", "not trustworthy")
        ):
            problems.append(f"{md.name}: no noise verdict")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the steps and their estimated times")
    ap.add_argument(
        "--check", action="store_true", help="run each step's quick variant into a scratch folder"
    )
    ap.add_argument("--only", nargs="+", metavar="STEP", help="these steps only (names: --list)")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the main venv")
    ap.add_argument("--verl-python", default=None, help="interpreter of verl's venv")
    args = ap.parse_args(argv)
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    unknown = set(args.only or ()) - {s.name for s in STEPS}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {[s.name for s in STEPS]}")
    if args.list:
        for s in steps:
            print(
                f"{s.name:28s} ~{s.minutes:3d} min  {'(verl venv) ' if s.verl else ''}{' '.join(s.command)}"
            )
        print(f"{'total':28s} ~{sum(s.minutes for s in steps):3d} min")
        return 0
    if any(s.verl for s in steps):
        args.verl_python = args.verl_python or verl_python()
    date = datetime.date.today().isoformat()
    scratch = tempfile.TemporaryDirectory() if args.check else None
    results = (
        Path(scratch.name)
        if scratch
        else Path(os.environ.get("TREETRAIN_RESULTS") or ROOT / "benchmarks/results")
    )
    log_dir = results / f"quiet_runs_{date}"
    log_dir.mkdir(parents=True, exist_ok=True)
    done = [run(s, args, results, log_dir, args.check) for s in steps]
    lines = [
        f"# quiet_runs.py{' --check' if args.check else ''}, {date}\n",
        "| step | command | estimate min | wall s | exit | written | problems |",
        "|" + "---|" * 7,
    ]
    for d in done:
        s = d["step"]
        lines.append(f"| {s.name} | `{' '.join(s.check if args.check else s.command)}` | {s.minutes} | "
                     f"{d['wall']:.0f} | {d['rc']} | {', '.join(p.name for p in d['written'])} | "
                     f"{'; '.join(d['problems']) or 'ok'} |")  # fmt: skip
    summary = "\n".join(lines) + "\n"
    print("\n" + summary)
    if not args.check:
        (results / f"quiet_runs_{date}.md").write_text(summary)
    if scratch:
        scratch.cleanup()
    return 1 if any(d["problems"] for d in done) else 0


if __name__ == "__main__":
    sys.exit(main())
