"""``treetrain train --objective dpo|reward``: tree packing == the per-path baseline, end to end.

Pairs with long shared prompts (48-64 tokens, responses 1-6 tokens, some responses equal or a
prefix of the other). Both packings compute the same sums in float32 in different orders, so they
differ by rounding only: the issue's bar is rel <= 1e-3 on losses and on the updates
(``|w_tree - w_seq| / |w_seq - w_0|``, 2-norm over all parameters; the max-norm is dominated by
entries whose gradient is rounding noise, which AdamW's first step turns into +-lr). Measured:
losses ~1e-7, updates ~1e-4.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers

from treetrain.train.build import build_model
from treetrain.train.config import TrainConfig
from treetrain.train.loop import train

from .reference import saved_weights, tiny_config, update_err

VOCAB = 97


def write_pairs(path, n: int = 6, seed: int = 0, ties: bool = True):
    """``ties=False``: no pair has chosen == rejected (they become chosen + one token instead)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = rng.integers(0, VOCAB, int(rng.integers(48, 64))).tolist()
            chosen = rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist()
            rejected = {0: chosen, 1: chosen[:1]}.get(i % 4, rng.integers(0, VOCAB, 3).tolist())
            if not ties and rejected == chosen:
                rejected = chosen + [int(rng.integers(0, VOCAB))]
            rec = {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected, "margin": 0.1 * i}
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pref")
    write_pairs(d / "pairs.jsonl")
    tiny_config("qwen3", vocab=VOCAB).save_pretrained(d / "tiny")
    return d


def run(setup_dir, out, **over):
    cfg = TrainConfig(
        data=str(setup_dir / "pairs.jsonl"),
        model=str(setup_dir / "tiny"),
        output=str(out),
        steps=3,
        batch_trees=2,
        lr=1e-2,
        schedule="constant",
        progress=False,
        prefetch=0,
        device="cpu",
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return train(cfg, quiet=True)


@pytest.mark.parametrize(
    "objective, loss, auto",
    [
        ("dpo", {}, transformers.AutoModelForCausalLM),
        ("dpo", {"loss_type": "ipo"}, transformers.AutoModelForCausalLM),
        ("reward", {}, transformers.AutoModelForSequenceClassification),
    ],
)
def test_tree_equals_sequence(setup_dir, tmp_path, objective, loss, auto):
    # No tied pairs here (test_objectives_preference covers them): a tie's gradient is zero in exact
    # arithmetic, which the tree gets exactly (the tied paths merge) while the baseline's packed
    # sequences get ~1e-9 of rounding at their other offsets, and Adam's g / (sqrt(v) + eps) turns
    # that noise into a full lr-sized step for every weight only the tie touches.
    data = write_pairs(tmp_path / "no_ties.jsonl", ties=False)
    runs = {
        p: run(setup_dir, tmp_path / p, objective=objective, loss=dict(loss), packing=p, data=str(data))
        for p in ("tree", "sequence")
    }
    tree, seq = runs["tree"].records, runs["sequence"].records
    assert all(r["tree_tokens"] < 0.6 * r["tokens"] for r in tree)  # long shared prompts
    for a, b in zip(tree, seq):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["computed_tokens"] < b["computed_tokens"] == b["tokens"]
    w = {p: saved_weights(r.final, auto) for p, r in runs.items()}
    auto_class = None if objective == "dpo" else "AutoModelForSequenceClassification"
    init = build_model(str(setup_dir / "tiny"), 0, torch.float32, torch.device("cpu"), auto_class)
    init = {k: v.double() for k, v in init.state_dict().items()}  # the runs' initial weights (seed 0)
    err = update_err(w["tree"], w["sequence"], init)
    print(f"{objective} {loss}: updates {err:.3g}")
    assert err <= 1e-3
    if objective == "dpo" and not loss:
        assert tree[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # policy == reference
        assert tree[0]["rewards/margins"] == 0 and "rewards/accuracies" in tree[0]


def test_reward_model_saved_loads_as_sequence_classifier(setup_dir, tmp_path):
    result = run(setup_dir, tmp_path / "rm", objective="reward", steps=1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(result.final)
    assert model.config.num_labels == 1 and type(model).__name__ == "Qwen3ForSequenceClassification"
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 1)


def test_ref_model_dir_and_bad_options(setup_dir, tmp_path):
    """``--ref-model DIR`` loads the reference (here a saved different model: the first loss is not
    ln 2); simpo needs none; bad loss options and unpaired data are clear errors."""
    other = tmp_path / "other"
    torch.manual_seed(5)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab=VOCAB))
    with torch.no_grad():  # far from uniform, so its log-probs differ from the policy's
        for p in ref.parameters():
            p.mul_(30.0 if p.ndim >= 2 else 1.0)
    ref.save_pretrained(other)
    r = run(setup_dir, tmp_path / "a", objective="dpo", ref_model=str(other), steps=1, batch_trees=6)
    assert abs(r.records[0]["loss"] - math.log(2)) > 1e-3
    r = run(setup_dir, tmp_path / "b", objective="dpo", loss={"loss_type": "simpo"}, steps=1)
    assert math.isfinite(r.records[0]["loss"])
    with pytest.raises(ValueError, match="loss_type"):
        run(setup_dir, tmp_path / "c", objective="dpo", loss={"loss_type": "hinge"}, steps=1)
    paths = tmp_path / "paths.jsonl"
    paths.write_text(json.dumps({"paths": [[1, 2, 3], [1, 2, 4]]}) + "\n")
    with pytest.raises(ValueError, match="preference pairs"):
        run(setup_dir, tmp_path / "d", objective="dpo", data=str(paths), steps=1)
