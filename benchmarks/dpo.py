"""DPO training step, tree packing vs the per-path baseline, on pairs with long shared prompts.

Each step is ``--pairs`` synthetic pairs (random prompt of ``--prompt-len`` tokens, chosen and
rejected responses of ``--response-len`` tokens) through the functions ``treetrain train
--objective dpo`` uses (``pair_microbatches`` + ``train_step``): the policy's forward and backward
and the frozen reference's no-grad forward. ``tree``: each pair one tree, the prompt computed once;
``sequence``: every path its own forward (the prompt computed twice, by the policy and the
reference). Both start from the same weights and their first losses must agree (ln 2). The first
step of each mode is the warm-up; then modes alternate and each time is the minimum over
``--repeats`` steps (the least disturbed by other load).

Beside the measured speedup: the token ratio (path tokens / tree tokens) and the FLOP bound
(``treetrain.trees.flops``: linear layers and LM head per token, attention per allowed query-key pair;
the reference forward scales both modes alike, so the bound is the training-FLOP ratio).

Usage::

    python benchmarks/dpo.py                                   # small CPU configuration, to stdout
    python benchmarks/dpo.py --prompt-len 2048 --response-len 128 --pairs 8 --hidden 1024 \\
        --layers 8 --device cuda --write                       # a GPU recording
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import time

import numpy as np
import torch
import transformers
from common import hardware, judge, machine_before, noise_section, result_path

from treetrain.bench import noise
from treetrain.bench.measure import peak_bytes
from treetrain.data.records import parse_record
from treetrain.objectives.preference.loss import PreferenceObjective
from treetrain.objectives.preference.pairs import pair_microbatches
from treetrain.objectives.preference.training import PreferenceTraining
from treetrain.train.batches import StepBatch
from treetrain.train.build import build_optimizer, configure_model
from treetrain.train.step import train_step
from treetrain.trees.flops import CostModel, flop_bound, token_bound
from treetrain.trees.packing import pack


def make_pairs(n: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rec = {
            "prompt_ids": rng.integers(0, vocab, prompt_len).tolist(),
            "chosen_ids": rng.integers(0, vocab, response_len).tolist(),
            "rejected_ids": rng.integers(0, vocab, response_len).tolist(),
        }
        out.append(parse_record(rec)[0])
    return out


def model_config(args):
    return transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=args.prompt_len + args.response_len + 8,
        tie_word_embeddings=False,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention", default=None, help="tree attention backend (default: by device)")
    p.add_argument("--write", action="store_true", help="write a markdown table to benchmarks/results/")
    args = p.parse_args()
    before = machine_before()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = model_config(args)
    base = transformers.AutoModelForCausalLM.from_config(config).to(device)
    trees = make_pairs(args.pairs, args.prompt_len, args.response_len, args.vocab, seed=0)
    loss = PreferenceObjective("dpo")
    capacity = 10**9
    runs = {}
    for mode in ("tree", "sequence"):
        model = configure_model(copy.deepcopy(base), False)
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        opt = build_optimizer(
            model, argparse.Namespace(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
        )
        micro = [pack(mb) for mb in pair_microbatches(trees, mode, capacity)]
        batch = StepBatch(trees=trees, micro=micro, trees_consumed=len(trees), packing=mode)
        objective = PreferenceTraining(loss)  # the train loop's view of the DPO objective
        objective.reference = ref
        runs[mode] = (model, objective, opt, batch)

    def step(mode):
        model, objective, opt, batch = runs[mode]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = train_step(model, opt, batch, objective, grad_clip=None, backend=args.attention)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out["loss"]

    first = {mode: step(mode)[1] for mode in runs}  # warm-up; the same weights: the same loss
    assert abs(first["tree"] - math.log(2)) < 1e-4 and abs(first["sequence"] - first["tree"]) < 1e-4, first
    times = {mode: [] for mode in runs}
    with noise.Monitor() as monitor:
        for r in range(args.repeats):
            for mode in list(runs) if r % 2 == 0 else list(runs)[::-1]:  # interleaved, order alternating
                times[mode].append(step(mode)[0])
    stats, untrusted = judge({"tree": times["tree"], "baseline": times["sequence"]}, monitor.load)
    # after the timings: one profiled step per mode (the profiler's cost stays out of the times)
    peak = {mode: peak_bytes(lambda mode=mode: step(mode), device) / 2**20 for mode in runs}
    t_tree, t_seq = min(times["tree"]), min(times["sequence"])
    bound = flop_bound(trees, CostModel.from_config(config))
    speedup = t_seq / t_tree
    untrusted += noise.verdict({}, efficiency=speedup / bound)  # above 1.05 of the bound: flagged
    row = (
        f"| {args.pairs} | {args.prompt_len} | {args.response_len} "
        f"| {args.hidden}x{args.layers}, V={args.vocab} | {token_bound(trees):.2f} | {bound:.2f} "
        f"| {t_seq * 1e3:.0f} | {t_tree * 1e3:.0f} | {speedup:.2f} "
        f"| {stats['baseline']['median'] / stats['tree']['median']:.2f} "
        f"({stats['baseline']['spread']:.0%}/{stats['tree']['spread']:.0%}) | {speedup / bound:.0%} "
        f"| {peak['sequence']:.0f} / {peak['tree']:.0f} ({peak['sequence'] / peak['tree']:.2f}x; "
        f"{token_bound(trees):.2f}x) | {'NOT TRUSTWORTHY' if untrusted else 'ok'} |"
    )
    header = (
        "| pairs | prompt | response | model (hidden x layers) | token ratio | FLOP bound | sequence ms "
        "| tree ms | speedup | median (spread seq/tree) | of bound "
        "| peak live MiB seq / tree (ratio; activation bound) | timings |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    table = f"{header}\n{row}\n\n" + noise_section(before, [(f"{args.pairs} pairs", untrusted)])
    print(table)
    print(
        f"first losses: tree {first['tree']:.6f}, sequence {first['sequence']:.6f} (ln 2 = {math.log(2):.6f})"
    )
    if args.write:
        dev = "cuda" if device.type == "cuda" else "cpu"
        where = torch.cuda.get_device_name(device) if dev == "cuda" else hardware()
        path = result_path("dpo", dev)
        path.write_text(
            f"# DPO step: tree packing vs per-path baseline ({datetime.date.today().isoformat()})\n\n"
            f"Hardware: {where}. Times: min over {args.repeats} steps after a warm-up, modes interleaved. "
            f"Policy forward+backward and the reference's no-grad forward per step. Peak live MiB: the "
            "most tensor bytes alive at once during one step of each mode (treetrain.bench.measure."
            f"peak_bytes), beside the activation bound (path tokens / distinct tokens).\n\n{table}\n"
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
