"""TRL's RLOO, DPO and reward trainers vs their tree drop-ins: one training forward + backward (and DPO's
reference forward), timed three ways on the same batch, with the FLOP bound of each comparison.

The batch is TRL's padded layout for ``--prompts`` prompts of ``P`` tokens and completions of length
uniform in ``[C/2, C]``: RLOO ``G`` samples per prompt (left-padded prompts, right-padded completions,
the last ``C`` columns scored), DPO and reward one pair per prompt (``[chosen rows; rejected rows]``,
right padding). Each mode runs the model call the trainer makes, with what the trainer asks of it:

- ``trl``: the TRL trainer as shipped: RLOO's ``_get_per_token_logps_and_entropies`` (one padded
  forward), DPO's fused LM head ``model(..., labels, fused_lm_head=True)`` for the policy (log-probs,
  entropy, mean logit, top-1) and the reference (log-probs, no grad), the reward model's
  ``model(input_ids, attention_mask)``;
- ``per-path``: the same calls, each row alone and unpadded (what a trainer without padding waste
  but without sharing would run);
- ``tree``: the tree trainers' forwards (``TreeRLOOTrainer``'s override; the requests
  ``TreeDPOTrainer``/``TreeRewardTrainer`` pass to the same calls): each shared prompt once.

Then ``backward`` of a loss of the trainer's shape (RLOO: ``-(A * sum logp)``; DPO: ``-logsigmoid``
of the log-ratio margin; reward: ``-logsigmoid`` of the score margin). Modes alternate; each time is
the best of ``--repeats`` after a warm-up. Bounds (``treetrain.trees.flops``: decoder FLOPs per token
run, attention per pair computed, the LM head per target scored): TRL runs every padded position
(``L x L`` scores per row under its explicit mask; the fused head scores every position on CPU), the
per-path calls every real token of each row (causal pairs; the head on every position of the row on
CPU), the tree every distinct token. ``efficiency = speedup / bound``.

Usage::

    python benchmarks/trl_trainers.py --quick --write     # small CPU check (a few minutes)
    python benchmarks/trl_trainers.py --prompt-lens 512 1024 --completion-lens 64 256 --write
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_allocator_flag, hardware, result_path, use_allocator  # noqa: E402
from trl_grpo import MODELS, make_batch, timed  # noqa: E402

from treetrain.integrations.flat import FlatBatch  # noqa: E402
from treetrain.trees.flops import CostModel, Work, baseline_pairs, tree_pairs  # noqa: E402

TRAINERS = ("rloo", "dpo", "reward")


def qwen3(model_name: str, device: str, dtype, seq_cls: bool = False):
    cfg = transformers.Qwen3Config(
        **MODELS[model_name], max_position_embeddings=32768, tie_word_embeddings=False, pad_token_id=0
    )
    torch.manual_seed(0)
    auto = transformers.AutoModelForSequenceClassification if seq_cls else transformers.AutoModelForCausalLM
    if seq_cls:
        cfg.num_labels = 1
    return auto.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device), cfg


def rloo_trainer(model, G: int, device: str, dtype, workdir: str):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import RLOOConfig

    from treetrain.integrations.trl import TreeRLOOTrainer

    tk = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    args = RLOOConfig(
        output_dir=workdir, per_device_train_batch_size=G, num_generations=G, report_to="none",
        use_cpu=device == "cpu", bf16=dtype == torch.bfloat16, max_completion_length=8, beta=0.0,
    )  # fmt: skip
    return TreeRLOOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * G}), processing_class=tok,
    )  # fmt: skip


def work(ids, mask, scored_cols: torch.Tensor, cfg, device: str, head: bool = True) -> dict:
    """Training FLOPs of the three modes and the two bounds. ``scored_cols [B, L]``: the scored tokens."""
    tree = FlatBatch.build(ids, mask).tree
    cost = CostModel.from_config(cfg)
    rows, L = ids.shape
    scored = int(scored_cols.sum()) if head else 0
    cpu = device != "cuda"
    every_pos = rows * (L - 1) if head else 0
    row_pos = int((mask.sum(1) - 1).clamp(min=0).sum()) if head else 0
    w = {
        "trl": Work(tokens=rows * L, pairs=rows * L * L, targets=every_pos if cpu else scored),
        "per_path": Work(
            tokens=tree.num_path_tokens, pairs=baseline_pairs(tree), targets=row_pos if cpu else scored
        ),
        "tree": Work(tokens=tree.num_tokens, pairs=tree_pairs(tree), targets=scored),
    }
    f = {k: v.flops(cost) for k, v in w.items()}
    return {"bound_trl": f["trl"] / f["tree"], "bound": f["per_path"] / f["tree"],
            "path_tokens": tree.num_path_tokens, "tree_tokens": tree.num_tokens}  # fmt: skip


def pair_batch(prompts: int, P: int, C: int, vocab: int, seed: int):
    """DPO/reward layout: ``[chosen rows; rejected rows]``, right padding."""
    ids, mask, _ = make_batch(prompts, P, 2, C, vocab, seed)
    order = torch.cat([torch.arange(0, 2 * prompts, 2), torch.arange(1, 2 * prompts, 2)])
    return ids[order], mask[order]


def rloo_modes(trainer, ids, mask, C):
    from trl import RLOOTrainer

    model, adv = trainer.model, torch.randn(ids.shape[0], device=ids.device)
    comp = mask[:, -C:]

    def step(score, i=ids, m=mask, c=C, a=adv, cm=comp):
        lp, _, _ = score(model, i, m, c, compute_entropy=True)
        (-(a * (lp * cm).sum(1)).mean()).backward()

    def per_path():
        for r in range(ids.shape[0]):
            real = mask[r].bool()
            n = int(real[-C:].sum())
            i, m = ids[r][real][None], mask[r][real][None]
            step(lambda *a, **k: RLOOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k),
                 i, m, n, adv[r : r + 1], m[:, -n:])  # fmt: skip

    trl_score = lambda *a, **k: RLOOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k)  # noqa: E731
    return model, {"trl": lambda: step(trl_score), "per_path": per_path,
                   "tree": lambda: step(trainer._get_per_token_logps_and_entropies)}  # fmt: skip


def dpo_modes(model, ref, ids, mask, P):
    from trl.trainer.utils import add_fused_lm_head

    from treetrain.integrations.trl.preference import FusedTreeRequest
    from treetrain.integrations.wrapped import REQUEST_KWARG, install_tree_scoring

    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(model, outputs=outputs)
    add_fused_lm_head(ref)
    install_tree_scoring(model)
    install_tree_scoring(ref)
    req = {REQUEST_KWARG: FusedTreeRequest("bench", outputs)}
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :P] = -100

    def step(extra, i=ids, m=mask, lab=labels):
        lp = model(input_ids=i, attention_mask=m, labels=lab, fused_lm_head=True, **extra).log_probs.sum(1)
        with torch.no_grad():
            ref_lp = ref(
                input_ids=i, attention_mask=m, labels=lab, fused_lm_head=True, **extra
            ).log_probs.sum(1)
        return lp - ref_lp

    def loss(ratio):
        c, r = ratio.chunk(2)
        (-F.logsigmoid(0.1 * (c - r))).mean().backward()

    def per_path():
        half = ids.shape[0] // 2
        ratios = []
        for r in range(ids.shape[0]):
            real = mask[r].bool()
            ratios.append(step({}, ids[r][real][None], mask[r][real][None], labels[r][real][None]))
        ratios = torch.cat(ratios)
        loss(torch.cat([ratios[:half], ratios[half:]]))

    return model, {"trl": lambda: loss(step({})), "per_path": per_path, "tree": lambda: loss(step(req))}


def reward_modes(model, ids, mask):
    from treetrain.integrations.trl.preference import RewardTreeRequest
    from treetrain.integrations.wrapped import REQUEST_KWARG, install_tree_scoring

    install_tree_scoring(model)
    req = {REQUEST_KWARG: RewardTreeRequest("bench")}

    def loss(scores):
        c, r = scores.squeeze(-1).chunk(2)
        (-F.logsigmoid(c - r)).mean().backward()

    def per_path():
        scores = [model(input_ids=ids[r][mask[r].bool()][None]).logits for r in range(ids.shape[0])]
        loss(torch.cat(scores))

    return model, {
        "trl": lambda: loss(model(input_ids=ids, attention_mask=mask).logits),
        "per_path": per_path,
        "tree": lambda: loss(model(input_ids=ids, attention_mask=mask, **req).logits),
    }


def run_case(name, args, P, C, dtype, workdir, seed=0) -> dict:
    dev = args.device
    model, cfg = qwen3(args.model, dev, dtype, seq_cls=name == "reward")
    if name == "rloo":
        G = args.group
        trainer = rloo_trainer(model, G, dev, dtype, workdir)
        ids, mask, comp = make_batch(args.prompts, P, G, C, cfg.vocab_size, seed)
        ids, mask = ids.to(dev), mask.to(dev)
        scored = torch.zeros_like(mask)
        scored[:, -C:] = comp
        model, modes = rloo_modes(trainer, ids, mask, C)
    else:
        ids, mask = (x.to(dev) for x in pair_batch(args.prompts, P, C, cfg.vocab_size, seed))
        scored = mask.clone()
        scored[:, :P] = 0
        if name == "dpo":
            ref, _ = qwen3(args.model, dev, dtype)
            model, modes = dpo_modes(model, ref, ids, mask, P)
        else:
            model, modes = reward_modes(model, ids, mask)
    b = work(ids.cpu(), mask.cpu(), scored.cpu(), cfg, dev, head=name != "reward")
    times = {m: [] for m in modes}
    for r in range(args.repeats + 1):
        for m, fn in modes.items():
            t = timed(fn, dev)
            model.zero_grad(set_to_none=True)
            if r:
                times[m].append(t)
    best = {m: min(v) for m, v in times.items()}
    sp, sp_pp = best["trl"] / best["tree"], best["per_path"] / best["tree"]
    times = {f"{m}_s": t for m, t in best.items()}
    ratios = {
        "speedup": sp,
        "efficiency_trl": sp / b["bound_trl"],
        "speedup_pp": sp_pp,
        "efficiency": sp_pp / b["bound"],
    }
    return {"trainer": name, "P": P, "C": C, "rows": ids.shape[0], **b, **times, **ratios}


def table(rows: list[dict]) -> str:
    head = (
        "| trainer | P | C | rows | path tok | tree tok | TRL s | per-path s | tree s | "
        "vs TRL: speedup / bound / efficiency | vs per-path: speedup / bound / efficiency |\n|"
        + "---|" * 11
        + "\n"
    )
    return (
        head
        + "\n".join(
            f"| {r['trainer']} | {r['P']} | {r['C']} | {r['rows']} | {r['path_tokens']} | "
            f"{r['tree_tokens']} | "
            f"{r['trl_s']:.3f} | {r['per_path_s']:.3f} | {r['tree_s']:.3f} | {r['speedup']:.2f}x / "
            f"{r['bound_trl']:.2f}x / **{r['efficiency_trl']:.2f}** | {r['speedup_pp']:.2f}x / "
            f"{r['bound']:.2f}x / **{r['efficiency']:.2f}** |"
            for r in rows
        )
        + "\n"
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--completion-lens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group", type=int, default=8, help="RLOO samples per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="P=256, C=32, G=4, 2 repeats: a CPU check")
    ap.add_argument("--note", default="", help="a line written under the table (e.g. machine contention)")
    ap.add_argument("--write", action="store_true", help="write the table to benchmarks/results/")
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    if argv is None:
        use_allocator(args, args.device)
    if args.quick:
        args.prompt_lens, args.completion_lens, args.group, args.repeats = [256], [32], 4, 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.trainers:
            for C in args.completion_lens:
                for P in args.prompt_lens:
                    rows.append(run_case(name, args, P, C, dtype, workdir))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else hardware()
    text = (
        f"# TRL trainers vs their tree drop-ins: one training forward + backward ({args.model}, {dtype})\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name}, torch "
        f"{torch.__version__}, command: `python benchmarks/{Path(__file__).name} "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
        + table(rows)
        + (f"\n{args.note}\n" if args.note else "")
    )
    print(text)
    if args.write:
        md = result_path(f"trl_trainers_{args.model}", args.device)
        md.write_text(text)
        print(f"wrote {md}")
    return rows


if __name__ == "__main__":
    main()
