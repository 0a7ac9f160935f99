"""bf16 autocast on CPU vs float32, on a real model: the tree's bf16 error against the float32 truth is
no larger than what the per-path baseline's own bf16 run gets.

SmolLM2-135M-Instruct (``treetrain.models.pretrained``), float32 weights; one SFT batch: the per-turn
airline dialogue of the bundled messages sample rendered with the model's own chat template (5 paths,
each the conversation up to one assistant turn, loss on that turn). Four runs of the same loss
(token mean over the trained targets) with a backward each:

- per-path float32 (the truth): every path alone through the plain Hugging Face forward;
- per-path bf16: the same under ``torch.autocast("cpu", dtype=torch.bfloat16)``;
- tree float32 and tree bf16: the whole tree in one forward (``treetrain.compute_loss``).

For each: the largest and mean |log-prob - truth| over the trained targets, the loss's relative
error, and the gradient's relative error ``||g - g_truth|| / ||g_truth||`` over all parameters.

Usage::

    python benchmarks/smollm2_bf16.py            # table to stdout (~5 min on a quiet 2-core CPU)
    python benchmarks/smollm2_bf16.py --write    # + benchmarks/results/smollm2_bf16_*.md and .png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware, machine_before, result_path  # noqa: E402

from treetrain.data.reader import sample_path  # noqa: E402
from treetrain.data.records import parse_record  # noqa: E402
from treetrain.logprobs import path_logprobs  # noqa: E402
from treetrain.models.hf import prepare_model  # noqa: E402
from treetrain.models.pretrained import resolve_model  # noqa: E402
from treetrain.objectives.policy.aggregation import loss_normalizer
from treetrain.objectives.policy.config import Objective  # noqa: E402
from treetrain.objectives.policy.loss import compute_loss  # noqa: E402
from treetrain.trees.packing import pack  # noqa: E402

RECORD = "airline-00/per-turn"
# a ratio tree-bf16 / per-path-bf16 up to 1 + NOISE counts as "no larger": both runs round the same
# matmuls to bf16, so their errors agree to about the tree's own float32 difference (1e-4 of bf16's here),
# and a mean over ~200 targets moves by a few parts in 1000 with which rows share one matmul
NOISE = 0.01


def autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def grads(model) -> torch.Tensor:
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return g


def per_path(model, tree, bf16: bool) -> tuple[list[torch.Tensor], float, torch.Tensor]:
    """Every path alone through the plain forward: trained-target log-probs, loss, gradient."""
    masks = tree.fields["loss_masks"]
    n = sum(int(m[1:].sum()) for m in masks)
    lps, total = [], 0.0
    for p in range(tree.num_paths):
        ids = torch.as_tensor(tree.path(p))[None]
        trained = torch.as_tensor(masks[p][1:], dtype=torch.bool)
        with autocast(bf16):
            logits = model(input_ids=ids).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0][trained]
        loss = -lp.sum() / n
        loss.backward()
        total += float(loss)
        lps.append(lp.detach())
    return lps, total, grads(model)


def tree_run(model, tree, bf16: bool) -> tuple[list[torch.Tensor], float, torch.Tensor]:
    """The tree in one forward: the same targets' log-probs, loss and gradient."""
    objective = Objective("sft", report_entropy=False)
    with autocast(bf16):
        loss, _ = compute_loss(model, pack([tree]), objective, loss_normalizer([tree], objective))
    loss.backward()
    g = grads(model)
    with torch.no_grad(), autocast(bf16):
        lps = path_logprobs(model, tree)
    masks = tree.fields["loss_masks"]
    lps = [lp.float()[torch.as_tensor(m[1:], dtype=torch.bool)] for lp, m in zip(lps, masks)]
    return lps, float(loss), g


