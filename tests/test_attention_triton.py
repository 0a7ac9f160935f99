"""Triton tree attention against the dense reference, on small trees, under the Triton interpreter.

``triton.jit`` chooses the interpreter when a function is *decorated*, Triton's own ``tl`` helpers
included, so ``TRITON_INTERPRET`` has to be set before anything imports triton: here, above the imports
(the tests skip, saying so, when triton was imported earlier). ``setdefault`` keeps an explicit
``TRITON_INTERPRET=0``, which runs the same tests compiled on CUDA, the only way to cover bf16 (the
interpreter has no bf16 ``tl.dot``).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import treetrain.attention.triton_kernel as tk  # noqa: E402
from treetrain.attention.dense import dense_attention  # noqa: E402
from treetrain.attention.mask import TreeMask, check_subtree_end, dense_tree_mask  # noqa: E402

from .strategies import random_parents, subtree_end_from_parents, tree_from_parents  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def _flag_set_too_late() -> bool:
    """Triton was imported before ``TRITON_INTERPRET`` was set: its own ``tl`` helpers are compiled-only."""
    if not INTERPRET or tk.triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(tk._fwd_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.skipif(not tk.triton_available(), reason="needs triton and CUDA or TRITON_INTERPRET"),
    pytest.mark.skipif(_flag_set_too_late(), reason="triton was imported before TRITON_INTERPRET=1 was set"),
]


# ------------------------------------------------------------------------------------------------
# Trees: subtree_end from parent links in DFS order.
# ------------------------------------------------------------------------------------------------


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def offset(parent: list[int], by: int) -> list[int]:
    return [p + by if p >= 0 else -1 for p in parent]


def test_subtree_end_helper_matches_design_example():
    # A B C D E F G H from paths [A B C D], [A B E F], [A G H].
    assert subtree_end_from_parents([-1, 0, 1, 2, 1, 4, 0, 6]).tolist() == [8, 6, 4, 4, 6, 6, 8, 8]


# ------------------------------------------------------------------------------------------------
# Comparison against the dense backend.
# ------------------------------------------------------------------------------------------------


def make_inputs(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, T, d, generator=g) for h in (hq, hkv, hkv))
    do = torch.randn(hq, T, d, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v, do)]


def run(attn, q, k, v, do, end: torch.Tensor, **kw) -> list[torch.Tensor]:
    """Output and (dq, dk, dv) of ``attn`` at the given inputs, as float64."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = attn(q, k, v, TreeMask(end.to(q.device)), 0.7, **kw)
    grads = torch.autograd.grad(o, (q, k, v), do.to(o.dtype))
    return [x.double().cpu() for x in (o, *grads)]


def max_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [(a - b).abs().max().item() for a, b in zip(got, ref)]


# fp32 accumulation over <= 100 keys of O(1) values rounds at ~1e-6; the kernels differ from the
# reference only in reduction order and exp2 vs exp, while a wrong mask entry shows up at ~1e-1.
FP32_ATOL = 1e-4


def check_fp32(parent: list[int], hq=2, hkv=1, d=16, block_m=16, block_n=16, seed=0):
    end = subtree_end_from_parents(parent)
    check_subtree_end(end)
    inputs = make_inputs(len(parent), hq, hkv, d, torch.float32, seed)
    ref = run(dense_attention, *(x.double() for x in inputs), end)
    got = run(tk.triton_tree_attention, *inputs, end, block_m=block_m, block_n=block_n)
    for name, err in zip(("out", "dq", "dk", "dv"), max_errors(got, ref)):
        assert err < FP32_ATOL, (name, err)


@pytest.mark.parametrize(
    "parent",
    [chain(40), star(37), chain(20) + offset(star(21), 20), [-1, 0, 1, 2, 1, 4, 0, 6], [-1]],
    ids=["chain", "star", "forest", "design-example", "single-token"],
)
def test_hand_written_trees(parent):
    check_fp32(parent, hq=4, hkv=2)


@pytest.mark.parametrize("d", [24, 64, 128])
def test_head_dims(d):
    check_fp32(chain(10) + offset(random_parents(40, random.Random(d)), 10), d=d, block_m=32)


