"""A GRPO ``train_batch`` in verl: verl's own FSDP2 engine, in its fastest configuration per case and
as configured by default, vs treetrain's (``strategy=treetrain``).

One process (world size 1), one random-init Qwen3-architecture model saved to a temporary folder and
loaded by both engines through verl's own config classes. The batch is verl's: ``prompts`` prompts
of ``P`` tokens with ``n`` sampled responses each, response lengths uniform in ``[C/2, C]``, padded
as a rollout and converted by ``verl.workers.utils.padding.left_right_2_no_padding`` as verl's
trainer does. Each engine runs ``train_batch`` with ``verl.workers.utils.losses.ppo_loss`` (GRPO:
one advantage per sample, token-mean, no entropy term): forward, backward, optimizer step.

verl's configurations (:func:`verl_configs`), the micro-batching a verl user chooses:

- ``1 row``, ``2 rows``, ``4 rows``: ``use_dynamic_bsz`` with ``max_token_len_per_gpu`` = that many
  times the longest row (verl's own ``prepare_micro_batches`` cuts them);
- ``packed``: all rows in one micro-batch;
- ``padded``: ``use_remove_padding=False``, all rows in one ``[rows, longest]`` padded micro-batch;
- ``default`` (its own column, never the baseline): verl's shipped settings, ``use_dynamic_bsz``
  with ``ppo_max_token_len_per_gpu = 16384`` (actor.yaml; its ``use_dynamic_bsz: false`` needs a
  micro-batch size that has no default), ``use_remove_padding=True`` (hf_model.yaml) and, on the
  CPU, the log-probs verl picks there (``logprobs_from_logits_v2``, a loop of one ``logsumexp`` per
  token; the other configurations run verl's vectorised ``logprobs_from_logits_naive``, the CPU's
  stand-in for the fused CUDA kernel, see :func:`use_verl_logprobs`).

Per case every configuration whose FLOPs are within ``--screen-flops`` (1.5x) of the least is timed
once (after a warm-up step of each engine); the fastest is verl's baseline. A configuration over
that cannot be the fastest unless per-micro-batch overheads exceed a third of the step (packing 16
rows of 4k tokens on the CPU scores 16x the pairs and would not fit in memory), and is reported as
skipped with its FLOP ratio. Then the tree, verl's fastest and verl's default run ``--repeats``
rounds interleaved (order alternating) after a warm-up round, under ``treetrain.bench.noise``.

The bound counts what each engine computes (``treetrain.trees.flops``: decoder FLOPs per token run,
attention per query-key pair computed, the LM head per position scored; x3 for forward + backward),
per configuration (:func:`verl_work`):

- verl: every row token through the decoder and the head (log-probs at every position); a padded
  micro-batch every padded position; attention pairs per micro-batch: a row's causal pairs
  ``L (L + 1) / 2`` on CUDA (flash-attention varlen) and for a one-row micro-batch on the CPU (SDPA's
  causal kernel), all ``N^2`` for a packed CPU micro-batch (SDPA with transformers' block-diagonal
  mask), ``rows x L^2`` for a padded one (SDPA with a padding mask);
- tree: the distinct tokens; the tree's allowed pairs; the head once per distinct (context, label);
- both: verl's default activation checkpointing (``enable_gradient_checkpointing``), which backward
  pays as one more forward of every decoder layer but its MLP's down projection (``--flops``
  counted it: the decoder's matmuls at 3.78 passes, not 3, on the tiny model).

``--flops`` checks that model against the FLOPs each step executes (``FlopCounterMode``, no timing:
valid on a loaded machine). Per-micro-batch overheads (FSDP hooks, Python) are time, not FLOPs: the
baseline is the measured fastest configuration and the bound the FLOPs of that configuration; an
efficiency above 1.05 is flagged as work the bound does not price, not a speedup.

Memory: each mode's peak of live tensors during one step (``treetrain.bench.measure.peak_bytes``,
allocator-independent) beside the activation bound, row tokens / tree tokens.

Usage::

    python benchmarks/verl_engine.py --quick                       # a CPU check (P=256, n=4, C=32)
    python benchmarks/verl_engine.py --preset small --write         # the CPU grid (QUIET_RUNS.md)
    python benchmarks/verl_engine.py --preset smollm2-135m --write  # a real vocabulary and depth
    python benchmarks/verl_engine.py --cases 1024:8:64 4096:16:512:2 --write  # P:n:C[:prompts]
    python benchmarks/verl_engine.py --preset small --estimate      # run time from FLOPs, no run
    python benchmarks/verl_engine.py --quick --model tiny --flops   # counted vs modeled FLOPs
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODEL_SHAPES,
    add_allocator_flag,
    block_rule_line,
    estimate_line,
    hardware,
    judge,
    machine_before,
    noise_section,
    result_path,
    timed,
    use_allocator,
)

from treetrain.bench import noise  # noqa: E402

MODELS = MODEL_SHAPES  # tiny (the tests' smoke runs), small, qwen3-0.6b, smollm2-135m

# (P, n, C, prompts) per preset, with the model and repeats; run times in benchmarks/QUIET_RUNS.md
PRESETS = {
    "quick": dict(model="small", cases=[(256, 4, 32, 1)], repeats=2),
    "small": dict(
        model="small",
        cases=[(1024, 8, 64, 1), (4096, 8, 64, 1), (1024, 8, 512, 1), (1024, 16, 64, 1), (1024, 16, 512, 1)]
        + [(4096, 16, 512, 1), (1024, 8, 256, 4), (2048, 8, 128, 2)],  # the last two: several prompts
        repeats=3,
    ),
    "smollm2-135m": dict(model="smollm2-135m", cases=[(1024, 4, 128, 1), (512, 4, 64, 2)], repeats=3),
    # two engines of 0.75B float32 parameters with AdamW need ~20 GB: off the 24 GB machine's runbook
    "qwen3-0.6b": dict(model="qwen3-0.6b", cases=[(512, 4, 64, 1)], repeats=2),
}
DEFAULT_TOKENS = 16384  # actor.yaml's ppo_max_token_len_per_gpu
SCREEN_FLOPS = 1.5  # configurations over this multiple of the least FLOPs are not timed
# FLOP/s of these training steps on the quiet 2-core AMD EPYC (small: the 2026-11-25 grid's verl steps,
# 93-106 GFLOP/s; the deeper shapes from treetrain bench's mid preset, MFU 0.83 of 195 GFLOP/s, less
# for SmolLM2's narrower matmuls): what --estimate divides by
RATES = {"tiny": 20e9, "small": 100e9, "smollm2-135m": 120e9, "qwen3-0.6b": 150e9}


def build_engines(path: str, device: str):
    """verl's ``FSDPEngineWithLMHead`` and treetrain's, same model folder, same configs."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    attn = "sdpa" if device == "cpu" else "flash_attention_2"
    engines = {}
    for mode in ("verl", "tree"):
        mc = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": attn})
        ec = FSDPEngineConfig(
            strategy="fsdp2",
            use_torch_compile=device != "cpu",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
            if device == "cpu"
            else None,  # verl's default on GPUs: bf16 parameters, fp32 reduction
        )
        args = (mc, ec, FSDPOptimizerConfig(lr=1e-6, total_training_steps=10**6), CheckpointConfig())
        if mode == "tree":
            object.__setattr__(ec, "strategy", "treetrain")  # as verl's actor config syncs its strategy
            engine = EngineRegistry.new("language_model", "treetrain", *args)
        else:
            engine = FSDPEngineWithLMHead(*args)
        engine.initialize()
        engines[mode] = engine
    return engines


