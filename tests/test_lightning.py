"""MiniMax lightning attention on trees: the blocked rule against the plain recurrence, its routing
on hand-built trees against each path alone (a one-token root, one-token nodes, a level of very
different node lengths, blocks shorter and longer than the nodes), the masked padding, and the
model in float32 against HF's own float32 error (the model zoo checks it in float64)."""

from __future__ import annotations

import functools

import pytest
import torch

from treetrain.models.lightning import lightning_rule, lightning_scan
from treetrain.models.scan import build_levels, tree_scan
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import assert_float32_within_2x, float32_runs
from .reference import rel_err
from .zoo import zoo_model

H, D = 2, 3
SLOPE = torch.tensor([0.7, 0.05], dtype=torch.float64)
TREES = {
    "one-token-root": [[1, 2, 3, 4], [1, 5], [1, 6, 7, 8, 9, 10, 11]],
    # a level of very different node lengths: 1 (with children), 2 and 12 tokens under a 3-token root
    "skewed-level": [[1, 2, 3, 4, 30, 31], [1, 2, 3, 4, 32], [1, 2, 3, 5, 6], [1, 2, 3, *range(10, 22)]],
    "one-token-nodes": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 8], [1, 9], [10]],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def _recurrence(q, k, v, slope, init=None):
    """Step by step: ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``; ``[L, H, D]``."""
    S = torch.zeros(H, D, D, dtype=q.dtype) if init is None else init
    out = []
    for t in range(q.shape[0]):
        S = torch.exp(-slope)[:, None, None] * S + k[t][:, :, None] * v[t][:, None, :]
        out.append((q[t][:, None, :] @ S)[:, 0])
    return torch.stack(out), S


def test_docstring_example():
    """lam = 1/2, q = k = v = 1, from S = 4: outputs [3, 2.5]; padded, the final state stays 2.5."""
    one = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    g = torch.full((1, 2, 1), -torch.log(torch.tensor(2.0, dtype=torch.float64)).item(), dtype=torch.float64)
    S0 = torch.full((1, 1, 1, 1), 4.0, dtype=torch.float64)
    out, S = lightning_rule(one, one, one, g, S0, block=1)
    assert out.flatten().tolist() == [3.0, 2.5] and S.item() == 2.5
    pad = lambda x: torch.cat([x, torch.zeros_like(x)], dim=1)  # noqa: E731
    valid = torch.tensor([[True, True, False, False]])
    out, S = lightning_scan(torch.tensor([2.0], dtype=torch.float64).log(), 3)((pad(one),) * 3, S0, valid)
    assert out[0, :2].flatten().tolist() == [3.0, 2.5] and S.item() == 2.5


@pytest.mark.parametrize("block", [1, 2, 5, 64])
def test_blocked_rule_is_the_recurrence(block):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 11, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    S0 = torch.randn(1, H, D, D, generator=g, dtype=torch.float64)
    decay = (-SLOPE).expand(1, 11, H)
    out, S = lightning_rule(q, k, v, decay, S0, block=block)
    want, want_S = _recurrence(q[0], k[0], v[0], SLOPE, S0[0])
    assert rel_err(out[0], want) < 1e-13 and rel_err(S[0], want_S) < 1e-13


def _per_path_check(paths, block, pad_slack, mask_padding=True):
    packed = pack(TrajectoryTree.from_paths(paths))
    T = packed.num_tokens
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent, pad_slack=pad_slack)
    scan = lightning_scan(SLOPE, block)
    if not mask_padding:  # the control: a fixed decay on every step, padding included
        plain = scan
        scan = lambda xs, init, valid: plain(xs, init, torch.ones_like(valid))  # noqa: E731
    out = tree_scan((q, k, v), levels, scan)
    worst = 0.0
    for p in range(packed.num_paths):
        rows = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]]
        want, _ = _recurrence(q[rows], k[rows], v[rows], SLOPE)
        worst = max(worst, rel_err(out[rows], want))
    return worst


@pytest.mark.parametrize("name", TREES)
@pytest.mark.parametrize("block", [1, 4, 256])
def test_routed_along_every_path(name, block):
    assert _per_path_check(TREES[name], block, pad_slack=None) < 1e-13  # one padded group per level
    assert _per_path_check(TREES[name], block, pad_slack=256) < 1e-13


def test_unmasked_padding_fails():
    """Control: decaying the padded steps shrinks the parents' states (the skewed level pads 11 steps)."""
    assert _per_path_check(TREES["skewed-level"], 4, pad_slack=None, mask_padding=False) > 1e-2


def test_float32_within_reference_rounding():
    """float32: the tree's error against the float64 truth is within 2x of HF's own per-path error."""
    paths = [p for tree in TREES.values() for p in tree if len(p) > 1]
    assert_float32_within_2x(float32_runs(functools.partial(zoo_model, "minimax"), paths))
