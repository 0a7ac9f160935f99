"""RecurrentGemma's recurrent block (RG-LRU + conv1d) on trees: the block's tree forward against the
block's own forward on each path alone (hand-built trees: a one-token root, nodes shorter than the
conv window, a level of very different node lengths), the masked padding, the docstring example, and
the model in float32 against HF's own float32 error (the model zoo checks it in float64)."""

from __future__ import annotations

import functools

import pytest
import torch

from treetrain.models.rglru import rglru_scan, tree_rglru_block_forward
from treetrain.models.scan import build_levels, tree_scan
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from . import zoo
from .hybrid_models import assert_float32_within_2x, float32_runs, float64_everywhere
from .reference import rel_err

TREES = {
    "one-token-root": [[1, 2, 3, 4], [1, 5], [1, 6, 7, 8, 9, 10, 11]],
    # 1-token nodes down a chain: a conv window of 4 reaches three nodes up
    "short-nodes": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 8], [1, 9], [10]],
    # a level of a 1-token node (with children), a 2-token one and a 12-token one
    "skewed-level": [[1, 2, 3, 4, 30, 31], [1, 2, 3, 4, 32], [1, 2, 3, 5, 6], [1, 2, 3, *range(10, 22)]],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def test_docstring_example():
    """a = 1/2, x = 1: root [A] -> 1; its children [B C] -> 1.5, 1.75 and [D] (padded) ends at 1.5."""
    packed = pack(TrajectoryTree.from_paths([[1, 2, 3], [1, 4]]))
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent, pad_slack=None)
    a = torch.full((4, 1), 0.5, dtype=torch.float64)
    a[0] = 0.0  # the reset at position 0
    h = tree_scan((a, torch.ones(4, 1, dtype=torch.float64)), levels, rglru_scan)
    assert h.flatten().tolist() == [1.0, 1.5, 1.75, 1.5]


def _block(conv_width=4):
    """A recurrent block of a float64 RecurrentGemma with slow decays (a ~ 0.5-0.99)."""
    saved = zoo.PER_TYPE["recurrent_gemma"]
    zoo.PER_TYPE["recurrent_gemma"] = {**saved, "conv1d_width": conv_width}
    try:
        model = zoo.zoo_model("recurrent_gemma")
    finally:
        zoo.PER_TYPE["recurrent_gemma"] = saved
    block = next(m for m in model.modules() if type(m).__name__ == "RecurrentGemmaRecurrentBlock")
    with torch.no_grad():
        block.rg_lru.recurrent_param.uniform_(-6.0, -1.0, generator=torch.Generator().manual_seed(0))
    return block


def _errors(block, paths, mask_padding=True):
    """Worst error of the block's tree forward against its own forward on each path alone."""
    packed = pack(TrajectoryTree.from_paths(paths))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, packed.num_tokens, block.hidden_size, generator=g, dtype=torch.float64)
    if mask_padding:
        out = tree_rglru_block_forward(block, x, packed)
    else:  # the control: padded steps decay the state (a = 0 there: it is wiped)
        import treetrain.models.rglru as rglru

        plain = rglru.rglru_scan
        rglru.rglru_scan = lambda xs, init, valid: plain(xs, init, torch.ones_like(valid))
        try:
            out = tree_rglru_block_forward(block, x, packed)
        finally:
            rglru.rglru_scan = plain
    worst = 0.0
    for p in range(packed.num_paths):
        rows = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]]
        pos = torch.arange(rows.numel())[None]
        want, _ = type(block).forward(block, x[:, rows], pos, None, use_cache=False)
        worst = max(worst, rel_err(out[:, rows], want))
    return worst


@pytest.mark.parametrize("name", TREES)
def test_block_routed_along_every_path(name):
    with float64_everywhere():
        assert _errors(_block(), TREES[name]) < 1e-12


def test_unmasked_padding_fails():
    with float64_everywhere():
        assert _errors(_block(), TREES["skewed-level"], mask_padding=False) > 1e-3


def test_float32_within_reference_rounding():
    """float32: the tree's error against the float64 truth is within 2x of HF's own per-path error."""
    paths = [p for tree in TREES.values() for p in tree if len(p) > 1]
    assert_float32_within_2x(float32_runs(functools.partial(zoo.zoo_model, "recurrent_gemma"), paths))
