"""Inkling's relative bias in the attention backends: ``rel_bias[h, q, pos[q] - pos[k]]`` below
distance ``E``, a differentiable input.

``dense`` is checked by hand (the module docstring's example) and against each path's own attention
with the bias at ``arange`` distances, as Hugging Face's Inkling computes it; ``blocksparse`` against
``dense`` on random forests (one-token nodes, new roots, GQA, per-query sinks, a sliding window;
float64: outputs and the gradients of q, k, v, the bias and the sinks); ``flex``'s forward (CPU
has no flex backward) and, with flex's CPU device check lifted, its eager backward, which
differentiates the same ``score_mod`` graph CUDA compiles. ``triton`` and the ``cp`` /
``depth_first`` runs refuse the bias by name.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.attention import check_features, get_backend
from treetrain.attention.mask import TreeMask, dense_tree_mask
from treetrain.attention.relbias import rel_bias_scores

from .reference import rel_err
from .test_attention_alibi import forests

# paths [A B C D], [A B E F], [A G H]
END = torch.tensor([8, 6, 4, 4, 6, 6, 8, 8])
POS = torch.tensor([0, 1, 2, 3, 2, 3, 1, 2])
PATHS = [[0, 1, 2, 3], [0, 1, 4, 5], [0, 6, 7]]  # DFS indices


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bias_by_hand():
    """E = 2: query E adds rel[E, 1] to B and rel[E, 0] to itself, nothing to A (2 back); G adds
    rel[G, 1] to A and rel[G, 0] to itself."""
    rel = torch.arange(16, dtype=torch.float64).view(1, 8, 2) + 1  # rel[0, t] = [2t + 1, 2t + 2]
    bias = rel_bias_scores(rel, POS)[0]
    visible = dense_tree_mask(END)
    assert bias[4][visible[4]].tolist() == [0.0, 10.0, 9.0]  # A, B, E
    assert bias[6][visible[6]].tolist() == [14.0, 13.0]  # A, G


def _inputs(T, hq, hkv, extent, d=8, seed=0, dtype=torch.float64, per_query_sinks=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    sinks = make(hq, T) if per_query_sinks else None
    return make(hq, T, d), make(hkv, T, d), make(hkv, T, d), make(hq, T, extent), sinks


def test_dense_equals_each_path_with_arange_distances():
    """Each path alone, as the model computes it: scores + rel[h, i, i - j] for ``0 <= i - j < E``
    (``arange`` distances), causal softmax. The tree's rows of that path are the same numbers."""
    q, k, v, rel, _ = _inputs(8, 4, 2, extent=2)
    got = get_backend("dense")(q, k, v, TreeMask(END, position_ids=POS), 0.3, rel_bias=rel)
    for path in PATHS:
        idx = torch.tensor(path)
        qp, kp, vp, rp = (
            q[:, idx],
            k[:, idx].repeat_interleave(2, 0),
            v[:, idx].repeat_interleave(2, 0),
            rel[:, idx],
        )
        n = len(path)
        d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        bias = rp.gather(2, d.clamp(0, 1).expand(4, n, n)).masked_fill((d < 0) | (d >= 2), 0.0)
        scores = (qp @ kp.transpose(-1, -2)) * 0.3 + bias
        want = torch.softmax(scores.masked_fill(d < 0, float("-inf")), -1) @ vp
        assert rel_err(got[:, idx], want) < 1e-14
    plain = get_backend("dense")(q, k, v, TreeMask(END, position_ids=POS), 0.3)
    assert rel_err(plain, got) > 1e-2  # the bias matters


def _run(backend, q, k, v, rel, sinks, end, pos, do, **kw):
    out = get_backend(backend)(q, k, v, TreeMask(end, position_ids=pos), 0.4, rel_bias=rel, sinks=sinks, **kw)
    wrt = [x for x in (q, k, v, rel, sinks) if x is not None]
    return (out.detach(), *torch.autograd.grad(out, wrt, do))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|, floored at 1 (the inputs are standard normal): a gradient
    that is zero in exact arithmetic (a row with one visible key) is ~1e-16 rounding either way."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=forests(),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]),
    block=st.sampled_from([1, 3, 8]),
    extent=st.integers(1, 6),
    sinks=st.booleans(),
    window=st.sampled_from([None, 3]),
)
def test_blocksparse_equals_dense(tree, heads, block, extent, sinks, window):
    end, pos = tree
    q, k, v, rel, s = _inputs(end.numel(), *heads, extent, per_query_sinks=sinks)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = _run("dense", q, k, v, rel, s, end, pos, do, window=window)
    got = _run("blocksparse", q, k, v, rel, s, end, pos, do, block=block, window=window)
    for a, b in zip(got, want):
        assert _err(a, b) < 1e-12


def test_flex_forward_equals_dense():
    q, k, v, rel, sinks = (x.detach() for x in _inputs(8, 4, 2, 3, dtype=torch.float32, per_query_sinks=True))
    mask = TreeMask(END, position_ids=POS)
    want = get_backend("dense")(
        *(x.double() for x in (q, k, v)), mask, 0.3, rel_bias=rel.double(), sinks=sinks.double()
    )
    got = get_backend("flex")(q, k, v, mask, 0.3, rel_bias=rel, sinks=sinks)
    assert rel_err(got, want) < 1e-5  # float32 rounding


def test_flex_eager_backward_equals_dense(monkeypatch):
    """flex refuses a CPU backward by a device check; lifted, its eager backward differentiates the
    ``score_mod``'s captured bias table (and the sinks through the log-sum-exp) as dense does."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    q, k, v, rel, sinks = _inputs(8, 4, 2, 3, per_query_sinks=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = _run("dense", q, k, v, rel, sinks, END, POS, do, window=3)
    got = _run("flex", q, k, v, rel, sinks, END, POS, do, window=3)
    for a, b in zip(got, want):
        assert _err(a, b) < 1e-12


@pytest.mark.parametrize("backend", ["triton", "cp", "depth_first"])
def test_backends_without_the_bias_refuse_by_name(backend):
    with pytest.raises(
        ValueError, match=r"does not support a learned relative .*'dense' or 'blocksparse' or 'flex'"
    ):
        check_features(backend, {"rel_bias"})


def test_bad_bias_is_refused():
    q, k, v, rel, _ = _inputs(8, 4, 2, 3)
    with pytest.raises(ValueError, match=r"rel_bias must be \[Hq, T, E\] = \[4, 8, E >= 1\]"):
        get_backend("blocksparse")(q, k, v, TreeMask(END, position_ids=POS), 0.3, rel_bias=rel[:2])
    with pytest.raises(ValueError, match="needs TreeMask.position_ids"):
        get_backend("dense")(q, k, v, TreeMask(END), 0.3, rel_bias=rel)