def make_batch(
    prompts: int, P: int, n: int, C: int, vocab: int, budget: int | None = None, seed: int = 0,
    remove_padding: bool = True,
):  # fmt: skip
    """verl's no-padding ``TensorDict`` for ``prompts x n`` rows, and the rows' token lists.

    ``budget``: ``max_token_len_per_gpu`` (None: all of the batch's tokens, one micro-batch);
    ``remove_padding``: verl's ``use_remove_padding`` (False: each micro-batch padded to its longest)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    B = prompts * n
    prompt_ids = torch.randint(1, vocab, (prompts, P), generator=g).repeat_interleave(n, 0)
    lens = torch.randint(C // 2, C + 1, (B,), generator=g)
    responses = torch.randint(1, vocab, (B, C), generator=g)
    rmask = (torch.arange(C)[None] < lens[:, None]).long()
    responses = responses * rmask
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), rmask], 1)
    adv = torch.randn(B, 1, generator=g).expand(B, C) * rmask
    td = TensorDict(
        dict(prompts=prompt_ids, responses=responses, input_ids=torch.cat([prompt_ids, responses], 1),
             attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
             response_mask=rmask, old_log_probs=-2.0 * rmask.float(), advantages=adv.contiguous()),
        batch_size=[B],
    )  # fmt: skip
    td = left_right_2_no_padding(td)
    budget = int(attention.sum()) if budget is None else budget
    meta = dict(
        temperature=1.0, global_batch_size=B, use_remove_padding=remove_padding, calculate_entropy=False
    )
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget, **meta)
    rows = [torch.cat([prompt_ids[b], responses[b, : lens[b]]]).tolist() for b in range(B)]
    return td, rows


def verl_micro_batches(td) -> list[list[int]]:
    """The rows of each micro-batch verl's engine runs (its own ``prepare_micro_batches``)."""
    from verl.workers.engine.utils import prepare_micro_batches

    _, indices = prepare_micro_batches(td, dp_group=None, same_micro_num_in_dp=True)
    return [list(map(int, idx)) for idx in indices]


