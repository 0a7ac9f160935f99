"""Depth-first execution (``treetrain.parallel.depth_first``): the packed run's log-probs, loss and
every parameter gradient (float64, only summation order differs: 1e-10 relative), with peak
saved-activation memory that follows the deepest path, not the tree's width; attention-only and
recurrent (hybrid) models."""

from __future__ import annotations

import random

import pytest
import torch

from tests.dist_worker import make_trees
from tests.reference import reference_logprobs, tiny_model
from treetrain import TrajectoryTree, pack
from treetrain.logprobs import expand_to_paths, tree_logprobs
from treetrain.models.rope import split_regimes
from treetrain.parallel.depth_first import depth_first_backward, node_children, weighted_token_loss
from treetrain.parallel.memory import SavedTensorMeter

RTOL = 1e-10


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread (a loaded 2-core machine spends more in thread hand-offs than in work)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_node_children():
    assert node_children(torch.tensor([-1, 0, 0, -1])) == [[1, 2], [], [], [], [0, 3]]
    assert node_children(torch.tensor([-1, 0, 1, 1, 0])) == [[1, 4], [2, 3], [], [], [], [0]]


def _packed_run(model, packed, w):
    logp, _ = tree_logprobs(model, packed, backend="dense", entropy=False)
    loss = -(w * logp).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), logp.detach(), grads


def _close(a, b) -> bool:
    return bool(((a - b).abs() <= RTOL * b.abs().max().clamp_min(1e-30)).all())


@pytest.mark.parametrize("arch, seed", [("qwen3", 0), ("llama", 1)])
def test_depth_first_equals_packed(arch, seed):
    model = tiny_model(arch, seed=seed)
    trees = make_trees(3, seed=seed)  # a forest: several roots, nested branch points
    trees.append(TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [1, 8]]))
    packed = pack(trees)
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(packed.num_tokens, generator=g, dtype=torch.float64)
    loss, logp, grads = _packed_run(model, packed, w)
    got_loss, got_logp = depth_first_backward(model, packed, weighted_token_loss(w))
    assert torch.allclose(got_loss, loss, rtol=RTOL, atol=0)
    assert _close(got_logp, logp)
    bad = [n for n, p in model.named_parameters() if not _close(p.grad, grads[n])]
    assert not bad, bad
    # and the per-path truth, each path alone through the unmodified model
    paths = [p for t in trees for p in t.paths()]
    ref = reference_logprobs(tiny_model(arch, seed=seed), paths)
    for a, b in zip(expand_to_paths(got_logp, packed), ref):
        assert torch.allclose(a, b.detach(), rtol=1e-10, atol=1e-12)


def _wide_tree(width: int, prefix: int = 48, branch: int = 48) -> TrajectoryTree:
    rng = random.Random(width)
    head = [rng.randrange(97) for _ in range(prefix)]
    tails = [[rng.randrange(97) for _ in range(branch)] for _ in range(width)]
    return TrajectoryTree.from_paths([head + t for t in tails])


def test_depth_first_fits_a_budget_the_packed_tree_does_not():
    model = tiny_model("qwen3")
    packed = pack(_wide_tree(12))
    w = torch.ones(packed.num_tokens, dtype=torch.float64)
    with SavedTensorMeter() as packed_mem:
        loss, _, grads = _packed_run(model, packed, w)
    budget = 4 * 2**20  # bytes of saved activations
    with SavedTensorMeter() as df_mem:
        got_loss, _ = depth_first_backward(model, packed, weighted_token_loss(w))
    assert packed_mem.peak > 2 * budget and df_mem.peak < budget, (packed_mem.peak, df_mem.peak)
    assert df_mem.current == 0  # every node's graph was freed
    assert torch.allclose(got_loss, loss, rtol=RTOL, atol=0)
    assert all(_close(p.grad, grads[n]) for n, p in model.named_parameters())


def test_depth_first_memory_does_not_grow_with_width():
    model = tiny_model("qwen3")
    peaks = []
    for width in (2, 8):
        packed = pack(_wide_tree(width, prefix=32, branch=32))
        with SavedTensorMeter() as meter:
            depth_first_backward(model, packed, weighted_token_loss(torch.ones(packed.num_tokens)))
        peaks.append(meter.peak)
        model.zero_grad(set_to_none=True)
    assert peaks[1] < 1.2 * peaks[0], peaks


# a 1-token node under a 5-token root with two grandchildren: a conv window (width 3-4) reaches
# through the 1-token node into the root, so a node's halo spans two ancestors on the stack
GRANDPARENT = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 5, 10, 11]]


def _recurrent_model(arch: str, window: int | None = None):
    """A tiny hybrid; ``window``: every sliding attention window set to it (the zoo's binds at 3)."""
    from tests.hybrid_models import tiny_hybrid_model
    from tests.zoo import zoo_model

    model = tiny_hybrid_model(arch) if arch == "qwen3_5" else zoo_model(arch)
    if window is not None:
        model.config.sliding_window = window
        for m in model.modules():
            if getattr(m, "sliding_window", None) is not None:
                m.sliding_window = window
    return model


