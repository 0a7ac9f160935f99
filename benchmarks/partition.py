"""Partitioning quality and speed: methods vs the exact optimum (small random trees), vs first-fit
in input order and a lower bound (realistic shapes), and planning time on 100k-node trees.

    /work/venv/bin/python benchmarks/partition.py [--sweep 2000] [--out benchmarks/results/...md]

The generators here are shared with tests/test_partition.py. Token ids are random; only the
sharing structure matters.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time
from collections.abc import Callable

import numpy as np

from treetrain import TrajectoryTree
from treetrain.trees.partition import lower_bound, partition, plan

VOCAB = 150_000
CAPACITIES = (4096, 8192, 16384)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, int(n)).tolist()


# ---- realistic shapes ---------------------------------------------------------------------------


def per_turn_tree(
    rng: np.random.Generator,
    capacity: int,
    dialogues: int = 8,
    turns: int = 40,
    turn: tuple[int, int] = (200, 800),
    think: tuple[int, int] | None = None,
) -> TrajectoryTree:
    """Per-turn samples of a batch of dialogues, in the order a trainer sees them: sample k of a
    dialogue is its context through turn k (nested prefixes: a chain). A dialogue has 2 to
    ``turns`` turns and ends early when the next sample would pass the budget. With ``think``,
    sample k also carries turn k's reasoning, which later samples drop (think mode): a branch per
    turn.
    """
    paths = []
    for _ in range(dialogues):
        ctx = _tokens(rng, rng.integers(300, 1000))  # system prompt + task
        for _ in range(rng.integers(2, turns + 1)):
            t = _tokens(rng, rng.integers(*turn))
            r = _tokens(rng, rng.integers(*think)) if think else []
            if len(ctx) + len(r) + len(t) > capacity:
                break
            paths.append(ctx + r + t)
            ctx = ctx + t
    return TrajectoryTree.from_paths(paths)


def group_tree(
    rng: np.random.Generator,
    capacity: int,
    prompts: int = 8,
    prompt: tuple[int, int] = (1000, 3000),
    samples: tuple[int, int] = (8, 16),
) -> TrajectoryTree:
    """GRPO-style groups: each prompt with 8-16 sampled continuations of 10-100% of the room left."""
    paths = []
    for _ in range(prompts):
        p = _tokens(rng, rng.integers(*prompt))
        room = capacity - len(p)
        for _ in range(rng.integers(samples[0], samples[1] + 1)):
            paths.append(p + _tokens(rng, rng.integers(room // 10, room + 1)))
    return TrajectoryTree.from_paths(paths)


def agent_tree(
    rng: np.random.Generator,
    capacity: int,
    rollouts: int = 4,
    turns: int = 12,
    fanout: tuple[int, int] = (1, 4),
    turn: tuple[int, int] = (100, 1500),
    max_paths: int = 32,
) -> TrajectoryTree:
    """Agent rollouts with parallel tool calls: every turn of every branch forks 1-3 ways (up to
    ``max_paths`` open branches per rollout); a branch ends when its next turn would not fit.
    """
    paths = []
    for _ in range(rollouts):
        open_ = [_tokens(rng, rng.integers(500, 2000))]
        for _ in range(turns):
            nxt = []
            for ctx in open_:
                for _ in range(rng.integers(*fanout) if len(nxt) < max_paths else 1):
                    t = _tokens(rng, rng.integers(*turn))
                    (paths.append(ctx) if len(ctx) + len(t) > capacity else nxt.append(ctx + t))
            open_ = nxt
        paths += open_
    return TrajectoryTree.from_paths(paths)


SHAPES: dict[str, Callable[..., TrajectoryTree]] = {
    "per_turn": per_turn_tree,
    "per_turn_think": lambda rng, c: per_turn_tree(rng, c, think=(100, 1500)),
    "group": group_tree,
    "agent": agent_tree,
}


# ---- small random trees (against the exact optimum) ---------------------------------------------


def small_tree(rng: np.random.Generator, max_leaves: int = 10) -> tuple[TrajectoryTree, int]:
    """A random tree with 3..``max_leaves`` leaves of one of five shapes, and a capacity between its
    longest path and its size (skewed toward tight budgets, where the choices are hard).
    """
    while True:
        kind = rng.integers(5)
        seg = lambda lo, hi: _tokens(rng, rng.integers(lo, hi))  # noqa: E731
        parents: list[int] = []
        segs: list[list[int]] = []
        if kind == 3:  # groups: a few prompts, a few continuations each
            for _ in range(rng.integers(1, 4)):
                parents.append(-1)
                segs.append(seg(20, 60))
                root = len(parents) - 1
                for _ in range(rng.integers(1, 5)):
                    parents.append(root)
                    segs.append(seg(5, 60))
        elif kind == 4:  # caterpillar: a spine with a leaf off every spine node (think mode)
            parents, segs, spine = [-1], [seg(5, 30)], 0
            for _ in range(rng.integers(2, 6)):
                parents += [spine, spine]
                segs += [seg(5, 40), seg(5, 30)]
                spine = len(parents) - 1
        else:  # random trees: uniform parents, deep (recent parents), or short prefixes/long leaves
            n = rng.integers(3, 16)
            lo, hi = ((1, 30), (1, 40), (1, 100))[kind]
            parents, segs = [-1], [seg(1, 10 if kind == 2 else hi)]
            for i in range(1, n):
                first = max(0, i - 3) if kind == 1 else (-1 if rng.random() < 0.1 else 0)
                parents.append(int(rng.integers(first, i)))
                segs.append(seg(lo, hi))
        tree = TrajectoryTree.from_nodes(parents, segs)
        n_leaves = tree.num_nodes - np.unique(tree.node_parent[tree.node_parent >= 0]).size
        longest, size = int(tree.path_lengths.max()), tree.num_tokens
        if 3 <= n_leaves <= max_leaves and size > longest:
            return tree, int(longest + (size - 1 - longest) * rng.random() ** 2)


# ---- very large trees, laid out directly --------------------------------------------------------


def tree_from_shape(parents: np.ndarray, lengths: np.ndarray) -> TrajectoryTree:
    """A ``TrajectoryTree`` laid out directly from a node tree (``parents[i] < i``, -1 for roots):
    every token distinct, one path per leaf. Skips ``from_paths``' sort, for 100k-node trees.
    """
    parents, lengths = np.asarray(parents, np.int64), np.asarray(lengths, np.int64)
    N = parents.size
    kids: list[list[int]] = [[] for _ in range(N)]
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            kids[p].append(i)
    order, stack = [], np.flatnonzero(parents < 0).tolist()[::-1]
    while stack:
        u = stack.pop()
        order.append(u)
        stack.extend(kids[u][::-1])
    order = np.asarray(order)
    rank = np.empty(N, np.int64)
    rank[order] = np.arange(N)
    parent = np.where(parents[order] >= 0, rank[np.maximum(parents[order], 0)], -1)
    length = lengths[order]
    end = np.cumsum(length)
    start = end - length
    above = np.zeros(N, np.int64)
    sub_end = end.copy()
    par = parent.tolist()
    for u in range(N):
        if par[u] >= 0:
            above[u] = above[par[u]] + length[par[u]]
    for u in range(N - 1, 0, -1):
        if par[u] >= 0 and sub_end[u] > sub_end[par[u]]:
            sub_end[par[u]] = sub_end[u]
    leaves = np.setdiff1d(np.arange(N), parent[parent >= 0])
    path_index = []
    for leaf in leaves.tolist():
        chain, u = [], leaf
        while u >= 0:
            chain.append(np.arange(start[u], end[u]))
            u = par[u]
        path_index.append(np.concatenate(chain[::-1]))
    T = int(end[-1])
    return TrajectoryTree(
        tokens=np.arange(T, dtype=np.int64),
        positions=np.repeat(above - start, length) + np.arange(T),
        node_start=start,
        node_end=end,
        node_parent=parent,
        node_subtree_end=sub_end,
        path_leaf=leaves,
        path_index=path_index,
        path_ids=np.arange(leaves.size),
    )


def big_agent_forest(rng: np.random.Generator, nodes: int = 100_000, per_tree: int = 1000) -> TrajectoryTree:
    """100 agent trees of 1000 nodes: prompt 500-3000 tokens, turns 20-400, uniform attachment."""
    parents, lengths = [], []
    while len(parents) < nodes:
        base = len(parents)
        parents.append(-1)
        lengths.append(int(rng.integers(500, 3000)))
        parents += (base + rng.integers(0, np.arange(1, per_tree))).tolist()
        lengths += rng.integers(20, 400, per_tree - 1).tolist()
    return tree_from_shape(np.array(parents[:nodes]), np.array(lengths[:nodes]))


def big_group_forest(rng: np.random.Generator, nodes: int = 100_000, group: int = 16) -> TrajectoryTree:
    """GRPO at scale: prompts of 200-2000 tokens with 16 continuations of 50-2000 each."""
    parents, lengths = [], []
    while len(parents) < nodes:
        base = len(parents)
        parents += [-1] + [base] * group
        lengths += [int(rng.integers(200, 2000))] + rng.integers(50, 2000, group).tolist()
    return tree_from_shape(np.array(parents[:nodes]), np.array(lengths[:nodes]))


# ---- measuring -----------------------------------------------------------------------------------


def plan_tokens(tree: TrajectoryTree, groups: list[np.ndarray]) -> int:
    """Total distinct tokens of a plan, from the node tree (no part trees built)."""
    parent, length = tree.node_parent.tolist(), (tree.node_end - tree.node_start).tolist()
    total = 0
    for g in groups:
        seen: set[int] = set()
        for u in tree.path_leaf[g].tolist():
            while u >= 0 and u not in seen:
                seen.add(u)
                total += length[u]
                u = parent[u]
    return total


def err(tree: TrajectoryTree, tokens: int) -> float:
    base, t = tree.num_path_tokens, tree.num_tokens
    return 1.0 if base == t else (base - tokens) / (base - t)


METHODS = {
    "beam_dp": dict(method="beam_dp"),
    "beam_dp (beam 1)": dict(method="beam_dp", beam=1),
    "greedy_dfs (paper)": dict(method="greedy_dfs"),
    "single_path": dict(method="single_path"),
    "first_fit": dict(method="first_fit"),
}


def sweep(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Excess over the exact optimum of every method on ``n`` random small trees."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(n):
        tree, cap = small_tree(rng)
        opt = plan_tokens(tree, plan(tree, cap, "optimal"))
        for name, kw in METHODS.items():
            out[name].append(plan_tokens(tree, plan(tree, cap, **kw)) / opt - 1)
    return {k: np.asarray(v) for k, v in out.items()}


def realistic(seeds: int = 3) -> list[dict]:
    rows = []
    for cap in CAPACITIES:
        for shape, make in SHAPES.items():
            acc: dict[str, list[float]] = {}
            for seed in range(seeds):
                tree = make(np.random.default_rng(seed), cap)
                lb = lower_bound(tree, cap)
                acc.setdefault("paths", []).append(tree.num_paths)
                acc.setdefault("por", []).append(tree.por)
                acc.setdefault("lower bound", []).append(err(tree, lb))
                for name, kw in METHODS.items():
                    acc.setdefault(name, []).append(err(tree, plan_tokens(tree, plan(tree, cap, **kw))))
                acc.setdefault("greedy/lb", []).append(plan_tokens(tree, plan(tree, cap)) / lb - 1)
                acc.setdefault("plan ms", []).append(1e3 * timed(lambda t=tree, c=cap: plan(t, c)))
                acc.setdefault("partition ms", []).append(1e3 * timed(lambda t=tree, c=cap: partition(t, c)))
            rows.append({"capacity": cap, "shape": shape, **{k: float(np.mean(v)) for k, v in acc.items()}})
    return rows


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed() -> list[dict]:
    rows = []
    for name, make in (("agent forest", big_agent_forest), ("group forest", big_group_forest)):
        tree = make(np.random.default_rng(0))
        for cap in (8192, 16384):
            row = {"tree": name, "nodes": tree.num_nodes, "paths": tree.num_paths, "capacity": cap}
            lb = lower_bound(tree, cap)
            for label, kw in (
                ("beam_dp", {}),
                ("beam_dp (beam 4)", {"beam": 4}),
                ("greedy_dfs", {"method": "greedy_dfs"}),
                ("first_fit", {"method": "first_fit"}),
            ):
                groups = plan(tree, cap, **kw)
                run = lambda t=tree, c=cap, kw=kw: plan(t, c, **kw)  # noqa: E731
                row[f"{label} s"] = timed(run, repeat=1 if "beam" in kw else 3)
                row[f"{label} vs lb"] = plan_tokens(tree, groups) / lb - 1
            row["lower_bound s"] = timed(lambda t=tree, c=cap: lower_bound(t, c))
            rows.append(row)
    return rows


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor() or "unknown"


def _table(rows: list[dict], fmt: Callable[[str, object], str]) -> list[str]:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(k, r[k]) for k in keys) + " |" for r in rows]
    return lines


def _err_cell(key: str, value: object) -> str:
    if key in ("paths", "por"):
        return f"{value:.2f}"
    if key.endswith("ms"):
        return f"{value:.1f}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _speed_cell(key: str, value: object) -> str:
    if key.endswith(" s"):
        return f"{value:.3f}"
    return f"{value:+.2%}" if key.endswith("lb") else str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", type=int, default=5000, help="random small trees against the optimum")
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args()
    cpu, cores = cpu_name(), os.cpu_count()
    lines = [
        f"# Partitioning benchmark, {datetime.date.today()}",
        "",
        f"CPU: {cpu}, {cores} cores; Python {platform.python_version()}, numpy {np.__version__}; "
        f"load average at start {os.getloadavg()[0]:.1f} (a shared machine: timings are upper bounds).",
        "",
    ]

    t0 = time.perf_counter()
    ex = sweep(args.sweep)
    lines += [
        f"## Excess over the exact optimum, {args.sweep} random small trees (3-10 leaves)",
        "",
        "| method | mean | p99 | worst | optimal in |",
        "|---|---|---|---|---|",
    ]
    for name, e in ex.items():
        lines.append(
            f"| {name} | {e.mean():.3%} | {np.quantile(e, 0.99):.2%} | {e.max():.2%} | "
            f"{(e < 1e-12).mean():.1%} |"
        )
    lines += ["", f"({time.perf_counter() - t0:.0f} s)", ""]
    print("\n".join(lines), flush=True)

    err_note = (
        "ERR = (baseline - partitioned) / (baseline - tree). `lower bound` is the ERR of the "
        "token lower bound (no partition reaches above it); `greedy/lb` is greedy's excess over it "
        "in tokens. `plan ms`: greedy's path assignment; `partition ms`: plus building the part trees "
        "(`TrajectoryTree.subset`, O(path tokens))."
    )
    speed_note = (
        "`greedy` is the default, which is beam 1 at this size (`BEAM_MAX_NODES`); `vs lb` is the "
        "excess in tokens over `lower_bound`."
    )
    for title, note, run, cell in (
        ("ERR on realistic shapes (mean of 3 seeds; higher is better)", err_note, realistic, _err_cell),
        ("Planning time on 100k-node trees (path assignment; best of 3, beam 4 once)", speed_note, speed,
         _speed_cell),
    ):  # fmt: skip
        block = [f"## {title}", "", note, "", *_table(run(), cell), ""]
        print("\n".join(block), flush=True)
        lines += block
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
