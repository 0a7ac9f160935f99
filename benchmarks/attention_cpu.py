"""CPU tree attention, forward + backward: blocksparse vs dense (masked SDPA) vs plain causal SDPA.

Attention work scales with the (query, key) pairs computed. On a tree whose mask allows ``A``
pairs the best to hope for is ``t_causal * A / (T (T + 1) / 2)``, with ``t_causal`` the time of plain
causal SDPA (the CPU flash kernel) on a sequence of the same length ``T``:
``efficiency = that bound / t_blocksparse``. ``vs paths`` compares with what tree training
replaces: causal SDPA over every root-to-leaf path on its own.

Trees (``T`` ~ 2k-5k):

- ``group``: one shared prompt then ``n`` sampled branches (a GRPO group).
- ``per-turn``: a multi-turn conversation's per-turn samples with the reasoning stripped from
  earlier turns: a spine of turns; at each turn a leaf (the response with its reasoning), the spine
  going on with the stripped response.

Timing is the fastest of ``--repeats`` runs (noise on a shared machine only adds time);
``--clock cpu`` measures process CPU time, which is robust to other load but meaningful with
``--threads 1`` only.

``--sweep``: the block and fanout the blocksparse backend should choose by tree shape
(``treetrain.attention.blockrule.choose_block``, whose rule was set from this sweep on the quiet
2-core EPYC, 2026-11-26: 128 / 4 for every shape). Group trees across prompt length, width and
branch length (1k-12k tokens), per-turn trees and small forests; per tree the efficiency (the
causal kernel's per-pair rate x the allowed pairs / time) of every ``(block, fanout)`` in
``--configs``, the best, the rule's pick, and the before (64 / 4, the old default) and after (the
rule) of that tree.

Usage::

    python benchmarks/attention_cpu.py --threads 1 --clock cpu --write
    python benchmarks/attention_cpu.py --blocks 64 128              # wall clock, default threads
    python benchmarks/attention_cpu.py --sweep --write              # the block rule's figures
    python benchmarks/attention_cpu.py --sweep --quick              # a seconds-long check of the sweep
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import machine_before, noise_section

from treetrain.attention.blockplan import build_plan
from treetrain.attention.blockrule import FANOUT, choose_block, segment_mean
from treetrain.attention.blocksparse import blocksparse_attention
from treetrain.attention.dense import dense_attention
from treetrain.attention.mask import TreeMask, dense_tree_mask
from treetrain.bench import noise


class Tree:
    """A tree built chain by chain in DFS order: ``parent`` per token, and its root-to-leaf paths."""

    def __init__(self):
        self.parent: list[int] = []
        self.leaves: list[int] = []

    def chain(self, n: int, after: int, leaf: bool = False) -> int:
        """Append ``n`` tokens below token ``after`` (-1: a new root); return the last one."""
        for _ in range(n):
            self.parent.append(after)
            after = len(self.parent) - 1
        if leaf:
            self.leaves.append(after)
        return after

    def subtree_end(self) -> torch.Tensor:
        end = list(range(1, len(self.parent) + 1))
        for t in reversed(range(len(self.parent))):
            if self.parent[t] >= 0:
                end[self.parent[t]] = max(end[self.parent[t]], end[t])
        return torch.tensor(end, dtype=torch.int64)

    def paths(self) -> list[torch.Tensor]:
        out = []
        for t in self.leaves:
            path = []
            while t >= 0:
                path.append(t)
                t = self.parent[t]
            out.append(torch.tensor(path[::-1]))
        return out


def group_tree(prompt: int, branches: int, length: int) -> Tree:
    tree = Tree()
    root = tree.chain(prompt, -1)
    for _ in range(branches):
        tree.chain(length, root, leaf=True)
    return tree


def per_turn_tree(turns: int, user: int, think: int, answer: int) -> Tree:
    """Turn ``i`` adds ``user`` spine tokens, a leaf (``think + answer``), then ``answer`` on the spine."""
    tree = Tree()
    spine = -1
    for _ in range(turns):
        spine = tree.chain(user, spine)
        tree.chain(think + answer, spine, leaf=True)
        spine = tree.chain(answer, spine)
    return tree


TREES = {
    "group: prompt 1024 + 6 x 512": lambda: group_tree(1024, 6, 512),
    "group: prompt 512 + 16 x 224": lambda: group_tree(512, 16, 224),
    "group: prompt 512 + 6 x 256": lambda: group_tree(512, 6, 256),
    "per-turn: 8 x (160 user, 160 think, 96 answer)": lambda: per_turn_tree(8, 160, 160, 96),
    "per-turn: 16 x (64 user, 96 think, 32 answer)": lambda: per_turn_tree(16, 64, 96, 32),
}

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def runs(fn: Callable[[], None], repeats: int, clock: str) -> list[float]:
    """Seconds of ``fn()`` in each of ``repeats`` runs, after one warm-up."""
    now = CLOCKS[clock]
    fn()
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return times


def fastest(fn: Callable[[], None], repeats: int, clock: str) -> float:
    """Fastest seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    return min(runs(fn, repeats, clock))


