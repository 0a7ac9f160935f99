"""Hybrid models, one per recurrent family: the tree's training step against the per-path baseline,
with the recurrent layers' FLOPs in the bound, and the routing's per-node overhead.

Part 1, tree vs baseline. Every family of :mod:`treetrain.bench.families` (Qwen3.5's Gated
DeltaNet, Kimi Linear's KDA, LFM2's short convolutions, Nemotron-H's Mamba2, Jamba's Mamba,
MiniMax's lightning attention, RecurrentGemma's RG-LRU, RWKV, xLSTM's mLSTM, BLOOM's ALiBi) on a
per-turn tree (``--turns`` nested samples of one dialogue) and a group tree (``--paths`` samples
sharing a prompt at ``--por``): one SFT training step per mode through the library
(:func:`treetrain.bench.cases.run_case`: a warm-up round, then interleaved repeats; best, median,
spread, the machine's load and the noise verdict; peak memory in fresh processes; the largest
log-prob difference between the modes). The tree gets its own token count as its micro-batch
budget; the baseline the fastest of that (several paths per micro-batch, as ``benchmarks/scaling.py``),
the longest path, and one path per forward, measured per case before the timed rounds: the torch step
loops (xLSTM, RWKV, KDA) pay per step a cost that grows with the paths a micro-batch stacks, so one
path per forward can be the faster baseline.
The bound counts the recurrent layers' state updates and convolutions
(:func:`treetrain.trees.flops.mixer_cost`) beside the linear layers, attention pairs and head.
Next to it, what the recurrent scans run in each mode, independent of the machine's load: calls
(one per length group of a level), sequential steps (each group's longest node, summed: what a
per-step loop pays) and tokens computed with padding.

Part 2, per-node overhead. One routed layer of each family, forward + backward, on trees of
``--node-tokens`` tokens cut into more and more nodes, two shapes: ``wide`` (a prompt of half the
tokens and k leaves sharing the other half: two levels) and ``deep`` (a spine of k nodes, each with
a leaf of its own: k + 1 levels, an agent chain whose turns drift). The slope of time over nodes
is the routing's cost per node (the level schedule, built once per forward, is timed apart); with
the model's training step on one path of as many tokens, it gives the node count at which the
routing adds 10% to the step.

Usage::

    python benchmarks/hybrids.py --quick                  # seconds per family: checks the code, no figure
    python benchmarks/hybrids.py --write --plot           # the recorded run: about 20 min, quiet 2-core CPU
    python benchmarks/hybrids.py --families gdn mamba --no-overhead
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import asdict
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
from treetrain.attention.mask import TreeMask  # noqa: E402
from treetrain.bench import cases as bench  # noqa: E402
from treetrain.bench.families import FAMILIES, family_cost, family_model, linear_flops  # noqa: E402
from treetrain.models.pathconv import conv_window_index  # noqa: E402
from treetrain.models.recurrent import patch_recurrent_layers, route, tree_layer_forward  # noqa: E402
from treetrain.models.scan import build_levels, merge_chains, tree_levels  # noqa: E402
from treetrain.trees.flops import CostModel, layer_kinds  # noqa: E402
from treetrain.trees.packing import pack  # noqa: E402
from treetrain.trees.tree import TrajectoryTree  # noqa: E402

QUICK = dict(hidden=64, vocab=512, turns=4, turn_len=16, paths=4, path_len=32, repeats=1, node_tokens=64)
QUICK_SPLITS = (1, 4, 16)
SPLITS = (1, 4, 16, 64, 256)  # k: leaves of the wide tree, spine nodes of the deep one


# ---- part 1: tree vs baseline -------------------------------------------------------------------


def scan_work(micro: list) -> dict:
    """What the recurrent scans run over packed micro-batches: calls, sequential steps, tokens
    computed with padding, and real tokens (:func:`treetrain.models.scan.tree_levels`)."""
    out = dict(calls=0, steps=0, padded=0, tokens=0)
    for packed in micro:
        levels = tree_levels(packed)
        groups = [g for lv in levels.levels for g in lv.groups]
        out["calls"] += len(groups)
        out["steps"] += sum(g.shape[1] for g in groups)
        out["padded"] += levels.num_padded
        out["tokens"] += levels.num_tokens
    return out


def step_loop_bound(model, trees, capacity: int, base_capacity: int, cost, rate: float, repeats: int) -> dict:
    """The speedup's upper limit with the recurrent layers priced by their measured time on each
    mode's own micro-batches instead of by FLOPs; None-valued where the model has no routed layer.

    The FLOP bound prices a token's state update the same whatever else its step carries, but a
    torch step loop (xLSTM, RWKV, KDA) pays per step a cost that depends on its width, and the two
    modes run different widths: the group tree's prompt 128 steps 1 wide and its leaves 128 steps 8
    wide, the baseline 512 steps 4 wide. Here each routed layer costs what one such layer takes
    alone, forward + backward (:func:`time_layer`, best of ``repeats``), on the micro-batches the
    mode runs (``L``, times the model's routed layers); the rest of the step, the mode's FLOPs less
    those layers' (their weight matmuls and :func:`treetrain.trees.flops.mixer_cost`), at the dense
    matmul ``rate`` (``A``). With the rest at ``s`` times that time (s >= 1: no faster than the
    rate, the same in both modes) the speedup is ``(s A_base + L_base) / (s A_tree + L_tree)``,
    monotone in ``s`` from its value at ``s = 1`` (``priced``) to ``A_base / A_tree`` (``rest``), so
    it cannot exceed ``bound = max(priced, rest)``.

    Example (the recorded run, 2026-11-26): mLSTM's group tree on 2 threads, L 1.328 s (baseline)
    / 0.523 s (tree), A 0.248 / 0.124 s: priced 1.576 / 0.647 = 2.44x where the FLOP bound says 1.99x;
    the step ran 2.38x."""
    layer = routed_layer(model)
    if layer is None:
        return dict(priced=None, rest=None, bound=None)
    hidden = model.config.get_text_config().hidden_size
    n_rec = sum(k not in ("attention", "none") for k in layer_kinds(model.config))
    vocab = model.get_output_embeddings().weight.shape[0]
    capacity = bench.case_capacity(trees, capacity)
    base_f, tree_f, tree_tokens = bench.case_flops(trees, capacity, cost, vocab)
    per_token = 3.0 * n_rec * (linear_flops(model, within=layer) + cost.recurrent / n_rec)
    tokens = dict(tree=tree_tokens, sequence=sum(int(t.path_lengths.sum()) for t in trees))
    flops = dict(tree=tree_f, sequence=base_f)
    caps = dict(tree=capacity, sequence=base_capacity or capacity)
    out = dict(layer_s={}, rest_s={})
    for mode in ("tree", "sequence"):
        micro = bench.prepare(mode, trees, caps[mode])
        out["layer_s"][mode] = n_rec * sum(min(time_layer(layer, p, hidden, repeats)) for p in micro)
        out["rest_s"][mode] = (flops[mode] - tokens[mode] * per_token) / rate
    return out | priced_bound(out["rest_s"], out["layer_s"])


def priced_bound(rest: dict[str, float], layers: dict[str, float]) -> dict[str, float]:
    """:func:`step_loop_bound`'s arithmetic: the rest's seconds at the matmul rate and the recurrent
    layers' measured seconds per mode (``sequence``, ``tree``) -> ``priced``, ``rest``, ``bound``.

    >>> b = priced_bound({"sequence": 0.4, "tree": 0.2}, {"sequence": 1.2, "tree": 0.4})
    >>> round(b["priced"], 3), b["rest"], round(b["bound"], 3)  # wider steps pay more: above 2x
    (2.667, 2.0, 2.667)
    >>> priced_bound({"sequence": 0.4, "tree": 0.2}, {"sequence": 0.3, "tree": 0.2})["bound"]
    2.0
    """
    priced = (rest["sequence"] + layers["sequence"]) / (rest["tree"] + layers["tree"])
    ratio = rest["sequence"] / rest["tree"]
    return dict(priced=priced, rest=ratio, bound=max(priced, ratio))


def shape_trees(a) -> dict[str, TrajectoryTree]:
    return {
        "per-turn": bench.per_turn_tree(a.turns, a.turn_len, a.vocab),
        "group": bench.group_tree(a.por, a.paths, a.path_len, a.vocab),
    }


def run_family(family: str, a, rate: float, device, dtype) -> list[dict]:
    """Part 1 for one family: a row per tree shape."""
    model_args = (family, a.hidden, a.vocab, device, dtype)
    model = family_model(*model_args)
    cost = family_cost(model)
    no_rec = CostModel(cost.linear, cost.per_pair, cost.head)
    rows = []
    for shape, tree in shape_trees(a).items():
        trees = [tree]
        capacity = max(tree.num_tokens, int(tree.path_lengths.max()))
        t0 = time.perf_counter()
        res = bench.run_case(
            f"{family} {shape}", model, model_args, trees, capacity, a.repeats, None, cost, rate, a.memory,
            a.matmul_size, factory=family_model,
            baseline_capacities=(int(tree.path_lengths.max()), bench.ONE_PATH),
        )  # fmt: skip
        base, tree_f, _ = bench.case_flops(trees, capacity, no_rec)
        scans = {m: scan_work(bench.prepare(m, trees, capacity)) for m in ("tree", "sequence")}
        loop = step_loop_bound(model, trees, capacity, res.baseline_capacity, cost, rate, a.repeats)
        rows.append(
            dict(
                family=family, model_type=FAMILIES[family][0], shape=shape, result=asdict(res),
                bound_no_recurrent=base / tree_f, scans=scans, step_loop=loop,
                recurrent_share=cost.recurrent / (cost.linear + cost.recurrent),
                wall_s=time.perf_counter() - t0,
            )
        )  # fmt: skip
        r = res
        if loop["bound"] is not None:
            print(
                f"{family:9s} {shape:8s} step-loop bound {loop['bound']:.2f}x (layers "
                f"{loop['layer_s']['sequence']:.3f}/{loop['layer_s']['tree']:.3f} s, rest "
                f"{loop['rest_s']['sequence']:.3f}/{loop['rest_s']['tree']:.3f} s at the matmul rate)",
                flush=True,
            )
        print(
            f"{family:9s} {shape:8s} tree {r.tree_s:.3f} s, baseline {r.baseline_s:.3f} s: "
            f"{r.speedup:.2f}x of "
            f"{r.flop_bound:.2f}x (efficiency {r.efficiency:.2f}){' NOT TRUSTWORTHY' if r.untrusted else ''} "
            f"({rows[-1]['wall_s']:.0f} s)",
            flush=True,
        )
    del model
    return rows


# ---- part 2: per-node overhead ------------------------------------------------------------------


def wide_tree(tokens: int, k: int, vocab: int, seed: int = 0) -> TrajectoryTree:
    """A prompt of ``tokens // 2`` and ``k`` leaves sharing the rest (two levels, ``k + 1`` nodes)."""
    rng = np.random.default_rng(seed)
    prompt, leaf = tokens // 2, max(1, (tokens - tokens // 2) // k)
    head = rng.integers(0, vocab, prompt)
    return TrajectoryTree.from_paths([np.concatenate([head, rng.integers(0, vocab, leaf)]) for _ in range(k)])


def deep_tree(tokens: int, k: int, vocab: int, seed: int = 0) -> TrajectoryTree:
    """A spine of ``k`` pieces of ``tokens // 2k``, path ``i`` its first ``i`` pieces and a leaf of as
    many tokens: ``2k - 1`` nodes on ``k`` levels (the last piece and its leaf are one node)."""
    rng = np.random.default_rng(seed)
    n = max(1, tokens // (2 * k))
    spine = rng.integers(0, vocab, k * n)
    return TrajectoryTree.from_paths(
        [np.concatenate([spine[: i * n], rng.integers(0, vocab, n)]) for i in range(1, k + 1)]
    )


def routed_layer(model):
    """The model's first routed recurrent layer (None for an attention-only model)."""
    patch_recurrent_layers(model)  # xLSTM's kernel backend gets its tree forward
    return next((m for m in model.modules() if route(m) is not None), None)


def time_layer(layer, packed, hidden: int, repeats: int) -> list[float]:
    """Forward + backward of ``layer`` over ``packed`` (schedule and conv windows cached, as every
    layer after a forward's first finds them): ``repeats`` times after a warm-up."""
    T = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    dtype = next(layer.parameters()).dtype
    x = torch.randn(1, T, hidden, generator=g).to(dtype).requires_grad_()
    coef = torch.randn(1, T, hidden, generator=g).to(dtype)
    mask = TreeMask(packed.subtree_end, cache={}, position_ids=packed.position_ids)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        (tree_layer_forward(layer, x, packed, mask) * coef).sum().backward()
        if r:
            times.append(time.perf_counter() - t0)
        x.grad = None
        layer.zero_grad(set_to_none=True)
    return times


def time_schedule(packed, width: int, repeats: int) -> float:
    """Best time to build a forward's routing schedule: the level schedule of the folded runs and
    one conv window index."""
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        build_levels(*merge_chains(packed.node_start, packed.node_end, packed.node_parent))
        conv_window_index(packed.prev, width)
        best = min(best, time.perf_counter() - t0)
    return best


def node_overhead(family: str, a, device, dtype, splits) -> dict | None:
    """Part 2 for one family; None where it has no routed layer (ALiBi)."""
    model = family_model(family, a.hidden, a.vocab, device, dtype)
    layer = routed_layer(model)
    if layer is None:
        return None
    n_rec = sum(k not in ("attention", "none") for k in layer_kinds(model.config))
    one = TrajectoryTree.from_paths([np.random.default_rng(0).integers(0, a.vocab, a.node_tokens)])
    micro = bench.prepare("tree", [one], a.node_tokens)
    step = []
    for r in range(a.repeats + 1):  # the model's whole training step on one path of as many tokens
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        bench.train_step("tree", model, [one], micro, None)
        if r:
            step.append(time.perf_counter() - t0)
    out = dict(family=family, layer=type(layer).__name__, recurrent_layers=n_rec, step_s=min(step), shapes={})
    for shape, make in (("wide", wide_tree), ("deep", deep_tree)):
        pts = []
        for k in splits:
            packed = pack(make(a.node_tokens, k, a.vocab))
            times = time_layer(layer, packed, a.hidden, a.repeats)
            levels = tree_levels(packed)
            pts.append(
                dict(
                    k=k, nodes=int(packed.node_start.numel()),
                    runs=sum(lv.parent_row.numel() for lv in levels.levels),
                    levels=len(levels.levels), tokens=packed.num_tokens, best_s=min(times), times=times,
                    schedule_s=time_schedule(packed, 4, a.repeats),
                )
            )  # fmt: skip
        nodes = np.array([p["nodes"] for p in pts], dtype=float)
        per_node = float(np.polyfit(nodes, [p["best_s"] for p in pts], 1)[0]) if len(pts) > 1 else 0.0
        sched = float(np.polyfit(nodes, [p["schedule_s"] for p in pts], 1)[0]) if len(pts) > 1 else 0.0
        cost = n_rec * max(per_node, 0.0) + max(sched, 0.0)  # per node, for the whole forward+backward
        out["shapes"][shape] = dict(
            points=pts, per_node_s=per_node, schedule_per_node_s=sched,
            nodes_at_10pct=(0.1 * out["step_s"] / cost) if cost > 0 else float("inf"),
        )  # fmt: skip
        print(
            f"{family:9s} {shape:4s}: {per_node * 1e6:.0f} us/node per layer, "
            f"schedule {sched * 1e6:.1f} us/node; "
            f"10% of the {out['step_s']:.2f} s step at {out['shapes'][shape]['nodes_at_10pct']:.0f} nodes",
            flush=True,
        )
    return out


# ---- report -------------------------------------------------------------------------------------


def part1_table(rows: list[dict]) -> str:
    out = [
        "| family (model) | tree | tree tokens | baseline tokens | baseline budget | tree s | baseline s "
        "| speedup "
        "| FLOP bound | bound w/o recurrent | efficiency | step-loop bound | efficiency vs it "
        "| spread tree/base | peak MB tree/base | max logprob diff | timings |",
        "|" + "---|" * 17,
    ]
    for row in rows:
        r = row["result"]
        budget = r.get("baseline_capacity") or r["tree_tokens"]
        budget = "1 path" if budget == bench.ONE_PATH else f"{budget:,}"
        mem = "-" if r["tree_peak_mb"] is None else f"{r['tree_peak_mb']:.0f}/{r['baseline_peak_mb']:.0f}"
        out.append(
            f"| {row['family']} ({row['model_type']}) | {row['shape']} | {r['tree_tokens']:,} | "
            f"{r['baseline_tokens']:,} | {budget} | {r['tree_s']:.3f} | {r['baseline_s']:.3f} "
            f"| {r['speedup']:.2f}x "
            f"| {r['flop_bound']:.2f}x | {row['bound_no_recurrent']:.2f}x | {r['efficiency']:.2f} "
            f"| {loop_cells(row, r['speedup'])} "
            f"| {r['tree_spread']:.0%}/{r['baseline_spread']:.0%} | {mem} | {r['max_logprob_diff']:.1e} "
            f"| {'NOT TRUSTWORTHY' if r['untrusted'] else 'ok'} |"
        )
    return "\n".join(out)


def loop_cells(row: dict, speedup: float) -> str:
    """The step-loop bound and the efficiency against it, or dashes (no routed layer)."""
    bound = (row.get("step_loop") or {}).get("bound")
    return "- | -" if bound is None else f"{bound:.2f}x | {speedup / bound:.2f}"


def scans_table(rows: list[dict]) -> str:
    out = [
        "| family | tree | recurrent share of FLOPs/token | scan calls tree/base "
        "| sequential steps tree/base "
        "| padded tokens tree/base (real) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, b = row["scans"]["tree"], row["scans"]["sequence"]
        if row["family"] == "alibi":
            continue
        out.append(
            f"| {row['family']} | {row['shape']} | {row['recurrent_share']:.1%} | {t['calls']}/{b['calls']} "
            f"| {t['steps']:,}/{b['steps']:,} "
            f"| {t['padded']:,} ({t['tokens']:,}) / {b['padded']:,} ({b['tokens']:,}) |"
        )
    return "\n".join(out)


def part2_table(over: list[dict]) -> str:
    out = [
        "| family (layer) | recurrent layers | model step, 1 path (s) | shape | nodes: layer fwd+bwd ms "
        "| per node per layer (us) | schedule per node (us) | nodes before +10% of the step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in over:
        for shape, s in o["shapes"].items():
            pts = " ".join(f"{p['nodes']}: {p['best_s'] * 1e3:.1f}" for p in s["points"])
            n10 = s["nodes_at_10pct"]
            out.append(
                f"| {o['family']} ({o['layer']}) | {o['recurrent_layers']} | {o['step_s']:.3f} "
                f"| {shape} | {pts} "
                f"| {s['per_node_s'] * 1e6:.0f} | {s['schedule_per_node_s'] * 1e6:.1f} "
                f"| {'never' if n10 == float('inf') else f'{n10:,.0f}'} |"
            )
    return "\n".join(out)


def plot(rows: list[dict], over: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    fams = list(dict.fromkeys(r["family"] for r in rows))
    for j, shape in enumerate(("per-turn", "group")):
        eff = [
            next((r["result"]["efficiency"] for r in rows if r["family"] == f and r["shape"] == shape), 0)
            for f in fams
        ]
        ax1.bar(np.arange(len(fams)) + 0.4 * j - 0.2, eff, width=0.4, label=shape)
        loop = [
            next(
                (r["result"]["speedup"] / r["step_loop"]["bound"] for r in rows
                 if r["family"] == f and r["shape"] == shape and (r.get("step_loop") or {}).get("bound")),
                np.nan,
            )
            for f in fams
        ]  # fmt: skip
        ax1.plot(np.arange(len(fams)) + 0.4 * j - 0.2, loop, "k_", ms=12, mew=2,
                 label="vs the step-loop bound" if j == 0 else None)  # fmt: skip
    ax1.axhline(0.9, color="k", ls="--", lw=1, label="0.9 of the bound")
    ax1.set_xticks(np.arange(len(fams)), fams, rotation=45, ha="right")
    ax1.set_ylabel("efficiency = speedup / FLOP bound")
    ax1.legend(fontsize=8)
    for i, o in enumerate(over):
        for shape, style in (("wide", "--"), ("deep", "-")):
            pts = o["shapes"][shape]["points"]
            label = o["family"] if shape == "deep" else None
            ax2.plot(
                [p["nodes"] for p in pts], [p["best_s"] * 1e3 for p in pts], style, color=f"C{i}", label=label
            )
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("nodes (same tokens); solid: deep, dashed: wide")
    ax2.set_ylabel("one routed layer, fwd+bwd (ms)")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--hidden", type=int, default=256, help="model width (families.py: 4 heads of hidden/4)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--turns", type=int, default=8, help="per-turn tree: turns (POR 1 - 2/(turns+1))")
    p.add_argument("--turn-len", type=int, default=128, help="per-turn tree: tokens per turn")
    p.add_argument("--paths", type=int, default=8, help="group tree: paths")
    p.add_argument("--path-len", type=int, default=256, help="group tree: tokens per path")
    p.add_argument("--por", type=float, default=0.5, help="group tree: POR")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per mode after a warm-up")
    p.add_argument("--node-tokens", type=int, default=1024, help="part 2: tokens of every tree")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip peak memory")
    p.add_argument("--no-overhead", dest="overhead", action="store_false", help="skip part 2")
    p.add_argument("--matmul-size", type=int, default=2048, help="side of the matmul timed for the rate")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help=f"tiny sizes, 1 repeat, no memory: {QUICK}")
    p.add_argument("--write", action="store_true", help="write benchmarks/results/hybrids_*.md (+ .json)")
    p.add_argument("--plot", action="store_true", help="a PNG beside the results file")
    add_allocator_flag(p)
    a = p.parse_args(argv)
    a.splits = SPLITS
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
        a.memory, a.matmul_size, a.splits = False, 256, QUICK_SPLITS
    a.command = " ".join(sys.argv[1:] if argv is None else argv)
    return a


def run(a: argparse.Namespace) -> tuple[list[dict], list[dict], str]:
    """Both parts: ``(part 1 rows, part 2 rows, the markdown report)``."""
    if a.threads:
        torch.set_num_threads(a.threads)
    device, dtype = torch.device("cpu"), torch.float32
    before = machine_before()
    rate = bench.matmul_rate(dtype, device, a.matmul_size)
    print(f"dense matmul rate {rate / 1e9:,.1f} GFLOP/s, {torch.get_num_threads()} threads", flush=True)
    t_start = time.perf_counter()
    rows = [row for f in a.families for row in run_family(f, a, rate, device, dtype)]
    over = [o for f in a.families if a.overhead for o in [node_overhead(f, a, device, dtype, a.splits)] if o]
    cases = [(f"{r['family']} {r['shape']}", r["result"]["untrusted"]) for r in rows]
    for o in over:  # part 2's noise: the spread of each point's repeats
        for shape, s in o["shapes"].items():
            _, why = judge({f"{o['family']} {shape} {p['nodes']} nodes": p["times"] for p in s["points"]})
            cases.append((f"overhead {o['family']} {shape}", why))
    head = (
        "## Hybrids: tree vs per-path baseline per recurrent family, and the routing's per-node overhead\n\n"
        f"- hardware: {hardware()}; torch {torch.__version__}, {torch.get_num_threads()} threads; date "
        f"{datetime.date.today()}; dense matmul rate {rate / 1e9:,.1f} GFLOP/s (float32); run took "
        f"{time.perf_counter() - t_start:.0f} s\n"
        f"- models (`treetrain.bench.families`): hidden {a.hidden}, vocab {a.vocab}, float32, random init\n"
        f"- trees: per-turn {a.turns} turns x {a.turn_len} tokens; group {a.paths} paths x {a.path_len} "
        f"at POR {a.por}; micro-batch budget: the tree's tokens (tree), the fastest of that, the "
        f"longest path and one path per forward (baseline, searched per case); best of {a.repeats} "
        "steps after a warm-up (median, spread in the JSON)\n"
        f"- command: `python benchmarks/hybrids.py {a.command}`\n\n"
    )
    text = head + "### Tree vs baseline (SFT training step)\n\n" + part1_table(rows) + "\n\n"
    text += "### What the recurrent scans run (no timing: load-independent)\n\n" + scans_table(rows) + "\n\n"
    if over:
        text += (
            f"### Per-node overhead: one routed layer, fwd+bwd, {a.node_tokens} tokens in more and more "
            "nodes\n\n"
            + part2_table(over) + "\n\n"
        )  # fmt: skip
    text += noise_section(before, cases)
    return rows, over, text


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    use_allocator(a)
    rows, over, text = run(a)
    print("\n" + text)
    if a.write or a.plot:
        path = result_path("hybrids")
        if a.write:
            path.write_text(text)
            path.with_suffix(".json").write_text(json.dumps(dict(rows=rows, overhead=over), indent=1))
            print(f"wrote {path} (+ .json)")
        if a.plot:
            plot(rows, over, path.with_suffix(".png"))
            print(f"plot: {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
