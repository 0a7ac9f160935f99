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

Three modes, the same batch and the same GRPO-shaped loss:

- ``trl``: ``trl.GRPOTrainer``'s own scoring, as shipped: one padded ``[rows, P + C]`` forward;
- ``per-path``: the library's per-path baseline (``treetrain.objectives.baseline``): every row alone, no
  padding, varlen-packed, the chunked head on the scored completion tokens only, entropies too;
- ``tree``: ``TreeGRPOTrainer``'s override, each prompt once.

Two bounds, each counting what its two modes compute (``treetrain.trees.flops``: decoder FLOPs per token
run, attention per pair computed, the LM head per target scored, x3 for forward + backward):

- vs TRL: TRL runs every padded position through the decoder; its padding mask makes SDPA compute
  the full ``L x L`` scores of every row (an explicit mask: no causal skip); its fused head scores
  every position on CPU (it compacts to the scored ones only on Triton devices, i.e. CUDA) and the
  scored ones on CUDA. ``efficiency = speedup / bound``;
- vs the per-path baseline: each row alone without padding, causal pairs, the head on scored
  targets; tree = distinct tokens.

Usage::

    python benchmarks/trl_grpo.py --quick   # small CPU check: 27 s on a quiet 2-core AMD EPYC
                                            # (glibc malloc), 15 min under a load average of 12
    python benchmarks/trl_grpo.py --model qwen3-0.6b --generation --write  # full sweep, a GPU
    python benchmarks/trl_grpo.py --groups 8 --completion-lens 64 256 --repeats 1 --write  # CPU

``--generation`` also times sampling the completions (HF ``generate``), reported in its own column.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
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
    timed,
    use_allocator,
)

from treetrain.bench import noise  # noqa: E402
from treetrain.integrations.flat import FlatBatch  # noqa: E402
from treetrain.trees.flops import CostModel, baseline_pairs, tree_pairs  # noqa: E402

MODELS = QWEN3_SHAPES


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


def bounds(ids, mask, C, cfg, device: str) -> dict:
    """Work and bounds of one batch: ``{"trl", "per_path", "tree"}`` training FLOPs, the two bounds,
    baseline and tree token counts. See the module docstring for what each mode computes."""
    from treetrain.trees.flops import Work

    tree = FlatBatch.build(ids, mask, logits_to_keep=C).tree
    cost = CostModel.from_config(cfg)
    rows, L = ids.shape
    scored = int(mask[:, -C:].sum())
    on_triton = device == "cuda"
    trl = Work(tokens=rows * L, pairs=rows * L * L, targets=scored if on_triton else rows * (L - 1))
    per_path = Work(tokens=tree.num_path_tokens, pairs=baseline_pairs(tree), targets=scored)
    tree_w = Work(tokens=tree.num_tokens, pairs=tree_pairs(tree), targets=scored)
    f = {k: w.flops(cost) for k, w in (("trl", trl), ("per_path", per_path), ("tree", tree_w))}
    return {
        "flops": f,
        "bound_trl": f["trl"] / f["tree"],
        "bound": f["per_path"] / f["tree"],
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


def run_case(trainer, P, G, C, prompts, repeats, device, seed=0, generation=False) -> dict:
    from trl import GRPOTrainer

    from treetrain.objectives.baseline import sequence_microbatches
    from treetrain.objectives.policy.aggregation import loss_normalizer
    from treetrain.objectives.policy.config import Objective
    from treetrain.objectives.policy.loss import compute_loss
    from treetrain.trees.packing import pack

    model = trainer.model
    vocab = model.config.vocab_size
    ids, mask, comp_mask = make_batch(prompts, P, G, C, vocab, seed)
    ids, mask, comp_mask = ids.to(device), mask.to(device), comp_mask.to(device)
    adv = torch.randn(ids.shape[0], 1, device=device)
    trees = per_path_trees(ids, mask, C)
    b = bounds(ids.cpu(), mask.cpu(), C, model.config, device)
    sft, norm = Objective("sft"), loss_normalizer(trees, Objective("sft"))
    # micro-batches no larger than the tree's one forward (treetrain.bench.command.case_capacity: on CPU the
    # cost per token grows with the forward's size, so a budget far above the tree's would charge the
    # baseline for a choice a careful user would not make)
    capacity = max(b["tree_tokens"], max(t.num_tokens for t in trees))
    micro = [pack(mb) for mb in sequence_microbatches(trees, capacity)]
    modes = {
        "trl": lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k),
        "tree": trainer._get_per_token_logps_and_entropies,
    }

    def step(score):
        lp, ent, _ = score(model, ids, mask, C, compute_entropy=True)
        loss = -(adv * lp * comp_mask).sum() / comp_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    def per_path_step():  # the same head (entropies too) on the same scored targets
        for packed in micro:
            compute_loss(model, packed, sft, norm, backend=trainer.tree_backend)[0].backward()
        model.zero_grad(set_to_none=True)

    def nograd(score):
        with torch.no_grad():
            score(model, ids, mask, C, batch_size=G)

    runs = {m: (lambda s=s: step(s)) for m, s in modes.items()} | {"per_path": per_path_step}
    times = {k: [] for k in (*runs, "trl_nograd", "tree_nograd")}
    peak = {}
    monitor = noise.Monitor()
    for r in range(repeats + 1):
        if r == 1:  # the first round is the warm-up
            monitor.start()
        for m in list(runs) if r % 2 == 0 else list(runs)[::-1]:  # interleaved, order alternating
            run = runs[m]
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                t_step = timed(run, device)
                t_ng = timed(lambda m=m: nograd(modes[m]), device) if m in modes else None
            except torch.OutOfMemoryError:
                return {"P": P, "G": G, "C": C, "oom": m}
            if device == "cuda":
                peak[m] = torch.cuda.max_memory_allocated() / 2**30
            if r:  # the first round is the warm-up
                times[m].append(t_step)
                if t_ng is not None:
                    times[m + "_nograd"].append(t_ng)
    load = monitor.stop() if repeats else None
    stats, untrusted = judge({k: v for k, v in times.items() if k in runs}, load)
    best = {k: min(v) for k, v in times.items()}
    speed = best["trl"] / best["tree"]
    speed_pp = best["per_path"] / best["tree"]
    gen = generation_time(model, ids, P, C, device) if generation else None
    return {
        "generate": gen,
        "P": P, "G": G, "C": C, "rows": ids.shape[0], "path_tokens": b["path_tokens"],
        "tree_tokens": b["tree_tokens"], "trl_step": best["trl"], "per_path_step": best["per_path"],
        "tree_step": best["tree"], "speedup": speed, "bound_trl": b["bound_trl"],
        "efficiency_trl": speed / b["bound_trl"], "speedup_per_path": speed_pp, "bound": b["bound"],
        "efficiency": speed_pp / b["bound"], "nograd_speedup": best["trl_nograd"] / best["tree_nograd"],
        "peak": peak, "repeats": repeats,
        "speedup_median": stats["trl"]["median"] / stats["tree"]["median"],
        "spread": {m: st["spread"] for m, st in stats.items()},
        "others_cores": None if load is None else load.others_cores, "untrusted": untrusted,
    }  # fmt: skip


