"""Peak activation memory and time vs tree width: packed, partitioned, depth-first.

One tree per width: a shared prefix of ``--prefix`` tokens, then ``W`` branches of ``--branch``
tokens. Every mode computes the same per-path SFT loss and the same gradients (checked: max relative
difference to the packed run); what differs is what is alive at once:

- packed: the whole tree in one forward (``tree_logprobs``, default CPU backend);
- partitioned: Tree Partitioning, parts of at most ``prefix + 2 x branch`` tokens, one forward and
  backward per part (the prefix is recomputed in every part);
- depth-first: ``treetrain.parallel.depth_first`` (only the root-to-node stack is alive).

Memory is the peak of tensors saved for backward (``parallel.memory.SavedTensorMeter``): exact
and deterministic on CPU, where torch keeps no allocator peak. Modes run interleaved in one
process, a few repeats, the median time is reported.

    python benchmarks/memory_vs_width.py                     # the recorded run
    python benchmarks/memory_vs_width.py --widths 1 2 4 --prefix 64 --branch 32 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import datetime
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, hardware, result_path  # noqa: E402

from treetrain import TrajectoryTree, pack  # noqa: E402
from treetrain.logprobs import tree_logprobs  # noqa: E402
from treetrain.parallel.depth_first import depth_first_backward, weighted_token_loss  # noqa: E402
from treetrain.parallel.memory import SavedTensorMeter  # noqa: E402
from treetrain.trees.partition import partition  # noqa: E402

MODES = ("packed", "partitioned", "depth-first")


def build_model(hidden: int, layers: int, vocab: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=65536,
        use_sliding_window=False,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def wide_tree(width: int, prefix: int, branch: int, vocab: int) -> TrajectoryTree:
    rng = random.Random(width)
    head = [rng.randrange(vocab) for _ in range(prefix)]
    tails = [[rng.randrange(vocab) for _ in range(branch)] for _ in range(width)]
    return TrajectoryTree.from_paths([head + t for t in tails])


def path_weights(packed) -> torch.Tensor:
    """``[T]``: how many paths score each DFS token (the per-path SFT loss counts a shared token once
    per path through it, so partitioned and packed runs have the same loss)."""
    return torch.bincount(packed.target_index(), minlength=packed.num_tokens).float()


def sft_packed(model, trees: list[TrajectoryTree]) -> None:
    """Forward and backward of each tree in turn (gradients accumulate): per-path SFT, summed."""
    for tree in trees:
        packed = pack(tree)
        logp, _ = tree_logprobs(model, packed, entropy=False)
        (-(path_weights(packed) * logp).sum()).backward()


def run_mode(model, mode: str, tree: TrajectoryTree, capacity: int) -> tuple[float, float]:
    """(peak saved MiB, seconds) of one forward+backward of ``tree`` in ``mode``."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with SavedTensorMeter() as meter:
        if mode == "packed":
            sft_packed(model, [tree])
        elif mode == "partitioned":
            sft_packed(model, partition(tree, capacity))
        else:
            packed = pack(tree)
            depth_first_backward(model, packed, weighted_token_loss(path_weights(packed)))
    return meter.peak / 2**20, time.perf_counter() - t0


def grad_diff(model, ref: dict[str, torch.Tensor]) -> float:
    params = model.named_parameters()
    return max(((p.grad - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--branch", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="", help="e.g. 'contended: 7 other jobs on 2 cores'")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build_model(args.hidden, args.layers, args.vocab)
    capacity = args.prefix + 2 * args.branch
    rows = []
    for mode in MODES:  # warm-up: first-call costs out of the timings
        run_mode(model, mode, wide_tree(2, 16, 8, args.vocab), 32)
    for w in args.widths:
        tree = wide_tree(w, args.prefix, args.branch, args.vocab)
        res = {m: [] for m in MODES}
        diffs = {}
        for _ in range(args.repeats):
            for mode in MODES:  # interleaved, so load changes hit every mode alike
                res[mode].append(run_mode(model, mode, tree, capacity))
                if mode == "packed":
                    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
                else:
                    diffs[mode] = grad_diff(model, ref)
        row = {"width": w, "tokens": tree.num_tokens, "path_tokens": tree.num_path_tokens}
        for mode in MODES:
            row[f"{mode}_mib"] = res[mode][0][0]
            row[f"{mode}_s"] = statistics.median(t for _, t in res[mode])
        row |= {f"{m}_grad_diff": d for m, d in diffs.items()}
        rows.append(row)
        print(row, flush=True)
    write_results(rows, args, capacity)


def write_results(rows: list[dict], args, capacity: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    md = result_path("memory_vs_width")
    png = md.with_suffix(".png")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        ws = [r["width"] for r in rows]
        ax1.plot(ws, [r[f"{mode}_mib"] for r in rows], marker="o", label=mode)
        ax2.plot(ws, [r[f"{mode}_s"] for r in rows], marker="o", label=mode)
    for ax, label in ((ax1, "peak saved activations (MiB)"), (ax2, "forward + backward (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree width (branches)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"prefix {args.prefix} + W x {args.branch} tokens, Qwen3 h={args.hidden} L={args.layers}; "
        f"{datetime.date.today()} {hardware()[:60]}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    head = (
        "| width | tokens | path tokens | packed MiB | partitioned MiB | depth-first MiB "
        "| packed s | partitioned s | depth-first s | partitioned grad diff | depth-first grad diff |"
    )
    lines = [
        "# Peak activation memory vs tree width: packed, partitioned, depth-first",
        "",
        f"Date {datetime.date.today()}; {hardware()}. {args.note}",
        f"Command: `python benchmarks/memory_vs_width.py {shlex.join(sys.argv[1:])}`",
        f"Tree: shared prefix {args.prefix} tokens + W branches of {args.branch}; partition capacity "
        f"{capacity}. Model: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, float32.",
        "Memory: peak bytes of tensors saved for backward (SavedTensorMeter). Time: median of "
        f"{args.repeats} interleaved repeats. Grad diff: max relative difference to the packed run.",
        "",
        head,
        "|" + "---|" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['tokens']} | {r['path_tokens']} | {r['packed_mib']:.1f} | "
            f"{r['partitioned_mib']:.1f} | {r['depth-first_mib']:.1f} | {r['packed_s']:.2f} | "
            f"{r['partitioned_s']:.2f} | {r['depth-first_s']:.2f} | {r['partitioned_grad_diff']:.1e} | "
            f"{r['depth-first_grad_diff']:.1e} |"
        )
    lines += ["", f"![plot]({png.name})", ""]
    md.write_text("\n".join(lines))
    print(f"wrote {md.relative_to(RESULTS.parent.parent)} and {png.name}")


if __name__ == "__main__":
    main()
