"""A custom GRPO loop whose scoring runs as prefix trees, through ``treetrain.integrations.flat``.

The loop keeps the usual padded layout of RL trainers: left-padded prompts, right-padded sampled
completions, one ``[B, P + C]`` batch. ``flat_logprobs`` turns it into a tree (each prompt once, its
G completions as branches), runs one forward and hands back ``[B, C]`` log-probs, differentiable.

Two tasks:

- default, a toy on a tiny random-init Qwen3 (CPU, about a minute): the reward is the share of the
  token ``TARGET`` in a completion; the mean reward rises as the policy learns to emit it;
- ``--model smollm2-135m-instruct`` (or a local model directory): a real instruct model learns the
  calculator tool task of ``calculator_task.py`` (each completion is a tool call; the reward runs
  it). ``--check`` also scores every step's batch with the plain padded Hugging Face forward
  (positions from the attention mask, each row as if alone) and reports the largest log-prob
  difference; ``--write`` records the run under ``benchmarks/results`` with a plot.

    python examples/custom_grpo_loop.py          # 20 steps; reward ~0.02 -> ~0.85
    python examples/custom_grpo_loop.py --model smollm2-135m-instruct --steps 16 --check --write
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

from treetrain.integrations.flat import flat_logprobs

PAD, EOS, TARGET, VOCAB = 0, 1, 7, 32


def tiny_policy(seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def sample(
    model, prompts: torch.Tensor, prompt_mask: torch.Tensor, group: int, max_new: int, eos: int, pad: int
):
    """Left-padded ``prompts [N, P]`` -> ids ``[N * G, P + C]``, attention mask, completion mask
    ``[N * G, C]`` (a completion's tokens up to and including its first ``eos``)."""
    ids, mask = prompts.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    comp = out[:, ids.shape[1] :]
    after_eos = (comp == eos).int().cumsum(1) - (comp == eos).int()  # > 0 strictly after the first eos
    comp_mask = (after_eos == 0).long()
    return out, torch.cat([mask, comp_mask], 1), comp_mask


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def padded_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, keep: int) -> torch.Tensor:
    """The plain padded forward's ``[B, keep]`` completion log-probs (no grad): positions counted from
    each row's first real token, so every row sees what it would alone."""
    with torch.no_grad():
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -keep - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -keep:, None])[..., 0]


class Toy:
    """Random prompts over a 32-token vocabulary; reward: the share of ``TARGET`` in the completion."""

    def __init__(self, args):
        self.model, self.args = tiny_policy(args.seed), args
        self.eos, self.pad = EOS, PAD
        self.g = torch.Generator().manual_seed(args.seed)

    def prompts(self, step: int):
        p = torch.randint(2, VOCAB, (self.args.prompts, self.args.prompt_len), generator=self.g)
        return p, torch.ones_like(p), None

    def rewards(self, ids, comp_mask, _batch) -> torch.Tensor:
        C = comp_mask.shape[1]
        return (((ids[:, -C:] == TARGET) * comp_mask).sum(1) / comp_mask.sum(1).clamp(min=1)).float()


