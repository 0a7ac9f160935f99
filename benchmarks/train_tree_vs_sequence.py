"""Training steps, tree packing vs the per-path sequence baseline, on the bundled sample.

Each selected tree of the bundled ``agent-dialogues`` sample is one optimizer step (SFT on its
loss masks) through the same functions ``treetrain train`` uses (``objective.microbatches`` +
``train_step``): ``--packing tree`` (every shared prefix once, tree attention: the CPU default
backend) and ``--packing sequence`` (the baseline of ``treetrain.objectives.baseline``: every path its own
sequence, packed padding-free under the same token budget, the same attention backend family, the
same chunked LM head on trained targets only, the same ``compute_loss``). Both
start from the same weights, so their first-step losses must agree; that first step is also the
warm-up, then modes alternate and each time is the minimum over ``--repeats`` further steps (the
least disturbed by other load on the machine; the weights move between steps, which does not change
the work).

Theoretical ratios beside the measured speedup:

- tokens: baseline path tokens / tokens the tree micro-batches compute (partitioning a tree
  larger than ``--capacity`` recomputes some prefixes);
- FLOPs: ``treetrain.trees.flops`` training-FLOP model of what each mode computes (linear layers per
  token run, attention per allowed query-key pair, LM head per trained target scored), baseline /
  tree: the bound on the speedup; efficiency = speedup / bound.

``--vocab compact`` renumbers the sample's token ids to ``0..K-1`` (K distinct ids) and shrinks the
model's vocabulary to K; the default ``full`` keeps Qwen3's 151,936 ids, whose LM head dominates a
model this small.

Usage::

    python benchmarks/train_tree_vs_sequence.py                    # table to stdout
    python benchmarks/train_tree_vs_sequence.py --write            # append to benchmarks/results/...md
    python benchmarks/train_tree_vs_sequence.py --vocab compact --lines 1 2 3 4 5 6 7 8 --write
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, add_allocator_flag, judge, machine_before, noise_section, use_allocator  # noqa: E402

from treetrain.bench import allocator, noise  # noqa: E402
from treetrain.bench.measure import peak_bytes
from treetrain.data.reader import iter_trees, sample_path
from treetrain.objectives.policy.config import Objective
from treetrain.objectives.policy.training import PolicyObjective
from treetrain.train.batches import StepBatch
from treetrain.train.build import build_optimizer, configure_model, default_model_config
from treetrain.train.config import TrainConfig
from treetrain.train.step import train_step
from treetrain.trees.flops import CostModel, baseline_work, tree_work
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

TITLE = (
    "# Training step: tree packing vs per-path sequences, bundled sample (CPU)\n\n"
    "Written by `python benchmarks/train_tree_vs_sequence.py --write` (one section per run).\n\n"
)


def cpu_name() -> str:
    model = platform.processor() or "cpu"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        if found:
            model = found.group(1).strip()
    return f"{model}, {os.cpu_count()} cores"


def load_trees(lines: list[int]) -> list[tuple[str, TrajectoryTree]]:
    """The selected lines (1-based) of the bundled sample, with their ids."""
    out = []
    for i, (tree, info) in enumerate(iter_trees(sample_path("agent-dialogues")), start=1):
        if i in lines:
            out.append((str(info.id), tree))
    return out


def compact_vocab(trees: list[TrajectoryTree]) -> tuple[list[TrajectoryTree], int]:
    """Renumber token ids to ``0..K-1`` (K distinct ids over all trees); structure unchanged."""
    ids = np.unique(np.concatenate([t.tokens for t in trees]))
    remap = {int(v): i for i, v in enumerate(ids)}
    out = []
    for t in trees:
        paths = [[remap[int(x)] for x in p] for p in t.paths()]
        out.append(TrajectoryTree.from_paths(paths, **t.fields))
    return out, int(ids.size)


def build(vocab: int, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(default_model_config(vocab), dtype=torch.float32)
    return configure_model(model, activation_checkpointing=False)


def timed_step(model, optimizer, trees, packing: str, capacity: int, objective) -> tuple[float, float, dict]:
    """One optimizer step; returns (wall s, process CPU s, metrics). Packing is not timed."""
    micro = [pack(mb) for mb in objective.microbatches(trees, packing, capacity)]
    batch = StepBatch(trees=trees, micro=micro, trees_consumed=len(trees), packing=packing)
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = train_step(model, optimizer, batch, objective, grad_clip=1.0)
    return time.perf_counter() - t0, time.process_time() - c0, metrics | {"computed": batch.computed_tokens}


def bench_tree(name, tree, vocab, args, objective, cost) -> dict:
    """Both modes on one tree, alternating, from the same initial weights."""
    base = build(vocab, args.seed)
    cfg = TrainConfig(lr=1e-4)
    runs = {}
    for packing in ("tree", "sequence"):
        model = copy.deepcopy(base)
        runs[packing] = {"model": model, "opt": build_optimizer(model, cfg), "wall": [], "cpu": []}
    monitor = noise.Monitor()
    for rep in range(args.repeats + 1):  # step 0: the first-step losses, and a warm-up (not timed)
        if rep == 1:
            monitor.start()
        for packing in ("tree", "sequence") if rep % 2 == 0 else ("sequence", "tree"):
            r = runs[packing]
            wall, cpu, m = timed_step(r["model"], r["opt"], [tree], packing, args.capacity, objective)
            if rep == 0:
                r["loss"], r["computed"] = m["loss"], m["computed"]
            else:
                r["wall"].append(wall)
                r["cpu"].append(cpu)
    load = monitor.stop() if args.repeats else None

    def one_step(packing: str):
        r = runs[packing]
        return timed_step(r["model"], r["opt"], [tree], packing, args.capacity, objective)

    # after the timings: one profiled step per mode (the profiler's cost stays out of the times)
    peak = {packing: peak_bytes(lambda p=packing: one_step(p)) / 2**20 for packing in runs}
    t, s = runs["tree"], runs["sequence"]
    stats, untrusted = judge({"tree": t["wall"], "baseline": s["wall"]}, load)
    parts = [part for mb in objective.microbatches([tree], "tree", args.capacity) for part in mb]
    flops_tree = tree_work(parts).flops(cost)
    flops_seq = baseline_work([tree]).flops(cost)
    efficiency = min(s["wall"]) / min(t["wall"]) / (flops_seq / flops_tree)
    untrusted += noise.verdict({}, efficiency=efficiency)  # above 1.05 of the bound: flagged
    return {
        "name": name,
        "paths": tree.num_paths,
        "path_tokens": tree.num_path_tokens,
        "tree_tokens": tree.num_tokens,
        "computed": t["computed"],
        "token_ratio": tree.num_path_tokens / t["computed"],
        "flop_ratio": flops_seq / flops_tree,
        "flops_tree": flops_tree,
        "flops_seq": flops_seq,
        "tree_s": min(t["wall"]),
        "seq_s": min(s["wall"]),
        "tree_cpu": min(t["cpu"]),
        "seq_cpu": min(s["cpu"]),
        "loss_tree": t["loss"],
        "loss_seq": s["loss"],
        "speedup_median": stats["baseline"]["median"] / stats["tree"]["median"],
        "spread": (stats["baseline"]["spread"], stats["tree"]["spread"]),
        "peak": (peak["sequence"], peak["tree"]),
        "untrusted": untrusted,
    }


def table(rows: list[dict]) -> str:
    out = [
        "| tree | paths | path tokens | tree tokens | computed | token ratio | FLOP bound | tree s "
        "| sequence s | speedup (wall) | median (spread seq/tree) | efficiency | speedup (CPU time) "
        "| loss tree | loss sequence | rel. diff | peak live MiB seq / tree (ratio; activation bound) "
        "| timings |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = abs(r["loss_tree"] - r["loss_seq"]) / abs(r["loss_seq"])
        out.append(
            f"| {r['name']} | {r['paths']} | {r['path_tokens']:,} | {r['tree_tokens']:,} | {r['computed']:,} "
            f"| {r['token_ratio']:.2f} | {r['flop_ratio']:.2f} | {r['tree_s']:.2f} | {r['seq_s']:.2f} "
            f"| **{r['seq_s'] / r['tree_s']:.2f}x** "
            f"| {r['speedup_median']:.2f}x ({r['spread'][0]:.0%}/{r['spread'][1]:.0%}) "
            f"| {r['seq_s'] / r['tree_s'] / r['flop_ratio']:.2f} "
            f"| {r['seq_cpu'] / r['tree_cpu']:.2f}x "
            f"| {r['loss_tree']:.6f} | {r['loss_seq']:.6f} | {rel:.1e} "
            f"| {r['peak'][0]:.0f} / {r['peak'][1]:.0f} ({r['peak'][0] / r['peak'][1]:.2f}x; "
            f"{r['token_ratio']:.2f}x) | {'NOT TRUSTWORTHY' if r['untrusted'] else 'ok'} |"
        )
    tot = {k: sum(r[k] for r in rows) for k in ("path_tokens", "tree_tokens", "computed", "tree_s", "seq_s")}
    cpu_t, cpu_s = sum(r["tree_cpu"] for r in rows), sum(r["seq_cpu"] for r in rows)
    flop_ratio = sum(r["flops_seq"] for r in rows) / sum(r["flops_tree"] for r in rows)
    out.append(
        f"| **all** | {sum(r['paths'] for r in rows)} | {tot['path_tokens']:,} | {tot['tree_tokens']:,} "
        f"| {tot['computed']:,} | {tot['path_tokens'] / tot['computed']:.2f} | {flop_ratio:.2f} "
        f"| {tot['tree_s']:.2f} | {tot['seq_s']:.2f} | **{tot['seq_s'] / tot['tree_s']:.2f}x** | "
        f"| {tot['seq_s'] / tot['tree_s'] / flop_ratio:.2f} | {cpu_s / cpu_t:.2f}x | | | | "
        f"| {'NOT TRUSTWORTHY' if any(r['untrusted'] for r in rows) else 'ok'} |"
    )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lines", type=int, nargs="+", default=[1, 2], help="sample lines (1-based), one step each"
    )
    p.add_argument("--vocab", choices=("full", "compact"), default="full")
    p.add_argument("--capacity", type=int, default=8192, help="tokens per micro-batch (both modes)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--write", action="store_true", help="write benchmarks/results/train_tree_vs_sequence_*.md"
    )
    add_allocator_flag(p)
    args = p.parse_args()
    use_allocator(args)

    named = load_trees(args.lines)
    names, trees = [n for n, _ in named], [t for _, t in named]
    vocab = default_model_config().vocab_size
    if args.vocab == "compact":
        trees, vocab = compact_vocab(trees)
    config = default_model_config(vocab)
    cost = CostModel.from_config(config)
    objective = PolicyObjective(Objective(name="sft"))
    before = machine_before()
    rows = []
    for name, tree in zip(names, trees):
        rows.append(bench_tree(name, tree, vocab, args, objective, cost))
        print(table(rows[-1:]).splitlines()[-2], flush=True)  # as it comes; the table follows at the end
    hw = cpu_name()
    head = (
        f"## Training step, tree packing vs per-path sequences: vocab {args.vocab}\n\n"
        f"- hardware: {hw}; torch {torch.__version__}, {torch.get_num_threads()} threads, allocator "
        f"{allocator.active()}; "
        f"date {datetime.date.today()}\n"
        f"- model: the embedded tiny Qwen3 (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads, vocab {vocab:,} ({args.vocab})), float32, random init\n"
        f"- one optimizer step (SFT on the loss masks, AdamW) per sample tree, capacity {args.capacity}; "
        f"a warm-up step, then the minimum of {args.repeats} steps per mode, modes alternating (median "
        "and spread beside it, the machine's load measured: see the notes below the table)\n"
        "- token ratio: path tokens / tokens the tree micro-batches compute; FLOP bound: "
        "treetrain.trees.flops training FLOPs of what each mode computes (head on trained targets only), "
        "baseline / tree; efficiency: speedup / bound\n"
        "- baseline: treetrain.objectives.baseline (every path alone, packed padding-free, same backend "
        "family, "
        "chunked head on trained targets, same compute_loss)\n"
        "- speedup (wall): sequence time / tree time; CPU time: process user+system time, less "
        "sensitive to other load on the machine\n"
        "- peak live MiB: the most tensor bytes alive at once during one step of each mode "
        "(treetrain.bench.measure.peak_bytes); activation bound: the token ratio\n\n"
    )
    text = head + table(rows) + "\n\n" + noise_section(before, [(r["name"], r["untrusted"]) for r in rows])
    print("\n" + text)
    if args.write:
        slug = re.sub(r"[^a-z0-9]+", "-", hw.lower()).strip("-")
        path = RESULTS / f"train_tree_vs_sequence_{slug}_{datetime.date.today()}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # one section per invocation (e.g. --vocab full, then compact)
            f.write(("\n" if f.tell() else TITLE) + text)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
