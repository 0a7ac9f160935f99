"""LoRA through PEFT: tree log-probs and adapter gradients == per-path forwards of the same
``PeftModel``; ``treetrain train --lora-r`` saves an adapter that ``PeftModel.from_pretrained`` loads.

float64 tolerance 1e-11: as test_logprobs (only the summation order differs, ~1e-13 measured).
"""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch

from treetrain import path_logprobs
from treetrain.cli import main
from treetrain.models.lora import apply_lora, lora_config
from treetrain.train.build import build_model
from treetrain.train.config import TrainConfig, validate
from treetrain.train.loop import train

from .hybrid_models import float64_everywhere, tiny_hybrid_model
from .reference import (
    float64_casts,
    grad_err,
    grads,
    random_coeffs,
    reference_logprobs,
    rel_err,
    tiny_config,
    tiny_model,
)
from .test_train import write_trees

PATHS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 9, 9], [1, 2, 3, 4, 5, 6], [1, 2], [5, 6, 7]]


def _lora(model, targets):
    # init_lora_weights=False: B is random too, so the adapter changes the output (PEFT's default
    # B = 0 would make the A gradients vanish and the test weaker)
    return apply_lora(model, lora_config(r=4, alpha=8, targets=targets, init_lora_weights=False))


def _compare(model, casts, paths=PATHS):
    ref = copy.deepcopy(model)  # before the first tree forward: its attention stays HF's own
    coeffs = random_coeffs(paths, 0)
    with casts():
        tree_lp = path_logprobs(model, paths, backend="dense")
        ref_lp = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, tree_lp)).backward()
        sum((c * lp).sum() for c, lp in zip(coeffs, ref_lp)).backward()
    g_tree, g_ref = grads(model), grads(ref)
    assert g_ref and all("lora_" in n for n in g_ref), sorted(g_ref)  # only the adapter trains
    return max(rel_err(a, b) for a, b in zip(tree_lp, ref_lp)), grad_err(g_tree, g_ref)


def test_lora_gradients_match_per_path():
    model = _lora(tiny_model("qwen3"), "q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj")
    lp_err, g_err = _compare(model, float64_casts)
    assert lp_err < 1e-11 and g_err < 1e-11, (lp_err, g_err)


def test_lora_on_gated_deltanet_layers_keeps_tree_routing():
    model = _lora(tiny_hybrid_model("qwen3_5"), "q_proj,v_proj,in_proj_qkv,out_proj")
    assert any("linear_attn" in n and "lora_" in n for n, _ in model.named_parameters())
    lp_err, g_err = _compare(model, float64_everywhere, PATHS[1:4])  # a branch and a duplicate
    assert lp_err < 1e-11 and g_err < 1e-11, (lp_err, g_err)


def test_train_cli_saves_a_peft_adapter(tmp_path):
    data = write_trees(tmp_path / "trees.jsonl", n_trees=2)
    tiny_config("qwen3", vocab=97).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--model", str(tmp_path / "tiny"), "--output", str(out)]
    argv += ["--steps", "2", "--lr", "0.05", "--no-progress", "--prefetch", "0"]
    argv += ["--lora-r", "4", "--lora-alpha", "16", "--lora-targets", "q_proj,v_proj"]
    assert main(argv) == 0
    final = out / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 16
    assert set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    assert not list(final.glob("model*.safetensors"))  # the adapter alone, not the full model
    base = build_model(str(tmp_path / "tiny"), 0, torch.float32, torch.device("cpu"))
    loaded = peft.PeftModel.from_pretrained(base, final)
    lora_b = {n: p for n, p in loaded.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.abs().max() > 0 for p in lora_b.values())  # trained away from B = 0
    assert json.loads((out / "config.json").read_text())["lora_r"] == 4


def test_python_peft_config(tmp_path):
    data = write_trees(tmp_path / "trees.jsonl", n_trees=2)
    cfg = TrainConfig(
        data=str(data), output=str(tmp_path / "run"), steps=1, progress=False, prefetch=0,
        model=None, peft_config={"r": 2, "lora_alpha": 4, "target_modules": ["o_proj"]},
    )  # fmt: skip
    tiny_config("qwen3", vocab=97).save_pretrained(tmp_path / "tiny")
    cfg.model = str(tmp_path / "tiny")
    res = train(cfg, quiet=True)
    assert json.loads((res.final / "adapter_config.json").read_text())["target_modules"] == ["o_proj"]
    cfg.packing, cfg.output = "sequence", str(tmp_path / "seq")  # the baseline runs LoRA models too
    seq = train(cfg, quiet=True)
    assert abs(seq.records[0]["loss"] - res.records[0]["loss"]) < 1e-4 * abs(res.records[0]["loss"])
    obj = TrainConfig(peft_config=peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert validate(obj).to_dict()["peft_config"]["target_modules"] == ["q_proj"]


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(lora_alpha=8.0), "need --lora-r"),
        (dict(lora_r=4, peft_config={"r": 4}), "set only one"),
        (dict(lora_r=-1), "positive integer"),
        (dict(lora_r=4, lora_dropout=1.5), "lora-dropout"),
        (dict(peft_config={"r": 4, "no_such_field": 1}), "not a valid peft.LoraConfig"),
    ],
)
def test_bad_lora_options(over, match):
    with pytest.raises(ValueError, match=match):
        validate(TrainConfig(**over))