class Calculator:
    """The calculator tool task (``calculator_task.py``) on a pretrained instruct model."""

    def __init__(self, args):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import calculator_task

        from treetrain.models.pretrained import resolve_model

        self.task, self.args = calculator_task, args
        path = resolve_model(args.model)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.eos, self.pad = self.tok.eos_token_id, self.tok.pad_token_id
        self.problems = calculator_task.problems(args.steps * args.prompts, args.seed)

    def prompts(self, step: int):
        batch = self.problems[step * self.args.prompts : (step + 1) * self.args.prompts]
        texts = [self.task.render(self.tok, p["messages"]) for p in batch]
        enc = self.tok(
            texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        return enc.input_ids, enc.attention_mask, batch

    def rewards(self, ids, comp_mask, batch) -> torch.Tensor:
        C, G = comp_mask.shape[1], self.args.group
        texts = self.tok.batch_decode(
            ids[:, -C:] * comp_mask + self.pad * (1 - comp_mask), skip_special_tokens=True
        )
        return torch.tensor([self.task.reward(t, batch[i // G]["answer"]) for i, t in enumerate(texts)])


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a pretrained model: the calculator tool task (see above)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--prompt-len", type=int, default=48, help="toy task: prompt tokens")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--lr", type=float, default=None, help="default 3e-3 (toy), 2e-5 (--model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare with the padded forward every step")
    ap.add_argument("--write", action="store_true", help="--model: record the run in benchmarks/results")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    job = Calculator(args) if args.model else Toy(args)
    model = job.model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr or (2e-5 if args.model else 3e-3))
    t0, rows = time.perf_counter(), []
    for step in range(args.steps):
        prompts, prompt_mask, batch = job.prompts(step)
        ids, attn, comp_mask = sample(
            model.eval(), prompts, prompt_mask, args.group, args.max_new, job.eos, job.pad
        )
        C = comp_mask.shape[1]
        rewards = job.rewards(ids, comp_mask, batch)
        adv = group_advantages(rewards.float(), args.group)

        model.train()
        logp = flat_logprobs(model, ids, attn, logits_to_keep=C)  # [B, C]: one tree forward
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1, with the policy gradient
        loss = -((ratio * adv[:, None]) * comp_mask).sum() / comp_mask.sum()
        diff = None
        if args.check:  # the same batch through the padded forward (the same weights, before the step)
            ref = padded_logprobs(model.eval(), ids, attn, C)
            diff = ((logp.detach() - ref).abs() * comp_mask).max().item()
        opt.zero_grad()
        loss.backward()
        opt.step()

        mean = rewards.float().mean().item()
        rows.append({"step": step, "reward": mean, "loss": loss.item(), "max_lp_diff": diff,
                     "time": time.perf_counter() - t0})  # fmt: skip
        check = "" if diff is None else f"  |tree - padded| {diff:.1e}"
        print(f"step {step:3d}  reward {mean:.3f}  loss {loss.item():+.4f}{check}  {rows[-1]['time']:5.1f}s")
    if args.write and args.model:
        write(rows, args)
    return rows[-1]["reward"] - rows[0]["reward"]


def write(rows: list[dict], args) -> None:
    import datetime
    import os
    import platform

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open("/proc/cpuinfo") as f:
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine()
        )
    slug = "".join(c if c.isalnum() else "-" for c in cpu.lower()).strip("-")[:24].strip("-")
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    stem = (
        results / f"smollm2_custom_grpo_cpu-{os.cpu_count()}core-{slug}_{datetime.date.today().isoformat()}"
    )
    fig, ax = plt.subplots(figsize=(6.5, 4))
    steps, rew = [r["step"] + 1 for r in rows], [r["reward"] for r in rows]
    run = [sum(rew[max(0, i - 3) : i + 1]) / len(rew[max(0, i - 3) : i + 1]) for i in range(len(rew))]
    ax.plot(steps, rew, "C0-o", label="mean reward per step")
    ax.plot(steps, run, "C3-", label="running mean of 4 steps")
    ax.set(xlabel="step", ylabel="reward (calculator task)", ylim=(-0.02, 1.02))
    ax.set_title("SmolLM2-135M-Instruct, examples/custom_grpo_loop.py (flat_logprobs)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
    half = len(rew) // 2
    diffs = [r["max_lp_diff"] for r in rows if r["max_lp_diff"] is not None]
    table = "\n".join(
        f"| {r['step'] + 1} | {r['reward']:.3f} | {r['loss']:+.5f} | "
        + ("-" if r["max_lp_diff"] is None else f"{r['max_lp_diff']:.1e}")
        + " |"
        for r in rows
    )
    stem.with_suffix(".md").write_text(
        "# SmolLM2-135M-Instruct in a custom GRPO loop (examples/custom_grpo_loop.py): calculator "
        "tool task\n\n"
        f"- command: `python examples/custom_grpo_loop.py --model {args.model} --steps {args.steps} "
        "--prompts "
        f"{args.prompts} --group {args.group} --max-new {args.max_new} --lr {args.lr or 2e-5:g}"
        f"{' --check' if args.check else ''} --write`\n"
        f"- hardware: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; load average at the end {os.getloadavg()[0]:.1f} "
        "(a shared "
        f"machine: times are not speed figures); {rows[-1]['time']:.0f} s in all\n"
        "- scoring: `treetrain.flat_logprobs` (each prompt once, its G completions as branches); on-policy "
        "GRPO (ratio 1), group-normalized advantages, AdamW\n\n"
        f"Reward: step 1 {rew[0]:.3f}, last {rew[-1]:.3f}; mean of the first half "
        f"{sum(rew[:half]) / max(1, half):.3f}, "
        f"of the second half {sum(rew[half:]) / max(1, len(rew) - half):.3f}."
        + (
            f" Largest |tree - padded forward| completion log-prob over all steps: {max(diffs):.1e}."
            if diffs
            else ""
        )
        + f"\n\n| step | reward | loss | max log-prob diff vs padded |\n|---|---|---|---|\n{table}\n\n"
        f"![reward]({stem.name}.png)\n"
    )
    print(f"wrote {stem}.md and .png")


if __name__ == "__main__":
    main()
