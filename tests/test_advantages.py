"""``--advantages``: per-path rewards -> GRPO advantages (TRL's scale_rewards); GRPO without
old_logprobs runs on-policy (ratio 1: the REINFORCE gradient), end to end through ``treetrain train``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from treetrain import TrajectoryTree, path_logprobs
from treetrain.cli import main
from treetrain.data.records import parse_record
from treetrain.objectives.advantages import assign_advantages
from treetrain.objectives.policy.aggregation import PathMeta
from treetrain.objectives.policy.config import Objective
from treetrain.objectives.policy.loss import objective

from .reference import tiny_config, tiny_model

VOCAB = 97


def test_scales_by_hand():
    """Tree 1 rewards [1, 0, 0, 1]: mean 0.5, unbiased std 1/sqrt(3); tree 2 [2, 4]: mean 3, std sqrt(2)."""
    t1 = TrajectoryTree.from_paths([[1, 2], [1, 3], [1, 4], [1, 5]], rewards=[1.0, 0.0, 0.0, 1.0])
    t2 = TrajectoryTree.from_paths([[6, 7], [6, 8]], rewards=[2.0, 4.0])
    g = [t.fields["advantages"] for t in assign_advantages([t1, t2], "group")]
    s = 1 / np.sqrt(3)
    assert np.allclose(g[0], np.array([0.5, -0.5, -0.5, 0.5]) / (s + 1e-4))
    assert np.allclose(g[1], np.array([-1.0, 1.0]) / (np.sqrt(2) + 1e-4))
    n = [t.fields["advantages"] for t in assign_advantages([t1, t2], "none")]
    assert n[0].tolist() == [0.5, -0.5, -0.5, 0.5] and n[1].tolist() == [-1.0, 1.0]
    b = [t.fields["advantages"] for t in assign_advantages([t1, t2], "batch")]
    std = np.std([1, 0, 0, 1, 2, 4], ddof=1)
    assert np.allclose(np.concatenate(b), np.concatenate(n) / (std + 1e-4))
    assert "advantages" not in t1.fields  # the input trees are left as they were


def test_equal_rewards_give_exactly_zero():
    """A group of equal rewards teaches nothing: 0, not the rounding of ``r - mean`` (np.mean of three
    0.1s is 0.1 + 1.4e-17), in every scale; a one-path group keeps its reward."""
    trees = [TrajectoryTree.from_paths([[1, 2], [1, 3], [1, 4]], rewards=[0.1] * 3),
             TrajectoryTree.from_paths([[5, 6]], rewards=[0.1])]  # fmt: skip
    for scale in ("group", "batch", "none"):
        equal, one = (t.fields["advantages"] for t in assign_advantages(trees, scale))
        assert equal.tolist() == [0.0, 0.0, 0.0] and one[0] != 0, scale


def test_errors_name_the_fix():
    with_rewards = TrajectoryTree.from_paths([[1, 2]], rewards=[1.0])
    with pytest.raises(ValueError, match=r"tree 1 .*no per-path \"rewards\""):
        assign_advantages([with_rewards, TrajectoryTree.from_paths([[1, 2]])], "group")
    both = TrajectoryTree.from_paths([[1, 2]], rewards=[1.0], advantages=[0.5])
    with pytest.raises(ValueError, match="both"):
        assign_advantages([both], "group")
    with pytest.raises(ValueError, match="expected one of group, batch, none"):
        assign_advantages([with_rewards], "std")
    with pytest.raises(ValueError, match="rewards: expected one finite number per path"):
        TrajectoryTree.from_paths([[1, 2]], rewards=[float("nan")])


def test_records_carry_rewards_and_partitions_keep_them():
    tree, _ = parse_record({"paths": [[1, 2, 3], [1, 2, 4]], "rewards": [1, 0.5]})
    assert tree.fields["rewards"].tolist() == [1.0, 0.5]
    assert tree.subset([1]).fields["rewards"].tolist() == [0.5]


def test_grpo_without_old_logprobs_is_on_policy():
    """Ratio 1: the clipped surrogate's gradient is REINFORCE's, -A * d logp."""
    paths = [[1, 2, 3, 4], [1, 2, 5]]
    tree = TrajectoryTree.from_paths(paths, advantages=[1.5, -0.5])
    meta = PathMeta.from_trees(tree)
    model = tiny_model("qwen3")
    gathered = []
    for name in ("grpo", "reinforce"):
        model.zero_grad()
        loss, metrics = objective(path_logprobs(model, paths), meta, Objective(name), 5.0)
        loss.backward()
        gathered.append([p.grad.clone() for p in model.parameters()])
        if name == "grpo":
            assert metrics["ratio_sum"].item() == pytest.approx(5.0)  # 5 targets, ratio 1 each
    for a, b in zip(*gathered):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_cli_grpo_from_rewards(tmp_path):
    rng = np.random.default_rng(0)
    with open(tmp_path / "groups.jsonl", "w") as f:
        for _ in range(2):
            prompt = rng.integers(0, VOCAB, 10).tolist()
            paths = [prompt + rng.integers(0, VOCAB, 5).tolist() for _ in range(4)]
            masks = [[0] * 10 + [1] * 5] * 4
            f.write(json.dumps({"paths": paths, "loss_masks": masks, "rewards": [1, 0, 0, 1]}) + "\n")
    tiny_config("qwen3", vocab=VOCAB).save_pretrained(tmp_path / "tiny")
    data, model, out = str(tmp_path / "groups.jsonl"), str(tmp_path / "tiny"), str(tmp_path / "out")
    args = ["train", "--data", data, "--model", model, "--objective", "grpo", "--steps", "2", "--output", out]
    args.append("--no-progress")
    assert main([*args, "--advantages", "group"]) == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    assert main(args) == 2  # without --advantages the records have no advantages: a one-line error
