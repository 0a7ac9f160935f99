"""Recurrent layers split over context-parallel ranks (``parallel.cp_recurrent``), in one process.

The ranks run one after another with a loopback transport (what rank ``r`` sends is what ``r + 1``
receives, in one autograd graph), so every chunk split can be checked cheaply against the whole
tree: outputs and every gradient, float64. The transport over ``torch.distributed`` (gloo) is
checked end to end in ``tests/test_parallel_cp.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treetrain.attention.mask import TreeMask
from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.recurrent import patch_recurrent_layers, route, tree_layer_forward
from treetrain.models.scan import tree_levels, tree_scan, tree_scan_varlen
from treetrain.parallel.cp_recurrent import CPSegment, chunk_halo, chunk_nodes, refine_nodes
from treetrain.parallel.memory import SavedTensorMeter
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import float64_everywhere, tiny_hybrid_model
from .reference import rel_err
from .strategies import tree_paths
from .zoo import zoo_model

DOC = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]  # DFS A B C D E F G H
# root [1..5], a 1-token child [6], grandchildren [7 8] and [9], and [10 11] under the root
GRANDPARENT = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 5, 10, 11]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread (a loaded 2-core machine spends more in thread hand-offs than in work)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_worked_example():
    """The module docstring: ``A B C | D E F G H``."""
    packed = pack(TrajectoryTree.from_paths(DOC))
    arrays = (packed.node_start.numpy(), packed.node_end.numpy(), packed.node_parent.numpy())
    start, end, parent = refine_nodes(*arrays, np.array([3]))
    assert (start.tolist(), parent.tolist()) == ([0, 1, 2, 3, 4, 6], [-1, 0, 1, 2, 1, 0])
    r0, r1 = (chunk_nodes(start, end, parent, [0, 3, 8], r) for r in (0, 1))
    assert r0["send"].tolist() == [0, 1, 2] and r0["num_in"] == 0  # A, B, C: all rank 0's own
    assert r1["node_start"].tolist() == [0, 1, 3] and r1["node_slot"].tolist() == [2, 1, 0]
    assert r1["num_in"] == 3 and r1["send"].size == 0
    window = np.array(
        [[8, 8, 0], [8, 0, 1], [0, 1, 2], [1, 2, 3], [0, 1, 4], [1, 4, 5], [8, 0, 6], [0, 6, 7]]
    )
    h = chunk_halo(window, [0, 3, 8], 1)
    assert h["sizes"].tolist() == [3, 0] and h["take"].tolist() == [0, 1, 2]  # halo A B C
    assert h["index"][:2].tolist() == [[1, 2, 3], [0, 1, 4]]  # D reads B C D, E reads A B E


class Loopback:
    """The ranks of one simulated group, run in order in one process (:class:`Transport`)."""

    def __init__(self, store: dict, rank: int, world: int, drop_states=False, drop_halo=False):
        self.store, self.rank, self.world = store, rank, world
        self.drop_states, self.drop_halo = drop_states, drop_halo

    def recv(self, op, anchor):
        got = self.store[("state", self.rank, op)]
        if self.drop_states:  # control: every chunk from zero states
            return tuple(map(torch.zeros_like, got)) if isinstance(got, tuple) else torch.zeros_like(got)
        return got

    def send(self, op, out, states):
        self.store[("state", self.rank + 1, op)] = states
        return out

    def gather(self, op, rows, sizes):
        self.store[("rows", self.rank, op)] = rows
        parts = []
        for q, n in enumerate(sizes):  # a later rank's rows are never read: zeros stand in
            part = self.store.get(("rows", q, op), rows.new_zeros(n, *rows.shape[1:]))
            parts.append(torch.zeros_like(part) if self.drop_halo and q != self.rank else part)
        return torch.cat(parts)


def split_run(forward, x: torch.Tensor, packed, bounds, **drop) -> list[torch.Tensor]:
    """``forward(x [n, ...], view, mask)`` of every chunk ``bounds[r]:bounds[r + 1]``, rank by rank."""
    store, outs = {}, []
    for r in range(len(bounds) - 1):
        segment = CPSegment(packed, bounds, r, Loopback(store, r, len(bounds) - 1, **drop))
        mask = TreeMask(packed.subtree_end, cache={"segment": segment})
        outs.append(forward(x[bounds[r] : bounds[r + 1]], segment.view, mask))
    return outs


# ---- a toy family: a conv, then a gated recurrence with a tuple state --------------------------

C, WIDTH = 3, 4


def _toy_scan(xs, init, valid):
    """``h <- exp(a) h + x`` and a running count of real steps (a tuple state; padding masked)."""
    a, x = xs
    n = a.shape[0]
    h, c = (a.new_zeros(n, C), a.new_zeros(n)) if init is None else init
    outs = []
    for t in range(a.shape[1]):
        keep = valid[:, t, None]
        h = torch.where(keep, a[:, t].exp() * h + x[:, t], h)
        c = c + valid[:, t]
        outs.append(h * (1 + c[:, None]))
    return torch.stack(outs, 1), (h, c)


def _toy_varlen(xs, init, cu):
    """The same through the varlen contract: node by node."""
    outs, hs, cs = [], [], []
    for i in range(cu.numel() - 1):
        part = tuple(x[None, cu[i] : cu[i + 1]] for x in xs)
        one = None if init is None else tuple(s[i : i + 1] for s in init)
        out, (h, c) = _toy_scan(part, one, torch.ones(1, part[0].shape[1], dtype=torch.bool))
        outs.append(out[0])
        hs.append(h)
        cs.append(c)
    return torch.cat(outs), (torch.cat(hs), torch.cat(cs))


def _toy_forward(params, varlen=False):
    weight, bias = params

    def forward(x, packed, mask):
        conv = tree_causal_conv1d(x[:, C:], weight, bias, path_window(packed, WIDTH, mask))
        levels = tree_levels(packed, mask)
        a = -torch.nn.functional.softplus(x[:, :C])
        if varlen:
            return tree_scan_varlen((a, conv), levels, _toy_varlen)
        return tree_scan((a, conv), levels, _toy_scan)

    return forward


def _bounds(T: int, cuts) -> list[int]:
    return [0, *sorted(set(c for c in cuts if 0 < c < T)), T]


@settings(max_examples=40, deadline=None)
@given(st.lists(tree_paths(max_paths=5, max_len=7), min_size=1, max_size=3), st.data())
def test_toy_family_split_equals_whole_forest(forest, data):
    packed = pack([TrajectoryTree.from_paths(p) for p in forest])
    T = packed.num_tokens
    bounds = _bounds(T, data.draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=4)))
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 2 * C, generator=g, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(C, WIDTH, generator=g, dtype=torch.float64, requires_grad=True) for _ in "w"]
    params.append(torch.randn(C, generator=g, dtype=torch.float64, requires_grad=True))
    coef = torch.randn(T, C, generator=g, dtype=torch.float64)
    for varlen in (False, True):
        forward = _toy_forward(params, varlen)
        whole = forward(x, packed, TreeMask(packed.subtree_end))
        want = torch.autograd.grad((whole * coef).sum(), [x, *params])
        got = torch.cat(split_run(forward, x, packed, bounds))
        assert rel_err(got, whole) < 1e-13
        for a, b in zip(torch.autograd.grad((got * coef).sum(), [x, *params]), want):
            assert rel_err(a, b) < 1e-13


# ---- the routed families ------------------------------------------------------------------------

# bounds for GRANDPARENT (DFS: root 0-4, [5] 1-token, [6 7], [8], [9 10]): a cut inside the root
# (mid-node), one at the 1-token node (its window reaches 3 back into the root, on rank 0), one
# between the grandchildren; and every token its own chunk
BOUNDS = {"mid_node": [0, 3, 6, 8, 11], "every_token": list(range(12)), "two": [0, 7, 11]}
# one model type per routed family (its routed layer): Gated DeltaNet, KDA, short convolution,
# Mamba2's SSD, Mamba's selective scan, RWKV's time-mix (a token shift through path_gather and a
# tuple state), xLSTM's mLSTM (the tree reaches its kernel as its initial state), MiniMax's
# lightning attention, RecurrentGemma's RG-LRU (reset where the path position is 0)
CASES = [
    *(("qwen3_5", split) for split in sorted(BOUNDS)),
    ("kimi_linear", "mid_node"),
    ("lfm2", "mid_node"),
    ("lfm2", "every_token"),
    *((arch, "mid_node") for arch in ("nemotron_h", "mamba", "rwkv", "xlstm", "minimax", "recurrent_gemma")),
]
LAYERS = {"rwkv": "RwkvSelfAttention"}
NO_STATE, NO_CONV = {"lfm2"}, {"minimax", "xlstm"}  # what a control can drop


@functools.cache
def _layer(arch: str):
    model = tiny_hybrid_model(arch) if arch == "qwen3_5" else zoo_model(arch)
    patch_recurrent_layers(model)  # xLSTM: its kernel backend's instance forward
    named = LAYERS.get(arch)
    layer = next(
        m for m in model.modules() if route(m) is not None and type(m).__name__ == (named or type(m).__name__)
    )
    if hasattr(layer, "A_log"):  # slow decays: every node's output depends on its parent's state
        with torch.no_grad():
            layer.A_log.copy_(torch.linspace(0.05, 0.5, layer.A_log.numel()).log().view_as(layer.A_log))
    return model.config.hidden_size, layer


def _layer_forward(layer):
    return lambda x, packed, mask: tree_layer_forward(layer, x[None], packed, mask)[0]


@pytest.mark.parametrize("arch, split", CASES)
def test_layer_split_equals_whole_tree(arch, split):
    with float64_everywhere():
        hidden, layer = _layer(arch)
        packed = pack(TrajectoryTree.from_paths(GRANDPARENT))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(packed.num_tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
        coef = torch.randn(packed.num_tokens, hidden, generator=g, dtype=torch.float64)
        params = list(layer.parameters())
        forward = _layer_forward(layer)
        whole = forward(x, packed, TreeMask(packed.subtree_end))
        want = torch.autograd.grad((whole * coef).sum(), [x, *params])
        got = torch.cat(split_run(forward, x, packed, BOUNDS[split]))
        mine = torch.autograd.grad((got * coef).sum(), [x, *params])
        # controls: without the handed-over states, or the halo, the chunks are far off
        if split == "mid_node":
            for drop in ("drop_states", "drop_halo"):
                if arch in (NO_STATE if drop == "drop_states" else NO_CONV):
                    continue  # a short convolution has no state
                off = torch.cat(split_run(forward, x, packed, BOUNDS[split], **{drop: True}))
                assert rel_err(off, whole) > 1e-3, drop
    assert rel_err(got, whole) < 1e-12
    for a, b in zip(mine, want):
        assert rel_err(a, b) < 1e-11


def test_split_holds_fewer_recurrent_activations_per_rank():
    """Replicated, every rank ran the whole tree's recurrent layer (what one process saves); split,
    a rank saves its chunk's share plus the handed-over states and halo."""
    hidden, layer = _layer("qwen3_5")
    paths = [[7] * 60 + [i] * 40 for i in range(4)]  # a 60-token prompt, four 40-token answers
    packed = pack(TrajectoryTree.from_paths(paths))
    x = torch.randn(packed.num_tokens, hidden, dtype=torch.float64, requires_grad=True)
    forward = _layer_forward(layer)
    with SavedTensorMeter() as whole:
        keep = forward(x, packed, TreeMask(packed.subtree_end))
    bounds = _bounds(packed.num_tokens, [110])  # cut inside the second answer
    per_rank = []
    store = {}
    for r in range(2):
        segment = CPSegment(packed, bounds, r, Loopback(store, r, 2))
        with SavedTensorMeter() as meter:
            out = forward(
                x[bounds[r] : bounds[r + 1]], segment.view, TreeMask(None, cache={"segment": segment})
            )
        per_rank.append(meter.peak)
        del out
    del keep
    # measured 0.52 and 0.65 of the whole (the delta rule in float64 here: its chunk buffers are
    # a rank's fixed share); replicated, each rank would hold 1.0
    assert max(per_rank) < 0.7 * whole.peak, (per_rank, whole.peak)
