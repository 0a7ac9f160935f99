"""The MoE router aux loss inside training: one micro-batch's aux by tree forward (path-count
weighted) and by the per-path baseline (one forward per path, sums added) both equal transformers'
aux over the same paths as one padded batch, value and gradients (float64, casts lifted: only
summation order differs, ~1e-14; bound 1e-11); ``treetrain train`` reports it as ``aux_loss``."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from treetrain import TrajectoryTree, pack
from treetrain.cli import main
from treetrain.objectives.moe_aux import aux_coef, micro_batch_aux_loss, recording
from treetrain.objectives.path_outputs import path_target_logprobs
from treetrain.train.config import TrainConfig
from treetrain.train.loop import train

from .hybrid_models import float64_everywhere, tiny_hybrid_config, tiny_hybrid_model
from .reference import grads, reference_copy, rel_err, tiny_model
from .test_moe import baseline_loss
from .test_train import write_trees
from .zoo import zoo_config

PATHS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12], [1, 2, 3, 4, 5]]


@pytest.mark.parametrize("packing", ["tree", "sequence"])
def test_micro_batch_aux_equals_padded_batch(packing):
    model = tiny_hybrid_model("qwen3_moe")
    ref = reference_copy(model)
    zero = [torch.zeros(len(p) - 1, dtype=torch.float64) for p in PATHS]
    packed = pack(TrajectoryTree.from_paths(PATHS))
    with float64_everywhere():
        coef = aux_coef(model)
        with recording(model, coef) as logits:
            lp = path_target_logprobs(model, packed, packing)
        aux = micro_batch_aux_loss(model, packed, packing, logits)
        (aux + 0 * lp.sum()).backward()
        _, want = baseline_loss(ref, PATHS, zero)
        want.backward()
    assert coef == pytest.approx(0.3)
    assert rel_err(aux, want) < 1e-11
    g, g_ref = grads(model), grads(ref)
    assert any(".gate." in n for n in g_ref)
    assert max(rel_err(g[n], g_ref[n]) for n in g_ref if ".gate." in n) < 1e-11
    assert aux_coef(tiny_model("qwen3")) is None  # dense models: no aux term


def test_train_reports_aux_loss_tree_equals_sequence(tmp_path):
    write_trees(tmp_path / "trees.jsonl", n_trees=4)
    tiny_hybrid_config("qwen3_moe").save_pretrained(tmp_path / "moe")
    records = {}
    for packing in ("tree", "sequence"):
        cfg = TrainConfig(
            data=str(tmp_path / "trees.jsonl"),
            model=str(tmp_path / "moe"),
            output=str(tmp_path / packing),
            steps=2,
            batch_trees=2,
            capacity=4096,  # one micro-batch per step in both modes: the same paths together
            packing=packing,
            progress=False,
            prefetch=0,
            device="cpu",
        )
        records[packing] = train(cfg, quiet=True).records
    for a, b in zip(records["tree"], records["sequence"]):
        assert a["aux_loss"] > 0 and a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def _all_dense_flint(**over):
    """Flint (an MoE type, its HF forward adds ``router_aux_loss_coef * aux``) with every layer dense."""
    cfg = zoo_config("flint")
    cfg.mlp_only_layers = list(range(cfg.num_hidden_layers))
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_aux_coef_without_routers():
    """No router built: nothing to add at the config's default coefficient, a ValueError naming the
    field at a coefficient the user set; an empty recording is a ValueError, not an IndexError."""
    model = transformers.AutoModelForCausalLM.from_config(_all_dense_flint())
    assert model.config.router_aux_loss_coef == 0.0005  # FlintConfig's default: not asked for
    assert aux_coef(model) is None
    with recording(model, aux_coef(model)) as logits:
        assert logits is None
    packed = pack(TrajectoryTree.from_paths(PATHS))
    with pytest.raises(ValueError, match="no router logits recorded"):
        micro_batch_aux_loss(model, packed, "tree", [])
    asked = transformers.AutoModelForCausalLM.from_config(_all_dense_flint(router_aux_loss_coef=0.01))
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.01, but every layer is dense"):
        aux_coef(asked)
    zero = transformers.AutoModelForCausalLM.from_config(_all_dense_flint(router_aux_loss_coef=0.0))
    assert aux_coef(zero) is None  # a coefficient of 0 asks for nothing


def test_cli_train_moe_type_with_dense_layers(tmp_path, capsys):
    """``treetrain train`` on an MoE type built all dense: trains without an aux term (it raised
    IndexError in the step), and refuses by name a coefficient set for the routers it lacks."""
    write_trees(tmp_path / "trees.jsonl", n_trees=2)
    _all_dense_flint().save_pretrained(tmp_path / "dense")
    _all_dense_flint(router_aux_loss_coef=0.01).save_pretrained(tmp_path / "asked")
    common = ["--data", str(tmp_path / "trees.jsonl"), "--steps", "1", "--batch-trees", "2", "--no-progress"]
    common += ["--device", "cpu", "--prefetch", "0"]
    assert main(["train", "--model", str(tmp_path / "dense"), "--output", str(tmp_path / "a"), *common]) == 0
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and "aux_loss" not in records[0] and math.isfinite(records[0]["loss"])
    capsys.readouterr()
    assert main(["train", "--model", str(tmp_path / "asked"), "--output", str(tmp_path / "b"), *common]) == 2
    err = capsys.readouterr().err
    assert "router_aux_loss_coef=0.01, but every layer is dense" in err and "Traceback" not in err
