"""The MoE router aux loss inside training: one micro-batch's aux by tree forward (path-count
weighted) and by the per-path baseline (one forward per path, sums added) both equal transformers'
aux over the same paths as one padded batch, value and gradients (float64, casts lifted: only
summation order differs, ~1e-14; bound 1e-11); ``treetrain train`` reports it as ``aux_loss``."""

from __future__ import annotations

import pytest
import torch

from treetrain import TrajectoryTree, pack
from treetrain.objectives.moe_aux import aux_coef, micro_batch_aux_loss, recording
from treetrain.objectives.path_outputs import path_target_logprobs
from treetrain.train.config import TrainConfig
from treetrain.train.loop import train

from .hybrid_models import float64_everywhere, tiny_hybrid_config, tiny_hybrid_model
from .reference import grads, reference_copy, rel_err, tiny_model
from .test_moe import baseline_loss
from .test_train import write_trees

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
