"""ALiBi in the attention backends: the bias ``alibi[h, k] - alibi[h, q]`` along each path.

``dense`` is checked by hand against Hugging Face's form (the key's term only: the query's is a
per-row constant the softmax ignores); ``blocksparse`` against ``dense`` on random forests (float64:
outputs and dq, dk, dv to 1e-12, as its plain tests), ``flex`` forward (no CPU backward). Triton's
kernels are checked in ``test_attention_triton.py`` (under the interpreter). Random per-token biases,
not only ``slope * position``, so a bias read at the wrong token or head cannot hide behind ties.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.attention import check_features, get_backend
from treetrain.attention.alibi import alibi_scores
from treetrain.attention.mask import TreeMask, dense_tree_mask

from .reference import rel_err

# paths [A B C D], [A B E F], [A G H]
END = torch.tensor([8, 6, 4, 4, 6, 6, 8, 8])
POS = torch.tensor([0, 1, 2, 3, 2, 3, 1, 2])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bias_by_hand():
    """Slope 0.5: query E (position 2) adds -1, -0.5, 0 to keys A, B, E; G adds -0.5, 0 to A, G."""
    bias = alibi_scores(0.5 * POS[None].double())[0]
    allowed = dense_tree_mask(END)
    assert bias[4][allowed[4]].tolist() == [-1.0, -0.5, 0.0]
    assert bias[6][allowed[6]].tolist() == [-0.5, 0.0]


def _inputs(T, hq, hkv, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    noise = torch.randn(hq, T, generator=g, dtype=torch.float64)
    return make(hq, T, d), make(hkv, T, d), make(hkv, T, d), noise


def test_dense_equals_the_models_key_only_bias():
    """HF adds ``slope * pos[k]`` to each score: the same softmax as ``slope * (pos[k] - pos[q])``."""
    q, k, v, _ = _inputs(8, 4, 2)
    slopes = torch.tensor([0.5, 0.25, 2**-0.5, 0.1], dtype=torch.float64)
    alibi = slopes[:, None] * POS[None]
    kk, vv = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    scores = (q @ kk.transpose(-1, -2)) * 0.3 + alibi[:, None, :]
    want = torch.softmax(scores.masked_fill(~dense_tree_mask(END), float("-inf")), -1) @ vv
    got = get_backend("dense")(q, k, v, TreeMask(END, position_ids=POS), 0.3, alibi=alibi)
    assert rel_err(got, want) < 1e-14
    plain = get_backend("dense")(q, k, v, TreeMask(END, position_ids=POS), 0.3)
    assert rel_err(plain, want) > 1e-2  # the bias matters


def subtree_end_from_parents(parent: list[int]) -> torch.Tensor:
    end = list(range(1, len(parent) + 1))
    for t in reversed(range(len(parent))):
        if parent[t] >= 0:
            end[parent[t]] = max(end[parent[t]], end[t])
    return torch.tensor(end, dtype=torch.int64)


@st.composite
def forests(draw, max_tokens: int = 48):
    """A random forest in DFS order (one-token nodes, new roots) with its path positions."""
    T = draw(st.integers(1, max_tokens))
    parent, path = [], []
    for t in range(T):
        path = path[: draw(st.integers(0, len(path)))]
        parent.append(path[-1] if path else -1)
        path.append(t)
    depth = []
    for p in parent:
        depth.append(0 if p < 0 else depth[p] + 1)
    return subtree_end_from_parents(parent), torch.tensor(depth)


def _run(backend, q, k, v, alibi, end, pos, do, **kw):
    out = get_backend(backend)(q, k, v, TreeMask(end, position_ids=pos), 0.4, alibi=alibi, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=forests(),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]),
    block=st.sampled_from([1, 3, 8]),
    random_bias=st.booleans(),
    window=st.sampled_from([None, 3]),
)
def test_blocksparse_equals_dense(tree, heads, block, random_bias, window):
    end, pos = tree
    q, k, v, noise = _inputs(end.numel(), *heads)
    slopes = torch.linspace(0.1, 1.0, heads[0], dtype=torch.float64)
    alibi = 3 * noise if random_bias else slopes[:, None] * pos[None]
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = _run("dense", q, k, v, alibi, end, pos, do, window=window)
    got = _run("blocksparse", q, k, v, alibi, end, pos, do, block=block, window=window)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-12


def test_flex_forward_equals_dense():
    q, k, v, _ = (x.detach() if x.requires_grad else x for x in _inputs(8, 4, 2, dtype=torch.float32))
    alibi = torch.randn(4, 8)
    mask = TreeMask(END, position_ids=POS)
    want = get_backend("dense")(*(x.double() for x in (q, k, v)), mask, 0.3, alibi=alibi.double())
    assert rel_err(get_backend("flex")(q, k, v, mask, 0.3, alibi=alibi), want) < 1e-5  # float32 rounding


@pytest.mark.parametrize("backend", ["cp", "depth_first"])
def test_backends_without_alibi_refuse_by_name(backend):
    with pytest.raises(ValueError, match=r"does not support ALiBi position bias \(alibi\).*'dense'"):
        check_features(backend, {"alibi"})


def test_bad_bias_is_refused():
    q, k, v, _ = _inputs(8, 4, 2)
    mask = TreeMask(END, position_ids=POS)
    with pytest.raises(ValueError, match=r"alibi must be \[Hq, T\] = \[4, 8\]"):
        get_backend("blocksparse")(q, k, v, mask, 0.3, alibi=torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="detached"):
        live = torch.zeros(4, 8, dtype=torch.float64, requires_grad=True)
        get_backend("dense")(q, k, v, mask, 0.3, alibi=live)
