"""The GUI-agent benchmark's record (``benchmarks/gui_agent.py``): its rows, its table and its verdict,
rendered from the run's data alone, so a record can be judged again from its .json
(``python benchmarks/gui_agent.py --rejudge RESULT.json``) after the judging changes, without
rerunning the hours of timing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from benchmarks.common import noise_section, table_head
from treetrain.bench import noise, paired

TIMING = (
    "## Timing\n\n"
    "The per-path steps (the baseline's, TRL's) are cut into chunks of about one tree step's FLOPs; each "
    "chunk runs between two tree steps and is measured in them (`treetrain.bench.paired`): a drift of "
    "the machine's speed slower than a bracket cancels. Speedup: each chunk's median over the rounds, "
    "summed (a stall that slows one chunk in one round moves it little); its 90% interval: the rounds "
    "drawn again with replacement (bootstrap), the speedup recomputed. Judged: that interval's width "
    "(over 10% of the speedup: not trustworthy), the machine's load, the FLOP bound (efficiency over 1.05: "
    "a bug, not a speedup), and how much the two tree steps around a chunk differ (a drift as fast as a "
    "bracket, which no bracket cancels). The rounds' own speedups (each round's chunks summed) and the "
    "raw medians (whole steps in seconds, and their ratio) are shown beside it, not judged.\n\n"
    "TRL: its own scoring (`GRPOTrainer._get_per_token_logps_and_entropies`), one path per forward (no "
    "padding), its fused chunked head on the action's tokens only (compact, as TRL runs it on CUDA), "
    "gradient checkpointing off, no entropies; each screenshot encoded once per path that holds it. "
    "Its bound counts its work as the baseline's plus its head's recomputation in backward.\n\n"
)
MODE_HEAD = [
    "vs", "speedup (chunk medians)", "90% interval", "FLOP bound", "efficiency (90% interval)",
    "rounds' speedups (spread)", "step s / tree step s (raw medians)", "raw speedup",
    "raw spread step / tree", "tree steps around a chunk differ (median / worst)", "loss diff",
]  # fmt: skip


def bracketed(data: dict) -> paired.Bracketed:
    """The timings of a run's data (``tree``, ``times``, ``losses``, ``load``)."""
    load = data.get("load")
    return paired.Bracketed(
        tree=data["tree"], times=data["times"], losses=data["losses"],
        load=None if load is None else noise.Load(**load),
    )  # fmt: skip


def mode_summary(b: paired.Bracketed, mode: str, bound: float) -> dict:
    """One mode against the tree: the speedup (:meth:`~treetrain.bench.paired.Bracketed.chunk_medians`)
    and its 90% interval, their efficiency against ``bound``, the rounds' own speedups, the raw step
    times and their spreads, the drift within a bracket (median, worst), the verdict
    (:func:`treetrain.bench.paired.verdict`)."""
    rounds = b.speedups(mode)
    speed, lo, hi = b.chunk_medians(mode), *b.interval(mode)
    raw, tree = noise.summary(b.raw(mode)), noise.summary(b.tree_steps())
    return {
        "speedup": speed, "interval": [lo, hi], "bound": bound, "efficiency": speed / bound,
        "efficiency_interval": [lo / bound, hi / bound], "rounds": len(rounds), "speedups": rounds,
        "speedup_spread": noise.summary(rounds)["spread"],
        "step_s": raw["median"], "step_spread": raw["spread"], "tree_s": tree["median"],
        "tree_spread": tree["spread"], "raw_speedup": raw["median"] / tree["median"],
        "bracket_drift": b.bracket_drift(), "loss_diff": abs(b.losses[mode] - b.losses["tree"]),
        "untrusted": paired.verdict(b, mode, bound),
    }  # fmt: skip


def mode_line(name: str, s: dict) -> str:
    """A table row of :func:`mode_summary`."""
    (lo, hi), (elo, ehi) = s["interval"], s["efficiency_interval"]
    return (
        f"| {name} | {s['speedup']:.2f}x | {lo:.2f}x-{hi:.2f}x | {s['bound']:.2f}x "
        f"| **{s['efficiency']:.2f}** ({elo:.2f}-{ehi:.2f}) "
        f"| {', '.join(f'{x:.2f}' for x in s['speedups'])} ({s['speedup_spread']:.0%}) "
        f"| {s['step_s']:.1f} / {s['tree_s']:.1f} | {s['raw_speedup']:.2f}x "
        f"| {s['step_spread']:.0%} / {s['tree_spread']:.0%} "
        f"| {s['bracket_drift'][0]:.0%} / {s['bracket_drift'][1]:.0%} | {s['loss_diff']:.1e} |"
    )


def render(data: dict) -> str:
    """The record's markdown from a run's data: ``preamble`` (provenance, preset, episode), ``names`` and
    ``flops`` of the modes, the timings (:func:`bracketed`), ``peaks`` (None: not measured), ``before``
    (the machine's load before the run), ``reading`` (optional: a hand-written reading, kept last);
    fills ``data["modes"]`` with each mode's :func:`mode_summary`."""
    b = bracketed(data)
    flops, names = data["flops"], data["names"]
    rows = {m: mode_summary(b, m, flops[m] / flops["tree"]) for m in names}
    data["modes"] = rows
    text = data["preamble"] + "\n\n" + TIMING + table_head(MODE_HEAD)
    text += "\n".join(mode_line(names[m], s) for m, s in rows.items())
    peaks = data.get("peaks")
    if peaks is None:
        text += "\n\nLive peaks: not measured (the run stopped before them, or is still running)."
    else:
        text += (
            f"\n\nLive peak (tensors alive at once in one step): baseline {peaks['sequence']:,.0f} MiB, "
            f"tree {peaks['tree']:,.0f} MiB."
        )
    steps = "\n".join(
        f"- round {r + 1}: tree steps {', '.join(f'{t:.1f}' for t in tree)} s; "
        + "; ".join(f"{m} chunks {', '.join(f'{t:.1f}' for t in b.times[m][r])} s" for m in names)
        for r, tree in enumerate(b.tree)
    )
    text += "\n\n### Every step (s)\n\n" + steps + "\n\n"
    if b.load is None:
        text += "Load while timed: not recorded by this run.\n\n"
    else:
        text += f"Load while timed: {noise.describe(b.load)}.\n\n"
    text += noise_section(data["before"], [(names[m], s["untrusted"]) for m, s in rows.items()])
    return text + (f"\n{data['reading']}" if data.get("reading") else "")


def load_dict(b: paired.Bracketed) -> dict | None:
    """``b.load`` for the .json."""
    return None if b.load is None else dataclasses.asdict(b.load)


def rejudge(path: Path) -> str:
    """Render the record of ``path`` (a run's .json) again with today's judging; rewrites the .json's
    rows and the .md beside it; returns the markdown."""
    data = json.loads(path.read_text())
    missing = [k for k in ("preamble", "names", "before") if k not in data]
    if missing:
        raise ValueError(
            f"{path}: no {', '.join(missing)}: a record from before 2026-11-29 (gui_agent.py wrote no "
            "preamble then); add them from its .md to judge it again"
        )
    text = render(data)
    path.write_text(json.dumps(data, indent=1))
    path.with_suffix(".md").write_text(text)
    return text
