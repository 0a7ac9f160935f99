"""``treetrain train --objective ppo_critic``: tree packing == the per-path baseline, end to end, and
resume after a checkpoint == the uninterrupted run.

Trees with a long shared prompt (40-56 tokens) and 3 branches of 2-6 tokens, a scalar reward per
path, ``old_logprobs`` in the second step's records (the first step runs on-policy, ratio 1). Both
packings compute the same sums in float32 in different orders, so they differ by rounding only: the
bar is rel <= 1e-3 on losses and on the updates of both models (``|w_tree - w_seq| / |w_seq - w_0|``,
2-norm over all parameters, as in test_train_preference). Measured: updates ~5e-6. The per-path
float64 equivalence of the loss and of every gradient is tests/test_objectives_value.py's; here it
is the wiring: data, critic, optimizers, schedule, checkpoints, export.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from treetrain.objectives.ppo_critic import build_critic
from treetrain.train.build import build_model
from treetrain.train.config import TrainConfig
from treetrain.train.kit import RunKit
from treetrain.train.loop import train
from treetrain.train.step import NonFiniteError

from .reference import saved_weights, tiny_config, update_err

VOCAB = 97


def write_trees(path, n: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = rng.integers(0, VOCAB, int(rng.integers(40, 56))).tolist()
            paths = [prompt + rng.integers(0, VOCAB, int(rng.integers(2, 7))).tolist() for _ in range(3)]
            masks = [[0] * len(prompt) + [1] * (len(p) - len(prompt)) for p in paths]
            rec = {"paths": paths, "loss_masks": masks, "rewards": rng.normal(size=3).round(3).tolist()}
            if i >= 2:  # 2nd step: the sampling policy's log-probs (a batch has them on all or none)
                rec["old_logprobs"] = [(-4.6 + 0.1 * rng.normal(size=len(p) - 1)).tolist() for p in paths]
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic")
    write_trees(d / "trees.jsonl")
    tiny_config("qwen3", vocab=VOCAB).save_pretrained(d / "tiny")
    return d


def run(setup_dir, out, **over):
    cfg = TrainConfig(
        data=str(setup_dir / "trees.jsonl"),
        model=str(setup_dir / "tiny"),
        output=str(out),
        objective="ppo_critic",
        loss={"critic_lr": "3e-3", "gamma": 0.99},  # a string, as `--set loss.critic_lr=3e-3` gives it
        steps=3,
        batch_trees=2,
        lr=1e-3,
        warmup_steps=1,
        schedule="cosine",
        progress=False,
        prefetch=0,
        device="cpu",
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return train(cfg, quiet=True)


def test_tree_equals_sequence_and_critic_export(setup_dir, tmp_path):
    runs = {p: run(setup_dir, tmp_path / p, packing=p) for p in ("tree", "sequence")}
    tree, seq = runs["tree"].records, runs["sequence"].records
    assert len(tree) == 3 and all(r["tree_tokens"] < 0.5 * r["tokens"] for r in tree)
    for a, b in zip(tree, seq):
        for key in ("loss", "value_loss", "policy_loss", "advantage", "value"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
        assert a["critic_grad_norm"] > 0 and a["computed_tokens"] < b["computed_tokens"]
    assert tree[0]["value_loss"] > 0 and tree[-1]["value_loss"] != tree[0]["value_loss"]

    policy_init = build_model(str(setup_dir / "tiny"), 0, torch.float32, torch.device("cpu"))
    init = {k: v.double() for k, v in policy_init.state_dict().items()}
    w = {p: saved_weights(r.final, transformers.AutoModelForCausalLM) for p, r in runs.items()}
    err_policy = update_err(w["tree"], w["sequence"], init)
    auto = transformers.AutoModelForTokenClassification
    c = {p: saved_weights(r.output / "final_critic", auto) for p, r in runs.items()}
    # the critic starts from the policy's backbone; its head from the seed (compared to itself)
    c_init = {k: init[k] for k in c["tree"] if k in init}
    backbone = [k for k in c["tree"] if k in init]
    err_critic = update_err(*({k: d[k] for k in backbone} for d in (c["tree"], c["sequence"], c_init)))
    print(f"ppo_critic updates: policy {err_policy:.3g}, critic backbone {err_critic:.3g}")
    assert err_policy <= 1e-3 and err_critic <= 1e-3
    head = [k for k in c["tree"] if k.startswith("score.")]
    assert head and all(torch.allclose(c["tree"][k], c["sequence"][k], rtol=1e-3, atol=1e-6) for k in head)

    critic = auto.from_pretrained(runs["tree"].output / "final_critic")
    assert type(critic).__name__ == "Qwen3ForTokenClassification" and critic.config.num_labels == 1
    with torch.no_grad():
        assert critic(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1)


def test_resume_gives_the_same_steps(setup_dir, tmp_path):
    """Both models, both AdamW states, the schedule and the data position come back: steps 3-4 of a
    resumed run are bit-identical to the uninterrupted run's (the critic's value loss included)."""
    full = run(setup_dir, tmp_path / "full", steps=4, checkpoint_every=2).records
    out = tmp_path / "cut"  # the run as if stopped after its step-2 checkpoint
    shutil.copytree(tmp_path / "full", out)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"  # the final step's
    shutil.rmtree(out / "checkpoints" / "step_4")
    (out / "checkpoints" / "latest").write_text("step_2\n")
    resumed = run(setup_dir, out, steps=4, checkpoint_every=2, resume=True).records
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        for key in ("loss", "value_loss", "grad_norm", "critic_grad_norm", "lr"):
            assert a[key] == b[key], key


def test_resume_with_lora_policy(setup_dir, tmp_path):
    """A LoRA policy (its optimizer has no no-decay parameters) with a full critic resumes exactly too."""
    lora = {"lora_r": 4, "steps": 2, "checkpoint_every": 1}
    full = run(setup_dir, tmp_path / "full", **lora).records
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_2")  # the final step's checkpoint
    (tmp_path / "cut" / "checkpoints" / "latest").write_text("step_1")
    resumed = run(setup_dir, tmp_path / "cut", resume=True, **lora).records
    assert [r["step"] for r in resumed] == [2]
    assert all(full[1][k] == resumed[0][k] for k in ("loss", "value_loss", "grad_norm", "critic_grad_norm"))


def test_critic_from_a_saved_model(setup_dir, tmp_path):
    """``loss.critic_model=DIR`` starts the critic from a saved model (here a 1-label sequence
    classifier, as a reward model is saved); with critic_lr 0 the exported critic is that model."""
    torch.manual_seed(3)
    rm = transformers.AutoModelForSequenceClassification.from_config(
        tiny_config("qwen3", vocab=VOCAB, num_labels=1)
    )
    rm.save_pretrained(tmp_path / "rm")
    loss = {"critic_model": str(tmp_path / "rm"), "critic_lr": 0.0}
    result = run(setup_dir, tmp_path / "out", loss=loss, steps=1)
    got = saved_weights(result.output / "final_critic", transformers.AutoModelForTokenClassification)
    want = {k: v.double() for k, v in rm.state_dict().items()}
    assert set(want) <= set(got) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(got["score.bias"], torch.zeros(1, dtype=torch.float64))  # the classifier has none
    with pytest.raises(ValueError, match="critic_model .*config.json"):
        run(setup_dir, tmp_path / "out2", loss={"critic_model": str(tmp_path)}, steps=1)


def test_bad_records_and_options(setup_dir, tmp_path):
    bad = tmp_path / "adv.jsonl"
    bad.write_text(json.dumps({"paths": [[1, 2, 3], [1, 2, 4]], "advantages": [1.0, -1.0]}) + "\n")
    with pytest.raises(ValueError, match=r"adv.jsonl:1: advantages: .* computes them"):
        run(setup_dir, tmp_path / "a", data=str(bad), steps=1)
    bad.write_text("\n" + json.dumps({"paths": [[1, 2, 3], [1, 2, 4]]}) + "\n")
    with pytest.raises(ValueError, match=r"adv.jsonl:2: rewards: missing"):
        run(setup_dir, tmp_path / "a2", data=str(bad), steps=1)
    bad.write_text(json.dumps({"paths": [[1, 2, 3], [1, 2, 4]], "rewards": [1e200, 0.0]}) + "\n")
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite .*critic (inf|nan)"):  # neither stepped
        run(setup_dir, tmp_path / "inf", data=str(bad), steps=1, grad_clip=1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        run(setup_dir, tmp_path / "b", loss={"kl_coef": 0.1}, steps=1)
    with pytest.raises(ValueError, match="vf_coef"):
        run(setup_dir, tmp_path / "c", loss={"vf_coef": -1}, steps=1)
    with pytest.raises(ValueError, match="bogus"):
        run(setup_dir, tmp_path / "d", loss={"bogus": 1}, steps=1)
    policy = build_model(str(setup_dir / "tiny"), 0, torch.float32, torch.device("cpu"))
    kit = RunKit(TrainConfig(objective="ppo_critic"), torch.device("cpu"), torch.float32)
    critic = build_critic(policy, kit)  # torchrun is no longer refused: test_train_objectives_distributed
    assert critic.name == "critic" and critic.model.score.out_features == 1
    with pytest.raises(ValueError, match=r"--cp 2 is not supported: the critic's values and GAE"):
        run(setup_dir, tmp_path / "cp", cp=2, steps=1)
