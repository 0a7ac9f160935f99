"""What ``treetrain bench`` runs: synthetic trees, one training step per mode, the plain HF step,
timings, peak memory and FLOPs of a case (:func:`run_case` -> :class:`Result`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from treetrain.bench import noise
from treetrain.trees.flops import CostModel, baseline_work, recomputed_targets, tree_targets, tree_work
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree


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


def one_path_tree(length: int, vocab: int, seed: int = 0) -> TrajectoryTree:
    """One path: no sharing (bound 1), the case to compare with a plain Hugging Face step."""
    return TrajectoryTree.from_paths([np.random.default_rng(seed).integers(0, vocab, length)])


def _objective():
    """What ``treetrain train --objective sft`` runs: its micro-batches and its loss."""
    from treetrain.objectives.policy.config import Objective
    from treetrain.objectives.policy.training import PolicyObjective

    return PolicyObjective(Objective("sft", report_entropy=False))  # as a plain HF step: no entropy metric


ONE_PATH = -1  # a baseline budget for ``prepare`` / ``run_case``: every path its own forward


def prepare(mode: str, trees: list[TrajectoryTree], capacity: int) -> list:
    """The packed micro-batches ``mode`` runs (built before timing, as a data loader would);
    ``capacity=ONE_PATH`` (baseline only): one path per micro-batch, whatever their lengths."""
    return [pack(mb) for mb in micro_units(mode, trees, capacity)]


def micro_units(mode: str, trees: list[TrajectoryTree], capacity: int) -> list[list[TrajectoryTree]]:
    """The trees (parts, or single paths for ``sequence``) each of :func:`prepare`'s micro-batches
    packs, in order: what prices a micro-batch (``baseline_work(units[i])``)."""
    if capacity == ONE_PATH:
        assert mode == "sequence", mode
        longest = max(int(t.path_lengths.max()) for t in trees)
        return [[path] for mb in _objective().microbatches(trees, mode, longest) for path in mb]
    return _objective().microbatches(trees, mode, capacity)


def train_step(mode: str, model, trees, micro, backend: str | None) -> float:
    """One forward+backward of ``mode`` (``tree`` | ``sequence`` | ``hf``) over its prepared
    micro-batches, with the loss training runs (``TrainObjective.micro_loss``); returns the loss
    (SFT, token-mean over the trees' trained targets)."""
    objective = _objective()
    if mode == "hf":
        from treetrain.objectives.policy.aggregation import loss_normalizer

        return hf_step(model, trees, loss_normalizer(trees, objective.config))
    loss_fn = objective.micro_loss(trees, mode)
    total = 0.0
    for packed in micro:
        loss, _ = loss_fn(model, packed, backend=backend)
        loss.backward()
        total += float(loss.detach())
    return total


def hf_step(model, trees, normalizer: float) -> float:
    """Plain Hugging Face training on every path: ``model(input_ids, labels=...)`` (causal SDPA,
    full ``[L, vocab]`` logits, cross-entropy over the trained targets), one path per forward."""
    device = model.get_input_embeddings().weight.device
    total = 0.0
    for tree in trees:
        masks = tree.fields.get("loss_masks")
        for p in range(tree.num_paths):
            ids = torch.as_tensor(tree.path(p), device=device)[None]
            labels = ids.clone()
            if masks is not None:
                labels[0, torch.as_tensor(np.asarray(masks[p]) == 0, device=device)] = -100
            n = int((labels[0, 1:] != -100).sum())
            if n == 0:
                continue
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss * (n / normalizer)
            loss.backward()
            total += float(loss.detach())
    return total


def max_logprob_diff(model, trees, capacity: int, backend) -> float:
    """Largest |tree - baseline| per-path log-prob over every path (no grad, not timed)."""
    from treetrain.logprobs import path_logprobs
    from treetrain.objectives.baseline import baseline_path_logprobs
    from treetrain.trees.partition import pack_microbatches

    offsets = np.cumsum([0] + [t.num_paths for t in trees])
    # global path numbers, kept through partitioning (a shallow copy, no rebuild)
    tagged = [
        dataclasses.replace(t, path_ids=np.arange(t.num_paths) + offsets[k]) for k, t in enumerate(trees)
    ]
    with torch.no_grad():
        base = baseline_path_logprobs(model, trees, capacity=capacity, backend=backend)
        worst = 0.0
        for mb in pack_microbatches(tagged, capacity):
            ids = [int(i) for part in mb for i in part.path_ids]
            for i, lp in zip(ids, path_logprobs(model, pack(mb), backend=backend)):
                if lp.numel():
                    worst = max(worst, (lp.float() - base[i].float()).abs().max().item())
    return worst


def matmul_rate(dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    """The machine's dense matmul rate (FLOP/s) for ``dtype``: best of ``repeats`` square
    ``size x size`` products (best-of: the least disturbed by other load)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _child_peak(mode: str, model_args: tuple, trees, capacity: int, backend, factory=None) -> int:
    """In a fresh process: bytes the RSS high-water mark grows by during one step.

    The mark is reset first (``/proc/self/clear_refs``): a spawned child otherwise inherits the
    parent's mark through fork+exec.
    """
    model = (factory or bench_model)(*model_args)
    micro = prepare(mode, trees, capacity) if mode != "hf" else []
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_bytes()
    train_step(mode, model, trees, micro, backend)
    return max(0, _peak_rss_bytes() - before)


def peak_memory(mode: str, model, model_args: tuple, trees, capacity: int, backend, factory=None) -> int:
    """Peak memory of one step: CUDA allocator stats, or a fresh CPU process's RSS high-water mark.

    ``factory(*model_args)`` builds the model in that process (default :func:`bench_model`; an
    importable function: the process is spawned).

    On CPU one process cannot measure both modes: freed memory stays mapped, so whichever mode
    runs second would look free. Each mode runs once in its own spawned process instead.
    """
    if model.device.type == "cuda":
        micro = prepare(mode, trees, capacity) if mode != "hf" else []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model.zero_grad(set_to_none=True)
        train_step(mode, model, trees, micro, backend)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child_peak, (mode, model_args, trees, capacity, backend, factory))


@dataclass
class Result:
    name: str
    paths: int
    baseline_tokens: int
    tree_tokens: int  # distinct tokens of the trees
    computed_tokens: int  # what the tree mode runs (parts recompute shared prefixes)
    por: float
    flop_bound: float  # baseline FLOPs / tree FLOPs of what each computes
    baseline_s: float
    tree_s: float
    speedup: float
    efficiency: float  # speedup / flop_bound
    baseline_mfu: float
    tree_mfu: float
    hf_s: float | None  # plain HF step (one-path cases), else None
    tree_vs_hf: float | None  # tree time / HF time
    baseline_peak_mb: float | None  # --memory: a fresh process's RSS growth over one step
    tree_peak_mb: float | None
    max_logprob_diff: float
    loss_diff: float  # |tree loss - baseline loss| of the warm-up step (same weights)
    matmul_gflops: float = 0.0  # the dense matmul rate the MFUs use (the best of the run's and the case's)
    # noise (treetrain.bench.noise): the times above are the best of `repeats`; medians and spreads
    # ((max - min) / median) of the same repeats, the load during the case, and why not to trust it
    repeats: int = 0
    baseline_median_s: float = 0.0
    tree_median_s: float = 0.0
    speedup_median: float = 0.0
    baseline_spread: float = 0.0
    tree_spread: float = 0.0
    others_cores: float | None = None  # CPU other processes used during the case, in cores
    loadavg: float | None = None  # 1-minute load average at the end of the case
    steal: float | None = None
    untrusted: list[str] = dataclasses.field(default_factory=list)  # reasons; empty: none found
    # the most MiB of tensors alive at once during one step (treetrain.bench.measure.peak_bytes:
    # activations, gradients, logits; not the allocator's caching), and its ideal ratio: the
    # activation bound, baseline tokens / distinct tokens
    baseline_live_mb: float | None = None
    tree_live_mb: float | None = None
    activation_bound: float = 1.0
    # the baseline's micro-batch token budget: ``capacity``, or the fastest of ``baseline_capacities``
    # (``ONE_PATH``: one path per forward)
    baseline_capacity: int = 0


def step_line(label: str, r: int, rounds: int, seconds: float) -> str:
    """A progress line of round ``r`` (0: the warm-up) of ``rounds`` timed ones, e.g.
    ``step_line("tree", 1, 2, 74.7)`` is ``"tree step 2 of 3 (timed): 74.7 s"``."""
    return f"{label} step {r + 1} of {rounds + 1} ({'timed' if r else 'warm-up'}): {seconds:.1f} s"


def _timed(fn, device) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def case_flops(trees, capacity: int, cost: CostModel, vocab: int | None = None) -> tuple[float, float, int]:
    """(baseline FLOPs, tree FLOPs, tokens the tree mode computes) of one step. With ``vocab``, the
    head matmuls each mode recomputes in backward count too: a micro-batch whose scored targets'
    logits exceed ``treetrain.logprobs.LOGITS_KEEP_BYTES`` (e.g. over 1,767 targets at vocab 151,936)."""
    from dataclasses import replace

    from treetrain.logprobs import LOGITS_KEEP_BYTES
    from treetrain.trees.partition import partition

    parts = [p for t in trees for p in partition(t, capacity)]
    base, tree = baseline_work(trees, cost.vision_patch), tree_work(parts, cost.vision_patch)
    if vocab is not None:
        for mode, work in (("sequence", base), ("tree", tree)):
            per_call = [
                sum(tree_targets(u) for u in mb) for mb in _objective().microbatches(trees, mode, capacity)
            ]
            work = replace(work, recomputed=recomputed_targets(per_call, vocab, LOGITS_KEEP_BYTES))
            base, tree = (work, tree) if mode == "sequence" else (base, work)
    return base.flops(cost), tree.flops(cost), sum(p.num_tokens for p in parts)


def case_capacity(trees: list[TrajectoryTree], capacity: int) -> int:
    """The micro-batch budget both modes use on a case: ``capacity``, or the case's distinct tokens
    when fewer (then the tree mode runs one forward and the baseline's forwards are no larger).

    Per-token cost grows with the micro-batch on CPU (activations leave the caches: the baseline's
    8k-token forwards ran at MFU 0.66 where 4k-token ones ran at 0.77), so a budget far above the
    tree's size would charge the baseline for a choice a careful user would not make. Example:
    16 paths of 256 sharing 218 tokens, ``--capacity 4096``: the tree has 826 tokens, so both modes
    take micro-batches of at most 826 (the baseline: 3 paths, 768 tokens, per forward).
    """
    return max(1, min(capacity, sum(t.num_tokens for t in trees)))


def run_case(
    name,
    model,
    model_args,
    trees,
    capacity,
    repeats,
    backend,
    cost: CostModel,
    rate: float,
    memory: bool,
    matmul_size: int = 2048,
    factory=None,
    baseline_capacities: tuple[int, ...] = (),
    baseline_capacity: int | None = None,
    progress=None,
) -> Result:
    """One case: both modes (and a plain HF step on one-path cases) timed ``repeats`` times each,
    interleaved, after an untimed warm-up round; the load while they ran and the verdict on them.
    ``factory(*model_args)`` rebuilds the model for the peak-memory processes (:func:`peak_memory`).
    ``baseline_capacities``: other micro-batch budgets for the baseline alone (``ONE_PATH``: one
    path per forward), searched before the timed rounds (:func:`fastest_capacity`); the fastest is
    the baseline; ``baseline_capacity``: the baseline's budget, fixed, instead of ``capacity`` (no search
    without ``baseline_capacities``). ``progress``: called with a line after each step (long CPU runs:
    a step of the GUI-agent preset takes minutes), e.g. ``"baseline step 2 of 3 (timed): 368.6 s"``."""
    device = model.get_input_embeddings().weight.device
    capacity = case_capacity(trees, capacity)
    vocab = model.get_output_embeddings().weight.shape[0]
    base_flops, tree_flops, computed = case_flops(trees, capacity, cost, vocab)
    plain = all(t.num_paths == 1 and t.image_table is None for t in trees)  # hf_step: token ids only
    modes = ["sequence", "tree"] + (["hf"] if plain else [])
    base_cap = capacity if baseline_capacity is None else baseline_capacity
    if baseline_capacities:
        base_cap = fastest_capacity(
            model, trees, (capacity, *baseline_capacities), backend, device, progress=progress
        )
    budget = {"sequence": base_cap, "tree": capacity}
    micro = {m: prepare(m, trees, budget[m]) if m != "hf" else [] for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, float] = {}
    # the rate right before this case's steps: on a shared machine the load changes during a run
    rate = max(rate, matmul_rate(next(model.parameters()).dtype, device, matmul_size))
    monitor = noise.Monitor()
    for r in range(repeats + 1):  # the first round warms up and is not timed
        if r == 1:
            monitor.start()
        for mode in modes if r % 2 == 0 else modes[::-1]:  # interleaved: slow phases hit both modes
            model.zero_grad(set_to_none=True)
            dt, loss = _timed(lambda m=mode: train_step(m, model, trees, micro[m], backend), device)
            if progress is not None:
                progress(step_line("baseline" if mode == "sequence" else mode, r, repeats, dt))
            if r > 0:
                times[mode].append(dt)
            else:
                losses[mode] = loss
    load = monitor.stop() if repeats else None
    model.zero_grad(set_to_none=True)
    peaks = {
        m: peak_memory(m, model, model_args, trees, budget[m], backend, factory) / 2**20 if memory else None
        for m in ("sequence", "tree")
    }
    live = {m: live_peak_mb(m, model, trees, micro[m], backend) for m in ("sequence", "tree")}
    stats = {("baseline" if m == "sequence" else m): noise.summary(v) for m, v in times.items()}
    med = {m: min(v) for m, v in times.items()}
    tb, tt = med["sequence"], med["tree"]
    base_tok = sum(t.num_path_tokens for t in trees)
    tree_tok = sum(t.num_tokens for t in trees)
    bound = base_flops / tree_flops
    efficiency = (tb / tt) / bound
    return Result(
        repeats=repeats,
        baseline_median_s=stats["baseline"]["median"],
        tree_median_s=stats["tree"]["median"],
        speedup_median=stats["baseline"]["median"] / stats["tree"]["median"],
        baseline_spread=stats["baseline"]["spread"],
        tree_spread=stats["tree"]["spread"],
        others_cores=None if load is None else load.others_cores,
        steal=None if load is None else load.steal,
        loadavg=None if load is None else load.loadavg,
        untrusted=noise.verdict(stats, load, bound, efficiency),
        name=name,
        paths=sum(t.num_paths for t in trees),
        baseline_tokens=base_tok,
        tree_tokens=tree_tok,
        computed_tokens=computed,
        por=1 - tree_tok / base_tok,
        flop_bound=bound,
        baseline_s=tb,
        tree_s=tt,
        speedup=tb / tt,
        efficiency=efficiency,
        baseline_mfu=base_flops / tb / rate,
        tree_mfu=tree_flops / tt / rate,
        hf_s=med.get("hf"),
        tree_vs_hf=tt / med["hf"] if "hf" in med else None,
        baseline_peak_mb=peaks["sequence"],
        tree_peak_mb=peaks["tree"],
        baseline_live_mb=live["sequence"],
        tree_live_mb=live["tree"],
        activation_bound=base_tok / tree_tok,
        max_logprob_diff=max_logprob_diff(model, trees, capacity, backend),
        loss_diff=abs(losses["tree"] - losses["sequence"]),
        matmul_gflops=rate / 1e9,
        baseline_capacity=base_cap,
    )


def fastest_capacity(
    model, trees, capacities: tuple[int, ...], backend, device, rounds: int = 2, progress=None
) -> int:
    """The baseline's fastest micro-batch budget among ``capacities``: each timed ``rounds`` times
    after a warm-up step, interleaved, the best of each compared. Per-step loops on CPU (xLSTM, RWKV,
    KDA's torch scans) pay per step a cost that depends on how many paths a micro-batch stacks, and a
    matmul's rate depends on its rows (the LM head of a 151,936-token vocabulary), not only on FLOPs,
    so the budget a careful user would pick is measured, not assumed. A budget may exceed the tree's
    tokens (up to all paths in one forward): only the fastest is kept. Budgets that cut the same
    micro-batches are timed once.

    Example: ``fastest_capacity(model, [tree], (1026, ONE_PATH), None, cpu)`` is ``ONE_PATH`` when
    one path per forward runs faster than four packed in 1,026 tokens."""
    total = sum(t.num_path_tokens for t in trees)
    micro: dict[int, list] = {}
    for c in sorted({c if c == ONE_PATH else max(1, min(c, total)) for c in capacities}):
        mb = prepare("sequence", trees, c)
        shapes = [p.num_tokens for p in mb]
        if all([q.num_tokens for q in other] != shapes for other in micro.values()):
            micro[c] = mb  # budgets that cut the same micro-batches are timed once
    caps = list(micro)
    best = dict.fromkeys(caps, float("inf"))
    for r in range(rounds + 1):
        for c in caps if r % 2 == 0 else caps[::-1]:
            model.zero_grad(set_to_none=True)
            dt, _ = _timed(lambda c=c: train_step("sequence", model, trees, micro[c], backend), device)
            if r > 0:
                best[c] = min(best[c], dt)
            if progress is not None:
                budget = "one path per forward" if c == ONE_PATH else f"budget {c:,}"
                progress(step_line(f"baseline search, {budget},", r, rounds, dt))
    model.zero_grad(set_to_none=True)
    return min(caps, key=best.__getitem__)


def live_peak_mb(mode: str, model, trees, micro, backend) -> float:
    """MiB of tensors alive at once during one step of ``mode`` (:func:`treetrain.bench.measure.peak_bytes`),
    gradients freed before and after."""
    from treetrain.bench.measure import peak_bytes

    model.zero_grad(set_to_none=True)
    peak = peak_bytes(lambda: train_step(mode, model, trees, micro, backend), next(model.parameters()).device)
    model.zero_grad(set_to_none=True)
    return peak / 2**20


def bench_model(
    hidden: int,
    layers: int,
    vocab: int,
    heads: int,
    device,
    dtype,
    seed: int = 0,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int | None = None,
    path: str | None = None,
):
    """A random-init Qwen3-architecture model (no download), untied head; unless given: GQA 2:1,
    ``head_dim = hidden // heads``, MLP ``3 * hidden``. With ``path``, the pretrained model of that
    local directory instead (its own sizes; the others are ignored; a vision-language model whole,
    its vision tower too, as ``train`` loads it)."""
    import transformers

    if path is not None:
        from pathlib import Path

        from treetrain.train.build import is_vision_language

        vlm = is_vision_language(Path(path))
        auto = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return model.to(device)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2),
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