# every routed family: GDN, KDA, short conv, Mamba2, Mamba, RWKV, mLSTM, lightning, RG-LRU, and two
# hybrids with Mamba layers; MiniMax's and RecurrentGemma's attention windows widened past every
# path (depth-first has no sliding window: a binding one is refused, below)
ARCHS = ["qwen3_5", "kimi_linear", "lfm2", "nemotron_h", "mamba", "rwkv", "xlstm", "minimax"]
ARCHS += ["recurrent_gemma", "jamba", "falcon_h1"]


@pytest.mark.parametrize("arch", ARCHS)
def test_depth_first_recurrent_equals_packed(arch):
    """Recurrent layers depth-first: each node from its parent's final states and its ancestors'
    last conv inputs, kept on the stack."""
    from tests.hybrid_models import float64_everywhere

    trees = [
        TrajectoryTree.from_paths(GRANDPARENT),
        TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]),
    ]
    with float64_everywhere():
        model = _recurrent_model(arch, window=64 if arch in ("minimax", "recurrent_gemma") else None)
        packed = pack([split_regimes(model, t) for t in trees])  # the zoo's length-dependent rope
        w = torch.rand(packed.num_tokens, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        loss, logp, grads = _packed_run(model, packed, w)
        got_loss, got_logp = depth_first_backward(model, packed, weighted_token_loss(w))
    assert torch.allclose(got_loss, loss, rtol=RTOL, atol=0)
    assert _close(got_logp, logp)
    bad = [n for n, p in model.named_parameters() if not _close(p.grad, grads[n])]
    assert not bad, bad


def test_depth_first_recurrent_memory_does_not_grow_with_width():
    """A node holds its parent's final states and last conv inputs, not its siblings': peak saved
    activations follow the deepest path, as for attention."""
    from tests.hybrid_models import tiny_hybrid_model

    model = tiny_hybrid_model("qwen3_5", dtype=torch.float32)
    peaks = []
    for width in (2, 8):
        packed = pack(_wide_tree(width, prefix=24, branch=24))
        with SavedTensorMeter() as meter:
            depth_first_backward(model, packed, weighted_token_loss(torch.ones(packed.num_tokens)))
        peaks.append(meter.peak)
        model.zero_grad(set_to_none=True)
    assert peaks[1] < 1.2 * peaks[0], peaks


def test_depth_first_refuses_a_binding_sliding_window():
    """RecurrentGemma's local attention (window 3 on paths of 8): refused by name, not run wrong."""
    model = _recurrent_model("recurrent_gemma")
    packed = pack(TrajectoryTree.from_paths(GRANDPARENT))
    loss = weighted_token_loss(torch.ones(packed.num_tokens, dtype=torch.float64))
    with pytest.raises(ValueError, match="'depth_first' does not support sliding-window attention"):
        depth_first_backward(model, packed, loss)


def test_depth_first_refuses_activation_checkpointing():
    model = tiny_model("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="depth-first execution does not take activation checkpointing"):
        depth_first_backward(
            model, TrajectoryTree.from_paths([[1, 2, 3]]), weighted_token_loss(torch.ones(3))
        )


def test_depth_first_trains_like_packed():
    """Two AdamW steps from depth-first gradients land on the packed run's weights."""
    trees = make_trees(2, seed=3)
    packed = pack(trees)
    w = torch.bincount(packed.target_index(), minlength=packed.num_tokens).double()  # per-path SFT
    weights = []
    for depth_first in (False, True):
        model = tiny_model("qwen3", seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            if depth_first:
                depth_first_backward(model, packed, weighted_token_loss(w))
            else:
                _, _, grads = _packed_run(model, packed, w)
                for n, p in model.named_parameters():
                    p.grad = grads[n]
            opt.step()
            opt.zero_grad(set_to_none=True)
        weights.append(dict(model.named_parameters()))
    # float64; AdamW divides by sqrt(v): near-zero gradients turn rounding into ~1e-12 moves
    assert max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0]) < 1e-9


def test_depth_first_memory_on_a_deep_tree_stays_below_packed():
    """A 24-turn comb (every turn branches off a short leaf): the stack is 24 nodes deep. Ancestors'
    K/V are referenced, never copied per node, so depth-first stays below the packed run."""
    rng = random.Random(5)
    paths, cur = [], []
    for _ in range(24):
        cur = cur + [rng.randrange(97) for _ in range(16)]
        paths.append(cur + [rng.randrange(97) for _ in range(4)])
    packed = pack(TrajectoryTree.from_paths([*paths, cur]))
    model, w = tiny_model("qwen3"), torch.ones(packed.num_tokens, dtype=torch.float64)
    with SavedTensorMeter() as packed_mem:
        _, _, grads = _packed_run(model, packed, w)
    with SavedTensorMeter() as df_mem:
        depth_first_backward(model, packed, weighted_token_loss(w))
    assert df_mem.peak < packed_mem.peak, (df_mem.peak, packed_mem.peak)
    assert all(_close(p.grad, grads[n]) for n, p in model.named_parameters())
