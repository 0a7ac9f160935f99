"""Gated DeltaNet routing on trees: level-batched (one call per tree level) vs node by node.

Both run transformers' PyTorch chunked gated delta rule with each node starting from its parent's
final state; they differ only in how many kernel calls the tree takes (levels vs nodes). Forward
and forward + backward, plus the one-off schedule build (shared by all layers of a forward).

    python benchmarks/gdn_routing.py [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
from common import hardware

from treetrain.models.gdn import tree_gated_delta_rule, tree_gated_delta_rule_nodewise
from treetrain.models.scan import build_levels
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

OUT = Path(__file__).parent / "results" / "gdn_routing_cpu_2026-11-22.md"


def _tok(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=rng).tolist()


def wide_tree(rng) -> list[list[int]]:
    """GRPO-like: a 256-token prompt, 16 samples of 32 tokens, each with 16 tool-call branches of 16."""
    prompt = _tok(rng, 256)
    return [prompt + s + _tok(rng, 16) for s in (_tok(rng, 32) for _ in range(16)) for _ in range(16)]


def bushy_tree(rng) -> list[list[int]]:
    """Short nodes: fan-out 8 over 3 levels, node lengths 1-4 (shorter than the conv kernel)."""
    lens = lambda: int(torch.randint(1, 5, (1,), generator=rng))  # noqa: E731
    prompt = _tok(rng, 64)
    paths = []
    for _ in range(8):
        a = _tok(rng, lens())
        for _ in range(8):
            b = _tok(rng, lens())
            paths += [prompt + a + b + _tok(rng, lens()) for _ in range(8)]
    return paths


def agent_chain(rng) -> list[list[int]]:
    """Per-turn samples of a 40-turn conversation with think-mode drift: 2 nodes per level, deep."""
    paths, prefix = [], _tok(rng, 128)
    for _ in range(40):
        turn = _tok(rng, 48)
        paths.append(prefix + _tok(rng, 24) + turn)  # the sample sees its own reasoning
        prefix = prefix + turn  # later turns see the turn with the reasoning stripped
    return paths


def skewed_tree(rng) -> list[list[int]]:
    """Samples of very different lengths at one level: 4 of 1024 tokens beside 60 of 8 (early
    stops), each sample with 4 short branches."""
    prompt = _tok(rng, 128)
    samples = [_tok(rng, 1024) for _ in range(4)] + [_tok(rng, 8) for _ in range(60)]
    return [prompt + s + _tok(rng, 12) for s in samples for _ in range(4)]


TREES = {
    "wide (GRPO + tool calls)": wide_tree,
    "bushy, 1-4 token nodes": bushy_tree,
    "agent chain, 40 turns": agent_chain,
    "skewed lengths in a level": skewed_tree,
}


def _inputs(T: int, Hk: int, Hv: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, Hk, D, generator=g) for _ in range(2))
    v = torch.randn(T, Hv, D, generator=g)
    decay = -torch.rand(T, Hv, generator=g) * 0.3
    beta = torch.rand(T, Hv, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(paths, Hk: int, Hv: int, D: int, repeats: int) -> dict:
    packed = pack(TrajectoryTree.from_paths(paths))
    T = packed.num_tokens
    args = _inputs(T, Hk, Hv, D)
    ns, ne, npar = packed.node_start, packed.node_end, packed.node_parent
    levels = build_levels(ns, ne, npar)
    levels_one = build_levels(ns, ne, npar, pad_slack=None)  # one padded call per level
    level_fn = lambda: tree_gated_delta_rule(*args, levels)  # noqa: E731
    one_fn = lambda: tree_gated_delta_rule(*args, levels_one)  # noqa: E731
    node_fn = lambda: tree_gated_delta_rule_nodewise(*args, ns, ne, npar)  # noqa: E731
    coef = torch.randn(T, Hv, D)

    def fwd_bwd(fn):
        (fn() * coef).sum().backward()
        for a in args:
            a.grad = None

    with torch.no_grad():
        diff = (level_fn() - node_fn()).abs().max().item() / node_fn().abs().max().item()
        t_level, t_node = _median_s(level_fn, repeats), _median_s(node_fn, repeats)
        t_one = _median_s(one_fn, repeats)
    tb_level, tb_node = (
        _median_s(lambda: fwd_bwd(level_fn), repeats),
        _median_s(lambda: fwd_bwd(node_fn), repeats),
    )
    t_build = _median_s(lambda: build_levels(ns, ne, npar), repeats)
    return dict(
        tokens=T,
        path_tokens=sum(len(p) for p in paths),
        nodes=packed.node_start.numel(),
        levels=len(levels.levels),
        padded=(levels_one.num_padded, levels.num_padded),
        calls=sum(len(lv.groups) for lv in levels.levels),
        fwd=(t_node, t_level),
        fwd_one=t_one,
        fwd_bwd=(tb_node, tb_level),
        build=t_build,
        diff=diff,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heads", type=str, default="4,8", help="key heads, value heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    Hk, Hv = map(int, a.heads.split(","))
    rows = []
    for name, make in TREES.items():
        r = bench(make(torch.Generator().manual_seed(0)), Hk, Hv, a.head_dim, a.repeats)
        print(name, r, flush=True)
        rows.append((name, r))

    lines = [
        "# Gated DeltaNet routing on trees: level-batched vs node by node",
        "",
        f"Hardware: {hardware()}; torch {torch.__version__}, {a.threads} intra-op thread(s). "
        f"Date: {datetime.date.today().isoformat()}. Load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared machine: timings are noisy, "
        "compare within a row).",
        f"One GDN core (transformers' PyTorch `torch_chunk_gated_delta_rule`, float32, {Hk} key / {Hv} "
        f"value heads, head dim {a.head_dim}); medians of {a.repeats} runs after a warm-up. "
        "`python benchmarks/gdn_routing.py`.",
        "",
        "Both compute the same recurrence (every node from its parent's final state; max relative "
        "difference in the last column). Node by node: one kernel call per node. Level-batched: the "
        "nodes of a level go through one call per length group (`calls` in all; a group pads its "
        "nodes to its longest, within 2x); `padded`: tokens computed, one padded call per level -> "
        "length-grouped. `one call/level`: forward with a single padded call per level. "
        "`schedule`: building the level index tensors, once per forward for all layers.",
        "",
        "| tree | path tokens | tree tokens | nodes | levels | calls | padded | fwd node-by-node (s) "
        "| fwd one call/level (s) | fwd level-batched (s) | speedup | fwd+bwd node-by-node (s) "
        "| fwd+bwd level-batched (s) | speedup | schedule (ms) | max rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        (fn, fl), (bn, bl), (p1, pg) = r["fwd"], r["fwd_bwd"], r["padded"]
        lines.append(
            f"| {name} | {r['path_tokens']:,} | {r['tokens']:,} | {r['nodes']} | {r['levels']} "
            f"| {r['calls']} | {p1:,} -> {pg:,} | {fn:.3f} | {r['fwd_one']:.3f} | {fl:.3f} | {fn / fl:.1f}x "
            f"| {bn:.3f} | {bl:.3f} | {bn / bl:.1f}x | {r['build'] * 1e3:.1f} | {r['diff']:.1e} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