def errors(run, truth) -> dict:
    lps, loss, g = run
    t_lps, t_loss, t_g = truth
    diff = torch.cat([(a - b).abs() for a, b in zip(lps, t_lps)])
    return {
        "logprob_max": diff.max().item(),
        "logprob_mean": diff.mean().item(),
        "loss_rel": abs(loss - t_loss) / abs(t_loss),
        "grad_rel": ((g - t_g).norm() / t_g.norm()).item(),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)

    before = machine_before()
    path = resolve_model(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = prepare_model(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    model.train()  # SmolLM2 has no dropout: train and eval forwards are the same
    with open(sample_path("agent-dialogues-messages")) as f:
        rec = next(r for r in map(json.loads, f) if r["id"] == RECORD)
    tree, _ = parse_record(rec, tokenizer=tok)
    t0 = time.perf_counter()
    truth = per_path(model, tree, bf16=False)
    runs = {
        "per-path bf16": per_path(model, tree, bf16=True),
        "tree float32": tree_run(model, tree, bf16=False),
        "tree bf16": tree_run(model, tree, bf16=True),
    }
    wall = time.perf_counter() - t0
    errs = {name: errors(run, truth) for name, run in runs.items()}
    keys = ("logprob_max", "logprob_mean", "loss_rel", "grad_rel")
    lines = [
        "| run (vs per-path float32) | max abs log-prob err | mean abs log-prob err | loss rel err "
        "| grad rel err |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {name} | " + " | ".join(f"{e[k]:.2e}" for k in keys) + " |" for name, e in errs.items()]
    ratio = {k: errs["tree bf16"][k] / errs["per-path bf16"][k] for k in keys}
    table = "\n".join(lines)
    verdict = (
        "tree bf16 error / per-path bf16 error: "
        + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items())
        + (
            f" (all <= {1 + NOISE:g}: no larger than the per-path bf16 error)"
            if all(v <= 1 + NOISE for v in ratio.values())
            else f" (NOT all <= {1 + NOISE:g}: the tree adds bf16 error)"
        )
    )
    print(table + "\n\n" + verdict + f"\n({wall:.0f} s)")
    out = {
        "errors": errs,
        "ratio": ratio,
        "wall_s": wall,
        "tree": str(tree),
        "table": table,
        "verdict": verdict,
    }
    if args.write:
        write(out, before, args)
    return out


def write(out: dict, before: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    md = result_path("smollm2_bf16")
    keys = ("logprob_max", "logprob_mean", "loss_rel", "grad_rel")
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.27
    for i, name in enumerate(out["errors"]):
        xs = [k + (i - 1) * width for k in range(len(keys))]
        ax.bar(xs, [max(out["errors"][name][k], 1e-12) for k in keys], width, label=name)
    ax.set_xticks(
        range(len(keys)), ["max |log-prob| err", "mean |log-prob| err", "loss rel err", "grad rel err"]
    )
    ax.set_yscale("log")
    ax.set_ylabel("error against per-path float32")
    ax.set_title("SmolLM2-135M-Instruct, bf16 autocast on CPU: tree vs per-path", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(md.with_suffix(".png"), dpi=110)
    plt.close(fig)
    md.write_text(
        "# bf16 autocast on CPU vs float32 on SmolLM2-135M-Instruct: tree vs per-path\n\n"
        f"- command: `python benchmarks/smollm2_bf16.py --write`\n"
        f"- hardware: {hardware()}; machine before the run: {before['line']}\n"
        f"- model: {args.model} (float32 weights, torch.autocast('cpu', bfloat16) for the bf16 runs)\n"
        f"- batch: {RECORD} of the bundled messages sample, the model's chat template: {out['tree']}\n"
        "- truth: every path alone through the plain Hugging Face forward in float32; the loss is the "
        "token mean over the trained targets, with one backward per run\n\n"
        f"{out['table']}\n\n{out['verdict']}.\n\n![errors]({md.with_suffix('.png').name})\n"
    )
    print(f"wrote {md} and .png")


if __name__ == "__main__":
    main()
