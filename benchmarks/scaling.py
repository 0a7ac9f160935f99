"""Scaling curves: time per training step and peak memory vs tree size, tree and per-path baseline.

Two tree shapes, each at a fixed POR while the size grows (so only the size changes):

- ``per-turn``: ``--turns`` nested per-turn samples of one dialogue (POR = 1 - 2 / (turns + 1)),
  the turn length grows with the size;
- ``group``: ``--paths`` paths sharing a prompt at ``--por``, the path length grows with the size.

Both modes run one SFT training step through the library (``treetrain.bench.command``: the same model,
loss and micro-batches as training, :class:`treetrain.objectives.policy.training.PolicyObjective`), each
in a single micro-batch (capacity = the largest of the step's tree and path lengths). Time: median of
``--repeats`` steps after a warm-up, modes alternating; peak memory: the RSS high-water mark of one step
in a fresh process (CPU) or the allocator's peak (CUDA). The fitted exponent is the log-log slope of time
vs tree tokens: ~1 when linear layers dominate, rising toward 2 where attention pairs (quadratic in the
path length) take over. ``--profile`` runs torch.profiler on the tree step of the largest size and lists
the top ops.

Usage::

    python benchmarks/scaling.py                                  # 1k..4k tokens, table to stdout
    python benchmarks/scaling.py --sizes 1024 2048 4096 8192 16384 32768 65536 --plot --profile --write
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    add_allocator_flag,
    hardware,
    judge,
    machine_before,
    noise_section,
    result_path,
    use_allocator,
)
from treetrain.bench import cases as bench  # noqa: E402
from treetrain.bench import noise  # noqa: E402
from treetrain.trees.flops import CostModel  # noqa: E402


def make_tree(shape: str, tokens: int, args, vocab: int):
    """A tree of about ``tokens`` distinct tokens of ``shape`` at the fixed POR."""
    if shape == "per-turn":  # T = turns * turn_len
        return bench.per_turn_tree(args.turns, max(1, round(tokens / args.turns)), vocab)
    # group: T = (1 - por) * paths * length
    length = max(2, round(tokens / ((1 - args.por) * args.paths)))
    return bench.group_tree(args.por, args.paths, length, vocab)


def measure(model, model_args, tree, args, cost, rate) -> dict:
    """Time (median), peak memory (RSS of a fresh process with ``--memory``; live tensors always) and
    MFU of both modes on one tree."""
    trees = [tree]
    capacity = max(tree.num_tokens, int(tree.path_lengths.max()))
    micro = {m: bench.prepare(m, trees, capacity) for m in ("sequence", "tree")}
    times: dict[str, list[float]] = {"sequence": [], "tree": []}
    monitor = noise.Monitor()
    for r in range(args.repeats + 1):
        if r == 1:  # the warm-up round is not timed
            monitor.start()
        for mode in ("sequence", "tree") if r % 2 == 0 else ("tree", "sequence"):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            bench.train_step(mode, model, trees, micro[mode], args.backend)
            bench._sync(model.device)
            if r:
                times[mode].append(time.perf_counter() - t0)
    load = monitor.stop() if args.repeats else None
    model.zero_grad(set_to_none=True)
    base_flops, tree_flops, _ = bench.case_flops(trees, capacity, cost, model.config.vocab_size)
    stats, untrusted = judge({"tree": times["tree"], "baseline": times["sequence"]}, load)
    row = {"tree_tokens": tree.num_tokens, "baseline_tokens": tree.num_path_tokens, "por": tree.por}
    row["spread"] = {"sequence": stats["baseline"]["spread"], "tree": stats["tree"]["spread"]}
    row["untrusted"] = untrusted
    for mode, flops in (("sequence", base_flops), ("tree", tree_flops)):
        t = statistics.median(times[mode])
        peak = (
            bench.peak_memory(mode, model, model_args, trees, capacity, args.backend) if args.memory else None
        )
        row[mode] = {"s": t, "mfu": flops / t / rate, "peak_mb": None if peak is None else peak / 2**20}
        row[mode]["live_mb"] = bench.live_peak_mb(mode, model, trees, micro[mode], args.backend)
    row["bound"] = base_flops / tree_flops
    row["flops"] = {"sequence": base_flops, "tree": tree_flops}
    row["speedup"] = row["sequence"]["s"] / row["tree"]["s"]
    row["untrusted"] += noise.verdict({}, efficiency=row["speedup"] / row["bound"])  # above 1.05: flagged
    return row


def exponent(rows: list[dict], mode: str, per: str = "tokens") -> float:
    """Log-log slope of step time vs tree tokens, or vs the mode's FLOPs (``per="flops"``: 1.0
    when time grows exactly as the work, linear layers per token plus attention per pair)."""
    if len(rows) < 2:
        return float("nan")
    x = np.log([r["tree_tokens"] if per == "tokens" else r["flops"][mode] for r in rows])
    y = np.log([r[mode]["s"] for r in rows])
    return float(np.polyfit(x, y, 1)[0])


def live(r: dict) -> str:
    """Peak live MiB of both modes, their ratio and the activation bound (path tokens / distinct)."""
    t, b = r["tree"].get("live_mb"), r["sequence"].get("live_mb")
    if t is None or b is None:
        return "-"
    return f"{t:.0f}/{b:.0f} ({b / t:.2f}x; {r['baseline_tokens'] / r['tree_tokens']:.2f}x)"


def table(results: dict[str, list[dict]]) -> str:
    out = [
        "| shape | tree tokens | baseline tokens | POR | tree s | baseline s | speedup | FLOP bound "
        "| efficiency | MFU tree/base | peak MB tree/base | live MiB tree/base (ratio; activation bound) "
        "| spread tree/base | timings |",
        "|" + "---|" * 14,
    ]
    for shape, rows in results.items():
        for r in rows:
            t, b = r["tree"], r["sequence"]
            mem = "-" if t["peak_mb"] is None else f"{t['peak_mb']:.0f}/{b['peak_mb']:.0f}"
            out.append(
                f"| {shape} | {r['tree_tokens']:,} | {r['baseline_tokens']:,} | {r['por']:.1%} "
                f"| {t['s']:.3f} | {b['s']:.3f} | {r['speedup']:.2f}x | {r['bound']:.2f}x "
                f"| {r['speedup'] / r['bound']:.2f} | {t['mfu']:.2f}/{b['mfu']:.2f} | {mem} | {live(r)} "
                f"| {r['spread']['tree']:.0%}/{r['spread']['sequence']:.0%} "
                f"| {'NOT TRUSTWORTHY' if r['untrusted'] else 'ok'} |"
            )
    out.append("")
    out.append(
        "| shape | time vs tokens: exponent tree / baseline | time vs FLOPs (tokens + pairs): exponent "
        "tree / baseline |"
    )
    out.append("|---|---|---|")
    for shape, rows in results.items():
        out.append(
            f"| {shape} | {exponent(rows, 'tree'):.2f} / {exponent(rows, 'sequence'):.2f} "
            f"| {exponent(rows, 'tree', 'flops'):.2f} / {exponent(rows, 'sequence', 'flops'):.2f} |"
        )
    return "\n".join(out)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (shape, rows) in enumerate(results.items()):
        x = [r["tree_tokens"] for r in rows]
        for mode, style in (("tree", "-o"), ("sequence", "--s")):
            label = f"{shape} {'tree' if mode == 'tree' else 'baseline'}"
            ax1.plot(x, [r[mode]["s"] for r in rows], style, color=f"C{i}", label=label)
            if rows[0][mode]["peak_mb"] is not None:
                ax2.plot(x, [r[mode]["peak_mb"] for r in rows], style, color=f"C{i}", label=label)
    for ax, name in ((ax1, "time per step (s)"), (ax2, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tree tokens")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile(model, tree, args, top: int = 15) -> str:
    """torch.profiler over one tree step (after a warm-up): the top ops by self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    trees = [tree]
    capacity = max(tree.num_tokens, int(tree.path_lengths.max()))
    micro = bench.prepare("tree", trees, capacity)
    bench.train_step("tree", model, trees, micro, args.backend)
    model.zero_grad(set_to_none=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        bench.train_step("tree", model, trees, micro, args.backend)
    model.zero_grad(set_to_none=True)
    key = "self_cuda_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096], help="tree tokens per step")
    p.add_argument("--shapes", nargs="+", default=["per-turn", "group"], choices=["per-turn", "group"])
    p.add_argument(
        "--per-turn-max",
        type=int,
        default=None,
        help="largest per-turn size (its baseline's attention grows as turns x path length^2: on a "
        "2-core CPU 16k tokens took 7 minutes); default: all --sizes",
    )
    p.add_argument("--turns", type=int, default=8, help="per-turn trees: turns (POR 1 - 2/(turns+1))")
    p.add_argument("--paths", type=int, default=8, help="group trees: paths")
    p.add_argument("--por", type=float, default=0.5, help="group trees: POR")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per mode (median) after a warm-up")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip peak memory")
    p.add_argument("--backend", default=None, help="tree attention backend (default: by device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--plot", action="store_true", help="write a PNG beside the results file")
    p.add_argument("--profile", action="store_true", help="torch.profiler top ops of the largest tree step")
    p.add_argument("--write", action="store_true", help="write benchmarks/results/scaling_*.md")
    add_allocator_flag(p)
    args = p.parse_args()

    device = torch.device(args.device)
    use_allocator(args, device.type)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    model_args = (args.hidden, args.layers, args.vocab, args.heads, device, dtype)
    model = bench.bench_model(*model_args)
    cost = CostModel.from_config(model.config)
    before = machine_before()
    rate = bench.matmul_rate(dtype, device)
    print(f"dense matmul rate {rate / 1e9:,.1f} GFLOP/s ({dtype}, {device})", flush=True)
    results: dict[str, list[dict]] = {}
    for shape in args.shapes:
        for size in sorted(args.sizes):
            if shape == "per-turn" and args.per_turn_max and size > args.per_turn_max:
                continue
            tree = make_tree(shape, size, args, args.vocab)
            t0 = time.perf_counter()
            row = measure(model, model_args, tree, args, cost, rate)
            results.setdefault(shape, []).append(row)
            print(
                f"{shape} {row['tree_tokens']:,} tokens: tree {row['tree']['s']:.3f} s, baseline "
                f"{row['sequence']['s']:.3f} s, efficiency {row['speedup'] / row['bound']:.2f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    cases = [
        (f"{shape} {r['tree_tokens']:,}", r["untrusted"]) for shape, rows in results.items() for r in rows
    ]
    text = table(results) + "\n\n" + noise_section(before, cases)
    prof = None
    if args.profile:
        largest = make_tree(args.shapes[-1], max(args.sizes), args, args.vocab)
        prof = profile(model, largest, args)
    head = (
        f"## Scaling: time per step and peak memory vs tree size\n\n"
        f"- hardware: {hardware()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"date {datetime.date.today()}; dense matmul rate {rate / 1e9:,.1f} GFLOP/s ({dtype})\n"
        f"- model: Qwen3-shaped, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab "
        f"{args.vocab}, {dtype}, {device}; SFT step, one micro-batch per mode\n"
        f"- shapes: per-turn {args.turns} turns; group {args.paths} paths at POR {args.por}; "
        f"median of {args.repeats} steps after a warm-up\n"
        f"- command: `python benchmarks/scaling.py {' '.join(sys.argv[1:])}`\n\n"
    )
    report = head + text + "\n"
    if prof is not None:
        title = f"torch.profiler: tree step, {args.shapes[-1]} {max(args.sizes):,} tokens"
        report += f"\n### {title}\n\n```\n{prof}\n```\n"
    print("\n" + report)
    if args.write or args.plot:
        path = result_path("scaling", device.type)
        if args.write:
            path.write_text(report)
            print(f"wrote {path}")
        if args.plot:
            png = path.with_suffix(".png")
            plot(results, png)
            print(f"plot: {png}")


if __name__ == "__main__":
    main()
