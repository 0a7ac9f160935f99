"""Shared helpers for the benchmark scripts: hardware description, the machine's load and the noise
of timed repeats (``treetrain.bench.noise``), a synchronized timer, the Qwen3 shapes and result files.

Every script that times something should say how far to trust it::

    before = machine_before()                 # prints the load; warns on a busy machine
    with noise.Monitor() as mon:
        times = {"tree": [...], "baseline": [...]}  # interleaved repeats
    stats, reasons = judge(times, mon.load)   # best, median, spread per mode; why not to trust
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path

from treetrain.bench import allocator, noise

# where result files go; TREETRAIN_RESULTS redirects them (quiet_runs.py --check writes to a scratch folder)
RESULTS = Path(os.environ.get("TREETRAIN_RESULTS") or Path(__file__).parent / "results")

# Qwen3-shaped random-init models of the TRL and verl benchmarks
QWEN3_SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=32000),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}  # fmt: skip
# the shapes the TRL and verl comparisons run: a tiny one for the tests' smoke runs, Qwen3's, and
# SmolLM2-135M's (30 layers, 9/3 heads of 64, vocab 49,152) on the Qwen3 architecture
MODEL_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=1000),
    **QWEN3_SHAPES,
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152),
}  # fmt: skip


def provenance(script: str, argv: list[str] | None, device: str, versions: str = "") -> str:
    """A result's provenance line: ``DATE UTC, device, torch X[versions], command: `python
    benchmarks/SCRIPT ARGS``` (``argv``: the script's arguments; None: ``sys.argv``'s)."""
    import sys

    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else hardware()
    args = " ".join(argv if argv is not None else sys.argv[1:])
    return (
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {name}, torch "
        f"{torch.__version__}{versions}, command: `python benchmarks/{Path(script).name} {args}`"
    )


def table_head(columns: list[str]) -> str:
    """A markdown table's header row and rule."""
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"


def timed(fn, device: str, clock=time.perf_counter) -> float:
    """Seconds ``fn()`` takes by ``clock``; on CUDA the queued work is waited for before and after."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t = clock()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return clock() - t


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def hardware() -> str:
    return (
        f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"allocator {allocator.active()}"
    )


def machine_before(seconds: float = 0.5) -> dict:
    """The machine's load before a run (:func:`treetrain.bench.noise.snapshot`), printed, with a
    WARNING line when it is busy; returns ``{"load", "top", "line", "busy"}`` for the result file."""
    snap = noise.snapshot(seconds)
    snap["line"] = noise.describe(snap["load"], snap["top"])
    snap["busy"] = noise.busy(snap["load"])
    print(f"machine before the run: {snap['line']}", flush=True)
    if snap["busy"]:
        print(
            "  WARNING, a busy machine: " + "; ".join(snap["busy"]) + ". Timings will be marked.", flush=True
        )
    return snap


def judge(times: dict[str, list[float]], load=None, bound: float | None = None) -> tuple[dict, list[str]]:
    """Per mode :func:`treetrain.bench.noise.summary` (best, median, spread), and the reasons not to
    trust them (:func:`treetrain.bench.noise.verdict`; empty: none found)."""
    stats = {m: noise.summary(t) for m, t in times.items() if t}
    return stats, noise.verdict(stats, load, bound)


def noise_section(before: dict, cases: list[tuple[str, list[str]]]) -> str:
    """Markdown for a result file: the load before the run and every case not to trust, with why."""
    lines = [f"Machine before the run: {before['line']}."]
    if before["busy"]:
        lines.append("**A busy machine:** " + "; ".join(before["busy"]) + ". Every figure is suspect.")
    bad = [(name, why) for name, why in cases if why]
    if bad:
        lines.append(
            f"**NOT TRUSTWORTHY: {len(bad)} of {len(cases)} rows** (rerun on a quiet machine):\n"
            + "\n".join(f"- {name}: " + "; ".join(why) for name, why in bad)
        )
    elif not before["busy"]:
        lines.append("Timings: no sign of noise (every spread <= 10%, the machine otherwise idle).")
    return "\n\n".join(lines) + "\n"


def add_allocator_flag(parser) -> None:
    """``--allocator`` (``treetrain.bench.allocator``): CPU runs re-execute under tcmalloc when installed."""
    allocator.add_flag(parser)


def use_allocator(args, device: str = "cpu") -> str:
    """Switch to ``args.allocator`` on CPU (may re-execute the script); the allocator in use."""
    return allocator.use(args.allocator) if device == "cpu" else allocator.active()


def result_path(name: str, device: str = "cpu") -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in cpu_name()).strip("-").lower()[:40]
    date = datetime.date.today().isoformat()
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}_{device}-{os.cpu_count()}core-{slug}_{date}.md"


def estimate_line(
    script: str, argv, seconds: float, rate: float, machine: str = "the quiet 2-core EPYC"
) -> str:
    """The line ``--estimate`` prints: the command, its estimated wall time and the rate it assumes
    (measured on ``machine``)."""
    import sys

    args = " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--estimate")
    return (
        f"estimate: `python benchmarks/{script} {args}`: about {seconds / 60:.0f} min ({seconds:,.0f} s) at "
        f"{rate / 1e9:.0f} GFLOP/s ({machine}'s rate on such steps; FLOPs only: fixed costs, "
        "model building and elementwise work come on top)"
    )


def flop_audit_table(rows: list[dict], unpriced: str) -> str:
    """Markdown: per case and mode, the FLOPs a step executed (``treetrain.bench.measure.count_flops``)
    beside the bound's model of them, by kind, and the elementwise passes over logits the model
    does not price. ``rows``: ``{"case", "mode", "counted": {...}, "model": {"linear", "attention",
    "head"}}``; ``unpriced``: what else the model leaves out, for the note under the table."""
    g = 1e9
    lines = [
        "| case | mode | counted GFLOP: linear / attention / head | model GFLOP: linear / attention / head "
        "| counted / model | logit elements (M) |",
        "|" + "---|" * 6,
    ]
    for r in rows:
        c, m = r["counted"], r["model"]
        total = sum(m.values())
        counted = " / ".join(f"{c[k] / g:.2f}" for k in ("linear", "attention", "head"))
        model = " / ".join(f"{m[k] / g:.2f}" for k in ("linear", "attention", "head"))
        lines.append(
            f"| {r['case']} | {r['mode']} | {counted} | {model} "
            f"| **{c['total'] / total if total else float('nan'):.3f}** | {c['logit_elements'] / 1e6:.1f} |"
        )
    note = (
        "\nCounted: every matmul and attention call the step ran (``FlopCounterMode``; the CPU flash "
        "kernel at its computed pairs: all L x S with a mask, the lower triangle when causal; backward = "
        "2x forward). Model: ``treetrain.trees.flops.Work`` of what the benchmark says the mode runs. "
        "*logit elements*: elements of ``[..., vocab]`` tensors written by elementwise ops (softmax, exp, "
        f"masks), which FLOPs do not price. Not counted by either: {unpriced}.\n"
    )
    return "\n".join(lines) + "\n" + note


def block_rule_line() -> str:
    """The CPU tree attention's block rule in force (``blockrule.BLOCK_RULE``), for result headers."""
    from treetrain.attention.blockrule import BLOCK_RULE

    rule = ", ".join(f"segment mean >= {m}: {b} / {f}" for m, b, f in BLOCK_RULE)
    return f"CPU tree attention: blocksparse, block / fanout by the tree's shape ({rule})"