def verl_configs(rows: list[list[int]], device: str) -> dict[str, dict]:
    """verl's micro-batch configurations for these rows: ``{name: {"budget", "remove_padding",
    "logprobs"}}`` (see the module docstring); ``default`` last."""
    longest, total, B = max(map(len, rows)), sum(map(len, rows)), len(rows)
    naive = "naive" if device == "cpu" else None
    out = {"1 row": dict(budget=longest)}
    out.update({f"{k} rows": dict(budget=k * longest) for k in (2, 4) if k < B})
    out["packed"] = dict(budget=total)
    out["padded"] = dict(budget=total, remove_padding=False)
    out = {name: dict(remove_padding=True, logprobs=naive) | c for name, c in out.items()}
    out["default"] = dict(budget=DEFAULT_TOKENS, remove_padding=True, logprobs="v2" if naive else None)
    return out


def verl_work(rows: list[list[int]], micro: list[list[int]], device: str, padded: bool = False):
    """``treetrain.trees.flops.Work`` of verl's step over these micro-batches (module docstring).

    >>> w = verl_work([[1, 2, 3], [1, 2, 4, 5]], [[0], [1]], "cpu")  # one row each: causal
    >>> (w.tokens, w.pairs, w.targets)
    (7, 16, 7)
    >>> w = verl_work([[1, 2, 3], [1, 2, 4, 5]], [[0, 1]], "cpu")  # packed: all (3 + 4)^2 pairs
    >>> (w.tokens, w.pairs)
    (7, 49)
    >>> w = verl_work([[1, 2, 3], [1, 2, 4, 5]], [[0, 1]], "cpu", padded=True)  # [2, 4] padded
    >>> (w.tokens, w.pairs, w.targets)
    (8, 32, 8)
    """
    from treetrain.trees.flops import Work

    total = Work()
    for idx in micro:
        lens = [len(rows[i]) for i in idx]
        causal = sum(L * (L + 1) // 2 for L in lens)
        if padded:
            tokens = len(lens) * max(lens)
            pairs = causal if device == "cuda" else len(lens) * max(lens) ** 2
        else:
            tokens = sum(lens)
            pairs = causal if device == "cuda" or len(lens) == 1 else tokens**2
        total += Work(tokens=tokens, pairs=pairs, targets=tokens)
    return total


def step_gib(rows: list[list[int]], micro: list[list[int]], padded: bool, cfg) -> float:
    """A conservative estimate of the GiB of live tensors one verl step over these micro-batches
    peaks at: the largest micro-batch's tokens (padded: rows x its longest) times 3 float32 vocab
    rows (logits, log-softmax, their gradient) and 16 floats per hidden unit and layer (checkpointed
    activations, recomputed ones), plus parameters, gradients and AdamW's two states.

    Calibrated on the quiet runs of 2026-11-26 (``small``): one row of 4,158 tokens peaked at 1,630
    MiB of live tensors where this says 2,081; one of 1,082 at 479 where this says 762.

    >>> cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    ...     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000)
    >>> round(step_gib([[0] * 4158], [[0]], False, cfg) * 1024)
    2081
    """
    params = _params(cfg)
    tokens = max(
        len(idx) * max(len(rows[i]) for i in idx) if padded else sum(len(rows[i]) for i in idx)
        for idx in micro
    )
    per_token = 4 * (3 * cfg.vocab_size + 16 * cfg.hidden_size * cfg.num_hidden_layers)
    return (tokens * per_token + 16 * params) / 2**30


def _params(cfg) -> int:
    """Parameters of a Qwen3 model of this shape with an untied head (as the benchmark builds it), the
    norms left out (a few thousand)."""
    h, L, d = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return 2 * cfg.vocab_size * h + L * (attn + 3 * h * cfg.intermediate_size)


def memory_budget_gib() -> float:
    """Half of the machine's memory: both engines, the allocator's cache and the tree's step live
    beside the configuration being timed."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**31


def verl_pairs(rows: list[list[int]], micro: list[list[int]], device: str) -> int:
    """Attention scores verl's engine computes over these (unpadded) micro-batches."""
    return verl_work(rows, micro, device).pairs


def tree_work(rows):
    """``Work`` of the tree engine's step (the whole batch as one tree) and the tree's tokens."""
    from treetrain.integrations.verl_rows import RowTree
    from treetrain.trees.flops import Work, tree_pairs
    from treetrain.trees.tree import TrajectoryTree

    tree = TrajectoryTree.from_paths(rows)
    values = torch.tensor([t for r in rows for t in r])
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    scored = RowTree.build(values, offsets).src.numel()
    return Work(tokens=tree.num_tokens, pairs=tree_pairs(tree), targets=scored), tree


def use_verl_logprobs(kind: str | None) -> None:
    """Which of verl's own log-prob functions its FSDP engine calls (``transformer_impl`` imports
    ``logprobs_from_logits`` by name). verl picks flash-attention's fused cross-entropy on CUDA; on
    the CPU it falls back to ``logprobs_from_logits_v2``, a Python loop of one ``logsumexp`` per token
    (its memory saver). ``naive``: verl's vectorised ``logprobs_from_logits_naive`` (log-softmax +
    gather, same values), the CPU's stand-in for the fused kernel; ``v2``: verl's CPU default;
    None: leave verl's choice (CUDA)."""
    if kind is None:
        return
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    chosen = {"naive": verl_F.logprobs_from_logits_naive, "v2": verl_F.logprobs_from_logits}[kind]
    transformer_impl.logprobs_from_logits = lambda logits, labels, inplace_backward=True: chosen(
        logits, labels
    )


class Case:
    """One case's batch, verl's configurations with their micro-batches and FLOPs, and one step of
    each mode (``tree``, a configuration's name)."""

    def __init__(self, engines, cfg, P, n, C, prompts, device, screen_flops=SCREEN_FLOPS, budget_gib=None):
        from treetrain.trees.flops import CostModel

        self.engines, self.cfg, self.device = engines, cfg, device
        self.P, self.n, self.C, self.prompts = P, n, C, prompts
        _, self.rows = make_batch(prompts, P, n, C, cfg.vocab_size)
        self.configs = verl_configs(self.rows, device)
        cost = CostModel.from_config(cfg)
        self.micro, self.work, self.flops, self.gib, seen = {}, {}, {}, {}, {}
        for name, c in self.configs.items():
            td, _ = make_batch(
                prompts, P, n, C, cfg.vocab_size, c["budget"], remove_padding=c["remove_padding"]
            )
            self.micro[name] = verl_micro_batches(td)
            self.work[name] = verl_work(self.rows, self.micro[name], device, not c["remove_padding"])
            self.flops[name] = self.work[name].flops(cost, checkpointing=True)
            self.gib[name] = step_gib(self.rows, self.micro[name], not c["remove_padding"], cfg)
            key = (tuple(map(tuple, self.micro[name])), c["remove_padding"], c["logprobs"])
            c["same_as"] = seen.setdefault(key, name)  # configurations that run the same step
        self.work["tree"], tree = tree_work(self.rows)
        self.flops["tree"] = self.work["tree"].flops(cost, checkpointing=True)
        self.path_tokens, self.tree_tokens = tree.num_path_tokens, tree.num_tokens
        budget = memory_budget_gib() if budget_gib is None else budget_gib
        self.too_big = {name: gib for name, gib in self.gib.items() if gib > budget}  # never run
        self.budget_gib = budget
        own = [name for name, c in self.configs.items() if name != "default" and c["same_as"] == name]
        fits = [name for name in own if name not in self.too_big]
        if not fits:
            raise ValueError(
                f"case P={P} n={n} C={C} x{prompts}: no verl configuration fits the memory budget "
                f"({budget:.1f} GiB; 1 row needs ~{self.gib['1 row']:.1f}): pass --memory-budget-gib"
            )
        self.least = min(fits, key=self.flops.get)
        self.screened = [name for name in fits if self.flops[name] <= screen_flops * self.flops[self.least]]

    def step(self, mode: str, clock=None):
        """A function that runs one ``train_batch`` of ``mode``; with ``clock``, it returns the
        seconds ``train_batch`` took by it (the batch built and the engine put in train mode before
        the clock starts, as verl's trainer does once per step outside its engine)."""
        from verl.workers.config import FSDPActorConfig
        from verl.workers.utils.losses import ppo_loss

        actor = FSDPActorConfig(
            strategy="fsdp2", rollout_n=self.n, use_dynamic_bsz=True, loss_agg_mode="token-mean"
        )
        loss_fn = functools.partial(ppo_loss, config=actor)
        c = (
            {"budget": None, "remove_padding": True, "logprobs": None}
            if mode == "tree"
            else self.configs[mode]
        )
        engine = self.engines["tree" if mode == "tree" else "verl"]
        args = (self.prompts, self.P, self.n, self.C, self.cfg.vocab_size, c["budget"])

        def run():
            td, _ = make_batch(*args, remove_padding=c["remove_padding"])
            use_verl_logprobs(c["logprobs"])
            with engine.train_mode():
                if clock is None:
                    return engine.train_batch(td, loss_fn)
                return timed(lambda: engine.train_batch(td, loss_fn), self.device, clock)

        return run


def run_case(case: Case, repeats: int, clock=time.perf_counter, default=True, memory=True) -> dict:
    """Warm up both engines, time each screened configuration (and the default) once, then the tree
    and verl's fastest ``repeats`` rounds interleaved (:func:`common.judge` gives the verdict), then
    the peak memory of one step of each."""
    dev = case.device
    for mode in ("tree", case.least):  # warm-up: one step of each engine
        case.step(mode)()
    default = default and "default" not in case.too_big
    names = case.screened + (["default"] if default else [])
    screen = {name: case.step(name, clock)() for name in names}
    best = min(screen, key=screen.get)
    modes = ["tree", best]
    steps = {m: case.step(m) for m in modes}
    timed_steps = {m: case.step(m, clock) for m in modes}
    times = {m: [] for m in modes}
    with noise.Monitor() as monitor:  # every step has run once: no warm-up round
        for r in range(repeats):
            for m in modes if r % 2 == 0 else modes[::-1]:
                times[m].append(timed_steps[m]())
    stats, untrusted = judge(times, monitor.load)
    bound = case.flops[best] / case.flops["tree"]
    speedup = stats[best]["best"] / stats["tree"]["best"]
    row = {
        "P": case.P, "n": case.n, "C": case.C, "prompts": case.prompts, "path_tokens": case.path_tokens,
        "tree_tokens": case.tree_tokens, "best": best, "screen": screen, "micro": len(case.micro[best]),
        "skipped": {n: case.flops[n] / case.flops[case.least] for n in case.configs
                    if n not in names and n not in case.too_big and case.configs[n]["same_as"] == n},
        "too_big": {n: case.gib[n] for n in case.too_big}, "budget_gib": case.budget_gib,
        "verl": stats[best]["best"], "tree": stats["tree"]["best"], "speedup": speedup, "bound": bound,
        "efficiency": speedup / bound,
        "median_efficiency": stats[best]["median"] / stats["tree"]["median"] / bound,
        "spread": {m: s["spread"] for m, s in stats.items()},
    }  # fmt: skip
    if default:  # one step (the screening's): a reference column, not the baseline
        row["default"] = screen["default"]
        row["bound_default"] = case.flops["default"] / case.flops["tree"]
        row["speedup_default"] = row["default"] / row["tree"]
    untrusted += noise.verdict({}, efficiency=row["efficiency"])
    row["untrusted"] = untrusted
    row["peak_mib"] = {}
    if memory:
        from treetrain.bench.measure import peak_bytes

        row["peak_mib"] = {
            "verl": peak_bytes(steps[best], dev) / 2**20,
            "tree": peak_bytes(steps["tree"], dev) / 2**20,
        }
    return row


def flop_audit(case: Case) -> list[dict]:
    """Per mode: FLOPs one step executes (``FlopCounterMode``) vs :func:`verl_work`'s model."""
    from treetrain.bench.measure import count_flops
    from treetrain.trees.flops import CostModel

    cost = CostModel.from_config(case.cfg)
    out = []
    for mode in ["tree"] + [n for n in case.configs if case.configs[n]["same_as"] == n]:
        if mode != "tree" and case.flops[mode] > 4 * case.flops[case.least]:
            continue  # a configuration far off the least: not run
        counted = count_flops(case.step(mode), vocab=case.cfg.vocab_size)
        w = case.work[mode]
        model = {
            "linear": w.tokens * (3 * cost.linear + cost.checkpointed),  # checkpointing: see the docstring
            "attention": 4 * w.pairs * cost.per_pair,
            "head": (3 * w.targets + w.recomputed) * cost.head,
        }
        out.append({"case": f"P={case.P} n={case.n} C={case.C} x{case.prompts}", "mode": mode,
                    "counted": counted, "model": model})  # fmt: skip
    return out


def audit_table(rows: list[dict]) -> str:
    from common import flop_audit_table

    return flop_audit_table(rows, "optimizer steps and elementwise work (log-softmax) are not FLOPs here")


def table(rows: list[dict]) -> str:
    head = (
        "| P | n | C | prompts | row tokens | tree tokens | verl fastest (micro-batches) | verl s | tree s "
        "| speedup | bound | efficiency (best) | efficiency (median) "
        "| verl default s (one step): speedup / bound | peak MiB verl / tree "
        "| memory verl / tree (activation bound) | spread verl / tree "
        "| timings |\n|" + "---|" * 18 + "\n"
    )
    lines = []
    for r in rows:
        d = (
            "-"
            if "default" not in r
            else (f"{r['default']:.3f}: {r['speedup_default']:.2f}x / {r['bound_default']:.2f}x")
        )
        pk = r["peak_mib"]
        mem = "-" if not pk else f"{pk['verl']:.0f} / {pk['tree']:.0f}"
        ratio = (
            "-" if not pk else f"{pk['verl'] / pk['tree']:.2f} ({r['path_tokens'] / r['tree_tokens']:.2f})"
        )
        trust = "NOT TRUSTWORTHY (below)" if r["untrusted"] else "ok"
        lines.append(
            f"| {r['P']} | {r['n']} | {r['C']} | {r['prompts']} | {r['path_tokens']} | {r['tree_tokens']} | "
            f"{r['best']} ({r['micro']}) | {r['verl']:.3f} | {r['tree']:.3f} | {r['speedup']:.2f}x | "
            f"{r['bound']:.2f}x | **{r['efficiency']:.2f}** | {r['median_efficiency']:.2f} | {d} | {mem} | "
            f"{ratio} | {r['spread'][r['best']]:.0%} / {r['spread']['tree']:.0%} | {trust} |"
        )  # fmt: skip
    return head + "\n".join(lines) + "\n"


def screen_table(rows: list[dict]) -> str:
    """verl's configurations per case: seconds of the one screening step, or why not timed."""
    lines = ["verl's configurations, one timed step each (the fastest is the baseline above):\n"]
    for r in rows:
        timed_ = [
            f"{n} {s:.3f} s" + (" **fastest**" if n == r["best"] else "") for n, s in r["screen"].items()
        ]
        skipped = [f"{n} skipped ({f:.1f}x the FLOPs)" for n, f in r["skipped"].items()]
        skipped += [
            f"{n} not run: ~{g:.1f} GiB estimated > the {r['budget_gib']:.1f} GiB budget"
            for n, g in r.get("too_big", {}).items()
        ]
        lines.append(f"- P={r['P']} n={r['n']} C={r['C']} x{r['prompts']}: " + "; ".join(timed_ + skipped))
    return "\n".join(lines) + "\n\n"


def read_table(md: Path) -> list[dict]:
    """The cases of a result file this script wrote (its first table)."""
    rows = []
    for line in md.read_text().splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if len(cells) == 18 and cells[0].isdigit():
            rows.append({"P": int(cells[0]), "n": int(cells[1]), "C": int(cells[2]), "prompts": int(cells[3]),
                         "speedup": float(cells[9].rstrip("x")), "bound": float(cells[10].rstrip("x")),
                         "efficiency": float(cells[11]), "trusted": cells[17] == "ok"})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Speedup beside its FLOP bound per case, the efficiency above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(min(13, max(6, 0.7 * len(rows))), 4.5))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], 0.4, label="measured speedup")
    ax.bar([i + 0.2 for i in x], [r["bound"] for r in rows], 0.4, label="FLOP bound", alpha=0.45)
    for i, r in zip(x, rows):
        mark = "" if r["trusted"] else "?"
        top = max(r["speedup"], r["bound"])
        ax.text(i, top * 1.02, f"{r['efficiency']:.2f}{mark}", ha="center", fontsize=8)
    labels = [f"P={r['P']}\nn={r['n']}\nC={r['C']}" + (f"\nx{r['prompts']}" if r["prompts"] > 1 else "")
              for r in rows]  # fmt: skip
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("verl's fastest step time / tree step time")
    ax.set_title(title + " (numbers: efficiency = speedup / bound; ?: not trustworthy)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _case(text: str) -> tuple[int, int, int, int]:
    try:
        parts = [int(x) for x in text.split(":")]
        if len(parts) not in (3, 4):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a case is P:n:C or P:n:C:prompts, e.g. 1024:8:64; got {text!r}"
        ) from None
    return (*parts, 1)[:4] if len(parts) == 3 else tuple(parts)


