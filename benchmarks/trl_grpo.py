"""A GRPO step's scoring, TRL's own vs ``TreeGRPOTrainer``: forward with gradients + backward, and
the no-grad scoring TRL runs for the old policy / reference.

One ``TreeGRPOTrainer`` (a ``trl.GRPOTrainer``) over a random-init Qwen3-shaped model; the batch is
TRL's padded layout for ``--prompts`` prompts of ``P`` tokens with ``G`` completions each, completion
lengths uniform in ``[C/2, C]`` (left-padded prompts, right-padded completions). The same batch goes
through ``GRPOTrainer._get_per_token_logps_and_entropies`` (TRL: one padded forward) and the
subclass's override (one tree forward per token budget), then ``backward`` of a GRPO-shaped loss
``-(A * logp * mask).sum() / mask.sum()``. Generation is not run: it is the same for all.
Modes are interleaved (the order reversed every round, so a slow phase of the machine hits each
alike); each time is the best of ``--repeats`` after a warm-up (the step least disturbed by other
load), with the median and the spread ``(max - min) / median`` beside it. The run measures its own
noise (``treetrain.bench.noise``: load before, other processes' CPU and steal during each case) and
marks a row NOT TRUSTWORTHY, with the reasons, when a spread exceeds 10% or the machine was busy.

Four modes, the same batch and the same GRPO-shaped loss:

- ``trl``: ``trl.GRPOTrainer``'s own scoring: one padded ``[rows, P + C]`` forward, its fused
  chunked LM head **on its best configuration**: scoring the completion positions only, as TRL runs
  it on CUDA (``compact``). On the CPU TRL as shipped scores *every* position (its device check
  ``_use_triton`` keeps tile shapes fixed for compilers such as Neuron's); :func:`trl_compact_head`
  lifts that check for the compaction alone (TRL's own torch tiles still run), which no TRL setting
  reaches. Nothing else in TRL's scoring is configurable that would help (one forward for the batch;
  fp32 on the CPU);
- ``trl-shipped``: the same, as shipped on this device (on the CPU: every position scored): its
  own column, never the baseline;
- ``per-path``: the library's per-path baseline (``treetrain.objectives.baseline``): every row alone, no
  padding, varlen-packed, the chunked head on the scored completion tokens only, entropies too; its
  micro-batch budget the faster of the tree's one forward and all rows in one (timed per case,
  :meth:`Case.search_per_path`: a matmul's rate depends on its rows, the forwards' count on it);
- ``tree``: ``TreeGRPOTrainer``'s override, each prompt once.

The bounds count what each mode computes (``treetrain.trees.flops``: decoder FLOPs per token run,
attention per pair computed, the LM head per target scored, x3 for forward + backward, one more head
matmul per target whose logits backward recomputes):

- TRL runs every padded position through the decoder; its padding mask makes SDPA compute the full
  ``L x L`` scores of every row (an explicit mask: no causal skip); its chunked head scores the
  completion positions (shipped on the CPU: every position) and always recomputes their logits in
  backward (found by counting the FLOPs each mode executes, ``--flops``);
- the per-path baseline: each row alone without padding, causal pairs, the head on scored targets;
- tree: distinct tokens; its head keeps its logits for backward up to 1 GiB, recomputes beyond.

``efficiency = speedup / bound``; a figure above 1.05 is flagged as work the bound does not price
(on the CPU, TRL as shipped runs ~18 elementwise passes over ``[positions, vocab]`` logits per
scored position, ``--flops`` counts them), never as a speedup.

Memory: each mode's peak of live tensors during one step (``treetrain.bench.measure.peak_bytes``)
beside the activation bound, path tokens / tree tokens.

Usage::

    python benchmarks/trl_grpo.py --quick   # small CPU check (P=256, G=4, C=32)
    python benchmarks/trl_grpo.py --preset small --write        # the CPU grid (QUIET_RUNS.md)
    python benchmarks/trl_grpo.py --preset qwen3-0.6b --write   # a real vocabulary and depth
    python benchmarks/trl_grpo.py --preset small --estimate     # run time from FLOPs, no run
    python benchmarks/trl_grpo.py --quick --flops               # counted vs modeled FLOPs (no timing)
    python benchmarks/trl_grpo.py --model qwen3-0.6b --generation --write  # full sweep, a GPU

``--generation`` also times sampling the completions (HF ``generate``), reported in its own column.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODEL_SHAPES,
    add_allocator_flag,
    block_rule_line,
    estimate_line,
    flop_audit_table,
    judge,
    machine_before,
    noise_section,
    provenance,
    result_path,
    timed,
    use_allocator,
)

from treetrain.bench import noise  # noqa: E402
from treetrain.integrations.flat import FlatBatch  # noqa: E402
from treetrain.trees.flops import CostModel, Work, baseline_pairs, path_targets, tree_pairs  # noqa: E402

MODELS = MODEL_SHAPES  # tiny (the tests' smoke runs), small, qwen3-0.6b, smollm2-135m
# (P, G, C, prompts) per preset, with the model and repeats; run times in benchmarks/QUIET_RUNS.md
PRESETS = {
    "quick": dict(model="small", cases=[(256, 4, 32, 1)], repeats=5),
    "small": dict(
        model="small",
        cases=[(1024, 8, 64, 1), (2048, 16, 64, 1), (1024, 16, 256, 1), (2048, 8, 256, 1), (1024, 8, 64, 2)],
        repeats=3,
    ),
    "smollm2-135m": dict(model="smollm2-135m", cases=[(512, 4, 64, 1)], repeats=3),
    "qwen3-0.6b": dict(model="qwen3-0.6b", cases=[(256, 4, 64, 1)], repeats=2),
}
# FLOP/s of these steps on the quiet 2-core AMD EPYC (what --estimate divides by; see verl_engine.RATES)
RATES = {"tiny": 20e9, "small": 100e9, "smollm2-135m": 120e9, "qwen3-0.6b": 150e9}
LOGITS_KEEP_BYTES = 2**30  # treetrain.logprobs.LOGITS_KEEP_BYTES: the tree's head keeps logits up to this


@contextlib.contextmanager
def trl_compact_head(on: bool = True):
    """TRL's fused LM head scoring only the labelled positions (what it does on CUDA, ``compact``) on
    any device: ``trl.trainer.utils._use_triton`` decides the compaction alone (the tile folds still
    run TRL's torch code: ``trl.kernels.chunked_logprob`` has its own ``_use_triton``)."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._use_triton
    if on:
        trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = saved


def qwen3(model_name: str, device: str, dtype: torch.dtype, seq_cls: bool = False, **config):
    """A random-init Qwen3 of ``MODELS[model_name]`` (SDPA), causal LM or one-label sequence classifier."""
    cfg = transformers.Qwen3Config(
        **MODELS[model_name], max_position_embeddings=32768, tie_word_embeddings=False, **config
    )
    torch.manual_seed(0)
    auto = transformers.AutoModelForSequenceClassification if seq_cls else transformers.AutoModelForCausalLM
    if seq_cls:
        cfg.num_labels = 1
    return auto.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device), cfg


