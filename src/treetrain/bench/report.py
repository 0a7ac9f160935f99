"""The report of ``treetrain bench``: its Markdown table with the noise notes, the results file's
header (hardware, model, what the baseline and the bound are) and the plot."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from treetrain.bench import allocator

if TYPE_CHECKING:
    import torch

    from treetrain.bench.cases import Result

__all__ = ["format_table", "hardware_slug", "model_line", "noise_notes", "plot", "results_header"]


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _block_rule() -> tuple:
    from treetrain.attention.blockrule import BLOCK_RULE

    return BLOCK_RULE


def _mib(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def _live(r: Result) -> str:
    if r.baseline_live_mb is None or r.tree_live_mb is None:
        return "-"
    ratio = r.baseline_live_mb / r.tree_live_mb if r.tree_live_mb else float("nan")
    return f"{_mib(r.baseline_live_mb)}/{_mib(r.tree_live_mb)} ({ratio:.2f}x; {r.activation_bound:.2f}x)"


def format_table(results: list[Result], machine: list[str] = ()) -> str:
    """The results as a Markdown table; speedup and efficiency from the best times, the median
    speedup and each mode's spread beside them, and whether the case's timings can be trusted."""
    head = (
        "| case | paths | baseline tok | tree tok | POR | speedup (best) | median (spread base/tree) "
        "| FLOP bound | efficiency | baseline s (budget) | tree s | MFU base/tree | HF s (tree/HF) "
        "| peak MB base/tree | live MiB base/tree (ratio; activation bound) | max lp diff | timings |"
    )
    lines = [head, "|" + "---|" * 17]
    for r in results:
        hf = "-" if r.hf_s is None else f"{r.hf_s:.3f} ({r.tree_vs_hf:.3f})"
        trust = f"NOT TRUSTWORTHY ({len(r.untrusted)} reasons below)" if r.untrusted else "ok"
        if machine and not r.untrusted:
            trust = "suspect (busy machine)"
        lines.append(
            f"| {r.name} | {r.paths} | {r.baseline_tokens:,} | {r.computed_tokens:,} | {r.por:.1%} "
            f"| {r.speedup:.2f}x | {r.speedup_median:.2f}x ({r.baseline_spread:.0%}/{r.tree_spread:.0%}) "
            f"| {r.flop_bound:.2f}x | **{r.efficiency:.2f}** | {r.baseline_s:.3f} ({_budget(r)}) "
            f"| {r.tree_s:.3f} | {r.baseline_mfu:.2f}/{r.tree_mfu:.2f} | {hf} "
            f"| {_opt(r.baseline_peak_mb, '.0f')}/{_opt(r.tree_peak_mb, '.0f')} | {_live(r)} "
            f"| {r.max_logprob_diff:.1e} "
            f"| {trust} |"
        )
    return "\n".join(lines) + noise_notes(results, machine)


def _budget(r: Result) -> str:
    """The baseline's micro-batch budget: tokens, or one path per forward (``ONE_PATH``, -1)."""
    return "1 path" if r.baseline_capacity == -1 else f"{r.baseline_capacity:,} tok"


def noise_notes(results: list[Result], machine: list[str] = ()) -> str:
    """The reasons behind every NOT TRUSTWORTHY row and a busy machine, or a line saying none was found."""
    bad = [r for r in results if r.untrusted]
    lines = []
    if machine:
        lines.append(
            "**A busy machine before the run:** " + "; ".join(machine) + ". Every figure is suspect, even "
            "where its own repeats agree."
        )
    if bad:
        lines.append(
            f"**NOT TRUSTWORTHY: {len(bad)} of {len(results)} cases.** Their speedups and efficiencies are "
            "the machine's load as much as the code's; rerun on a quiet machine (or with more --repeats):"
        )
        lines[-1] += "\n" + "\n".join(f"- {r.name}: " + "; ".join(r.untrusted) for r in bad)
    if not lines:
        lines.append(
            "Timings: no sign of noise (every spread <= 10%, the machine otherwise idle); the best "
            "times are the figures."
        )
    return "\n\n" + "\n\n".join(lines)


