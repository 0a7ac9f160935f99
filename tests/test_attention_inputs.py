"""Every attention backend's entry point rejects bad inputs with the same ``ValueError``; a backend
that cannot run is never replaced silently."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from treetrain import attention
from treetrain.attention.blocksparse import blocksparse_attention
from treetrain.attention.dense import dense_attention
from treetrain.attention.flex import flex_tree_attention
from treetrain.attention.mask import TreeMask
from treetrain.attention.triton_kernel import triton_tree_attention


@contextlib.contextmanager
def warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


BACKENDS = [dense_attention, blocksparse_attention, flex_tree_attention, triton_tree_attention]
END = torch.tensor([4, 3, 3, 4])  # paths [0 1 2], [0 3]


def qkv(hq=4, hkv=2, T=4, D=8, dtype=torch.float32):
    return (
        torch.randn(hq, T, D, dtype=dtype),
        torch.randn(hkv, T, D, dtype=dtype),
        torch.randn(hkv, T, D, dtype=dtype),
    )


@pytest.mark.parametrize("fn", BACKENDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("gqa", "multiple of key/value heads"),
        ("rank", r"must be \[H, T, D\]"),
        ("length", "same T and D"),
        ("dtype", "one dtype"),
        ("mask", "subtree_end must be"),
    ],
)
def test_bad_inputs_raise_value_error_alike(fn, case, match):
    q, k, v = qkv(hq=3) if case == "gqa" else qkv()
    end = END
    if case == "rank":
        q = q[None]
    elif case == "length":
        k, v = k[:, :3], v[:, :3]
    elif case == "dtype":
        v = v.double()
    elif case == "mask":
        end = END[:3]
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, TreeMask(end), 0.5)


@pytest.mark.parametrize("fn", BACKENDS[:3], ids=lambda f: f.__name__)
def test_score_keywords_are_the_shared_ones(fn):
    """dense, blocksparse and flex take the keywords of ``mask.TreeScores`` (declared once): a
    misspelled one is Python's TypeError, and an accepted one reaches the backend (``window=1``: each
    token sees itself alone, so the output is its own value)."""
    q, k, v = qkv(hq=2, hkv=2)
    with pytest.raises(TypeError, match=rf"^{fn.__name__}\(\) got an unexpected keyword argument 'windw'$"):
        fn(q, k, v, TreeMask(END), 0.5, windw=1)
    out = fn(q, k, v, TreeMask(END, position_ids=torch.tensor([0, 1, 2, 1])), 0.5, window=1)
    torch.testing.assert_close(out, v)


def test_triton_block_sizes_raise_value_error():
    q, k, v = qkv()
    if attention.triton_kernel.triton is None:
        pytest.skip("triton is not installed: the entry point raises RuntimeError before the block check")
    with pytest.raises(ValueError, match="powers of two"):
        triton_tree_attention(q, k, v, TreeMask(END), 0.5, block_m=24)


def test_fallback_to_dense_warns_once_and_says_why(monkeypatch):
    monkeypatch.setitem(attention.BACKENDS, "blocksparse", ("treetrain.attention.no_such_module", "fn"))
    monkeypatch.setattr(attention, "_announced", set())
    with pytest.warns(
        RuntimeWarning, match=r"'dense' backend: it builds the T x T mask.*'blocksparse' is unavailable"
    ):
        assert attention.default_backend("cpu") == "dense"
    with warnings_as_errors():
        assert attention.default_backend("cpu") == "dense"  # said once per process


def test_available_default_backend_is_silent():
    with warnings_as_errors():
        assert attention.default_backend("cpu") == "blocksparse"


def test_backend_for_follows_features(monkeypatch):
    """The automatic choice reads attention.FEATURES: the default when it computes every feature the
    model uses, else the first backend of the device's order that does."""
    assert attention.backend_for("cpu", {"window", "sinks"}) == "blocksparse"
    assert attention.backend_for("cpu", {"softcap"}) == "dense"
    monkeypatch.setitem(attention.FEATURES, "blocksparse", attention.FEATURES["dense"])
    assert attention.backend_for("cpu", {"softcap"}) == "blocksparse"  # one place decides
    monkeypatch.setattr(attention, "default_backend", lambda device: "triton")
    assert attention.backend_for("cuda", {"softcap"}) == "flex"
    with pytest.raises(ValueError, match="no_such_feature"):
        attention.backend_for("cpu", {"no_such_feature"})