def online_trainer(kind: str, model, group: int, device: str, dtype: torch.dtype, workdir: str, **config):
    """``TreeGRPOTrainer`` or ``TreeRLOOTrainer`` (``kind``: GRPO | RLOO) over ``model``: a word-level
    tokenizer, ``group`` samples of one prompt, ``config``: more ``GRPOConfig``/``RLOOConfig`` options
    (generation is not run)."""
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    from treetrain.integrations import trl as tree_trl

    tk = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    args = getattr(trl, f"{kind}Config")(
        output_dir=workdir, per_device_train_batch_size=group, num_generations=group, report_to="none",
        use_cpu=device == "cpu", bf16=dtype == torch.bfloat16, max_completion_length=8, **config,
    )  # fmt: skip
    return getattr(tree_trl, f"Tree{kind}Trainer")(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * group}), processing_class=tok,
    )  # fmt: skip


def make_trainer(model_name: str, device: str, dtype: torch.dtype, group: int, workdir: str):
    model, cfg = qwen3(model_name, device, dtype)
    return online_trainer("GRPO", model, group, device, dtype, workdir), cfg


def make_batch(prompts: int, P: int, G: int, C: int, vocab: int, seed: int):
    """TRL's layout: ``ids, mask [N*G, P + C]``, completion mask ``[N*G, C]``."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * G
    ids = torch.zeros(rows, P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for n in range(prompts):
        prompt = torch.randint(3, vocab, (P,), generator=g)
        for j in range(G):
            r = n * G + j
            length = int(torch.randint(C // 2, C + 1, (1,), generator=g))
            ids[r, :P], mask[r, :P] = prompt, 1
            ids[r, P : P + length] = torch.randint(3, vocab, (length,), generator=g)
            mask[r, P : P + length] = 1
    return ids, mask, mask[:, P:].clone()


def bounds(ids, mask, C, cfg, device: str, micro_targets: list[int] | None = None) -> dict:
    """Work, training FLOPs and bounds of one batch (see the module docstring for what each mode
    computes): ``{"work", "flops", "bound", "bound_trl", "bound_shipped", "bound_nograd", ...}``.
    ``micro_targets``: the per-path baseline's scored targets per micro-batch (its head recomputes
    a micro-batch's logits beyond 1 GiB); None: one micro-batch."""
    from treetrain.trees.flops import recomputed_targets

    tree = FlatBatch.build(ids, mask, logits_to_keep=C).tree
    cost = CostModel.from_config(cfg)
    rows, L = ids.shape
    V = cfg.vocab_size
    scored = int(mask[:, -C:].sum())
    every = scored if device == "cuda" else rows * (L - 1)  # TRL's head as shipped on this device
    padded = dict(tokens=rows * L, pairs=rows * L * L)
    work = {
        "trl": Work(**padded, targets=scored, recomputed=scored),
        "trl_shipped": Work(**padded, targets=every, recomputed=every),
        "per_path": Work(
            tokens=tree.num_path_tokens, pairs=baseline_pairs(tree), targets=scored,
            recomputed=recomputed_targets(micro_targets or [scored], V, LOGITS_KEEP_BYTES),
        ),
        "tree": Work(tokens=tree.num_tokens, pairs=tree_pairs(tree), targets=scored,
                     recomputed=recomputed_targets([scored], V, LOGITS_KEEP_BYTES)),
    }  # fmt: skip
    f = {k: w.flops(cost) for k, w in work.items()}
    return {
        "work": work,
        "flops": f,
        "bound_trl": f["trl"] / f["tree"],
        "bound_shipped": f["trl_shipped"] / f["tree"],
        "bound": f["per_path"] / f["tree"],
        "bound_nograd": work["trl"].forward_flops(cost) / work["tree"].forward_flops(cost),
        "path_tokens": tree.num_path_tokens,
        "tree_tokens": tree.num_tokens,
    }