def cpu_name() -> str:
    model = "cpu"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        model = found.group(1).strip() if found else model
    return f"{model}, {os.cpu_count()} cores"


def matmul_time(T: int, heads: int, kv_heads: int, dim: int, layer: list[int], repeats: int, clock: str):
    """Forward + backward seconds of a transformer layer's matmuls on ``T`` tokens: the q, k, v, o
    projections and a SwiGLU MLP, ``layer = [hidden, ffn]``. What attention's cost adds to."""
    hidden, ffn = layer
    x = torch.randn(T, hidden, requires_grad=True)
    shapes = [(hidden, heads * dim), (hidden, 2 * kv_heads * dim), (heads * dim, hidden)]
    shapes += [(hidden, 2 * ffn), (ffn, hidden)]
    w_q, w_kv, w_o, w_up, w_down = ((torch.randn(*s) * s[0] ** -0.5).requires_grad_() for s in shapes)

    def run():
        h = x + (x @ w_q) @ w_o  # stands in for q -> attention -> o
        gate, up = (h @ w_up).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down
        (y.sum() + (x @ w_kv).sum()).backward()

    return fastest(run, repeats, clock)


def bench_tree(name: str, tree: Tree, args: argparse.Namespace) -> list[str]:
    heads, kv_heads, dim, blocks = args.heads, args.kv_heads or args.heads, args.dim, args.blocks
    time_it = lambda fn, repeats=args.repeats: fastest(fn, repeats, args.clock)  # noqa: E731
    se = tree.subtree_end()
    T = se.numel()
    causal_pairs = T * (T + 1) // 2
    allowed = int((se - torch.arange(T)).sum())
    paths = tree.paths()
    path_pairs = sum(len(p) * (len(p) + 1) // 2 for p in paths)
    scale = dim**-0.5
    # [H, T, D] views of token-major storage, as attention layers produce them
    q = torch.randn(T, heads, dim).transpose(0, 1).requires_grad_()
    k, v = (torch.randn(T, kv_heads, dim).transpose(0, 1).requires_grad_() for _ in range(2))
    dense_bool = dense_tree_mask(se)

    def step(fn: Callable) -> Callable[[], None]:
        def run():
            q.grad = k.grad = v.grad = None
            out = fn()
            out.backward(torch.ones_like(out))

        return run

    def sdpa(idx=slice(None), **kw):  # 4-D inputs: SDPA's CPU flash kernel
        return F.scaled_dot_product_attention(
            q[None, :, idx], k[None, :, idx], v[None, :, idx], scale=scale, enable_gqa=True, **kw
        )

    def per_path():  # what tree training replaces: every path on its own
        return torch.cat([sdpa(p, is_causal=True).flatten() for p in paths])

    t_causal = time_it(step(lambda: sdpa(is_causal=True)))
    t_paths = time_it(step(per_path))
    t_dense = time_it(step(lambda: dense_attention(q, k, v, TreeMask(se), scale)), max(1, args.repeats // 3))
    t_flash_masked = time_it(step(lambda: sdpa(attn_mask=dense_bool)))
    t_matmul = 0.0
    if args.layer is not None:
        t_matmul = matmul_time(T, heads, kv_heads, dim, args.layer, args.repeats, args.clock)
    bound = t_causal * allowed / causal_pairs
    head = f"| {name} | {T} | {allowed / causal_pairs:.3f} | {path_pairs / allowed:.2f} "
    rows = []

    def row(method: str, block, computed, t: float) -> None:
        layer = "" if args.layer is None else f" {(t_matmul + bound) / (t_matmul + t):.3f} |"
        rows.append(
            head + f"| {method} | {block} | {computed} | {1e3 * t:.1f} | {t_dense / t:.1f}x "
            f"| {bound / t:.2f} | {t_paths / t:.2f}x |" + layer
        )

    row("causal SDPA, no tree", "-", f"{causal_pairs / allowed:.2f}", t_causal)
    row("per-path causal SDPA", "-", f"{path_pairs / allowed:.2f}", t_paths)
    row("dense (repo: 3-D SDPA = math path)", "-", f"{T * T / allowed:.2f}", t_dense)
    row("dense mask, 4-D SDPA (flash)", "-", f"{T * T / allowed:.2f}", t_flash_masked)
    for block in blocks:
        plan = build_plan(se, block, args.fanout)  # not timed: built once per forward, shared by all layers

        def blocksparse(block=block, plan=plan):
            mask = TreeMask(se)
            mask.cache[("blocksparse", block, args.fanout)] = plan
            return blocksparse_attention(q, k, v, mask, scale, block, fanout=args.fanout)

        t = time_it(step(blocksparse))
        row(f"**blocksparse** ({len(plan.tiles)} tiles)", block, f"{plan.computed_pairs / allowed:.3f}", t)
    return rows


def forest(trees: list[Tree]) -> Tree:
    """Several trees side by side (a batch of prompts), in DFS order."""
    out = Tree()
    for t in trees:
        base = len(out.parent)
        out.parent += [p + base if p >= 0 else -1 for p in t.parent]
        out.leaves += [leaf + base for leaf in t.leaves]
    return out


def sweep_trees(quick: bool = False) -> dict[str, Callable[[], Tree]]:
    """The sweep's tree shapes: group trees (prompt P, n branches of b) across 1k-12k tokens, per-turn
    trees, and forests of small groups (several prompts per batch)."""
    if quick:
        return {"group: prompt 256 + 4 x 64": lambda: group_tree(256, 4, 64)}
    trees = {}
    for P, n, b in [
        (512, 16, 224), (1024, 6, 512), (1024, 16, 64), (2048, 8, 64), (2048, 8, 512), (4096, 8, 64),
        (4096, 16, 384), (4096, 4, 1024), (8192, 4, 256), (512, 4, 128),
    ]:  # fmt: skip
        trees[f"group: prompt {P} + {n} x {b}"] = lambda P=P, n=n, b=b: group_tree(P, n, b)
    trees["per-turn: 8 x (160 user, 160 think, 96 answer)"] = lambda: per_turn_tree(8, 160, 160, 96)
    trees["per-turn: 16 x (64 user, 96 think, 32 answer)"] = lambda: per_turn_tree(16, 64, 96, 32)
    trees["per-turn: 8 x (512 user, 512 think, 128 answer)"] = lambda: per_turn_tree(8, 512, 512, 128)
    trees["forest: 4 x (prompt 256 + 4 x 48)"] = lambda: forest([group_tree(256, 4, 48) for _ in range(4)])
    trees["forest: 2 x (prompt 1024 + 8 x 128)"] = lambda: forest(
        [group_tree(1024, 8, 128) for _ in range(2)]
    )
    return trees


CONFIGS = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 4), (256, 8), (512, 8)]


def sweep_tree(name: str, tree: Tree, args: argparse.Namespace, configs) -> dict:
    """Efficiency of every ``(block, fanout)`` on one tree (see :func:`bench_tree` for the measure)."""
    heads, kv_heads, dim = args.heads, args.kv_heads or args.heads, args.dim
    se = tree.subtree_end()
    T = se.numel()
    allowed = int((se - torch.arange(T)).sum())
    q = torch.randn(T, heads, dim).transpose(0, 1).requires_grad_()
    k, v = (torch.randn(T, kv_heads, dim).transpose(0, 1).requires_grad_() for _ in range(2))

    def step(fn):
        def run():
            q.grad = k.grad = v.grad = None
            out = fn()
            out.backward(torch.ones_like(out))

        return run

    causal = lambda: F.scaled_dot_product_attention(  # noqa: E731
        q[None], k[None], v[None], is_causal=True, scale=dim**-0.5, enable_gqa=True
    )
    rule = choose_block(se)
    times = {}
    with noise.Monitor() as monitor:
        times["causal"] = runs(step(causal), args.repeats, args.clock)
        for block, fanout in dict.fromkeys([*configs, rule]):
            plan = build_plan(se, block, fanout)  # not timed: built once per forward, shared by all layers

            def blocksparse(plan=plan, block=block, fanout=fanout):
                mask = TreeMask(se)
                mask.cache[("blocksparse", block, fanout)] = plan
                return blocksparse_attention(q, k, v, mask, dim**-0.5, block, fanout=fanout)

            times[(block, fanout)] = runs(step(blocksparse), args.repeats, args.clock)
    bound = min(times["causal"]) * allowed / (T * (T + 1) // 2)
    eff = {c: bound / min(t) for c, t in times.items() if c != "causal"}
    stats = {str(c): noise.summary(t) for c, t in times.items()}
    spread = max(st["spread"] for st in stats.values())
    untrusted = noise.verdict(stats, monitor.load if args.clock == "wall" else None)
    return {"name": name, "T": T, "segment_mean": segment_mean(se), "eff": eff, "best": max(eff, key=eff.get),
            "rule": rule, "spread": spread, "untrusted": untrusted}  # fmt: skip


def sweep_table(rows: list[dict], configs) -> str:
    cols = " | ".join(f"{b}/{f}" for b, f in configs)
    lines = [
        f"| tree | T | segment mean | {cols} | best | rule | before (64/4) | after (rule) | rule / best "
        "| spread (widest) | timings |",
        "|" + "---|" * (len(configs) + 10),
    ]
    for r in rows:
        effs = " | ".join(f"{r['eff'][c]:.3f}" for c in configs)
        before, after, best = r["eff"][(64, 4)], r["eff"][r["rule"]], r["eff"][r["best"]]
        lines.append(
            f"| {r['name']} | {r['T']} | {r['segment_mean']:.0f} | {effs} | {r['best'][0]}/{r['best'][1]} | "
            f"{r['rule'][0]}/{r['rule'][1]} | {before:.3f} | **{after:.3f}** | {after / best:.3f} | "
            f"{r['spread']:.0%} | {'NOT TRUSTWORTHY (below)' if r['untrusted'] else 'ok'} |"
        )
    return "\n".join(lines) + "\n"


def run_sweep(args: argparse.Namespace) -> list[str]:
    configs = [(32, 4), (64, 4), (256, 8)] if args.quick else args.configs or CONFIGS
    configs = list(dict.fromkeys([(64, 4), *configs]))  # the old default: the "before" column
    before = machine_before()
    rows = []
    for name, make in sweep_trees(args.quick).items():
        rows.append(sweep_tree(name, make(), args, configs))
        r = rows[-1]
        print(f"{name}: T {r['T']}, best {r['best']} {r['eff'][r['best']]:.3f}, rule {r['rule']} "
              f"{r['eff'][r['rule']]:.3f}, 64/4 {r['eff'][(64, 4)]:.3f}", flush=True)  # fmt: skip
    return [
        "Efficiency per (block / fanout): the causal kernel's per-pair rate x allowed pairs / time, "
        "forward + backward; *segment mean*: the token-weighted mean length of the tree's chains "
        "(`blockrule.segment_mean`), what the rule reads; *rule*: `blockrule.choose_block` "
        "(BLOCK_RULE in force when the sweep ran).\n",
        sweep_table(rows, configs),
        noise_section(before, [(r["name"], r["untrusted"]) for r in rows]),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--fanout", type=int, default=FANOUT, help="row blocks per parent block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--trees", nargs="+", type=int, help="indices into the tree list (default: all)")
    p.add_argument(
        "--layer", type=int, nargs=2, metavar=("HIDDEN", "FFN"),
        help="add a layer-efficiency column: (matmuls + attention bound) / (matmuls + attention)",
    )  # fmt: skip
    p.add_argument(
        "--write", action="store_true", help="append to benchmarks/results/attention_cpu_<cpu>_<date>.md"
    )
    p.add_argument(
        "--sweep", action="store_true", help="the block and fanout by tree shape (module docstring)"
    )
    p.add_argument("--quick", action="store_true", help="with --sweep: one small tree, three configurations")
    p.add_argument(
        "--configs",
        nargs="+",
        type=lambda t: tuple(int(x) for x in t.split(":")),
        metavar="BLOCK:FANOUT",
        help="with --sweep: the (block, fanout) pairs to time (default: "
        + " ".join(f"{b}:{f}" for b, f in CONFIGS)
        + ")",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    names = list(TREES)
    chosen = [names[i] for i in args.trees] if args.trees else names
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    layer = "" if args.layer is None else f", layer hidden {args.layer[0]} ffn {args.layer[1]}"
    header = (
        f"### fp32, Hq = {args.heads}, Hkv = {args.kv_heads or args.heads}, D = {args.dim}{layer}, "
        f"fanout {args.fanout}; "
        f"{args.threads} thread(s), {args.clock} clock, fastest of {args.repeats}, "
        f"load average {load:.1f} at start\n\n"
        "| tree | T | allowed / causal pairs | path pairs / allowed | method | block "
        "| computed / allowed | fwd+bwd ms | vs dense | efficiency | vs paths |"
        + ("" if args.layer is None else " layer efficiency |")
        + "\n|---|---|---|---|---|---|---|---|---|---|---|"
        + ("" if args.layer is None else "---|")
    )
    if args.sweep:
        header = (
            f"### sweep: fp32, Hq = {args.heads}, Hkv = {args.kv_heads or args.heads}, D = {args.dim}; "
            f"{args.threads} thread(s), {args.clock} clock, fastest of {args.repeats}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
        )
        print(header, flush=True)
        lines = [header] + run_sweep(args)
        print("\n".join(lines[1:]))
    else:
        print(header, flush=True)
        lines = [header]
    for name in [] if args.sweep else chosen:
        for line in bench_tree(name, TREES[name](), args):
            print(line, flush=True)
            lines.append(line)
    if args.write:
        hw = cpu_name()
        slug = re.sub(r"[^a-z0-9]+", "-", hw.lower()).strip("-")
        results = os.environ.get("TREETRAIN_RESULTS") or os.path.join(os.path.dirname(__file__), "results")
        path = os.path.join(
            results, f"attention_cpu_{'sweep_' if args.sweep else ''}{slug}_{datetime.date.today()}.md"
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fresh = not os.path.exists(path)
        with open(path, "a") as f:
            if fresh:
                f.write(f"# CPU tree attention, forward + backward\n\n{hw}; torch {torch.__version__}\n\n")
            f.write("\n".join(lines) + "\n\n")
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