@given(
    T=st.integers(1, 100),
    rng=st.randoms(use_true_random=False),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    d=st.sampled_from([16, 32]),
    blocks=st.sampled_from([(16, 16), (16, 32), (32, 16)]),
)
@settings(max_examples=25, deadline=None)
def test_random_trees(T, rng, heads, d, blocks):
    check_fp32(random_parents(T, rng), *heads, d, *blocks, seed=rng.randint(0, 2**16))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the first tree's own rows
def test_skips_fully_masked_blocks():
    # Two trees filling whole blocks: the second tree's tiles never touch the first tree's keys, so
    # NaNs there cannot leak into it (a visited but masked tile would give 0 * NaN = NaN).
    end = subtree_end_from_parents(chain(32) + offset(random_parents(32, random.Random(0)), 32))
    q, k, v, do = make_inputs(64, 2, 2, 16, torch.float32)
    k[:, :32], v[:, :32] = float("nan"), float("nan")
    got = run(tk.triton_tree_attention, q, k, v, do, end, block_m=16, block_n=16)
    ref = run(dense_attention, *(x[:, 32:].double() for x in (q, k, v, do)), end[32:] - 32)
    for a, b in zip(got, ref):
        assert (a[:, 32:] - b).abs().max() < FP32_ATOL


def test_empty_query_row_is_zero_not_nan():
    # Malformed on purpose (subtree_end[1] == 1): query 1 sees no key. Packing never produces this.
    end = torch.tensor([1, 1, 3, 4])
    q, k, v, do = make_inputs(4, 1, 1, 16, torch.float32)
    o, dq, dk, dv = run(tk.triton_tree_attention, q, k, v, do, end, block_m=16, block_n=16)
    assert o[:, 1].abs().max() == 0 and dq[:, 1].abs().max() == 0
    assert all(x.isfinite().all() for x in (o, dq, dk, dv))


def test_block_bounds_are_cached_on_the_mask():
    mask = TreeMask(subtree_end_from_parents(random_parents(50, random.Random(1))).to(DEVICE))
    q, k, v, _ = make_inputs(50, 1, 1, 16, torch.float32)
    tk.triton_tree_attention(q, k, v, mask, 1.0, block_m=16, block_n=16)
    assert set(mask.cache) == {("triton_block_bounds", 16)}  # O(T / 16) ints; no T x T mask anywhere
    out = tk.triton_tree_attention(q, k, v, mask, 1.0, block_m=16, block_n=16)  # reuses them
    assert torch.allclose(out, dense_attention(q, k, v, mask, 1.0), atol=FP32_ATOL)


# ------------------------------------------------------------------------------------------------
# Low precision: bounded by the reference's own low-precision error.
# ------------------------------------------------------------------------------------------------


