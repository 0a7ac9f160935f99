"""Mamba (selective scan) and Mamba2 (SSD) mixers on trees == each path through the mixer's own
forward (transformers' PyTorch code), layer by layer and end to end.

Layer checks build one mixer of each layout alone (Mamba2; Falcon-H1 with its gate instead of the
norm; Mamba; Zamba's multi-head Mamba) and compare its tree forward with its own forward on every
path, outputs and every gradient, on hand-built trees: a node shorter than the conv width whose
child's window reaches into its grandparent, a level whose nodes differ in length by 38x (one
padded group: the padding must be an identity step), a one-token root. The model zoo
(``tests/test_model_zoo.py``) checks all ten model types with float64 internals; here they are also
checked as shipped (their float32 casts inside a float64 model), and in float32 for one Mamba and
one Mamba2 type.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from torch import nn

from treetrain.logprobs import path_logprobs
from treetrain.models import mamba, mamba2
from treetrain.models.recurrent import FORWARDS, ROUTES, patch_recurrent_layers, tree_layer_forward
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import float32_runs, float64_everywhere, grad_l2_err
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err
from .strategies import tree_paths
from .zoo import zoo_model, zoo_paths

MAMBA1_TYPES = ("mamba", "falcon_mamba", "jamba", "zamba")
MAMBA2_TYPES = ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")

# root [1 2 3], a one-token child [4] (shorter than the conv width 4), grandchildren [5 6] and
# [7 8]: the window of 5 is [2 3 4 5], two tokens of it in the grandparent
GRANDPARENT = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 9, 10]]
# under [1 2]: children of 38, 1 and 2 tokens, one padded group of 38 steps (chunks of 3)
SKEWED = [[1, 2, *range(20, 58)], [1, 2, 3], [1, 2, 4, 5]]
ONE_TOKEN_ROOT = [[1, 2, 3], [1, 4, 5, 6], [1, 7]]
HAND = {"grandparent": GRANDPARENT, "skewed": SKEWED, "one_token_root": ONE_TOKEN_ROOT}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


# ---- one mixer alone ----------------------------------------------------------------------------


def _layer(kind: str) -> nn.Module:
    """A float64 mixer with chunks of 3, conv width 4, 2 B/C groups or heads, biases on."""
    one = dict(num_hidden_layers=1, hidden_size=16)
    if kind == "mamba2":
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

        cfg = transformers.Mamba2Config(
            **one, num_heads=4, head_dim=8, state_size=4, n_groups=2, chunk_size=3, conv_kernel=4,
            use_bias=True, time_step_limit=(0.05, 1.5),
        )  # fmt: skip
        m = Mamba2Mixer(cfg, 0)
    elif kind == "falcon_h1":  # the default Falcon-H1 mixer: no norm, y * silu(gate)
        from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

        cfg = transformers.FalconH1Config(
            **one, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4, mamba_n_groups=2,
            mamba_chunk_size=3, mamba_d_conv=4, ssm_in_multiplier=0.7, mamba_proj_bias=True, head_dim=8,
            ssm_multipliers=[0.5, 0.6, 0.7, 0.8, 0.9], num_attention_heads=2, num_key_value_heads=1,
        )  # fmt: skip
        m = FalconH1Mixer(cfg, 0)
        assert not m.mamba_rms_norm
        m.register_buffer("mup_vector", compute_mup_vector(cfg))
    elif kind == "mamba":
        from transformers.models.mamba.modeling_mamba import MambaMixer

        cfg = transformers.MambaConfig(
            **one, intermediate_size=32, state_size=4, time_step_rank=4, conv_kernel=4, use_bias=True
        )
        m = MambaMixer(cfg, 0)
    elif kind == "zamba":
        from transformers.models.zamba.modeling_zamba import ZambaMambaMixer

        cfg = transformers.ZambaConfig(
            **one, n_mamba_heads=2, mamba_d_state=4, mamba_dt_rank=4, mamba_d_conv=4, mamba_proj_bias=True,
            num_attention_heads=2, num_key_value_heads=2, layers_block_type=["linear_attention"],
        )  # fmt: skip
        m = ZambaMambaMixer(cfg, 0)
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):  # slow decays: every node's state reaches its children
                p.copy_((torch.rand(p.shape, generator=g) * 0.45 + 0.05).log())
            elif "dt" in name and ("bias" in name or p.ndim == 1):
                p.copy_(-torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m.double()


def _layer_check(m: nn.Module, paths) -> tuple[float, float]:
    """Worst relative error of the tree's outputs and of every gradient (parameters and inputs) of
    a random linear function of them, against the mixer's own forward on each path."""
    packed = pack(TrajectoryTree.from_paths(paths))
    g = torch.Generator().manual_seed(1)
    h = torch.randn(packed.num_tokens, 16, generator=g, dtype=torch.float64, requires_grad=True)
    rows = [packed.path_index[a:b] for a, b in zip(packed.path_offsets[:-1], packed.path_offsets[1:])]
    coeffs = [torch.randn(len(r), 16, generator=g, dtype=torch.float64) for r in rows]
    wrt = [h, *m.parameters()]
    with float64_everywhere():
        tree = tree_layer_forward(m, h[None], packed)[0]
        refs = [type(m).forward(m, h[r][None])[0] for r in rows]
        g_tree = torch.autograd.grad(sum((c * tree[r]).sum() for c, r in zip(coeffs, rows)), wrt)
        g_ref = torch.autograd.grad(sum((c * y).sum() for c, y in zip(coeffs, refs)), wrt)
    out = max(rel_err(tree[r], y) for r, y in zip(rows, refs))
    return out, max(rel_err(a, b) for a, b in zip(g_tree, g_ref))