def per_path_trees(ids, mask, C: int):
    """Every row alone as a one-path tree (its real tokens, no padding), completions trained."""
    from treetrain import TrajectoryTree

    trees = []
    for r in range(ids.shape[0]):
        real = mask[r].bool()
        toks = ids[r][real].cpu().numpy()
        loss = torch.zeros(ids.shape[1], dtype=torch.float32)
        loss[-C:] = 1.0
        trees.append(TrajectoryTree.from_paths([toks], loss_masks=[loss[real.cpu()].numpy()]))
    return trees


def generation_time(model, ids, P: int, C: int, device: str) -> float:
    """Seconds to sample ``C`` new tokens for every row from its prompt (HF generate; the same for
    both modes, reported beside the scoring, never added to it)."""
    with torch.no_grad():
        return timed(
            lambda: model.generate(
                ids[:, :P], attention_mask=torch.ones_like(ids[:, :P]), do_sample=True, max_new_tokens=C,
                min_new_tokens=C, pad_token_id=0, eos_token_id=None,
            ),
            device,
        )  # fmt: skip


class Case:
    """One case's batch, its bounds and a step function per mode (built before any clock starts)."""

    def __init__(self, trainer, P, G, C, prompts, device, seed=0):
        from trl import GRPOTrainer

        from treetrain.objectives.baseline import sequence_microbatches
        from treetrain.objectives.policy.aggregation import loss_normalizer
        from treetrain.objectives.policy.config import Objective
        from treetrain.objectives.policy.loss import compute_loss
        from treetrain.trees.packing import pack

        self.P, self.G, self.C, self.prompts, self.device = P, G, C, prompts, device
        model = self.model = trainer.model
        ids, mask, comp_mask = make_batch(prompts, P, G, C, model.config.vocab_size, seed)
        ids, mask, comp_mask = ids.to(device), mask.to(device), comp_mask.to(device)
        self.ids, self.mask = ids, mask
        adv = torch.randn(ids.shape[0], 1, device=device)
        trees = per_path_trees(ids, mask, C)
        tree_tokens = FlatBatch.build(ids.cpu(), mask.cpu(), logits_to_keep=C).tree.num_tokens
        sft, norm = Objective("sft"), loss_normalizer(trees, Objective("sft"))
        # the per-path baseline's micro-batch budgets, searched per case (run_case keeps the fastest):
        # the tree's one forward (on CPU the cost per token grows with the forward's size) and every row
        # in one forward (a matmul's rate grows with its rows: the head of a large vocabulary)
        budgets = {max(tree_tokens, max(t.num_tokens for t in trees)), sum(t.num_tokens for t in trees)}
        self.per_path = {}
        for budget in sorted(budgets):
            parts = sequence_microbatches(trees, budget)
            self.per_path[budget] = (
                [pack(mb) for mb in parts],
                [sum(path_targets(t) for t in mb) for mb in parts],
            )
        self.bounds_for = lambda budget: bounds(ids.cpu(), mask.cpu(), C, model.config, device,
                                                self.per_path[budget][1])  # fmt: skip
        self.budget = min(self.per_path)
        self.bounds = self.bounds_for(self.budget)
        trl_score = lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k)  # noqa: E731
        self.scores = {
            "trl": trl_score,
            "trl_shipped": trl_score,
            "tree": trainer._get_per_token_logps_and_entropies,
        }

        def step(mode):
            def run():
                with trl_compact_head(mode == "trl"):
                    lp, _, _ = self.scores[mode](model, ids, mask, C, compute_entropy=True)
                    loss = -(adv * lp * comp_mask).sum() / comp_mask.sum()
                    loss.backward()
                model.zero_grad(set_to_none=True)

            return run

        def per_path_step(budget=None):  # the same head (entropies too) on the same scored targets
            for packed in self.per_path[budget or self.budget][0]:
                compute_loss(model, packed, sft, norm, backend=trainer.tree_backend)[0].backward()
            model.zero_grad(set_to_none=True)

        def nograd(mode):
            def run():
                with torch.no_grad(), trl_compact_head(mode == "trl"):
                    self.scores[mode](model, ids, mask, C, batch_size=G)

            return run

        self.steps = {m: step(m) for m in ("trl", "trl_shipped", "tree")} | {"per_path": per_path_step}
        self.nograd = {m: nograd(m) for m in ("trl", "tree")}

    def search_per_path(self, rounds: int = 2) -> None:
        """Keep the per-path baseline's fastest budget: each timed ``rounds`` times after a warm-up
        step, interleaved (``self.budget``, ``self.bounds`` follow)."""
        if len(self.per_path) == 1:
            return
        best = dict.fromkeys(self.per_path, float("inf"))
        for r in range(rounds + 1):
            for budget in list(best) if r % 2 == 0 else list(best)[::-1]:
                t = timed(lambda b=budget: self.steps["per_path"](b), self.device)
                best[budget] = min(best[budget], t) if r else best[budget]
        self.budget = min(best, key=best.get)
        self.bounds = self.bounds_for(self.budget)


