"""TRL's RLOO, DPO and reward trainers vs their tree drop-ins: one training forward + backward (and DPO's
reference forward), timed four ways on the same batch, with the FLOP bound of each comparison.

The batch is TRL's padded layout for ``prompts`` prompts of ``P`` tokens and completions of length
uniform in ``[C/2, C]``: RLOO ``G`` samples per prompt (left-padded prompts, right-padded completions,
the last ``C`` columns scored), DPO and reward one pair per prompt (``[chosen rows; rejected rows]``,
right padding). Each mode runs the model call the trainer makes, with what the trainer asks of it:

- ``trl``: the TRL trainer in its best configuration: RLOO's ``_get_per_token_logps_and_entropies``
  (one padded forward), DPO's fused LM head ``model(..., labels, fused_lm_head=True)`` for the policy
  (log-probs, entropy, mean logit, top-1) and the reference (log-probs, no grad), the reward model's
  ``model(input_ids, attention_mask)``; the fused head scores the completion positions only, as TRL
  runs it on CUDA (``trl_grpo.trl_compact_head``: on the CPU TRL as shipped scores every position);
- ``trl-shipped`` (RLOO, DPO): the same as shipped on this device, its own column, never the baseline;
- ``per-path``: the same calls (best configuration), each row alone and unpadded (what a trainer
  without padding waste but without sharing would run);
- ``tree``: the tree trainers' forwards (``TreeRLOOTrainer``'s override; the requests
  ``TreeDPOTrainer``/``TreeRewardTrainer`` pass to the same calls): each shared prompt once.

Then ``backward`` of a loss of the trainer's shape (RLOO: ``-(A * sum logp)``; DPO: ``-logsigmoid``
of the log-ratio margin; reward: ``-logsigmoid`` of the score margin). ``--repeats`` rounds after a
warm-up round, the modes interleaved (order alternating), under ``treetrain.bench.noise``: each time
is the best, with each mode's spread and the reasons not to trust a row.

Bounds (``treetrain.trees.flops``: decoder FLOPs per token run, attention per pair computed, the LM
head per target scored, x3 for forward + backward, one more head matmul per target whose logits
backward recomputes; DPO's reference forward x1): TRL runs every padded position (``L x L`` scores
per row under its explicit mask), its chunked head on the completion positions (shipped, on the CPU:
every position) and recomputes their logits in backward; the per-path calls every real token of each
row (causal pairs); the tree every distinct token, its head keeping logits up to 1 GiB.
``efficiency = speedup / bound``; above 1.05 is flagged (work the bound does not price), not a speedup.
``--flops`` counts what each mode executes (``FlopCounterMode``) against that model.

Memory: each mode's peak of live tensors during one step beside the activation bound.

Usage::

    python benchmarks/trl_trainers.py --quick                       # small CPU check
    python benchmarks/trl_trainers.py --preset small --write        # the CPU cases (QUIET_RUNS.md)
    python benchmarks/trl_trainers.py --preset smollm2-135m --write # a real vocabulary and depth
    python benchmarks/trl_trainers.py --quick --flops               # counted vs modeled FLOPs
    python benchmarks/trl_trainers.py --preset small --estimate     # run time from FLOPs, no run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
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
from trl_grpo import (  # noqa: E402
    LOGITS_KEEP_BYTES,
    MODELS,
    RATES,
    add_verdicts_and_peaks,
    make_batch,
    online_trainer,
    qwen3,
    trl_compact_head,
)

from treetrain.bench import noise  # noqa: E402
from treetrain.integrations.flat import FlatBatch  # noqa: E402
from treetrain.trees.flops import CostModel, Work, baseline_pairs, recomputed_targets, tree_pairs  # noqa: E402

TRAINERS = ("rloo", "dpo", "reward")
# (P, C, prompts) per preset, with the model, RLOO's group and repeats
PRESETS = {
    "quick": dict(model="small", cases=[(256, 32, 2)], group=4, repeats=2),
    "small": dict(model="small", cases=[(512, 64, 2), (1024, 256, 2)], group=8, repeats=3),
    "smollm2-135m": dict(model="smollm2-135m", cases=[(512, 64, 2)], group=4, repeats=3),
    "qwen3-0.6b": dict(model="qwen3-0.6b", cases=[(256, 64, 2)], group=4, repeats=2),
}


def rloo_trainer(model, G: int, device: str, dtype, workdir: str):
    return online_trainer("RLOO", model, G, device, dtype, workdir, beta=0.0)


def work(ids, mask, scored_cols: torch.Tensor, cfg, device: str, name: str) -> dict:
    """Work of each mode (``{"trl", "trl_shipped", "per_path", "tree"}``: ``(train, reference)``
    ``Work`` pairs), their FLOPs and the bounds. ``scored_cols [B, L]``: the scored tokens."""
    tree = FlatBatch.build(ids, mask).tree
    cost = CostModel.from_config(cfg)
    rows, L = ids.shape
    V = cfg.vocab_size
    head = name != "reward"
    scored = int(scored_cols.sum()) if head else 0
    every = (scored if device == "cuda" else rows * (L - 1)) if head else 0
    padded = dict(tokens=rows * L, pairs=rows * L * L)
    train = {
        "trl": Work(**padded, targets=scored, recomputed=scored),
        "trl_shipped": Work(**padded, targets=every, recomputed=every),
        "per_path": Work(tree.num_path_tokens, baseline_pairs(tree), scored, scored),
        "tree": Work(
            tree.num_tokens, tree_pairs(tree), scored, recomputed_targets([scored], V, LOGITS_KEEP_BYTES)
        ),
    }
    if name == "dpo":  # TreeDPOTrainer answers the fused-head call with TRL's own kernel: it recomputes too
        train["tree"] = Work(tree.num_tokens, tree_pairs(tree), scored, scored)
    if not head:  # the reward model's score head is hidden x 1: not counted
        train["per_path"] = Work(tree.num_path_tokens, baseline_pairs(tree))
    ref = {m: (Work(w.tokens, w.pairs, w.targets) if name == "dpo" else Work()) for m, w in train.items()}
    flops = {m: train[m].flops(cost) + ref[m].forward_flops(cost) for m in train}
    return {
        "work": {m: (train[m], ref[m]) for m in train},
        "flops": flops,
        "bound_trl": flops["trl"] / flops["tree"],
        "bound_shipped": flops["trl_shipped"] / flops["tree"],
        "bound": flops["per_path"] / flops["tree"],
        "path_tokens": tree.num_path_tokens,
        "tree_tokens": tree.num_tokens,
    }


def pair_batch(prompts: int, P: int, C: int, vocab: int, seed: int):
    """DPO/reward layout: ``[chosen rows; rejected rows]``, right padding."""
    ids, mask, _ = make_batch(prompts, P, 2, C, vocab, seed)
    order = torch.cat([torch.arange(0, 2 * prompts, 2), torch.arange(1, 2 * prompts, 2)])
    return ids[order], mask[order]


def rloo_modes(trainer, ids, mask, C):
    from trl import RLOOTrainer

    model, adv = trainer.model, torch.randn(ids.shape[0], device=ids.device)
    comp = mask[:, -C:]
    trl_score = lambda *a, **k: RLOOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k)  # noqa: E731

    def step(score, i=ids, m=mask, c=C, a=adv, cm=comp):
        lp, _, _ = score(model, i, m, c, compute_entropy=True)
        (-(a * (lp * cm).sum(1)).mean()).backward()

    def per_path():
        for r in range(ids.shape[0]):
            real = mask[r].bool()
            n = int(real[-C:].sum())
            i, m = ids[r][real][None], mask[r][real][None]
            step(trl_score, i, m, n, adv[r : r + 1], m[:, -n:])

    return model, {
        "trl": lambda: step(trl_score),
        "trl_shipped": lambda: step(trl_score),
        "per_path": per_path,
        "tree": lambda: step(trainer._get_per_token_logps_and_entropies),
    }


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
        ratios = []
        for r in range(ids.shape[0]):
            real = mask[r].bool()
            ratios.append(step({}, ids[r][real][None], mask[r][real][None], labels[r][real][None]))
        loss(torch.cat(ratios))

    return model, {
        "trl": lambda: loss(step({})),
        "trl_shipped": lambda: loss(step({})),
        "per_path": per_path,
        "tree": lambda: loss(step(req)),
    }


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


class Case:
    """One trainer's case: the model(s), the batch, its work and bounds, one step function per mode
    (the fused head compacted for every mode but ``trl_shipped``)."""

    def __init__(self, name, args, P, C, prompts, dtype, workdir, seed=0):
        dev = args.device
        self.name, self.P, self.C, self.prompts, self.device = name, P, C, prompts, dev
        model, cfg = qwen3(args.model, dev, dtype, seq_cls=name == "reward", pad_token_id=0)
        if name == "rloo":
            trainer = rloo_trainer(model, args.group, dev, dtype, workdir)
            ids, mask, comp = make_batch(prompts, P, args.group, C, cfg.vocab_size, seed)
            ids, mask = ids.to(dev), mask.to(dev)
            scored = torch.zeros_like(mask)
            scored[:, -C:] = comp
            model, modes = rloo_modes(trainer, ids, mask, C)
        else:
            ids, mask = (x.to(dev) for x in pair_batch(prompts, P, C, cfg.vocab_size, seed))
            scored = mask.clone()
            scored[:, :P] = 0
            if name == "dpo":
                ref, _ = qwen3(args.model, dev, dtype, pad_token_id=0)
                model, modes = dpo_modes(model, ref, ids, mask, P)
            else:
                model, modes = reward_modes(model, ids, mask)
        self.model, self.cfg, self.rows = model, cfg, ids.shape[0]
        self.bounds = work(ids.cpu(), mask.cpu(), scored.cpu(), cfg, dev, name)

        def compacted(mode, fn):
            def run():
                with trl_compact_head(mode != "trl_shipped"):
                    fn()
                model.zero_grad(set_to_none=True)

            return run

        self.steps = {m: compacted(m, fn) for m, fn in modes.items()}


def run_case(case: Case, repeats: int, shipped=True, memory=True) -> dict:
    dev = case.device
    steps = {m: f for m, f in case.steps.items() if shipped or m != "trl_shipped"}
    times = {m: [] for m in steps}
    monitor = noise.Monitor()
    for r in range(repeats + 1):
        if r == 1:  # the first round is the warm-up
            monitor.start()
        for m in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            t = timed(steps[m], dev)
            if r:
                times[m].append(t)
    load = monitor.stop() if repeats else None
    stats, untrusted = judge(times, load)
    best = {m: s["best"] for m, s in stats.items()}
    b = case.bounds
    sp, sp_pp = best["trl"] / best["tree"], best["per_path"] / best["tree"]
    row = {
        "trainer": case.name, "P": case.P, "C": case.C, "prompts": case.prompts, "rows": case.rows,
        "path_tokens": b["path_tokens"], "tree_tokens": b["tree_tokens"],
        **{f"{m}_s": t for m, t in best.items()},
        "speedup": sp, "bound_trl": b["bound_trl"], "efficiency_trl": sp / b["bound_trl"],
        "speedup_pp": sp_pp, "bound": b["bound"], "efficiency": sp_pp / b["bound"],
        "spread": {m: s["spread"] for m, s in stats.items()},
    }  # fmt: skip
    if "trl_shipped" in best:
        row["speedup_shipped"] = best["trl_shipped"] / best["tree"]
        row["bound_shipped"] = b["bound_shipped"]
        row["efficiency_shipped"] = row["speedup_shipped"] / b["bound_shipped"]
    checks = {
        "efficiency_trl": "vs TRL",
        "efficiency": "vs per-path",
        "efficiency_shipped": "vs TRL as shipped",
    }
    add_verdicts_and_peaks(row, untrusted, checks, case, dev, memory)
    return row


def flop_audit(case: Case) -> list[dict]:
    """Per mode: the FLOPs one step executes (``FlopCounterMode``) vs the bound's model of it."""
    from treetrain.bench.measure import count_flops

    cost = CostModel.from_config(case.cfg)
    out = []
    for mode, step in case.steps.items():
        train, ref = case.bounds["work"][mode]
        model = {
            "linear": (3 * train.tokens + ref.tokens) * cost.linear,
            "attention": (3 * train.pairs + ref.pairs) * cost.per_pair,
            "head": (3 * train.targets + train.recomputed + ref.targets) * cost.head,
        }
        counted = count_flops(step, vocab=case.cfg.vocab_size if case.name != "reward" else None)
        out.append({"case": f"{case.name} P={case.P} C={case.C} x{case.prompts}", "mode": mode,
                    "counted": counted, "model": model})  # fmt: skip
    return out


