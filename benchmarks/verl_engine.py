"""A GRPO ``train_batch`` in verl: verl's own FSDP2 engine vs treetrain's (``strategy=treetrain``).

One process (world size 1), one random-init Qwen3-shaped model saved to a temporary folder and loaded
by both engines through verl's own config classes. The batch is verl's: ``--prompts`` prompts of
``P`` tokens with ``n`` sampled responses each, response lengths uniform in ``[C/2, C]``, padded as a
rollout and converted by ``verl.workers.utils.padding.left_right_2_no_padding`` as verl's trainer does.
Each engine runs ``train_batch`` with ``verl.workers.utils.losses.ppo_loss`` (GRPO: one advantage per
sample, token-mean, no entropy term): forward, backward, optimizer step.

Micro-batches (``max_token_len_per_gpu``): the tree runs the whole batch as one tree. verl runs its
best configuration for the device (``--verl-micro``): on CUDA the whole batch packed in one
micro-batch (flash-attention varlen attends within each row, so packing costs nothing); on the CPU
one row per micro-batch (budget = the longest row): packed rows there go through SDPA with
transformers' block-diagonal mask, which scores all ``N^2`` pairs of the ``N`` packed tokens (16x
the causal pairs at 8 rows of 1k tokens) where a lone row runs SDPA's causal kernel; a careful user
on the CPU would not pay that, so the baseline does not either. ``--verl-micro batch`` measures it.

The bound counts what each engine computes (``treetrain.trees.flops``: decoder FLOPs per token run,
attention per query-key pair computed, the LM head per position scored; x3 for forward + backward):

- verl: every row token through the decoder and the head (log-probs at every position); attention
  pairs per micro-batch as verl's own ``prepare_micro_batches`` cut them: a row's causal pairs
  ``L (L + 1) / 2`` (CUDA; a one-row micro-batch on the CPU), all ``N^2`` for a packed CPU one;
- tree: the distinct tokens; the tree's allowed pairs (blocksparse on the CPU, triton/flex on CUDA);
  the head once per distinct (context, label) pair.

``efficiency = speedup / bound``; a figure above 1.10 means the bound misses work verl does (or the
tree skips), not a speedup to quote. Timing: a warm-up step per engine, then ``--repeats`` rounds
with the engines interleaved (order alternating), under ``treetrain.bench.noise``: each row gives
the best and the median, each engine's spread, and the reasons not to trust it (spread > 10%,
other load on the machine) in the file's last section.

Usage::

    python benchmarks/verl_engine.py --quick            # a CPU check (P=256, n=4, C=32)
    python benchmarks/verl_engine.py --write            # the sweep (a GPU): P 1k-4k, n 8/16, C 64-512
    python benchmarks/verl_engine.py --cases 1024:8:64 4096:16:512 --write   # chosen cases (P:n:C)
    python benchmarks/verl_engine.py --quick --clock cpu  # on a shared, loaded CPU: CPU seconds, 1 thread
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QWEN3_SHAPES,
    add_allocator_flag,
    judge,
    machine_before,
    noise_section,
    provenance,
    result_path,
    table_head,
    timed,
    use_allocator,
)

from treetrain.bench import noise  # noqa: E402

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=1000),  # the test's smoke run
    **QWEN3_SHAPES,
}  # fmt: skip


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


def make_batch(prompts: int, P: int, n: int, C: int, vocab: int, budget: int | None = None, seed: int = 0):
    """verl's no-padding ``TensorDict`` for ``prompts x n`` rows, and the rows' token lists.

    ``budget``: ``max_token_len_per_gpu`` (None: all of the batch's tokens, one micro-batch)."""
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
    meta = dict(temperature=1.0, global_batch_size=B, use_remove_padding=True, calculate_entropy=False)
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget, **meta)
    rows = [torch.cat([prompt_ids[b], responses[b, : lens[b]]]).tolist() for b in range(B)]
    return td, rows


def verl_micro_batches(td) -> list[list[int]]:
    """The rows of each micro-batch verl's engine runs (its own ``prepare_micro_batches``)."""
    from verl.workers.engine.utils import prepare_micro_batches

    _, indices = prepare_micro_batches(td, dp_group=None, same_micro_num_in_dp=True)
    return [list(map(int, idx)) for idx in indices]


