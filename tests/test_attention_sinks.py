"""Attention sinks in every backend, per head (GPT-OSS) and per head and query (Inkling2): forward
and the gradients of q, k, v and the sinks, against HF's eager definition (the sink joins the
softmax as one more column and is dropped)."""

from __future__ import annotations

import copy

import pytest
import torch

from treetrain.attention import get_backend
from treetrain.attention.mask import TreeMask, dense_tree_mask
from treetrain.attention.sinks import add_sinks
from treetrain.logprobs import path_logprobs
from treetrain.models.hf import _tree_attention

from .hybrid_models import float64_everywhere
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err
from .zoo import zoo_model, zoo_paths

# paths [A B C D], [A B E F], [A G H]
END = torch.tensor([8, 6, 4, 4, 6, 6, 8, 8])
POS = torch.tensor([0, 1, 2, 3, 2, 3, 1, 2])


def test_add_sinks_by_hand():
    """One row, scores [0, 0] over values [1, 3], sink 0: softmax [1/3, 1/3, 1/3] over [1, 3, 0]."""
    out = torch.tensor([[[2.0]]], dtype=torch.float64)  # the row's output without the sink
    lse = torch.tensor([[2.0]], dtype=torch.float64).log()
    sunk, new_lse = add_sinks(out, lse, torch.zeros(1, dtype=torch.float64))
    assert torch.allclose(sunk, torch.tensor([[[4 / 3]]], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(new_lse.exp(), torch.tensor([[3.0]], dtype=torch.float64), atol=1e-15)


def _inputs(dtype, seed=0, hq=4, hkv=2, d=8, per_query=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    sinks = make(hq, 8) if per_query else make(hq)
    return make(hq, 8, d), make(hkv, 8, d), make(hkv, 8, d), sinks * 2


def _eager(q, k, v, sinks, scale, window=None):
    """HF's eager attention with sinks over the dense tree mask: ``[Hq, T, D]``."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~dense_tree_mask(END, POS, window), float("-inf"))
    column = sinks[:, None, None] if sinks.dim() == 1 else sinks[:, :, None]
    scores = torch.cat([scores, column.expand(-1, scores.shape[1], 1)], -1)
    return torch.softmax(scores, -1)[..., :-1] @ v


# float64 backends: rounding only (1e-12); the Triton interpreter runs float32: its own error is
# ~1e-7 relative on these O(1) values, so 1e-5 leaves a 100x margin
CASES = [("dense", torch.float64, 1e-12, {}), ("blocksparse", torch.float64, 1e-12, {"block": 2})]
CASES += [("triton", torch.float32, 1e-5, {})]


@pytest.mark.parametrize("per_query", [False, True], ids=["per_head", "per_query"])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("backend, dtype, tol, kw", CASES, ids=[c[0] for c in CASES])
def test_sinks_forward_and_gradients(backend, dtype, tol, kw, window, per_query):
    if backend == "triton":
        pytest.importorskip("triton")
        from treetrain.attention.triton_kernel import triton_available

        if not triton_available():
            pytest.skip("no CUDA device and TRITON_INTERPRET unset")
    q, k, v, sinks = _inputs(dtype, per_query=per_query)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    want = _eager(*(x.double() for x in (q, k, v, sinks)), 0.3, window)
    want_g = torch.autograd.grad((want * g.double()).sum(), (q, k, v, sinks))
    mask = TreeMask(END, position_ids=POS)
    got = get_backend(backend)(q, k, v, mask, 0.3, window=window, sinks=sinks, **kw)
    got_g = torch.autograd.grad((got * g).sum(), (q, k, v, sinks))
    assert rel_err(got, want) < tol
    for a, b in zip(got_g, want_g):
        assert rel_err(a, b) < tol
    assert want_g[3].abs().max() > 1e-2  # the sinks get a real gradient


def test_flex_sinks_forward():
    """FlexAttention has no CPU backward: the forward here (its gradient flows through flex's
    differentiable log-sum-exp on CUDA)."""
    for per_query in (False, True):
        q, k, v, sinks = (x.detach() for x in _inputs(torch.float32, per_query=per_query))
        want = _eager(*(x.double() for x in (q, k, v, sinks)), 0.3)
        got = get_backend("flex")(q, k, v, TreeMask(END, position_ids=POS), 0.3, sinks=sinks)
        assert rel_err(got, want) < 1e-5  # float32 kernel: its own rounding, ~1e-7


def test_bad_sinks_are_refused():
    q, k, v, _ = _inputs(torch.float64)
    for backend in ("dense", "blocksparse"):
        with pytest.raises(ValueError, match=r"sinks must be \[Hq\] = \[4\] or \[Hq, T\] = \[4, 8\]"):
            get_backend(backend)(q, k, v, TreeMask(END, position_ids=POS), 0.3, sinks=torch.zeros(4, 7))


@pytest.mark.parametrize("backend", ["cp", "depth_first"])
def test_backend_without_sinks_refuses_naming_feature_and_alternatives(backend):
    q, k, v, sinks = (x.detach()[None] for x in _inputs(torch.float32))
    mask = TreeMask(END, backend=backend, position_ids=POS)
    with pytest.raises(ValueError, match=r"does not support attention sinks .*'dense' or 'blocksparse'"):
        _tree_attention(None, q, k, v, None, scaling=0.3, tree_mask=mask, s_aux=sinks[0])


@pytest.mark.parametrize("backend", ["dense", "blocksparse"])
def test_gpt_oss_model_exact_with_sinks(backend):
    """The whole GPT-OSS model (sinks, sliding window 3, MoE) per backend: log-probs and gradients
    (sinks included) equal the per-path eager forwards in float64."""
    paths = zoo_paths()
    coeffs = random_coeffs(paths, seed=5)
    with float64_everywhere():
        ref = zoo_model("gpt_oss")
        tree = copy.deepcopy(ref)
        want = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
        got = path_logprobs(tree, paths, backend=backend)
        sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-12
    g_tree, g_ref = grads(tree), grads(ref)
    assert grad_err(g_tree, g_ref) < 1e-10
    assert all(g_tree[n].abs().max() > 1e-3 for n in g_tree if n.endswith("sinks"))


def test_prepared_gpt_oss_ordinary_call_keeps_sinks():
    """A prepared model called without a tree (e.g. generation) still applies its sinks."""
    from treetrain.models.hf import prepare_model

    with float64_everywhere(), torch.no_grad():
        ref = zoo_model("gpt_oss")
        model = prepare_model(copy.deepcopy(ref))
        ids = torch.tensor([[5, 9, 17, 3, 44, 8]])
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-12