def lowp_reference(q, k, v, mask: TreeMask, scale: float) -> torch.Tensor:
    """Textbook attention with every matmul and the softmax rounded to the input dtype."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~dense_tree_mask(mask.subtree_end), float("-inf"))
    return s.softmax(-1) @ v


LOWP = [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRET, reason="no bf16 dot")),
]


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("seed", [0, 1])
def test_low_precision(dtype, seed):
    # Both errors are against float64 on the same rounded inputs. The reference error is the worse of
    # the dense backend (on CPU it upcasts internally and only rounds its results) and textbook
    # attention with every op rounded to the dtype. Like FlashAttention-2, the kernels round P and dS
    # before their matmuls and take delta = rowsum(dO * O) from the rounded O; the latter dominates
    # dq/dk: over 40 random trees the worst ratio was 2.7 (1.7 with delta from the exact O).
    rng = random.Random(seed)
    end = subtree_end_from_parents(chain(12) + offset(random_parents(60, rng), 12))
    inputs = make_inputs(72, 4, 2, rng.choice([16, 64]), dtype, seed=seed)
    exact = run(dense_attention, *(x.double() for x in inputs), end)
    dense_err = max_errors(run(dense_attention, *inputs, end), exact)
    textbook_err = max_errors(run(lowp_reference, *inputs, end), exact)
    got = max_errors(run(tk.triton_tree_attention, *inputs, end, block_m=16, block_n=32), exact)
    for name, err, a, b in zip(("out", "dq", "dk", "dv"), got, dense_err, textbook_err):
        assert err <= 3 * max(a, b), (name, err, a, b)


# ------------------------------------------------------------------------------------------------
# ALiBi: the bias alibi[h, k] - alibi[h, q] inside every tile (forward, dq, dk/dv).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parent, heads, window",
    [
        (chain(17) + offset(random_parents(30, random.Random(3)), 17), (4, 2), None),  # forest, GQA
        (chain(3) + offset(star(20), 3), (2, 1), 4),  # one-token leaves; a sliding window too
        (random_parents(33, random.Random(5), p_continue=0.4), (3, 3), None),
    ],
    ids=["forest-gqa", "star-window", "bushy"],
)
def test_alibi_against_dense(parent, heads, window):
    end, pos = tree_from_parents(parent)
    hq = heads[0]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / hq) for h in range(hq)])
    # slope * position, plus a random term so a bias read at the wrong token or head shows
    noise = torch.randn(hq, len(parent), generator=torch.Generator().manual_seed(0))
    alibi = slopes[:, None] * pos[None] + noise
    q, k, v, do = make_inputs(len(parent), *heads, 16, torch.float32)

    def go(attn, q, k, v, do, **kw):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        mask = TreeMask(end.to(q.device), position_ids=pos.to(q.device))
        o = attn(q, k, v, mask, 0.7, alibi=alibi.to(q.device, q.dtype), window=window, **kw)
        return [x.double().cpu() for x in (o, *torch.autograd.grad(o, (q, k, v), do.to(o.dtype)))]

    ref = go(dense_attention, *(x.double() for x in (q, k, v, do)))
    got = go(tk.triton_tree_attention, q, k, v, do, block_m=16, block_n=16)
    for name, err in zip(("out", "dq", "dk", "dv"), max_errors(got, ref)):
        assert err < FP32_ATOL, (name, err)


def test_triton_available():
    assert tk.triton_available() == (tk.triton is not None)


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
import treetrain.attention.triton_kernel as tk

P, D = "*{dtype}", {d}
cfg = dict(GROUP=2, D=D, BLOCK_M={block_m}, BLOCK_N={block_n}, BLOCK_D=D, PRECISION="tf32")
rows = dict(LSE="*fp32", DELTA="*fp32", SEND="*i64", KMIN="*i32", KMAX="*i32", T="i32")
rows |= dict(POS="*i64", WINDOW="i32")  # the sliding window's positions and width
rows |= dict(AB="*fp32")  # ALiBi's bias per head and token
sigs = {{
    tk._fwd_kernel: dict(Q=P, K=P, V=P, O=P, qk_scale="fp32"),
    tk._bwd_delta_kernel: dict(O=P, DO=P),
    tk._bwd_dkdv_kernel: dict(Q=P, K=P, V=P, DO=P, DK=P, DV=P, qk_scale="fp32", sm_scale="fp32"),
    tk._bwd_dq_kernel: dict(Q=P, K=P, V=P, DO=P, DQ=P, qk_scale="fp32", sm_scale="fp32"),
}}
# plain, and sliding window with ALiBi (every optional branch compiled once)
flags = [dict(HAS_WINDOW=f, HAS_ALIBI=f) for f in (False, True)]
for (fn, sig), flag in [(item, f) for item in sigs.items() for f in flags]:
    sig = sig | {{a: t for a, t in rows.items() if a in fn.arg_names}}
    cx = {{a: v for a, v in (cfg | flag).items() if a in fn.arg_names}}
    sig |= dict.fromkeys(cx, "constexpr")
    sig = {{a: sig[a] for a in fn.arg_names}}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps={num_warps}))
"""


@pytest.mark.skipif(tk.triton is None, reason="needs triton")
@pytest.mark.parametrize(
    "dtype, d, block_m, block_n, num_warps", [("bf16", 64, 64, 64, 4), ("fp16", 128, 32, 32, 8)]
)
def test_kernels_compile_for_sm90(dtype, d, block_m, block_n, num_warps):
    # The interpreter skips type checking and lowering; compile ahead of time for an H100 (Triton ships
    # ptxas, no GPU needed) so CPU-only CI still catches kernels that would not build on CUDA.
    pytest.importorskip("triton.backends.nvidia")
    script = COMPILE_SCRIPT.format(dtype=dtype, d=d, block_m=block_m, block_n=block_n, num_warps=num_warps)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