def verl_pairs(rows: list[list[int]], micro: list[list[int]], device: str) -> int:
    """Attention scores verl's engine computes: per row, causal, on CUDA (flash-attention varlen);
    on the CPU a one-row micro-batch runs SDPA's causal kernel (``L (L + 1) / 2``), a packed one
    SDPA with transformers' block-diagonal mask over all ``N^2`` pairs of its ``N`` tokens."""
    total = 0
    for idx in micro:
        lens = [len(rows[i]) for i in idx]
        if device == "cuda" or len(lens) == 1:
            total += sum(L * (L + 1) // 2 for L in lens)
        else:
            total += sum(lens) ** 2
    return total


def bounds(rows, micro, cfg, device: str) -> dict:
    """Training FLOPs of each engine's step and the bound (see the module docstring)."""
    from treetrain.integrations.verl_rows import RowTree
    from treetrain.trees.flops import CostModel, Work, tree_pairs
    from treetrain.trees.tree import TrajectoryTree

    tree = TrajectoryTree.from_paths(rows)
    values = torch.tensor([t for r in rows for t in r])
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    pairs_scored = RowTree.build(values, offsets).src.numel()
    N = tree.num_path_tokens
    cost = CostModel.from_config(cfg)
    verl = Work(tokens=N, pairs=verl_pairs(rows, micro, device), targets=N).flops(cost)
    tree_f = Work(tokens=tree.num_tokens, pairs=tree_pairs(tree), targets=pairs_scored).flops(cost)
    return {"bound": verl / tree_f, "path_tokens": N, "tree_tokens": tree.num_tokens}


def use_verl_logprobs(kind: str) -> None:
    """Which of verl's own log-prob functions its FSDP engine calls (``transformer_impl`` imports
    ``logprobs_from_logits`` by name). verl picks flash-attention's fused cross-entropy on CUDA; on
    the CPU it falls back to ``logprobs_from_logits_v2``, a Python loop of one ``logsumexp`` per token
    (its memory saver). ``naive``: verl's vectorised ``logprobs_from_logits_naive`` (log-softmax +
    gather, same values), the CPU's stand-in for the fused kernel; ``v2``: verl's CPU default."""
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    chosen = {"naive": verl_F.logprobs_from_logits_naive, "v2": verl_F.logprobs_from_logits}[kind]
    transformer_impl.logprobs_from_logits = lambda logits, labels, inplace_backward=True: chosen(
        logits, labels
    )


def head_check(cfg, lengths: list[int], repeats: int, clock=time.perf_counter) -> list[dict]:
    """Seconds of one LM-head forward + backward over ``L`` positions (same FLOPs on every side):
    verl's two CPU log-prob paths on full ``[L, vocab]`` logits, and treetrain's chunked head
    (``treetrain.logprobs.target_logprobs``, what the tree engine runs). Explains how much more a
    scored position costs verl than the FLOP bound says."""
    import verl.utils.torch_functional as verl_F

    from treetrain.logprobs import target_logprobs
    from treetrain.models.head import LMHead

    g = torch.Generator().manual_seed(0)
    W = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02)
    linear = torch.nn.functional.linear
    paths = {
        "verl v2": lambda h, y: verl_F.logprobs_from_logits_v2(linear(h, W), y),
        "verl naive": lambda h, y: verl_F.logprobs_from_logits_naive(linear(h, W), y),
        # logits kept for backward, as the engine keeps them (treetrain.integrations.verl._logits_keep_bytes)
        "tree": lambda h, y: target_logprobs(h, LMHead(W), y, entropy=False, keep_bytes=2**62)[0],
    }
    out = []
    for L in lengths:
        h = torch.randn(L, cfg.hidden_size, generator=g).requires_grad_()
        labels = torch.randint(0, cfg.vocab_size, (L,), generator=g)
        w = torch.randn(L, generator=g)
        times = {k: [] for k in paths}
        for r in range(repeats + 1):
            for k, f in paths.items():
                t = clock()
                (f(h, labels) * w).sum().backward()
                h.grad = W.grad = None
                if r:
                    times[k].append(clock() - t)
        out.append({"L": L} | {k: min(v) for k, v in times.items()})
    return out


def head_table(heads: list[dict]) -> str:
    if not heads:
        return ""
    lines = [
        "LM head alone, forward + backward over L positions (best of the repeats; same FLOPs in each "
        "column):\n\n| L | verl v2 s | verl naive s | tree s | v2 / tree | naive / tree |\n|" + "---|" * 6
    ]
    for h in heads:
        lines.append(
            f"| {h['L']} | {h['verl v2']:.3f} | {h['verl naive']:.3f} | {h['tree']:.3f} | "
            f"{h['verl v2'] / h['tree']:.2f} | {h['verl naive'] / h['tree']:.2f} |"
        )
    return "\n".join(lines) + "\n\n"