def add_verdicts_and_peaks(row: dict, untrusted: list[str], checks: dict, case, dev, memory: bool) -> None:
    """``row["untrusted"]``: ``untrusted`` plus the verdict on each efficiency ``checks`` names (key ->
    what it compares) that ``row`` holds; ``row["peak"]``: each mode's peak MiB (``memory``), else {}."""
    for key, what in checks.items():
        if key in row:
            untrusted += [f"{what}: {x}" for x in noise.verdict({}, efficiency=row[key])]
    row["untrusted"] = untrusted
    row["peak"] = {}
    if memory:
        from treetrain.bench.measure import peak_bytes

        row["peak"] = {m: peak_bytes(case.steps[m], dev) / 2**20 for m in ("trl", "per_path", "tree")}


def run_case(case: Case, repeats, generation=False, shipped=True, memory=True) -> dict:
    """``repeats`` rounds of every mode interleaved (order alternating) after a warm-up round, each
    step followed by the no-grad scoring of TRL and the tree; then one step of each for its peak
    memory. Times are each mode's best; the verdict lists the reasons not to trust them."""
    dev = case.device
    case.search_per_path()
    runs = {m: f for m, f in case.steps.items() if shipped or m != "trl_shipped"}
    times = {k: [] for k in (*runs, "trl_nograd", "tree_nograd")}
    monitor = noise.Monitor()
    for r in range(repeats + 1):
        if r == 1:  # the first round is the warm-up
            monitor.start()
        for m in list(runs) if r % 2 == 0 else list(runs)[::-1]:  # interleaved, order alternating
            try:
                t_step = timed(runs[m], dev)
                t_ng = timed(case.nograd[m], dev) if m in case.nograd else None
            except torch.OutOfMemoryError:
                return {"P": case.P, "G": case.G, "C": case.C, "prompts": case.prompts, "oom": m}
            if r:
                times[m].append(t_step)
                if t_ng is not None:
                    times[m + "_nograd"].append(t_ng)
    load = monitor.stop() if repeats else None
    stats, untrusted = judge({k: v for k, v in times.items() if k in runs}, load)
    best = {k: min(v) for k, v in times.items()}
    b = case.bounds
    speed, speed_pp = best["trl"] / best["tree"], best["per_path"] / best["tree"]
    row = {
        "P": case.P, "G": case.G, "C": case.C, "prompts": case.prompts, "rows": case.ids.shape[0],
        "path_tokens": b["path_tokens"], "tree_tokens": b["tree_tokens"], "trl_step": best["trl"],
        "per_path_step": best["per_path"], "tree_step": best["tree"], "speedup": speed,
        "bound_trl": b["bound_trl"], "efficiency_trl": speed / b["bound_trl"], "speedup_per_path": speed_pp,
        "bound": b["bound"], "efficiency": speed_pp / b["bound"], "per_path_budget": case.budget,
        "per_path_micro": len(case.per_path[case.budget][0]),
        "nograd_speedup": best["trl_nograd"] / best["tree_nograd"], "bound_nograd": b["bound_nograd"],
        "repeats": repeats, "speedup_median": stats["trl"]["median"] / stats["tree"]["median"],
        "spread": {m: st["spread"] for m, st in stats.items()},
        "others_cores": None if load is None else load.others_cores,
    }  # fmt: skip
    row["efficiency_nograd"] = row["nograd_speedup"] / b["bound_nograd"]
    if shipped:
        row["shipped_step"] = best["trl_shipped"]
        row["speedup_shipped"] = best["trl_shipped"] / best["tree"]
        row["bound_shipped"] = b["bound_shipped"]
        row["efficiency_shipped"] = row["speedup_shipped"] / b["bound_shipped"]
    checks = {"efficiency_trl": "vs TRL", "efficiency": "vs per-path", "efficiency_nograd": "no-grad vs TRL"}
    checks["efficiency_shipped"] = "vs TRL as shipped"
    add_verdicts_and_peaks(row, untrusted, checks, case, dev, memory)
    row["generate"] = generation_time(case.model, case.ids, case.P, case.C, dev) if generation else None
    return row


