"""Part 4, verl's trainer end to end: ``python -m verl.trainer.main_ppo`` (its default V1 trainer, a
vLLM rollout, actor + reference + critic in one run: GAE advantages, a KL loss) for two steps with
``strategy=fsdp2`` (verl's own engine) and with ``strategy=treetrain`` for the actor, reference and
critic, on the same seed; then the first step's metrics of the two runs side by side.

It is a GPU part because verl 0.9.1 cannot run its trainer on a CPU (``docs/guides/verl.md`` says
which verl code stops it). It runs where ``--verl-python`` (default: this interpreter) imports verl
and vLLM; elsewhere, and in the CPU dry run, each run is recorded ``unavailable`` after the inputs
are written (a random-init Qwen3-shaped model with a small digit tokenizer and a chat template, a
prompt set, a reward function: no download) and the command is recorded, so the dry run checks all
but the launch. ``tests/test_integrations_verl_host.py`` composes the same command with verl's
own Hydra config (``--cfg job``) in the verl venv: every override is a key verl knows.

The comparison: step 1's rollout (``response_length/mean``, ``critic/score/mean``) must be the same
in both runs (vLLM with ``rollout.full_determinism``, one seed) else the engines saw different data
and the case says so; then every engine metric of step 1 (old-policy entropy, policy loss, KL,
critic values and loss, gradient norms) within bf16 noise: ``ENGINE_TOL`` relative, or absolute
near zero. Step 2 is recorded, not compared (the weights have already moved apart by bf16 rounding).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("fsdp2", "treetrain")
STEPS = 2
ROLLOUT_SAME = ("response_length/mean", "critic/score/mean")  # the data both engines train on
# step 1 metrics of the engines, with the bf16 tolerance (relative; the second number absolute, near
# zero): on the CPU verl's own bf16 engine is 0.03 off float64 in log-probs and up to 0.27 relative in
# gradients (tests/test_integrations_verl.py), the tree 0.002 and 0.014; two bf16 engines differ by
# about verl's error
ENGINE_TOL = {
    "actor/entropy": (0.05, 0.01),
    "actor/pg_loss": (0.1, 0.01),
    "actor/kl_loss": (0.1, 1e-3),
    "actor/grad_norm": (0.3, 0.01),
    "critic/vf_loss": (0.1, 0.01),
    "critic/values/mean": (0.1, 0.01),
    "critic/grad_norm": (0.3, 0.01),
}

REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The share of the digits in the response that equal the prompt's last digit."""
    digits = [c for c in solution_str if c.isdigit()]
    return sum(c == ground_truth for c in digits) / max(len(digits), 1)
