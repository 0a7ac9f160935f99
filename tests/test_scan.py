"""The generic recurrence routing (``models.scan.tree_scan``): every path of a forest gets what the
same recurrence gives when run over that path alone, step by step, for plain and tuple states and
for a recurrence whose padded steps are not identities (it must mask them with ``valid``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from treetrain.models.scan import build_levels, tree_scan
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .strategies import tree_paths

D = 3


def _inputs(packed, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = packed.num_tokens
    f64 = dict(generator=g, dtype=torch.float64)
    return -torch.rand(T, D, **f64), torch.randn(T, D, **f64)


def _gated(xs, init, valid):
    """``h_t = exp(a_t) * h_{t-1} + x_t`` (a zero input is an identity step): state ``[n, D]``."""
    a, x = xs
    h = torch.zeros(a.shape[0], D, dtype=a.dtype) if init is None else init
    out = []
    for t in range(a.shape[1]):
        h = a[:, t].exp() * h + x[:, t]
        out.append(h)
    return torch.stack(out, 1), h


def _decaying(xs, init, valid):
    """``h_t = 0.5 h_{t-1} + x_t`` and a running count (a tuple state): a fixed decay, so padded
    steps must be masked."""
    _, x = xs
    n = x.shape[0]
    h, c = (torch.zeros(n, D, dtype=x.dtype), torch.zeros(n, dtype=x.dtype)) if init is None else init
    out = []
    for t in range(x.shape[1]):
        keep = valid[:, t, None]
        h = torch.where(keep, 0.5 * h + x[:, t], h)
        c = c + valid[:, t]
        out.append(h + c[:, None])
    return torch.stack(out, 1), (h, c)


def _per_path(scan, xs, packed):
    """Each path alone: its DFS indices gathered into one row, run from a zero state."""
    outs = []
    for p in range(packed.num_paths):
        rows = packed.path_index[packed.path_offsets[p] : packed.path_offsets[p + 1]]
        out, _ = scan(tuple(x[rows][None] for x in xs), None, torch.ones(1, rows.numel(), dtype=torch.bool))
        outs.append((rows, out[0]))
    return outs


def _check(paths, scan, pad_slack):
    packed = pack(TrajectoryTree.from_paths(paths))
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent, pad_slack=pad_slack)
    xs = _inputs(packed)
    got = tree_scan(xs, levels, scan)
    assert got.shape == (packed.num_tokens, D)
    for rows, want in _per_path(scan, xs, packed):
        torch.testing.assert_close(got[rows], want, rtol=1e-12, atol=1e-12)


def test_hand_tree():
    """The docstring's tree: [A B C D], [A B E F], [A G H]."""
    paths = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]
    for scan in (_gated, _decaying):
        for slack in (None, 0, 256):
            _check(paths, scan, slack)


@settings(max_examples=40, deadline=None)
@given(tree_paths(max_paths=6, max_len=9))
def test_random_trees(paths):
    _check(paths, _gated, 0)  # slack 0: a level splits into length groups wherever it can
    _check(paths, _decaying, None)  # one padded group per level: padded steps must be masked


def test_gradients_flow_through_parent_states():
    """A leaf's output depends on its root's input through the handed-over state."""
    packed = pack(TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4, 5]]))
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent)
    a, x = _inputs(packed)
    x.requires_grad_(True)
    tree_scan((a, x), levels, _gated)[-1].sum().backward()
    assert x.grad[0].abs().sum() > 0