def flop_audit(case: Case) -> list[dict]:
    """Per mode: the FLOPs one step executes (``FlopCounterMode``) vs the bound's model of it."""
    from treetrain.bench.measure import count_flops

    cost = CostModel.from_config(case.model.config)
    out = []
    for mode, step in case.steps.items():
        w = case.bounds["work"][mode]
        model = {"linear": 3 * w.tokens * cost.linear, "attention": 3 * w.pairs * cost.per_pair,
                 "head": (3 * w.targets + w.recomputed) * cost.head}  # fmt: skip
        counted = count_flops(step, vocab=case.model.config.vocab_size)
        out.append({"case": case_name(case.__dict__), "mode": mode, "counted": counted, "model": model})
    return out


HEAD = (
    "| P | G | C | prompts | path tok | tree tok | TRL s | per-path s (forwards) | tree s "
    "| vs TRL: speedup / bound / efficiency | median speedup vs TRL (spread TRL/per-path/tree) "
    "| vs per-path: speedup / bound / efficiency | no-grad vs TRL: speedup / bound "
    "| vs TRL as shipped: s, speedup / bound | peak MiB TRL / per-path / tree "
    "| memory TRL / tree (activation bound) | generate s (apart) | timings |\n|" + "---|" * 18
)


def case_name(r: dict) -> str:
    return f"P={r['P']} G={r['G']} C={r['C']} x{r['prompts']}"