'''
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_inputs(root: Path, model: dict, prompts: int = 16) -> Path:
    """The model (random init, float32 safetensors), its tokenizer, train/val parquet and the
    reward function under ``root``; returns ``root``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    special = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(special + list("0123456789 +=?"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", chat_template=CHAT
    )
    fast.add_tokens(special[2:], special_tokens=True)  # the chat markers stay whole
    fast.save_pretrained(root / "model")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=max(model["vocab"], len(vocab)), hidden_size=model["hidden"],
        intermediate_size=model["ffn"], num_hidden_layers=model["layers"],
        num_attention_heads=model["heads"], num_key_value_heads=model["kv_heads"],
        head_dim=model["head_dim"], tie_word_embeddings=model["tied"], max_position_embeddings=4096,
        pad_token_id=vocab["<|pad|>"], eos_token_id=vocab["<|end|>"], bos_token_id=None,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(root / "model")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(prompts):
        digits = "".join(str(d) for d in torch.randint(0, 10, (8,), generator=g).tolist())
        rows.append({
            "data_source": "digits", "prompt": [{"role": "user", "content": digits}],
            "reward_model": {"style": "rule", "ground_truth": digits[-1]}, "extra_info": {"index": i},
        })  # fmt: skip
    for split in ("train", "val"):
        pq.write_table(pa.Table.from_pylist(rows), root / f"{split}.parquet")
    (root / "reward.py").write_text(REWARD)
    return root


def overrides(root: Path, strategy: str, steps: int = STEPS) -> list[str]:
    """``main_ppo``'s Hydra overrides: one GPU, 8 prompts x 4 samples a step, GAE with a critic, a
    KL loss against the reference, the file logger; ``strategy`` for the actor (the reference
    follows it) and the critic."""
    model = str(root / "model")
    return [
        f"data.train_files={root / 'train.parquet'}", f"data.val_files={root / 'val.parquet'}",
        "data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=64",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        f"actor_rollout_ref.actor.strategy={strategy}", f"critic.strategy={strategy}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.full_determinism=True", "actor_rollout_ref.rollout.seed=0",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8", "critic.ppo_mini_batch_size=8",
        "algorithm.adv_estimator=gae",
        f"reward.custom_reward_function.path={root / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[file]", "trainer.project_name=treetrain", f"trainer.experiment_name={strategy}",
    ]  # fmt: skip


def command(python: str, root: Path, strategy: str) -> list[str]:
    return [python, "-m", "verl.trainer.main_ppo", *overrides(root, strategy)]


def unavailable(python: str, dry_run: bool) -> str | None:
    """Why ``main_ppo`` cannot run here, or None."""
    if dry_run:
        return "CPU dry run: verl 0.9.1's trainer needs a GPU (docs/guides/verl.md)"
    if shutil.which(python) is None and not Path(python).exists():
        return f"--verl-python {python} not found"
    probe = subprocess.run([python, "-c", "import verl, vllm"], capture_output=True, text=True)
    if probe.returncode:
        return f"verl and vLLM do not import in {python}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def metrics(path: Path) -> dict[int, dict]:
    """verl's file logger: one JSON line per step, ``{"step": s, "data": {name: value}}``."""
    return {r["step"]: r["data"] for r in map(json.loads, path.read_text().splitlines())}


def compare(a: dict, b: dict) -> dict:
    """Step-1 metrics of two runs (``a``: verl's engine, ``b``: the tree): the rollout must match
    exactly, the engine metrics within ``ENGINE_TOL``."""
    rollout = {k: (a.get(k), b.get(k)) for k in ROLLOUT_SAME}
    same_data = all(x == y and x is not None for x, y in rollout.values())
    rows, bad = [], []
    for key, (rel, floor) in ENGINE_TOL.items():
        if key not in a or key not in b:
            bad.append(f"{key} missing")
            continue
        x, y = float(a[key]), float(b[key])
        diff, tol = abs(x - y), max(rel * abs(x), floor)
        rows.append({"metric": key, "fsdp2": x, "treetrain": y, "diff": diff, "tol": tol})
        if diff > tol:
            bad.append(f"{key}: {x:.4g} vs {y:.4g}")
    out = {"rollout": rollout, "same_rollout": same_data, "rows": rows, "mismatches": bad}
    if not same_data:
        out |= {"status": "error", "error": f"the two runs' rollouts differ: {rollout}"}
    elif bad:
        out |= {"status": "error", "error": "; ".join(bad)}
    return out


def plan(sizes, out: Path, python: str | None) -> list:
    from .runner import Case

    python = python or sys.executable
    dry_run = sizes.device.type == "cpu"
    work = out / "verl" / "run"
    model = sizes.e2e_model

    def run(strategy: str):
        def go() -> dict:
            if not (work / "reward.py").exists():
                write_inputs(work, model)
            cmd = command(python, work, strategy)
            rec = {"command": " ".join(cmd)}
            why = unavailable(python, dry_run)
            if why:
                return rec | {"unavailable": why, "headline": f"unavailable: {why}"}
            log = work / f"{strategy}.jsonl"
            env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(log), PYTHONPATH=str(ROOT / "src"))
            proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
            (work / f"{strategy}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode:
                raise RuntimeError(f"main_ppo exited {proc.returncode}: {proc.stderr[-1500:]}")
            steps = metrics(log)
            return rec | {"steps": len(steps), "headline": f"{len(steps)} steps, log verl/run/{strategy}.log"}

        return go

    def check() -> dict:
        logs = [work / f"{s}.jsonl" for s in STRATEGIES]
        if not all(p.exists() for p in logs):
            return {"unavailable": "no main_ppo runs to compare", "headline": "unavailable"}
        a, b = (metrics(p)[1] for p in logs)
        res = compare(a, b)
        return res | {"headline": "step 1 metrics within bf16 noise" if not res["mismatches"] else ""}

    return [Case(f"main_ppo strategy={s}", run(s)) for s in STRATEGIES] + [Case("step 1 metrics", check)]
