"""RWKV on trees: the token shift along each path (by hand), the WKV recurrence routed on hand-built
trees against the model's own CPU recurrence on each path alone (a one-token root, one-token nodes,
a level of very different node lengths), the masked padding, ordinary calls, and the model in
float32 against HF's own float32 error (the model zoo checks it in float64)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

from treetrain.models.hf import prepare_model
from treetrain.models.rwkv import _shifted, wkv_scan
from treetrain.models.scan import build_levels, tree_scan
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import assert_float32_within_2x, float32_runs
from .reference import rel_err
from .zoo import zoo_model

A = 3  # channels
TREES = {
    "one-token-root": [[1, 2, 3, 4], [1, 5], [1, 6, 7, 8, 9, 10, 11]],
    "one-token-nodes": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 8], [1, 9], [10]],
    "skewed-level": [[1, 2, 3, 4, 30, 31], [1, 2, 3, 4, 32], [1, 2, 3, 5, 6], [1, 2, 3, *range(10, 22)]],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def test_token_shift_by_hand():
    """Paths [A B C], [A D]: B and D read A, C reads B, A reads zeros."""
    packed = pack(TrajectoryTree.from_paths([[1, 2, 3], [1, 4]]))  # DFS: A B C D
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert _shifted(x, packed, None).flatten().tolist() == [0.0, 1.0, 2.0, 1.0]


def _wkv_errors(paths, mask_padding=True):
    packed = pack(TrajectoryTree.from_paths(paths))
    T = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(T, A, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    decay, first = (torch.randn(A, generator=g, dtype=torch.float64) for _ in range(2))
    scan = wkv_scan(-torch.exp(decay), first)
    if not mask_padding:  # the control: the padding's zero keys decay and add to the state
        plain = scan
        scan = lambda xs, init, valid: plain(xs, init, torch.ones_like(valid))  # noqa: E731
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent, pad_slack=None)
    out = tree_scan((k, v), levels, scan)
    worst = 0.0
    for p in range(packed.num_paths):
        rows = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]]
        want, _ = rwkv_linear_attention_cpu(decay, first, k[rows][None], v[rows][None])
        worst = max(worst, rel_err(out[rows], want[0]))
    return worst


@pytest.mark.parametrize("name", TREES)
def test_wkv_routed_along_every_path(name):
    assert _wkv_errors(TREES[name]) < 1e-13


def test_unmasked_padding_fails():
    assert _wkv_errors(TREES["skewed-level"], mask_padding=False) > 1e-3


def test_ordinary_calls_unchanged():
    model = zoo_model("rwkv", dtype=torch.float32)
    ref = copy.deepcopy(model)
    prepare_model(model)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        # use_cache=False: HF's own cached forward fails when attention_hidden_size != hidden_size
        got, want = (m(input_ids=ids, use_cache=False).logits for m in (model, ref))
        assert torch.equal(got, want)


def test_float32_within_reference_rounding():
    """float32: the tree's error against the float64 truth is within 2x of HF's own per-path error."""
    paths = [p for tree in TREES.values() for p in tree if len(p) > 1]
    assert_float32_within_2x(float32_runs(functools.partial(zoo_model, "rwkv"), paths))