def table(rows: list[dict], head: bool = True) -> str:
    """Markdown rows (with the header unless ``head=False``: rows printed as they come)."""
    lines = [HEAD] if head else []
    for r in rows:
        if "oom" in r:
            lines.append(
                f"| {r['P']} | {r['G']} | {r['C']} | {r['prompts']} | OOM in {r['oom']} |" + " |" * 13
            )
            continue
        spread = "/".join(f"{r['spread'][m]:.0%}" for m in ("trl", "per_path", "tree"))
        trust = f"NOT TRUSTWORTHY ({len(r['untrusted'])} reasons below)" if r["untrusted"] else "ok"
        pk = r["peak"]
        peak = " / ".join(f"{pk[m]:.0f}" for m in ("trl", "per_path", "tree")) if pk else "-"
        mem = f"{pk['trl'] / pk['tree']:.2f} ({r['path_tokens'] / r['tree_tokens']:.2f})" if pk else "-"
        shipped = (
            "-"
            if "shipped_step" not in r
            else (f"{r['shipped_step']:.3f}, {r['speedup_shipped']:.2f}x / {r['bound_shipped']:.2f}x")
        )
        lines.append(
            f"| {r['P']} | {r['G']} | {r['C']} | {r['prompts']} | {r['path_tokens']} | {r['tree_tokens']} | "
            f"{r['trl_step']:.3f} | {r['per_path_step']:.3f} ({r.get('per_path_micro', '?')} fwd) | "
            f"{r['tree_step']:.3f} | "
            f"{r['speedup']:.2f}x / {r['bound_trl']:.2f}x / **{r['efficiency_trl']:.2f}** | "
            f"{r['speedup_median']:.2f}x ({spread}) | "
            f"{r['speedup_per_path']:.2f}x / {r['bound']:.2f}x / **{r['efficiency']:.2f}** | "
            f"{r['nograd_speedup']:.2f}x / {r['bound_nograd']:.2f}x | {shipped} | {peak} | {mem} | "
            f"{'-' if r['generate'] is None else format(r['generate'], '.2f')} | {trust} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "oom" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, bound, title) in zip(
        axes,
        [
            ("speedup", "bound_trl", "vs trl.GRPOTrainer as shipped"),
            ("speedup_per_path", "bound", "vs the per-path baseline (no padding)"),
        ],
    ):
        for G, C in sorted({(r["G"], r["C"]) for r in ok}):
            sel = sorted((r for r in ok if (r["G"], r["C"]) == (G, C)), key=lambda r: r["P"])
            P = [r["P"] for r in sel]
            (line,) = ax.plot(P, [r[key] for r in sel], "o-", label=f"G={G}, C={C}")
            ax.plot(P, [r[bound] for r in sel], "--", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel("speedup (dashed: FLOP bound)")
        ax.set_title(f"GRPO scoring + backward: tree {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _case(text: str) -> tuple[int, int, int, int]:
    try:
        parts = [int(x) for x in text.split(":")]
        assert len(parts) in (3, 4)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"a case is P:G:C or P:G:C:prompts, e.g. 1024:8:64; got {text!r}"
        ) from None
    return (*parts, 1) if len(parts) == 3 else tuple(parts)


def estimate(args, cases) -> float:
    """Seconds the run would take from its FLOPs (no model built): per case ``repeats + 1`` rounds of
    every mode with the no-grad scorings (forward only), and a memory step of three modes."""
    cfg = transformers.Qwen3Config(**MODELS[args.model])
    cost = CostModel.from_config(cfg)
    total = 0.0
    for P, G, C, prompts in cases:
        ids, mask, _ = make_batch(prompts, P, G, C, cfg.vocab_size, 0)
        b = bounds(ids, mask, C, cfg, args.device)
        f, w = b["flops"], b["work"]
        modes = ["trl", "per_path", "tree"] + (["trl_shipped"] if not args.no_shipped else [])
        per_round = sum(f[m] for m in modes) + w["trl"].forward_flops(cost) + w["tree"].forward_flops(cost)
        flops = (args.repeats + 1) * per_round + (
            0 if args.no_memory else f["trl"] + f["per_path"] + f["tree"]
        )
        total += flops
        print(f"  {case_name(dict(P=P, G=G, C=C, prompts=prompts))}: {flops / 1e12:.1f} TFLOP, "
              f"{flops / args.rate:.0f} s", flush=True)  # fmt: skip
    return total / args.rate


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/trl_grpo.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model, cases and repeats")
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--completion-lens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per batch (rows = prompts x G)")
    ap.add_argument("--cases", type=_case, nargs="+", metavar="P:G:C[:prompts]", help="instead of the grid")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="--preset quick: P=256, G=4, C=32, 5 repeats")
    ap.add_argument("--generation", action="store_true", help="also time sampling C tokens (reported apart)")
    ap.add_argument("--no-shipped", action="store_true", help="skip the column of TRL as shipped")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step of each mode")
    ap.add_argument("--flops", action="store_true", help="only count each mode's FLOPs vs the bound's model")
    ap.add_argument("--estimate", action="store_true", help="only print the run time estimated from FLOPs")
    ap.add_argument("--rate", type=float, default=None, help="FLOP/s for --estimate (default: RATES)")
    ap.add_argument("--write", action="store_true", help="write the table and plot to benchmarks/results/")
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    preset = PRESETS["quick" if args.quick else args.preset] if (args.quick or args.preset) else {}
    args.model = args.model or preset.get("model", "small")
    args.repeats = args.repeats if args.repeats is not None else preset.get("repeats", 3)
    grid = args.cases or preset.get("cases") or [
        (P, G, C, args.prompts) for G in args.groups for C in args.completion_lens for P in args.prompt_lens
    ]  # fmt: skip
    if args.estimate:
        args.rate = args.rate or RATES[args.model]
        print(estimate_line(Path(__file__).name, argv, estimate(args, grid), args.rate))
        return []
    if argv is None:  # this process is the command: it may re-execute itself under tcmalloc
        use_allocator(args, args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    before = machine_before()
    if not args.flops:
        print(HEAD, flush=True)  # then each row as it is measured
    rows, audit = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for G in dict.fromkeys(g for _, g, _, _ in grid):
            trainer, _ = make_trainer(args.model, args.device, dtype, G, workdir)
            for P, _, C, prompts in (c for c in grid if c[1] == G):
                case = Case(trainer, P, G, C, prompts, args.device)
                if args.flops:
                    audit += flop_audit(case)
                    continue
                rows.append(
                    run_case(case, args.repeats, args.generation, not args.no_shipped, not args.no_memory)
                )
                print(table(rows[-1:], head=False), end="", flush=True)
            del trainer
    stamp = f"{provenance(__file__, argv, args.device)}; {block_rule_line()}\n\n"
    if args.flops:
        text = f"# GRPO scoring + backward: FLOPs executed vs the bound's model ({args.model}, {dtype})\n\n"
        text += stamp + flop_audit_table(audit, "the optimizer, and the tree's index bookkeeping")
        print(text)
    else:
        notes = noise_section(before, [(case_name(r), r.get("untrusted", [])) for r in rows])
        print("\n" + notes, end="")  # the rows are printed above, as they came
        text = (
            f"# GRPO scoring + backward: TreeGRPOTrainer vs trl.GRPOTrainer ({args.model}, {dtype})\n\n"
            + stamp + table(rows) + "\n" + notes
        )  # fmt: skip
    if args.write:
        md = result_path(f"trl_grpo_{'flops_' if args.flops else ''}{args.model}", args.device)
        md.write_text(text)
        if not args.flops:
            plot(rows, md.with_suffix(".png"))
        print(f"wrote {md}" + ("" if args.flops else f" and {md.with_suffix('.png')}"))
    return rows if not args.flops else audit


if __name__ == "__main__":
    main()