def estimate(args, cases) -> float:
    """Seconds the run would take, from each case's FLOPs (no engine built): a warm-up step of the
    tree and the least-FLOP configuration, one step of each screened configuration and the default,
    ``repeats`` rounds and a memory step of the tree and the least-FLOP configuration (the likely
    fastest), at ``args.rate`` FLOP/s (a quiet 2-core CPU's measured rate, QUIET_RUNS.md)."""
    from treetrain.trees.flops import CostModel

    cfg = transformers.Qwen3Config(**MODELS[args.model])
    cost = CostModel.from_config(cfg)
    budget = args.memory_budget_gib or memory_budget_gib()
    total = 0.0
    for P, n, C, prompts in cases:
        _, rows = make_batch(prompts, P, n, C, cfg.vocab_size)
        w_tree = tree_work(rows)[0].flops(cost, checkpointing=True)
        flops = {}
        for name, c in verl_configs(rows, args.device).items():
            td, _ = make_batch(
                prompts, P, n, C, cfg.vocab_size, c["budget"], remove_padding=c["remove_padding"]
            )
            micro = verl_micro_batches(td)
            if step_gib(rows, micro, not c["remove_padding"], cfg) > budget:
                continue  # not run (Case.too_big)
            flops[name] = verl_work(rows, micro, args.device, not c["remove_padding"]).flops(cost, True)
        least = min(f for n_, f in flops.items() if n_ != "default")
        screened = sum(f for n_, f in flops.items() if n_ != "default" and f <= args.screen_flops * least)
        screened += 0 if args.no_default else flops.get("default", 0.0)
        case_flops = (w_tree + least) * (1 + args.repeats + (0 if args.no_memory else 1)) + screened
        total += case_flops
        parts = ", ".join(f"{k} {f / 1e12:.1f}" for k, f in flops.items())
        print(f"  P={P} n={n} C={C} x{prompts}: tree {w_tree / 1e12:.1f}, {parts} TFLOP per step")
        print(f"  P={P} n={n} C={C} x{prompts}: {case_flops / 1e12:.1f} TFLOP, "
              f"{case_flops / args.rate:.0f} s", flush=True)  # fmt: skip
    return total / args.rate


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model, cases and repeats")
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16], help="samples per prompt (n)")
    ap.add_argument("--response-lens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument(
        "--prompts", type=int, default=1, help="prompts per batch for the grid (rows = prompts x n)"
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", type=_case, nargs="+", metavar="P:n:C[:prompts]",
                    help="run these cases instead of the preset's or the grid of --prompt-lens x --groups x "
                    "--response-lens")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="--preset quick: one small case (P=256, n=4, C=32)")
    ap.add_argument("--write", action="store_true", help="write the table to benchmarks/results/")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU seconds on one thread (a shared, loaded CPU machine)",
    )
    ap.add_argument(
        "--screen-flops",
        type=float,
        default=SCREEN_FLOPS,
        help="time verl's configurations within this multiple of the least FLOPs",
    )
    ap.add_argument(
        "--no-default", action="store_true", help="skip the column of verl's default configuration"
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step of each mode")
    ap.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="do not run verl configurations whose step_gib estimate exceeds this (default: half the RAM)",
    )
    ap.add_argument(
        "--flops",
        action="store_true",
        help="only count the FLOPs each mode's step executes vs the bound's model (no timing)",
    )
    ap.add_argument("--estimate", action="store_true", help="only print the run time estimated from FLOPs")
    ap.add_argument(
        "--rate",
        type=float,
        default=None,
        help="FLOP/s for --estimate (default: the quiet 2-core EPYC's rate on the model's steps, RATES)",
    )
    ap.add_argument("--plot", type=Path, metavar="MD", help="only plot a result file this script wrote")
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    if args.plot:
        png = args.plot.with_suffix(".png")
        plot(read_table(args.plot), png, "verl GRPO train_batch: strategy=treetrain vs verl's fastest")
        print(f"wrote {png}")
        return read_table(args.plot)
    preset = PRESETS["quick" if args.quick else args.preset] if (args.quick or args.preset) else {}
    args.model = args.model or preset.get("model", "small")
    args.repeats = args.repeats if args.repeats is not None else preset.get("repeats", 3)
    grid = (
        args.cases
        or preset.get("cases")
        or [
            (P, n, C, args.prompts) for n in args.groups for C in args.response_lens for P in args.prompt_lens
        ]
    )
    if args.estimate:
        args.rate = args.rate or RATES[args.model]
        seconds = estimate(args, grid)
        print(estimate_line(Path(__file__).name, argv, seconds, args.rate))
        return []
    if argv is None:  # this process is the command: it may re-execute itself under tcmalloc
        use_allocator(args, args.device)
    clock = time.perf_counter
    if args.clock == "cpu":
        if args.device != "cpu":
            raise SystemExit("--clock cpu measures CPU runs only")
        torch.set_num_threads(1)  # no OpenMP spin-waits counted as work
        clock = time.process_time
    import torch.distributed as dist

    if args.device == "cpu":
        from treetrain.integrations.verl_cpu import use_cpu_platform

        use_cpu_platform()
    import treetrain.integrations.verl  # noqa: F401  (registers strategy=treetrain)

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:  # a free port: another run (or a test) may hold any fixed one
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3Config(
        **MODELS[args.model], max_position_embeddings=16384, tie_word_embeddings=False
    )
    rows, audit = [], []
    before = machine_before()
    with tempfile.TemporaryDirectory() as workdir:
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(workdir)
        engines = build_engines(workdir, args.device)
        for i, (P, n, C, prompts) in enumerate(grid):
            print(f"case {i + 1}/{len(grid)}: P={P} n={n} C={C} prompts={prompts}", flush=True)
            case = Case(
                engines, cfg, P, n, C, prompts, args.device, args.screen_flops, args.memory_budget_gib
            )
            if args.flops:
                audit += flop_audit(case)
                continue
            rows.append(run_case(case, args.repeats, clock, not args.no_default, not args.no_memory))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else hardware()
    import verl

    command = (
        f"`python benchmarks/{Path(__file__).name} {' '.join(argv if argv is not None else sys.argv[1:])}`"
    )
    stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name}, torch "
    stamp += f"{torch.__version__}, verl {verl.__version__}, transformers {transformers.__version__}"
    stamp += f"; {block_rule_line()}"
    if args.flops:
        text = f"# verl vs tree: FLOPs executed vs the bound's model ({args.model})\n\n{stamp}, {command}\n\n"
        text += audit_table(audit)
        print(text)
    else:
        text = (
            f"# verl GRPO train_batch: strategy=treetrain vs verl's fastest configuration ({args.model}, "
            f"{'fp32' if args.device == 'cpu' else 'bf16 mixed precision'}; times: "
            f"{'CPU seconds, one thread' if args.clock == 'cpu' else 'wall seconds'})\n\n"
            f"{stamp}, command: {command}\n\n"
            + table(rows)
            + "\n"
            + screen_table(rows)
            + noise_section(
                before, [(f"P={r['P']} n={r['n']} C={r['C']} x{r['prompts']}", r["untrusted"]) for r in rows]
            )
        )
        print(text)
    if args.write:
        md = result_path(f"verl_engine_{'flops_' if args.flops else ''}{args.model}", args.device)
        md.write_text(text)
        print(f"wrote {md}")
        if not args.flops:
            try:
                plot(read_table(md), md.with_suffix(".png"), text.splitlines()[0].lstrip("# "))
                print(f"wrote {md.with_suffix('.png')}")
            except ImportError:
                print(
                    f"(no matplotlib here: plot it with python benchmarks/{Path(__file__).name} --plot {md})"
                )
    dist.destroy_process_group()
    return rows if not args.flops else audit


if __name__ == "__main__":
    main()