LAYERS = ("mamba2", "falcon_h1", "mamba", "zamba")


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("name", sorted(HAND))
def test_layer_hand_trees(kind, name):
    out, grad = _layer_check(_layer(kind), HAND[name])
    # float64, every internal cast lifted: summation order only (measured <= 1e-15)
    assert out < 1e-12 and grad < 1e-12, (out, grad)


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=tree_paths(vocab=6, max_paths=6, max_len=9))
def test_layer_random_trees(kind, paths):
    out, grad = _layer_check(_layer(kind), paths)
    assert out < 1e-12 and grad < 1e-12, (out, grad)


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_without_parent_states_the_check_fails(kind, monkeypatch):
    """Control: every node from a zero state (the conv windows still along the paths)."""
    family = mamba2 if kind == "mamba2" else mamba
    run = family.tree_scan
    orphans = lambda xs, lv, scan: run(xs, lv, lambda a, _, v: scan(a, None, v))  # noqa: E731
    monkeypatch.setattr(family, "tree_scan", orphans)
    out, _ = _layer_check(_layer(kind), GRANDPARENT)
    assert out > 1e-3


def test_padded_steps_leave_the_state_unchanged():
    """A zero row (dt = 0) is an identity step of both scans: final states after 3 real steps
    equal those after the same 3 steps and 5 zero ones."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    pad = lambda x: torch.cat([x, x.new_zeros(x.shape[0], 5, *x.shape[2:])], 1)  # noqa: E731
    x, dt, B, C, s0 = r(2, 3, 6), r(2, 3, 6).exp(), r(2, 3, 2, 4), r(2, 3, 2, 4), r(2, 6, 4)
    A = -r(6, 4).exp()
    y, s = mamba.selective_scan(x, dt, A, B, C, s0)
    y_p, s_p = mamba.selective_scan(pad(x), pad(dt), A, pad(B), pad(C), s0)
    assert torch.equal(s_p, s) and torch.equal(y_p[:, :3], y)
    scan, fused = mamba2.chunk_scan_of(_layer("mamba2"), torch.device("cpu"))
    assert not fused
    x, dt, B, C, s0 = r(2, 3, 4, 2), r(2, 3, 4).exp(), r(2, 3, 2, 4), r(2, 3, 2, 4), r(2, 4, 2, 4)
    A = -r(4).exp()
    kw = dict(chunk_size=3, initial_states=s0, return_final_states=True)
    _, s = scan(x, dt, A, B, C, **kw)
    _, s_p = scan(pad(x), pad(dt), A, pad(B), pad(C), **kw)
    assert rel_err(s_p, s) < 1e-15


def test_older_transformers_without_the_scan_is_a_clear_error(monkeypatch):
    """transformers before the Mamba2 scan became a function of its own (e.g. verl's 5.10)."""
    import transformers.models.mamba2.modeling_mamba2 as hf

    monkeypatch.delattr(hf, "mamba2_chunk_scan")
    with pytest.raises(ValueError, match="has no mamba2_chunk_scan .* use transformers >= 5.24"):
        _layer_check(_layer("mamba2"), ONE_TOKEN_ROOT)


# ---- the model types, end to end ----------------------------------------------------------------


def _model_errors(model_type: str, dtype=torch.float64) -> tuple[float, float]:
    paths = zoo_paths()
    coeffs = random_coeffs(paths, seed=3)
    ref = zoo_model(model_type, dtype=dtype)
    tree = copy.deepcopy(ref)
    want = reference_logprobs(ref, paths)
    sum((c.to(dtype) * lp).sum() for c, lp in zip(coeffs, want)).backward()
    got = path_logprobs(tree, paths, backend="dense")
    sum((c.to(dtype) * lp).sum() for c, lp in zip(coeffs, got)).backward()
    return max(rel_err(a, b) for a, b in zip(got, want)), grad_err(grads(tree), grads(ref))


@pytest.mark.parametrize("model_type", MAMBA1_TYPES + MAMBA2_TYPES)
def test_float64_as_shipped(model_type):
    """float64 models as transformers ships them: their scans still compute in float32 inside
    (``.float()``), so tree and paths round differently at ~1e-7 (measured <= 1e-7 log-probs,
    1.2e-6 gradients)."""
    lp, grad = _model_errors(model_type)
    assert lp < 1e-6 and grad < 1e-5, (lp, grad)


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_float32_within_reference_rounding(model_type):
    """float32: against the float64 truth, the tree's log-probs are at most twice as far off as
    each path's own float32 forward, and so is its gradient (all parameters, 2-norm); no single
    parameter's gradient more than 4x. Both round at ~6e-8 per op in different orders (chunk and
    node boundaries, sums over shared tokens): over 6 seeds the ratios measured 0.8-1.6
    (log-probs), 0.7-1.8 (2-norm), 0.7-2.3 (worst parameter; Llama's attention alone: up to 1.9)."""
    paths = zoo_paths()
    # the truth is built before float64_everywhere: inside it, some init draws differ
    (truth_lp, truth_g), (ref_lp, ref_g), (tree_lp, tree_g) = float32_runs(
        functools.partial(zoo_model, model_type),
        paths,
        lambda m, p: path_logprobs(m, p, backend="dense"),
        truth_inside=False,
    )
    assert rel_err(tree_lp, truth_lp) <= 2 * rel_err(ref_lp, truth_lp)
    assert grad_l2_err(tree_g, truth_g) <= 2 * grad_l2_err(ref_g, truth_g)
    assert grad_err(tree_g, truth_g) <= 4 * grad_err(ref_g, truth_g)


# ---- how the tree reaches the mixers ------------------------------------------------------------


def test_a_layer_of_no_known_class_is_refused_by_name():
    with pytest.raises(ValueError, match="Linear is not a Mamba mixer: .*MambaMixer"):
        mamba._layout(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Linear is not a Mamba2 mixer: .*Mamba2Mixer"):
        mamba2._layer_class(torch.nn.Linear(2, 2))


def test_every_layer_class_is_routed():
    assert set(mamba2.MAMBA2_LAYERS) | set(mamba.MAMBA_LAYOUTS) <= set(ROUTES)
    for model_type in MAMBA1_TYPES + MAMBA2_TYPES:
        model = zoo_model(model_type, dtype=torch.float32)
        assert patch_recurrent_layers(model) >= 1, model_type


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_handed_down_under_checkpointing_and_subclasses(model_type, monkeypatch):
    """Mamba's decoder and Jamba's Mamba layer do not pass the tree's kwargs on (``FORWARDS``):
    the tree still reaches the mixers through FSDP2-style ``FSDP<Name>`` subclasses and in training
    mode with activation checkpointing, where the backward replays each layer (each mixer's tree
    forward runs twice); ordinary calls are unchanged."""
    calls = []
    for name, fn in list(ROUTES.items()):
        counted = lambda *a, fn=fn, **k: calls.append(1) or fn(*a, **k)  # noqa: E731
        monkeypatch.setitem(ROUTES, name, counted)
    with float64_everywhere():
        ref = zoo_model(model_type)
        model = copy.deepcopy(ref).train()
        for m in model.modules():
            if type(m).__name__ in set(FORWARDS) | set(ROUTES):
                m.__class__ = type(f"FSDP{type(m).__name__}", (type(m),), {})
        mixers = patch_recurrent_layers(model)
        ids = torch.tensor([[3, 14, 15, 92, 65]])
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        paths = zoo_paths()
        coeffs = random_coeffs(paths, seed=3)
        want = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
        got = path_logprobs(model, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    assert len(calls) == 2 * mixers
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-12
    assert grad_err(grads(model), grads(ref)) < 1e-10
