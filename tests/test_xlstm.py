"""xLSTM (mLSTM) on trees: the layer's tree forward against its own forward on each path alone
(HF's inference mode: chunks of 4, then its step kernel; hand-built trees: a one-token root,
one-token nodes, a level of very different node lengths), the masked padding, and the model in
float32 against HF's own float32 error (the model zoo checks it in float64). The gates' weights are
drawn at random here: HF initializes them to zero (the gates then ignore the input)."""

from __future__ import annotations

import copy

import pytest
import torch

import treetrain.models.xlstm as xlstm
from treetrain.logprobs import path_logprobs
from treetrain.models.recurrent import patch_recurrent_layers
from treetrain.models.xlstm import tree_xlstm_layer_forward
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import float64_everywhere
from .reference import grads, random_coeffs, reference_logprobs, rel_err
from .zoo import zoo_model

TREES = {
    "one-token-root": [[1, 2, 3, 4], [1, 5], [1, 6, 7, 8, 9, 10, 11]],
    "one-token-nodes": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 8], [1, 9], [10]],
    "skewed-level": [[1, 2, 3, 4, 30, 31], [1, 2, 3, 4, 32], [1, 2, 3, 5, 6], [1, 2, 3, *range(10, 22)]],
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(dtype=torch.float64):
    model = zoo_model("xlstm", dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # input-dependent gates: forget in (0.5, 1) mostly, input gates around 0
        for name, p in model.named_parameters():
            if "gate_preact.weight" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _errors(layer, paths, mask_padding=True):
    """Worst error of the layer's tree forward against its own forward on each path alone."""
    packed = pack(TrajectoryTree.from_paths(paths))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, packed.num_tokens, layer.config.hidden_size, generator=g, dtype=torch.float64)
    plain = xlstm.mlstm_scan
    if not mask_padding:  # the control: padded steps update the state
        xlstm.mlstm_scan = lambda eps: (lambda xs, init, valid: plain(eps)(xs, init, torch.ones_like(valid)))
    try:
        out = tree_xlstm_layer_forward(layer, x, packed)
    finally:
        xlstm.mlstm_scan = plain
    worst = 0.0
    for p in range(packed.num_paths):
        rows = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]]
        want, _ = type(layer).forward(layer, x[:, rows])
        worst = max(worst, rel_err(out[:, rows], want))
    return worst


@pytest.mark.parametrize("name", TREES)
def test_layer_routed_along_every_path(name):
    with float64_everywhere():
        model = _model()
        layer = next(m for m in model.modules() if type(m).__name__ == "xLSTMLayer")
        patch_recurrent_layers(model)  # the backend's instance forward
        assert _errors(layer, TREES[name]) < 1e-12


def test_unmasked_padding_fails():
    with float64_everywhere():
        model = _model()
        patch_recurrent_layers(model)
        layer = next(m for m in model.modules() if type(m).__name__ == "xLSTMLayer")
        assert _errors(layer, TREES["skewed-level"], mask_padding=False) > 1e-3


def test_float32_within_reference_rounding():
    """float32: the tree's error against the float64 truth is within 2x of HF's own per-path error."""
    paths = [p for tree in TREES.values() for p in tree if len(p) > 1]
    coeffs = random_coeffs(paths, seed=0)

    def run(model, fn):
        lps = fn(model, paths)
        sum((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, lps)).backward()
        return torch.cat(lps), grads(model)

    with float64_everywhere():
        truth_lp, truth_g = run(_model(), reference_logprobs)
    model32 = _model(torch.float32)
    ref_lp, ref_g = run(copy.deepcopy(model32), reference_logprobs)
    tree_lp, tree_g = run(model32, path_logprobs)
    ref_e, tree_e = rel_err(ref_lp, truth_lp), rel_err(tree_lp, truth_lp)
    assert tree_e <= 2 * ref_e + 1e-6, (tree_e, ref_e)  # both round at ~6e-8 per op
    for n in truth_g:
        ref_e, tree_e = rel_err(ref_g[n], truth_g[n]), rel_err(tree_g[n], truth_g[n])
        assert tree_e <= 2 * ref_e + 1e-5, (n, tree_e, ref_e)
