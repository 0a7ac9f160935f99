"""Short convolutions (LFM2), KDA (Kimi Linear, Bailing hybrid) and the OLMo Hybrid Gated DeltaNet on
hand-built trees: one routed layer's tree forward equals the unmodified layer run over each path
alone (outputs, the gradient of its input and of every parameter), in float64.

The trees are the routing's corner cases: a node shorter than the conv width, so a window reaches
through it into its grandparent; a one-token root; a level whose nodes differ in length by 70x (it
is split into several padded groups, and its longest node spans two of the rule's 64-step chunks).
The model types end to end: ``tests/test_model_zoo.py``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from treetrain.logprobs import path_logprobs
from treetrain.models.kda import _layout, _torch_rule, tree_kda_rule
from treetrain.models.recurrent import tree_layer_forward
from treetrain.models.scan import build_levels
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import float64_everywhere
from .reference import grads, random_coeffs, reference_logprobs, rel_err
from .strategies import tree_paths
from .zoo import zoo_model, zoo_paths

# root [1..5], a 1-token child [6], grandchildren [7 8] and [9]: with width 4, 7's window is 4 5 6 7
GRANDPARENT = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 5, 10, 11]]
ONE_TOKEN_ROOT = [[1, 2, 3], [1, 4, 5, 6, 7], [1, 8]]
# level 1: nodes of 70, 1, 2 and 1 tokens
SKEWED = [[1, 2, *range(10, 80)], [1, 2, 3], [1, 2, 4, 5], [1, 2, 6]]
TREES = {"grandparent": GRANDPARENT, "one_token_root": ONE_TOKEN_ROOT, "skewed": SKEWED}

# model type -> its routed layer; each family's conv width is 3 or 4 in the zoo configs
LAYERS = {
    "lfm2": "Lfm2ShortConv",
    "kimi_linear": "KimiLinearDeltaAttention",
    "bailing_hybrid": "BailingHybridDeltaAttention",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "qwen4_exp_text": "Qwen4ExpTextGatedDeltaNet",  # the model type is refused (its QSA attention)
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.cache
def _layer(model_type: str):
    """(hidden size, the model's first routed layer); built once per type (tests take gradients with
    ``torch.autograd.grad``, so nothing accumulates on it)."""
    model = zoo_model(model_type)
    layer = next(m for m in model.modules() if type(m).__name__ == LAYERS[model_type])
    if hasattr(layer, "A_log"):  # slow decays: every node's output depends on its parent's state
        with torch.no_grad():
            layer.A_log.copy_(torch.linspace(0.05, 0.5, layer.A_log.numel()).log().view_as(layer.A_log))
    return model.config.hidden_size, layer


def _path_rows(packed):
    return [packed.path_index[a:b] for a, b in zip(packed.path_offsets[:-1], packed.path_offsets[1:])]


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("model_type", sorted(LAYERS))
def test_layer_matches_each_path_alone(model_type, tree):
    with float64_everywhere():  # the layers and rules cast to float32 inside otherwise
        hidden, layer = _layer(model_type)
        packed = pack(TrajectoryTree.from_paths(TREES[tree]))
        T = packed.num_tokens
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, hidden, generator=g, dtype=torch.float64, requires_grad=True)
        coef = torch.randn(T, hidden, generator=g, dtype=torch.float64)
        params = [p for p in layer.parameters() if p.requires_grad]

        out = tree_layer_forward(layer, x[None], packed)[0]
        # a token shared by n paths is counted n times in the per-path sum below
        counts = torch.bincount(packed.path_index, minlength=T).double()
        mine = torch.autograd.grad((out * coef * counts[:, None]).sum(), [x, *params])

        total, worst = 0.0, 0.0
        for rows in _path_rows(packed):
            ref = layer(x[rows][None])[0]
            worst = max(worst, rel_err(out[rows], ref))
            total = total + (ref * coef[rows]).sum()
        want = torch.autograd.grad(total, [x, *params])
        # control: the unmodified layer over the DFS order as one sequence leaks across branches
        leak = rel_err(layer(x[None])[0], out)
    assert worst < 1e-12, worst
    for a, b in zip(mine, want):
        assert rel_err(a, b) < 1e-11
    assert leak > 1e-3


def _rule_inputs(T, H=2, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    q, k, v = (torch.randn(T, H, D, **f64) for _ in range(3))
    decay = -0.3 * torch.rand(T, H, D, **f64)  # per channel, slow
    beta = torch.rand(T, H, **f64)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def _check_kda_rule(paths):
    packed = pack(TrajectoryTree.from_paths(paths))
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent)
    rule = _torch_rule(_layout(_layer("kimi_linear")[1])[0])
    xs = _rule_inputs(packed.num_tokens)
    out = tree_kda_rule(*xs, levels, rule)
    coef = torch.randn_like(out)
    counts = torch.bincount(packed.path_index, minlength=packed.num_tokens).double()
    mine = torch.autograd.grad((out * coef * counts[:, None, None]).sum(), xs)
    total = 0.0
    for rows in _path_rows(packed):
        q, k, v, g, b = (t[rows][None] for t in xs)
        o, _ = rule(q, k, v, g=g, beta=b, use_qk_l2norm_in_kernel=True)
        assert rel_err(out[rows], o[0]) < 1e-12
        total = total + (o[0] * coef[rows]).sum()
    for a, b in zip(mine, torch.autograd.grad(total, xs)):
        assert rel_err(a, b) < 1e-11
    return packed, out


@pytest.mark.parametrize("tree", sorted(TREES))
def test_kda_rule_matches_each_path_alone(tree):
    with float64_everywhere():
        packed, out = _check_kda_rule(TREES[tree])
        # control: every node from a zero state (its parent's state dropped) is far off
        orphans = build_levels(packed.node_start, packed.node_end, torch.full_like(packed.node_parent, -1))
        rule = _torch_rule(_layout(_layer("kimi_linear")[1])[0])
        unrouted = tree_kda_rule(*_rule_inputs(packed.num_tokens), orphans, rule)
    assert rel_err(unrouted, out) > 1e-2


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=tree_paths(vocab=6, max_paths=6, max_len=10))
def test_kda_rule_random_trees(paths):
    with float64_everywhere():
        _check_kda_rule(paths)


@pytest.mark.parametrize("model_type", ["lfm2", "kimi_linear", "olmo_hybrid"])  # one per family
def test_float32_within_reference_rounding(model_type):
    """float32, the whole model: the tree's error against the float64 truth is within 2x of the
    per-path reference's own (log-probs, and each parameter's gradient)."""
    paths = [*zoo_paths(), *GRANDPARENT, *ONE_TOKEN_ROOT]
    coeffs = random_coeffs(paths, 0)

    def run(model, fn):
        lps = fn(model, paths)
        sum(((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, lps))).backward()
        return torch.cat(lps), grads(model)

    truth_model = zoo_model(model_type)  # built outside: float64_everywhere changes some init draws
    with float64_everywhere():
        truth_lp, truth_g = run(truth_model, reference_logprobs)
    model32 = zoo_model(model_type, dtype=torch.float32)
    ref_lp, ref_g = run(copy.deepcopy(model32), reference_logprobs)
    tree_lp, tree_g = run(model32, lambda m, p: path_logprobs(m, p, backend="dense"))
    assert rel_err(tree_lp, truth_lp) <= 2 * rel_err(ref_lp, truth_lp)
    # both round at ~6e-8 per op, in different orders (a level's batched rule vs a path's, the conv's
    # gather vs F.conv1d): a parameter whose gradient the reference happens to get almost exactly
    # right needs a floor, 1e-6 (~16 float32 ulps). Measured: log-probs at most 1.5x the reference's
    # error, gradients at most 1.2x + 1e-6 (without the floor a few parameters reach 2.3x)
    for n in truth_g:
        ref_e, tree_e = rel_err(ref_g[n], truth_g[n]), rel_err(tree_g[n], truth_g[n])
        assert tree_e <= 2 * ref_e + 1e-6, (n, tree_e, ref_e)


@pytest.mark.parametrize("model_type", ["lfm2", "kimi_linear"])
def test_fsdp_style_subclass_is_routed(model_type):
    """FSDP2's fully_shard swaps a module's class for an ``FSDP<Name>`` subclass."""
    hidden, layer = _layer(model_type)
    twin = copy.deepcopy(layer)
    twin.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    packed = pack(TrajectoryTree.from_paths(GRANDPARENT))
    x = torch.randn(1, packed.num_tokens, hidden, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(tree_layer_forward(twin, x, packed), tree_layer_forward(layer, x, packed))