def case_name(r: dict) -> str:
    return f"{r['trainer']} P={r['P']} C={r['C']} x{r['prompts']}"


def table(rows: list[dict]) -> str:
    head = (
        "| trainer | P | C | prompts | rows | path tok | tree tok | TRL s | per-path s | tree s | "
        "vs TRL: speedup / bound / efficiency | vs per-path: speedup / bound / efficiency | "
        "vs TRL as shipped: s, speedup / bound | peak MiB TRL / per-path / tree | memory TRL / tree "
        "(activation bound) | spread TRL / per-path / tree | timings |\n|" + "---|" * 17 + "\n"
    )
    lines = []
    for r in rows:
        pk = r["peak"]
        peak = " / ".join(f"{pk[m]:.0f}" for m in ("trl", "per_path", "tree")) if pk else "-"
        mem = f"{pk['trl'] / pk['tree']:.2f} ({r['path_tokens'] / r['tree_tokens']:.2f})" if pk else "-"
        shipped = "-"
        if "trl_shipped_s" in r:
            shipped = f"{r['trl_shipped_s']:.3f}, {r['speedup_shipped']:.2f}x / {r['bound_shipped']:.2f}x"
        spread = " / ".join(f"{r['spread'][m]:.0%}" for m in ("trl", "per_path", "tree"))
        trust = f"NOT TRUSTWORTHY ({len(r['untrusted'])} reasons below)" if r["untrusted"] else "ok"
        lines.append(
            f"| {r['trainer']} | {r['P']} | {r['C']} | {r['prompts']} | {r['rows']} | {r['path_tokens']} | "
            f"{r['tree_tokens']} | {r['trl_s']:.3f} | {r['per_path_s']:.3f} | {r['tree_s']:.3f} | "
            f"{r['speedup']:.2f}x / {r['bound_trl']:.2f}x / **{r['efficiency_trl']:.2f}** | "
            f"{r['speedup_pp']:.2f}x / {r['bound']:.2f}x / **{r['efficiency']:.2f}** | {shipped} | {peak} | "
            f"{mem} | {spread} | {trust} |"
        )
    return head + "\n".join(lines) + "\n"