def plot(results: list[Result], out: str) -> None:
    """Speedup and FLOP bound vs POR (log scale). Names and efficiencies go in the legend, below
    the axes, never beside the points: points at nearly the same place (a case and its bound, the
    sample beside a group tree) would print their labels over each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted((r for r in results if r.name.startswith("group")), key=lambda r: r.por)
    others = [r for r in results if not r.name.startswith("group")]
    fig, ax = plt.subplots(figsize=(7, 4.2 + 0.22 * (len(others) + 2)))
    if sweep:
        por = [r.por * 100 for r in sweep]
        effs = ", ".join(f"{r.efficiency:.2f}" for r in sweep)
        ax.plot(
            por,
            [r.flop_bound for r in sweep],
            "k--",
            marker="o",
            mfc="none",
            label="FLOP bound (group trees)",
        )
        ax.plot(por, [r.speedup for r in sweep], "C0-o", label=f"measured, group trees (efficiency {effs})")
    markers = "s^vDP*Xh"
    for i, r in enumerate(others):
        color, m = f"C{i + 1}", markers[i % len(markers)]
        ax.plot(r.por * 100, r.flop_bound, m, color=color, mfc="none", ms=9)
        ax.plot(
            r.por * 100,
            r.speedup,
            m,
            color=color,
            label=f"{r.name}: {r.speedup:.2f}x, bound {r.flop_bound:.2f}x (hollow), "
            f"efficiency {r.efficiency:.2f}",
        )
    ax.set_xlabel("POR (%)")
    ax.set_ylabel("speedup over per-path baseline (x)")
    ax.set_yscale("log")
    top = max(max(r.speedup, r.flop_bound) for r in results)
    low = min(min(r.speedup, r.flop_bound) for r in results)
    ax.set_ylim(min(0.9, low / 1.15), top * 1.3)
    ticks = [
        t for t in (0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if low / 1.15 <= t <= 1.3 * top
    ]
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(-5, 105)
    untrusted = sum(bool(r.untrusted) for r in results)
    title = "tree vs per-path baseline: speedup (filled) and FLOP bound"
    if untrusted:
        title += f"\n{untrusted} of {len(results)} cases NOT TRUSTWORTHY (noisy machine, see the table)"
    ax.set_title(title, fontsize=9, color="C3" if untrusted else "black")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def hardware_slug(device: torch.device) -> str:
    """``cpu-2core-intel-xeon...`` or ``cuda-nvidia-h100...``: the hardware, for file names."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "unknown"
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1] for ln in f if ln.startswith("model name")), name)
        name = f"{os.cpu_count()}core-{name}"
    slug = "".join(c if c.isalnum() else "-" for c in name.strip().lower())
    return f"{device.type}-" + "-".join(filter(None, slug.split("-")))[:48]


def model_line(args) -> str:
    if not getattr(args, "model", None):
        return "Qwen3-shaped"
    return (
        f"{args.model} (pretrained weights; the cases' token ids are random, or the sample's renumbered "
        "to 0..n-1 with the tree shapes of the tiny-model rows: meaningless to this vocabulary, and the "
        "timing does not depend on them)"
    )


def results_header(args, rate: float, dtype, device, load: str = "unknown") -> str:
    import platform
    import sys

    import torch

    return (
        f"# treetrain bench, preset {args.preset}\n\n"
        f"- command: `treetrain {' '.join(sys.argv[1:]) or 'bench'}`\n"
        f"- hardware: {hardware_slug(device)} ({platform.processor() or platform.machine()}), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"allocator {getattr(args, 'allocator_used', allocator.active())}\n"
        f"- machine before the run: {load}\n"
        f"- tree attention: {args.backend or 'by device'}; on the CPU blocksparse, block / fanout by the "
        f"tree's shape (treetrain.attention.blockrule.BLOCK_RULE {_block_rule()})\n"
        f"- model: {model_line(args)}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads or max(1, args.heads // 2)} key/value, "
        f"{args.head_dim or args.hidden // args.heads} wide), MLP {args.intermediate or 3 * args.hidden}, "
        "vocab "
        f"{args.vocab}, {dtype}; dense matmul rate {rate / 1e9:,.1f} GFLOP/s\n"
        "- baseline: treetrain.objectives.baseline, every path its own sequence, packed padding-free "
        "(varlen) "
        "into micro-batches (budget: the fastest of the tree's, --capacity, the longest path's and one path "
        "per forward, timed per case unless --no-baseline-search; the table's budget column), the same "
        "attention backend family, the chunked LM head on "
        "trained targets only, the same compute_loss (SFT token-mean)\n"
        "- FLOP bound: baseline / tree training FLOPs of what each computes (treetrain.trees.flops); "
        "efficiency "
        "= speedup / bound (above 1.05: flagged, work the bound does not price); MFU = model FLOPs / time / "
        "matmul rate\n"
        "- memory: live MiB = the most tensor bytes alive at once during one step of each mode "
        "(treetrain.bench.measure.peak_bytes); activation bound = baseline tokens / distinct tokens\n\n"
    )
