"""xLSTM (mLSTM) on trees: the layer's tree forward against its own forward on each path alone
(HF's inference mode: chunks of 4, then its step kernel; hand-built trees: a one-token root,
one-token nodes, a level of very different node lengths), the masked padding, and the model in
float32 against HF's own float32 error (the model zoo checks it in float64). The gates' weights are
drawn at random here: HF initializes them to zero (the gates then ignore the input)."""

from __future__ import annotations

import pytest
import torch

import treetrain.models.xlstm as xlstm
from treetrain.models.recurrent import patch_recurrent_layers
from treetrain.models.xlstm import tree_xlstm_layer_forward
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import assert_float32_within_2x, float32_runs, float64_everywhere
from .reference import rel_err
from .zoo import zoo_model

TREES = {
    "one-token-root": [[1, 2, 3, 4], [1, 5], [1, 6, 7, 8, 9, 10, 11]],
    "one-token-nodes": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 8], [1, 9], [10]],
    "skewed-level": [[1, 2, 3, 4, 30, 31], [1, 2, 3, 4, 32], [1, 2, 3, 5, 6], [1, 2, 3, *range(10, 22)]],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


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
        xlstm.mlstm_scan = lambda eps: lambda xs, init, valid: plain(eps)(xs, init, torch.ones_like(valid))
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
    assert_float32_within_2x(float32_runs(_model, paths))
