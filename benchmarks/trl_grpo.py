"""A GRPO step's scoring, TRL's own vs ``TreeGRPOTrainer``: forward with gradients + backward, and
the no-grad scoring TRL runs for the old policy / reference.

One ``TreeGRPOTrainer`` (a ``trl.GRPOTrainer``) over a random-init Qwen3-shaped model; the batch is
TRL's padded layout for ``--prompts`` prompts of ``P`` tokens with ``G`` completions each, completion
lengths uniform in ``[C/2, C]`` (left-padded prompts, right-padded completions). The same batch goes
through ``GRPOTrainer._get_per_token_logps_and_entropies`` (TRL: one padded forward) and the
subclass's override (one tree forward per token budget), then ``backward`` of a GRPO-shaped loss
``-(A * logp * mask).sum() / mask.sum()``. Generation is not run: it is the same for both.
Modes alternate; each time is the median of ``--repeats`` after a warm-up.

FLOP bound (``treetrain.flops.CostModel`` of the model): decoder FLOPs per token and per allowed
attention pair, the LM head only on scored targets (TRL and the tree both head only completions on
GPU), x3 for forward + backward; baseline = each row alone without padding, tree = distinct tokens.
efficiency = measured speedup / bound. On CPU, TRL's fused head scores every position (it compacts
to the scored ones only on Triton devices) and the padding too, so CPU efficiency can exceed 1.

Usage::

    python benchmarks/trl_grpo.py --quick                                # small CPU check (~1 min)
    python benchmarks/trl_grpo.py --model qwen3-0.6b --generation --write  # full sweep, a GPU
    python benchmarks/trl_grpo.py --groups 8 --completion-lens 64 256 --repeats 1 --write  # CPU

``--generation`` also times sampling the completions (HF ``generate``), reported in its own column.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, result_path  # noqa: E402

from treetrain.flops import CostModel, baseline_pairs, tree_pairs  # noqa: E402
from treetrain.integrations.flat import FlatBatch  # noqa: E402

MODELS = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=32000),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}  # fmt: skip


def make_trainer(model_name: str, device: str, dtype: torch.dtype, group: int, workdir: str):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import GRPOConfig

    from treetrain.integrations.trl import TreeGRPOTrainer

    cfg = transformers.Qwen3Config(
        **MODELS[model_name], max_position_embeddings=32768, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(
        device
    )
    tk = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    args = GRPOConfig(
        output_dir=workdir, per_device_train_batch_size=group, num_generations=group, report_to="none",
        use_cpu=device == "cpu", bf16=dtype == torch.bfloat16, max_completion_length=8,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a"] * group})
    trainer = TreeGRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=data, processing_class=tok,
    )  # fmt: skip
    return trainer, cfg


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


def flop_bound(ids, mask, C, cfg) -> tuple[float, int, int]:
    """(baseline / tree training FLOPs, baseline tokens, tree tokens); the head on scored targets only."""
    tree = FlatBatch.build(ids, mask, logits_to_keep=C).tree
    cost = CostModel.from_config(cfg)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    scored = int(mask[:, -C:].sum())
    per_tok = cost.per_token - head

    def flops(tokens, pairs):
        return 3.0 * (tokens * per_tok + pairs * cost.per_pair + scored * head)

    base = flops(tree.num_path_tokens, baseline_pairs(tree))
    return base / flops(tree.num_tokens, tree_pairs(tree)), tree.num_path_tokens, tree.num_tokens


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


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


def run_case(trainer, P, G, C, prompts, repeats, device, seed=0, generation=False) -> dict:
    from trl import GRPOTrainer

    model = trainer.model
    vocab = model.config.vocab_size
    ids, mask, comp_mask = make_batch(prompts, P, G, C, vocab, seed)
    ids, mask, comp_mask = ids.to(device), mask.to(device), comp_mask.to(device)
    adv = torch.randn(ids.shape[0], 1, device=device)
    modes = {
        "trl": lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k),
        "tree": trainer._get_per_token_logps_and_entropies,
    }

    def step(score):
        lp, ent, _ = score(model, ids, mask, C, compute_entropy=True)
        loss = -(adv * lp * comp_mask).sum() / comp_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    def nograd(score):
        with torch.no_grad():
            score(model, ids, mask, C, batch_size=G)

    times = {(m, k): [] for m in modes for k in ("step", "nograd")}
    peak = {}
    for r in range(repeats + 1):
        for m, score in modes.items():
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                t_step = timed(lambda score=score: step(score), device)
                t_ng = timed(lambda score=score: nograd(score), device)
            except torch.OutOfMemoryError:
                return {"P": P, "G": G, "C": C, "oom": m}
            if device == "cuda":
                peak[m] = torch.cuda.max_memory_allocated() / 2**30
            if r:  # the first round is the warm-up
                times[(m, "step")].append(t_step)
                times[(m, "nograd")].append(t_ng)
    med = {k: statistics.median(v) for k, v in times.items()}
    bound, base_tok, tree_tok = flop_bound(ids.cpu(), mask.cpu(), C, model.config)
    speed = med[("trl", "step")] / med[("tree", "step")]
    gen = generation_time(model, ids, P, C, device) if generation else None
    return {
        "generate": gen,
        "P": P, "G": G, "C": C, "rows": ids.shape[0], "path_tokens": base_tok, "tree_tokens": tree_tok,
        "trl_step": med[("trl", "step")], "tree_step": med[("tree", "step")], "speedup": speed,
        "nograd_speedup": med[("trl", "nograd")] / med[("tree", "nograd")],
        "bound": bound, "efficiency": speed / bound, "peak": peak,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    head = (
        "| P | G | C | path tok | tree tok | TRL step s | tree step s | speedup | no-grad speedup | "
        "FLOP bound | efficiency | peak GiB TRL / tree | generate s (apart) |\n|" + "---|" * 13 + "\n"
    )
    lines = []
    for r in rows:
        if "oom" in r:
            lines.append(f"| {r['P']} | {r['G']} | {r['C']} | OOM in {r['oom']} |" + " |" * 9)
            continue
        peak = " / ".join(f"{r['peak'][m]:.1f}" for m in ("trl", "tree")) if r["peak"] else "-"
        lines.append(
            f"| {r['P']} | {r['G']} | {r['C']} | {r['path_tokens']} | {r['tree_tokens']} | "
            f"{r['trl_step']:.3f} | {r['tree_step']:.3f} | {r['speedup']:.2f}x | "
            f"{r['nograd_speedup']:.2f}x | {r['bound']:.2f}x | {r['efficiency']:.2f} | {peak} | "
            f"{'-' if r['generate'] is None else format(r['generate'], '.2f')} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "oom" not in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    for G, C in sorted({(r["G"], r["C"]) for r in ok}):
        sel = sorted((r for r in ok if (r["G"], r["C"]) == (G, C)), key=lambda r: r["P"])
        P = [r["P"] for r in sel]
        (line,) = ax.plot(P, [r["speedup"] for r in sel], "o-", label=f"G={G}, C={C}")
        ax.plot(P, [r["bound"] for r in sel], "--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens P")
    ax.set_ylabel("speedup over TRL (dashed: FLOP bound)")
    ax.set_title("GRPO scoring + backward: TreeGRPOTrainer vs TRL")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--completion-lens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per batch (rows = prompts x G)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="one small case (P=256, G=4, C=32): a CPU check")
    ap.add_argument("--generation", action="store_true", help="also time sampling C tokens (reported apart)")
    ap.add_argument("--write", action="store_true", help="write the table and plot to benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_lens, args.groups, args.completion_lens, args.repeats = [256], [4], [32], 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for G in args.groups:
            trainer, _ = make_trainer(args.model, args.device, dtype, G, workdir)
            for C in args.completion_lens:
                for P in args.prompt_lens:
                    rows.append(
                        run_case(
                            trainer,
                            P,
                            G,
                            C,
                            args.prompts,
                            args.repeats,
                            args.device,
                            generation=args.generation,
                        )
                    )
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
            del trainer
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else hardware()
    text = (
        f"# GRPO scoring + backward: TreeGRPOTrainer vs trl.GRPOTrainer ({args.model}, {dtype})\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name}, torch "
        f"{torch.__version__}, command: `python benchmarks/{Path(__file__).name} "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n" + table(rows)
    )
    print(text)
    if args.write:
        md = result_path(f"trl_grpo_{args.model}", args.device)
        md.write_text(text)
        plot(rows, md.with_suffix(".png"))
        print(f"wrote {md} and {md.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