HEAD = (
    "| P | G | C | path tok | tree tok | TRL step s | per-path step s | tree step s | vs TRL: speedup "
    "/ bound / efficiency | median speedup vs TRL (spread TRL/per-path/tree) | vs per-path: speedup / "
    "bound / efficiency | no-grad speedup vs TRL | peak GiB TRL / tree | generate s (apart) | timings |\n|"
    + "---|"
    * 15
)


def case_name(r: dict) -> str:
    return f"P={r['P']} G={r['G']} C={r['C']}"


def table(rows: list[dict], head: bool = True) -> str:
    """Markdown rows (with the header unless ``head=False``: rows printed as they come)."""
    lines = [HEAD] if head else []
    for r in rows:
        if "oom" in r:
            lines.append(f"| {r['P']} | {r['G']} | {r['C']} | OOM in {r['oom']} |" + " |" * 11)
            continue
        spread = "/".join(f"{r['spread'][m]:.0%}" for m in ("trl", "per_path", "tree"))
        trust = f"NOT TRUSTWORTHY ({len(r['untrusted'])} reasons below)" if r["untrusted"] else "ok"
        peak = " / ".join(f"{r['peak'][m]:.1f}" for m in ("trl", "tree")) if r["peak"] else "-"
        lines.append(
            f"| {r['P']} | {r['G']} | {r['C']} | {r['path_tokens']} | {r['tree_tokens']} | "
            f"{r['trl_step']:.3f} | {r['per_path_step']:.3f} | {r['tree_step']:.3f} | "
            f"{r['speedup']:.2f}x / {r['bound_trl']:.2f}x / **{r['efficiency_trl']:.2f}** | "
            f"{r['speedup_median']:.2f}x ({spread}) | "
            f"{r['speedup_per_path']:.2f}x / {r['bound']:.2f}x / **{r['efficiency']:.2f}** | "
            f"{r['nograd_speedup']:.2f}x | {peak} | "
            f"{'-' if r['generate'] is None else format(r['generate'], '.2f')} | {trust} |"
        )
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


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/trl_grpo.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--completion-lens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per batch (rows = prompts x G)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--quick", action="store_true", help="one small case (P=256, G=4, C=32, 5 repeats): a CPU check"
    )
    ap.add_argument("--generation", action="store_true", help="also time sampling C tokens (reported apart)")
    ap.add_argument("--write", action="store_true", help="write the table and plot to benchmarks/results/")
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    if argv is None:  # this process is the command: it may re-execute itself under tcmalloc
        use_allocator(args, args.device)
    if args.quick:
        args.prompt_lens, args.groups, args.completion_lens, args.repeats = [256], [4], [32], 5
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    before = machine_before()
    print(HEAD, flush=True)  # then each row as it is measured
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
                    print(table(rows[-1:], head=False), end="", flush=True)
            del trainer
    notes = noise_section(before, [(case_name(r), r.get("untrusted", [])) for r in rows])
    print("\n" + notes, end="")  # the rows are printed above, as they came
    text = (
        f"# GRPO scoring + backward: TreeGRPOTrainer vs trl.GRPOTrainer ({args.model}, {dtype})\n\n"
        f"{provenance(__file__, argv, args.device)}\n\n" + table(rows) + "\n" + notes
    )
    if args.write:
        md = result_path(f"trl_grpo_{args.model}", args.device)
        md.write_text(text)
        plot(rows, md.with_suffix(".png"))
        print(f"wrote {md} and {md.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