def read_table(md: Path) -> list[dict]:
    """The cases of a result file this script wrote (its first table)."""
    rows = []
    for line in md.read_text().splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if len(cells) == 14 and cells[0].isdigit():
            rows.append({"P": int(cells[0]), "n": int(cells[1]), "C": int(cells[2]),
                         "speedup": float(cells[8].rstrip("x")), "bound": float(cells[9].rstrip("x")),
                         "efficiency": float(cells[10]), "trusted": cells[13] == "ok"})  # fmt: skip
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
    ax.set_xticks(list(x), [f"P={r['P']}\nn={r['n']}\nC={r['C']}" for r in rows], fontsize=7)
    ax.set_ylabel("verl step time / tree step time")
    ax.set_title(title + " (numbers: efficiency = speedup / bound; ?: not trustworthy)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_case(engines, cfg, P, n, C, prompts, repeats, device, verl_micro, clock=time.perf_counter) -> dict:
    """One case: warm-up, then ``repeats`` rounds of both engines interleaved (order alternating),
    under :class:`treetrain.bench.noise.Monitor`; times are each engine's best, the verdict
    (:func:`common.judge`) lists the reasons not to trust them."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    actor = FSDPActorConfig(strategy="fsdp2", rollout_n=n, use_dynamic_bsz=True, loss_agg_mode="token-mean")
    loss_fn = functools.partial(ppo_loss, config=actor)
    _, rows = make_batch(prompts, P, n, C, cfg.vocab_size)
    longest = max(len(r) for r in rows)
    budgets = {"verl": longest if verl_micro == "row" else None, "tree": None}
    micro = verl_micro_batches(make_batch(prompts, P, n, C, cfg.vocab_size, budgets["verl"])[0])
    times = {m: [] for m in engines}

    def step(mode):
        td, _ = make_batch(prompts, P, n, C, cfg.vocab_size, budgets[mode])
        with engines[mode].train_mode():
            return timed(lambda: engines[mode].train_batch(td, loss_fn), device, clock)

    for mode in engines:  # warm-up
        step(mode)
    with noise.Monitor() as monitor:
        for r in range(repeats):
            for mode in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                times[mode].append(step(mode))
    stats, untrusted = judge(times, monitor.load)
    row = {"P": P, "n": n, "C": C, "verl": stats["verl"]["best"], "tree": stats["tree"]["best"]}
    row.update(bounds(rows, micro, cfg, device))
    row["speedup"] = row["verl"] / row["tree"]
    row["efficiency"] = row["speedup"] / row["bound"]
    row["median_efficiency"] = stats["verl"]["median"] / stats["tree"]["median"] / row["bound"]
    row["spread"] = {m: s["spread"] for m, s in stats.items()}
    row["micro"] = len(micro)
    row["untrusted"] = untrusted
    return row


def table(rows: list[dict]) -> str:
    head = table_head([
        "P", "n", "C", "row tokens", "tree tokens", "verl micro-batches", "verl step s", "tree step s",
        "speedup", "bound", "efficiency (best)", "efficiency (median)", "spread verl / tree", "timings",
    ])  # fmt: skip
    lines = [
        f"| {r['P']} | {r['n']} | {r['C']} | {r['path_tokens']} | {r['tree_tokens']} | {r['micro']} | "
        f"{r['verl']:.3f} | {r['tree']:.3f} | {r['speedup']:.2f}x | {r['bound']:.2f}x | "
        f"**{r['efficiency']:.2f}** | {r['median_efficiency']:.2f} | "
        f"{r['spread']['verl']:.0%} / {r['spread']['tree']:.0%} | "
        f"{'NOT TRUSTWORTHY (below)' if r['untrusted'] else 'ok'} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def _case(text: str) -> tuple[int, int, int]:
    try:
        P, n, C = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is P:n:C, e.g. 1024:8:64; got {text!r}") from None
    return P, n, C


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16], help="samples per prompt (n)")
    ap.add_argument("--response-lens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per batch (rows = prompts x n)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--cases",
        type=_case,
        nargs="+",
        metavar="P:n:C",
        help="run these cases instead of the grid of --prompt-lens x --groups x --response-lens",
    )
    ap.add_argument("--quick", action="store_true", help="one small case (P=256, n=4, C=32): a CPU check")
    ap.add_argument("--write", action="store_true", help="write the table to benchmarks/results/")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU seconds on one thread (a shared, loaded CPU machine; not for GPUs)",
    )
    ap.add_argument(
        "--verl-micro",
        choices=("row", "batch"),
        default=None,
        help="verl's micro-batches (max_token_len_per_gpu): row = the longest row, so one row each "
        "(its best on the CPU: SDPA's causal kernel, no N^2 packed mask); batch = all rows in one "
        "(its best on CUDA, flash-attention varlen). Default: row on cpu, batch on cuda. The tree "
        "always runs the batch as one tree.",
    )
    ap.add_argument(
        "--verl-logprobs",
        choices=("naive", "v2"),
        default="naive",
        help="CPU only: verl's log-prob function in its engine (see use_verl_logprobs): naive = its "
        "vectorised log-softmax + gather (default: the stand-in for the fused CUDA kernel), v2 = its "
        "CPU default, a Python loop over tokens",
    )
    ap.add_argument(
        "--head-check",
        type=int,
        nargs="*",
        metavar="L",
        help="also time one LM-head forward + backward over L positions: verl's two CPU paths vs "
        "treetrain's chunked head (default lengths: 1070 4144)",
    )
    ap.add_argument("--plot", type=Path, metavar="MD", help="only plot a result file this script wrote")
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    if args.plot:
        png = args.plot.with_suffix(".png")
        plot(read_table(args.plot), png, "verl GRPO train_batch: strategy=treetrain vs verl's FSDP2 engine")
        print(f"wrote {png}")
        return read_table(args.plot)
    if args.verl_micro is None:
        args.verl_micro = "row" if args.device == "cpu" else "batch"
    if argv is None:  # this process is the command: it may re-execute itself under tcmalloc
        use_allocator(args, args.device)
    if args.quick:
        args.cases, args.repeats = [(256, 4, 32)], 2
    clock = time.perf_counter
    if args.clock == "cpu":
        if args.device != "cpu":
            raise SystemExit("--clock cpu measures CPU runs only")
        torch.set_num_threads(1)  # no OpenMP spin-waits counted as work
        clock = time.process_time
    import os

    import torch.distributed as dist

    if args.device == "cpu":
        from treetrain.integrations.verl_cpu import use_cpu_platform

        use_cpu_platform()
        use_verl_logprobs(args.verl_logprobs)
    import treetrain.integrations.verl  # noqa: F401  (registers strategy=treetrain)

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29617")
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3Config(
        **MODELS[args.model], max_position_embeddings=8192, tie_word_embeddings=False
    )
    rows = []
    before = machine_before()
    with tempfile.TemporaryDirectory() as workdir:
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(workdir)
        engines = build_engines(workdir, args.device)
        grid = args.cases or [
            (P, n, C) for n in args.groups for C in args.response_lens for P in args.prompt_lens
        ]
        for i, (P, n, C) in enumerate(grid):
            print(f"case {i + 1}/{len(grid)}: P={P} n={n} C={C}", flush=True)
            rows.append(
                run_case(
                    engines, cfg, P, n, C, args.prompts, args.repeats, args.device, args.verl_micro, clock
                )
            )
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    heads = []
    if args.head_check is not None:
        heads = head_check(cfg, args.head_check or [1070, 4144], max(args.repeats, 2), clock)
    import verl

    versions = f", verl {verl.__version__}, transformers {transformers.__version__}"
    text = (
        f"# verl GRPO train_batch: strategy=treetrain vs verl's FSDP2 engine ({args.model}, "
        f"{'fp32' if args.device == 'cpu' else 'bf16 mixed precision'}; times: "
        f"{'CPU seconds, one thread' if args.clock == 'cpu' else 'wall seconds'})\n\n"
        f"{provenance(__file__, argv, args.device, versions)}"
        f"; verl micro-batches: {args.verl_micro}"
        + (f"; verl log-probs: {args.verl_logprobs}" if args.device == "cpu" else "")
        + "\n\n"
        + table(rows)
        + "\n"
        + head_table(heads)
        + noise_section(before, [(f"P={r['P']} n={r['n']} C={r['C']}", r["untrusted"]) for r in rows])
    )
    print(text)
    if args.write:
        md = result_path(f"verl_engine_{args.model}", args.device)
        md.write_text(text)
        print(f"wrote {md}")
        try:
            plot(read_table(md), md.with_suffix(".png"), text.splitlines()[0].lstrip("# "))
            print(f"wrote {md.with_suffix('.png')}")
        except ImportError:
            print(f"(no matplotlib here: plot it with python benchmarks/{Path(__file__).name} --plot {md})")
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
