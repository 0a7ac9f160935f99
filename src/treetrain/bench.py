"""``treetrain bench``: per-path baseline vs tree training on the same model and data.

Baseline: every path its own sequence with plain causal attention (SDPA ``is_causal``, the best
causal kernel on the device), grouped into micro-batches of at most ``capacity`` tokens whose losses
are summed before one backward. Tree: each tree (partitioned to ``capacity`` if needed) in one
forward. Both run a forward+backward of the same loss (a fixed random linear function of all
log-probs), alternating, and report medians.

The bound beside each speedup is the FLOP ratio (``treetrain.flops``): linear layers per token,
attention per allowed query-key pair.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .flops import CostModel, baseline_pairs, train_flops, tree_pairs
from .logprobs import path_logprobs
from .packing import pack
from .tree import TrajectoryTree

# ---- synthetic data --------------------------------------------------------------------------


def group_tree(por: float, paths: int, length: int, vocab: int, seed: int = 0) -> TrajectoryTree:
    """``paths`` paths of ``length`` tokens sharing a prompt sized for the requested POR.

    POR = shared * (P - 1) / (P * L), so the shared prompt is ``por * P * L / (P - 1)`` tokens:
    the number of paths and baseline tokens stay the same across settings.
    """
    rng = np.random.default_rng(seed)
    shared = round(por * paths * length / (paths - 1))
    if not 0 <= shared < length:
        raise ValueError(f"--por {por}: needs a shared prefix of {shared} tokens, paths are {length}")
    prompt = rng.integers(0, vocab, shared)
    return TrajectoryTree.from_paths(
        [np.concatenate([prompt, rng.integers(0, vocab, length - shared)]) for _ in range(paths)]
    )


def per_turn_tree(turns: int, turn_len: int, vocab: int, seed: int = 0) -> TrajectoryTree:
    """Per-turn samples of one dialogue: path k is the first k turns (nested prefixes)."""
    rng = np.random.default_rng(seed)
    full = rng.integers(0, vocab, turns * turn_len)
    return TrajectoryTree.from_paths([full[: (k + 1) * turn_len] for k in range(turns)])


# ---- the two modes ---------------------------------------------------------------------------


def _coeffs(trees: list[TrajectoryTree], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(n) - 1, generator=g) for t in trees for n in t.path_lengths]


def _microbatches(lengths: list[int], capacity: int) -> list[list[int]]:
    """Consecutive paths grouped into micro-batches of at most ``capacity`` tokens."""
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if out[-1] and used + n > capacity:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def baseline_step(model, trees, coeffs, capacity: int) -> list[torch.Tensor]:
    """Forward+backward of every path alone (causal SDPA), micro-batched; returns log-probs."""
    device = model.get_input_embeddings().weight.device
    paths = [p for t in trees for p in t.paths()]
    out: list[torch.Tensor] = []
    for mb in _microbatches([len(p) for p in paths], capacity):
        loss = 0.0
        for i in mb:
            ids = torch.as_tensor(paths[i], device=device)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            loss = loss + (coeffs[i].to(device) * lp).sum()
            out.append(lp.detach())
        loss.backward()
    return out


def tree_step(model, trees, coeffs, capacity: int, backend: str | None) -> list[torch.Tensor]:
    """Forward+backward of the trees (parts of at most ``capacity`` tokens); returns log-probs."""
    from .partition import pack_microbatches

    device = model.get_input_embeddings().weight.device
    offsets = np.cumsum([0] + [t.num_paths for t in trees])
    out: list[torch.Tensor | None] = [None] * int(offsets[-1])
    # global path numbers (kept through partitioning); a shallow copy, no rebuild
    tagged = [dataclasses.replace(t, path_ids=t.path_ids + offsets[k]) for k, t in enumerate(trees)]
    for mb in pack_microbatches(tagged, capacity):
        lps = path_logprobs(model, pack(mb), backend=backend)
        ids = [int(i) for part in mb for i in part.path_ids]
        loss = sum((coeffs[i].to(device) * lp).sum() for i, lp in zip(ids, lps))
        loss.backward()
        for i, lp in zip(ids, lps):
            out[i] = lp.detach()
    return out  # type: ignore[return-value]


# ---- measurement -----------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one_step(mode: str, model, trees, capacity: int, backend) -> list[torch.Tensor]:
    coeffs = _coeffs(trees)
    if mode == "baseline":
        return baseline_step(model, trees, coeffs, capacity)
    return tree_step(model, trees, coeffs, capacity, backend)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _child_peak(mode: str, model_args: tuple, trees, capacity: int, backend) -> int:
    """In a fresh process: bytes the RSS high-water mark grows by during one step.

    The mark is reset first (``/proc/self/clear_refs``): a spawned child otherwise inherits the
    parent's mark through fork+exec.
    """
    model = bench_model(*model_args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_bytes()
    _one_step(mode, model, trees, capacity, backend)
    return max(0, _peak_rss_bytes() - before)


def peak_memory(mode: str, model, model_args: tuple, trees, capacity: int, backend) -> int:
    """Peak memory of one step: CUDA allocator stats, or a fresh CPU process's RSS high-water mark.

    On CPU one process cannot measure both modes: freed memory stays mapped, so whichever mode
    runs second would look free. Each mode runs once in its own spawned process instead.
    """
    if model.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model.zero_grad(set_to_none=True)
        _one_step(mode, model, trees, capacity, backend)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child_peak, (mode, model_args, trees, capacity, backend))


@dataclass
class Result:
    name: str
    paths: int
    baseline_tokens: int
    tree_tokens: int
    por: float
    flop_bound: float
    baseline_s: float
    tree_s: float
    speedup: float
    efficiency: float
    baseline_peak_mb: float
    tree_peak_mb: float
    max_logprob_diff: float


def _timed(fn, device) -> tuple[float, list[torch.Tensor]]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    lps = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, lps


def run_case(name, model, model_args, trees, capacity, repeats, backend, cost: CostModel) -> Result:
    device = model.get_input_embeddings().weight.device
    base_tok = sum(t.num_path_tokens for t in trees)
    tree_tok = sum(t.num_tokens for t in trees)
    base_flops = sum(train_flops(t.num_path_tokens, baseline_pairs(t), cost) for t in trees)
    tree_flops = sum(train_flops(t.num_tokens, tree_pairs(t), cost) for t in trees)
    times: dict[str, list[float]] = {"baseline": [], "tree": []}
    last: dict[str, list[torch.Tensor]] = {}
    steps = {m: (lambda m=m: _one_step(m, model, trees, capacity, backend)) for m in ("baseline", "tree")}
    for r in range(repeats + 1):  # the first round warms up and is not timed
        for mode in ("baseline", "tree") if r % 2 == 0 else ("tree", "baseline"):
            model.zero_grad(set_to_none=True)
            dt, lps = _timed(steps[mode], device)
            if r > 0:
                times[mode].append(dt)
            last[mode] = lps
    peaks = {m: peak_memory(m, model, model_args, trees, capacity, backend) for m in ("baseline", "tree")}
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(last["baseline"], last["tree"])
        if a.numel()
    )
    tb, tt = statistics.median(times["baseline"]), statistics.median(times["tree"])
    bound = base_flops / tree_flops
    return Result(
        name=name,
        paths=sum(t.num_paths for t in trees),
        baseline_tokens=base_tok,
        tree_tokens=tree_tok,
        por=1 - tree_tok / base_tok,
        flop_bound=bound,
        baseline_s=tb,
        tree_s=tt,
        speedup=tb / tt,
        efficiency=(tb / tt) / bound,
        baseline_peak_mb=peaks["baseline"] / 2**20,
        tree_peak_mb=peaks["tree"] / 2**20,
        max_logprob_diff=diff,
    )


# ---- CLI ---------------------------------------------------------------------------------------


def bench_model(hidden: int, layers: int, vocab: int, heads: int, device, dtype, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="baseline vs tree training speed, memory and equivalence")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--paths", type=int, default=16, help="paths per synthetic group tree")
    p.add_argument("--path-len", type=int, default=256, help="tokens per synthetic path")
    p.add_argument("--por", type=float, nargs="*", default=[0.2, 0.35, 0.5, 0.65, 0.8, 0.92])
    p.add_argument("--turns", type=int, default=0, help="also a per-turn chain tree with N turns")
    p.add_argument("--turn-len", type=int, default=150)
    p.add_argument("--sample", action="store_true", help="also the bundled realistic sample")
    p.add_argument("--capacity", type=int, default=16384, help="micro-batch token budget")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default=None, help="tree attention backend (default: by device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of speedup vs POR here")
    p.set_defaults(handler=main)
    return p


def _cases(args, vocab: int) -> list[tuple[str, list[TrajectoryTree]]]:
    cases = [(f"group POR {p:.0%}", [group_tree(p, args.paths, args.path_len, vocab)]) for p in args.por]
    if args.turns:
        cases.append((f"per-turn {args.turns} turns", [per_turn_tree(args.turns, args.turn_len, vocab)]))
    if args.sample:
        from . import data

        trees = [t for t, _ in data.iter_trees(data.sample_path("agent-dialogues"))]
        cases.append(("bundled sample", renumber(trees, vocab)))
    return cases


def renumber(trees: list[TrajectoryTree], vocab: int) -> list[TrajectoryTree]:
    """Map the distinct token ids used to ``0..n-1`` (a bijection: the trees keep their shape)."""
    used = np.unique(np.concatenate([t.tokens for t in trees]))
    if used.size > vocab:
        raise ValueError(f"--sample uses {used.size} distinct token ids; use --vocab {used.size} or more")
    return [
        TrajectoryTree.from_paths([np.searchsorted(used, p) for p in t.paths()], **t.fields) for t in trees
    ]


def format_table(results: list[Result]) -> str:
    head = (
        "| case | paths | baseline tok | tree tok | POR | FLOP bound | baseline s | tree s | speedup "
        "| efficiency | peak MB base/tree | max lp diff |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        lines.append(
            f"| {r.name} | {r.paths} | {r.baseline_tokens:,} | {r.tree_tokens:,} | {r.por:.1%} | "
            f"{r.flop_bound:.2f}x | {r.baseline_s:.3f} | {r.tree_s:.3f} | {r.speedup:.2f}x | "
            f"{r.efficiency:.2f} | {r.baseline_peak_mb:.0f}/{r.tree_peak_mb:.0f} | {r.max_logprob_diff:.1e} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sweep = sorted((r for r in results if r.name.startswith("group")), key=lambda r: r.por)
    others = [r for r in results if not r.name.startswith("group")]
    if sweep:
        por = [r.por * 100 for r in sweep]
        ax.plot(por, [r.flop_bound for r in sweep], "k--o", label="FLOP bound (group trees)")
        ax.plot(por, [r.speedup for r in sweep], "C0-o", label="measured (group trees)")
    for i, r in enumerate(others):
        ax.plot(r.por * 100, r.flop_bound, "k^", label="FLOP bound (other)" if i == 0 else None)
        ax.plot(r.por * 100, r.speedup, "C1s", label="measured (other)" if i == 0 else None)
        ax.annotate(r.name, (r.por * 100, r.speedup), fontsize=7, xytext=(-60, 6), textcoords="offset points")
    ax.set_xlabel("POR (%)")
    ax.set_ylabel("speedup over per-path baseline (x)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    model_args = (args.hidden, args.layers, args.vocab, args.heads, device, dtype)
    model = bench_model(*model_args)
    cost = CostModel.from_config(model.config)
    results = []
    for name, trees in _cases(args, args.vocab):
        print(f"{name}: {sum(t.num_path_tokens for t in trees):,} baseline tokens ...", flush=True)
        r = run_case(name, model, model_args, trees, args.capacity, args.repeats, args.backend, cost)
        print(
            f"  speedup {r.speedup:.2f}x of bound {r.flop_bound:.2f}x (efficiency {r.efficiency:.2f}), "
            f"max log-prob diff {r.max_logprob_diff:.1e}",
            flush=True,
        )
        results.append(r)
    print()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0