def estimate(args, cases) -> float:
    """Seconds the run would take from its FLOPs (no model built): ``repeats + 1`` rounds of every
    mode and a memory step of three, per trainer and case."""
    cfg = transformers.Qwen3Config(**MODELS[args.model])
    total = 0.0
    for name in args.trainers:
        for P, C, prompts in cases:
            if name == "rloo":
                ids, mask, comp = make_batch(prompts, P, args.group, C, cfg.vocab_size, 0)
                scored = torch.zeros_like(mask)
                scored[:, -C:] = comp
            else:
                ids, mask = pair_batch(prompts, P, C, cfg.vocab_size, 0)
                scored = mask.clone()
                scored[:, :P] = 0
            f = work(ids, mask, scored, cfg, args.device, name)["flops"]
            modes = ["trl", "per_path", "tree"] + (
                ["trl_shipped"] if name != "reward" and not args.no_shipped else []
            )
            flops = (args.repeats + 1) * sum(f[m] for m in modes)
            flops += 0 if args.no_memory else f["trl"] + f["per_path"] + f["tree"]
            total += flops
            print(f"  {name} P={P} C={C} x{prompts}: {flops / 1e12:.1f} TFLOP, {flops / args.rate:.0f} s")
    return total / args.rate


def _case(text: str) -> tuple[int, int, int]:
    try:
        parts = [int(x) for x in text.split(":")]
        assert len(parts) in (2, 3)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"a case is P:C or P:C:prompts, e.g. 512:64:2; got {text!r}"
        ) from None
    return (*parts, 2) if len(parts) == 2 else tuple(parts)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model, cases, group, repeats")
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--completion-lens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per batch")
    ap.add_argument("--cases", type=_case, nargs="+", metavar="P:C[:prompts]", help="instead of the grid")
    ap.add_argument("--group", type=int, default=None, help="RLOO samples per prompt")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="--preset quick: P=256, C=32, G=4, 2 repeats")
    ap.add_argument("--no-shipped", action="store_true", help="skip the column of TRL as shipped")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory step of each mode")
    ap.add_argument("--flops", action="store_true", help="only count each mode's FLOPs vs the bound's model")
    ap.add_argument("--estimate", action="store_true", help="only print the run time estimated from FLOPs")
    ap.add_argument(
        "--rate", type=float, default=None, help="FLOP/s for --estimate (default: trl_grpo.RATES)"
    )
    ap.add_argument("--note", default="", help="a line written under the table (e.g. machine contention)")
    ap.add_argument("--write", action="store_true", help="write the table to benchmarks/results/")
    add_allocator_flag(ap)
    args = ap.parse_args(argv)
    preset = PRESETS["quick" if args.quick else args.preset] if (args.quick or args.preset) else {}
    args.model = args.model or preset.get("model", "small")
    args.group = args.group or preset.get("group", 8)
    args.repeats = args.repeats if args.repeats is not None else preset.get("repeats", 3)
    grid = args.cases or preset.get("cases") or [
        (P, C, args.prompts) for C in args.completion_lens for P in args.prompt_lens
    ]  # fmt: skip
    if args.estimate:
        args.rate = args.rate or RATES[args.model]
        print(estimate_line(Path(__file__).name, argv, estimate(args, grid), args.rate))
        return []
    if argv is None:
        use_allocator(args, args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    before = machine_before()
    rows, audit = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.trainers:
            for P, C, prompts in grid:
                case = Case(name, args, P, C, prompts, dtype, workdir)
                if args.flops:
                    audit += flop_audit(case)
                    continue
                rows.append(run_case(case, args.repeats, not args.no_shipped, not args.no_memory))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    stamp = f"{provenance(__file__, argv, args.device)}; {block_rule_line()}\n\n"
    if args.flops:
        text = (
            f"# TRL trainers vs their tree drop-ins: FLOPs executed vs the bound's model ({args.model})\n\n"
        )
        text += stamp + flop_audit_table(audit, "the reward model's hidden x 1 score head, the optimizer")
    else:
        text = (
            f"# TRL trainers vs their tree drop-ins: one training forward + backward ({args.model}, {dtype})"
            f"\n\n{stamp}{table(rows)}\n"
            + noise_section(before, [(case_name(r), r["untrusted"]) for r in rows])
            + (f"\n{args.note}\n" if args.note else "")
        )
    print(text)
    if args.write:
        md = result_path(f"trl_trainers_{'flops_' if args.flops else ''}{args.model}", args.device)
        md.write_text(text)
        print(f"wrote {md}")
    return rows if not args.flops else audit


if __name__ == "__main__":
    main()
