"""Triton tree attention: FlashAttention-2 forward and backward that read ``subtree_end`` directly.

Query ``q`` may attend key ``k`` iff ``k <= q < subtree_end[k]`` (see ``mask.py``). Tiles are classified
with per-key-block ``min``/``max`` of ``subtree_end`` (``O(T / BLOCK_N)`` ints, cached on the ``TreeMask``
so every layer of one forward reuses them). For a query block ``[q0, q1)`` and a key block ``[k0, k1)``:

- skipped       if ``k0 > q1 - 1`` or ``max(subtree_end[k0:k1]) <= q0``;
- fully visible if ``k1 - 1 <= q0`` and ``min(subtree_end[k0:k1]) >= q1``: no mask is applied;
- otherwise partial: the mask is computed in the tile from ``subtree_end[k0:k1]``.

The backward visits, for a key block, only the query rows ``[k0, max(subtree_end[k0:k1]))``; in a
well-formed DFS layout that whole range is attended by some key of the block, so no tile is skipped.
Runs on CUDA, and on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from treetrain.attention.mask import TreeMask, block_bounds, check_inputs
from treetrain.attention.sinks import add_sinks, sink_grad

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): the module still imports, triton_available() is False
    triton = None
    tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


def triton_available() -> bool:
    """True if Triton is importable and can run here: a CUDA device, or the CPU interpreter."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------------------------------------
# Kernels. Tensors are contiguous [H, T, D]; scores live in log2 units (scale * log2(e) folded in).
# ------------------------------------------------------------------------------------------------


@_jit
def _visible(q_idx, k_idx, k_end):
    """Tree mask for broadcastable query indices, key indices and the keys' ``subtree_end``."""
    return (k_idx <= q_idx) & (q_idx < k_end)


@_jit
def _near(q_pos, k_pos, WINDOW):
    """Sliding window along the path: ``pos[q] - pos[k] < WINDOW`` (Hugging Face's semantics)."""
    return q_pos - k_pos < WINDOW


@_jit
def _is_full(q0, k0, k_min, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Every query of ``[q0, q0+BLOCK_M)`` sees every key of ``[k0, k0+BLOCK_N)``. Never true for
    tiles that cross ``T`` (``k_min <= T``, and a key block crossing ``T`` ends past every ``q0``)."""
    return (k0 + BLOCK_N - 1 <= q0) & (k_min >= q0 + BLOCK_M)


@_jit
def _load_rows(ptr, idx, T, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``idx`` of a ``[T, D]`` matrix as ``[len(idx), BLOCK_D]``; rows past ``T`` and padded
    columns read as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (idx[:, None] < T) & (offs_d[None, :] < D)
    return tl.load(ptr + idx[:, None] * D + offs_d[None, :], mask=mask, other=0.0)


@_jit
def _store_rows(ptr, idx, x, T, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    mask = (idx[:, None] < T) & (offs_d[None, :] < D)
    tl.store(ptr + idx[:, None] * D + offs_d[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@_jit
def _key_tile(
    q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Keys ``[k0, k0+BLOCK_N)``: ``k, v [BLOCK_N, BLOCK_D]`` and the scores of the query rows ``q``
    against them ``[BLOCK_M, BLOCK_N]`` (log2 units), plus the key's ALiBi bias minus the row's
    (``HAS_ALIBI``; ``AB``: this head's bias ``[T]``, ``q_ab`` the rows' own), -inf where the tree
    (``MASKED``) or the window hides a key; keys past ``T`` are hidden from all."""
    offs_n = k0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K, offs_n, T, D, BLOCK_D)
    v = _load_rows(V, offs_n, T, D, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if HAS_ALIBI:
        s += tl.load(AB + offs_n, mask=offs_n < T, other=0.0)[None, :] - q_ab[:, None]
    if MASKED:
        k_end = tl.load(SEND + offs_n, mask=offs_n < T, other=0)
        vis = _visible(offs_m[:, None], offs_n[None, :], k_end[None, :])
        if HAS_WINDOW:
            k_pos = tl.load(POS + offs_n, mask=offs_n < T, other=0)
            vis = vis & _near(q_pos[:, None], k_pos[None, :], WINDOW)
        s = tl.where(vis, s, float("-inf"))
    return k, v, s


@_jit
def _fwd_tile(
    acc, m_i, l_i, q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys ``[k0, k0+BLOCK_N)``. acc: [BLOCK_M, BLOCK_D] fp32."""
    _, v, s = _key_tile(
        q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale, D, BLOCK_N, BLOCK_D, PRECISION,
        MASKED, HAS_WINDOW, HAS_ALIBI,
    )  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: avoid nan
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@_jit
def _fwd_kernel(
    Q, K, V, SEND, POS, WINDOW, AB, KMIN, KMAX, O, LSE, T, qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_M), Hq). Writes O [Hq, T, D] and LSE [Hq, T] (log2 units, +inf if empty).
    With ``HAS_WINDOW`` every visited tile is masked (the window is checked per pair). With
    ``HAS_ALIBI`` every score gets ``AB[h, k] - AB[h, q]`` (``AB [Hq, T]``, log2 units)."""
    q0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1).to(tl.int64)
    Q += h * T * D
    O += h * T * D
    K += (h // GROUP) * T * D
    V += (h // GROUP) * T * D
    offs_m = q0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, offs_m, T, D, BLOCK_D)
    q_pos = tl.load(POS + offs_m, mask=offs_m < T, other=0) if HAS_WINDOW else offs_m
    AB += h * T
    q_ab = tl.load(AB + offs_m, mask=offs_m < T, other=0.0) if HAS_ALIBI else q_pos

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for kb in range(0, tl.cdiv(tl.minimum(q0 + BLOCK_M, T), BLOCK_N)):
        if tl.load(KMAX + kb) > q0:
            k0 = kb * BLOCK_N
            if HAS_WINDOW:
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
                    D, BLOCK_N, BLOCK_D, PRECISION, True, True, HAS_ALIBI,
                )  # fmt: skip
            elif _is_full(q0, k0, tl.load(KMIN + kb), BLOCK_M, BLOCK_N):
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
                    D, BLOCK_N, BLOCK_D, PRECISION, False, False, HAS_ALIBI,
                )  # fmt: skip
            else:
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
                    D, BLOCK_N, BLOCK_D, PRECISION, True, False, HAS_ALIBI,
                )  # fmt: skip

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    _store_rows(O, offs_m, acc / l_safe[:, None], T, D, BLOCK_D)
    lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("inf"))  # +inf: p = 0 in the backward
    tl.store(LSE + h * T + offs_m, lse, mask=offs_m < T)


@_jit
def _bwd_delta_kernel(O, DO, DELTA, T, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), Hq). DELTA [Hq, T] = rowsum(dO * O) in fp32."""
    h = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(O + h * T * D, offs_m, T, D, BLOCK_D).to(tl.float32)
    do = _load_rows(DO + h * T * D, offs_m, T, D, BLOCK_D).to(tl.float32)
    tl.store(DELTA + h * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@_jit
def _bwd_dkdv_tile(
    dk, dv, k, v, k_end, k_pos, POS, WINDOW, AB, k_ab, Q, DO, LSE, DELTA, offs_n, q0, T, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Accumulate queries ``[q0, q0+BLOCK_M)`` into dk, dv [BLOCK_N, BLOCK_D] (transposed tiles)."""
    offs_m = q0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, offs_m, T, D, BLOCK_D)
    do = _load_rows(DO, offs_m, T, D, BLOCK_D)
    lse = tl.load(LSE + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + offs_m, mask=offs_m < T, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    if HAS_ALIBI:
        s_t += k_ab[:, None] - tl.load(AB + offs_m, mask=offs_m < T, other=0.0)[None, :]
    if MASKED:
        vis = _visible(offs_m[None, :], offs_n[:, None], k_end[:, None])
        if HAS_WINDOW:
            q_pos = tl.load(POS + offs_m, mask=offs_m < T, other=0)
            vis = vis & _near(q_pos[None, :], k_pos[:, None], WINDOW)
        s_t = tl.where(vis, s_t, float("-inf"))
    p_t = tl.exp2(s_t - lse[None, :])
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@_jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, SEND, POS, WINDOW, AB, KMIN, KMAX, DK, DV, T, qk_scale, sm_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_N), Hkv). One program owns a key block of one KV head and sums over the
    GROUP query heads sharing it, so dk, dv need no atomics."""
    kb = tl.program_id(0)
    h_kv = tl.program_id(1).to(tl.int64)
    k0 = kb * BLOCK_N
    offs_n = k0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K + h_kv * T * D, offs_n, T, D, BLOCK_D)
    v = _load_rows(V + h_kv * T * D, offs_n, T, D, BLOCK_D)
    k_end = tl.load(SEND + offs_n, mask=offs_n < T, other=0)
    k_pos = tl.load(POS + offs_n, mask=offs_n < T, other=0) if HAS_WINDOW else offs_n
    k_min = tl.load(KMIN + kb)
    k_max = tl.load(KMAX + kb)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Qh, DOh, LSEh, DELTAh = Q + h * T * D, DO + h * T * D, LSE + h * T, DELTA + h * T
        ABh = AB + h * T
        k_ab = tl.load(ABh + offs_n, mask=offs_n < T, other=0.0) if HAS_ALIBI else k_pos
        for q0 in range((k0 // BLOCK_M) * BLOCK_M, k_max, BLOCK_M):
            if HAS_WINDOW:
                dk, dv = _bwd_dkdv_tile(
                    dk, dv, k, v, k_end, k_pos, POS, WINDOW, ABh, k_ab, Qh, DOh, LSEh, DELTAh, offs_n, q0, T,
                    qk_scale, D, BLOCK_M, BLOCK_D, PRECISION, True, True, HAS_ALIBI,
                )  # fmt: skip
            elif _is_full(q0, k0, k_min, BLOCK_M, BLOCK_N):
                dk, dv = _bwd_dkdv_tile(
                    dk, dv, k, v, k_end, k_pos, POS, WINDOW, ABh, k_ab, Qh, DOh, LSEh, DELTAh, offs_n, q0, T,
                    qk_scale, D, BLOCK_M, BLOCK_D, PRECISION, False, False, HAS_ALIBI,
                )  # fmt: skip
            else:
                dk, dv = _bwd_dkdv_tile(
                    dk, dv, k, v, k_end, k_pos, POS, WINDOW, ABh, k_ab, Qh, DOh, LSEh, DELTAh, offs_n, q0, T,
                    qk_scale, D, BLOCK_M, BLOCK_D, PRECISION, True, False, HAS_ALIBI,
                )  # fmt: skip
    _store_rows(DK + h_kv * T * D, offs_n, dk * sm_scale, T, D, BLOCK_D)
    _store_rows(DV + h_kv * T * D, offs_n, dv, T, D, BLOCK_D)


@_jit
def _bwd_dq_tile(
    dq, q, do, lse, delta, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Accumulate keys ``[k0, k0+BLOCK_N)`` into dq [BLOCK_M, BLOCK_D]."""
    k, v, s = _key_tile(
        q, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale, D, BLOCK_N, BLOCK_D, PRECISION,
        MASKED, HAS_WINDOW, HAS_ALIBI,
    )  # fmt: skip
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@_jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, SEND, POS, WINDOW, AB, KMIN, KMAX, DQ, T, qk_scale, sm_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_M), Hq). Same key-block walk as the forward."""
    q0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1).to(tl.int64)
    K += (h // GROUP) * T * D
    V += (h // GROUP) * T * D
    offs_m = q0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + h * T * D, offs_m, T, D, BLOCK_D)
    do = _load_rows(DO + h * T * D, offs_m, T, D, BLOCK_D)
    lse = tl.load(LSE + h * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + h * T + offs_m, mask=offs_m < T, other=0.0)
    q_pos = tl.load(POS + offs_m, mask=offs_m < T, other=0) if HAS_WINDOW else offs_m
    AB += h * T
    q_ab = tl.load(AB + offs_m, mask=offs_m < T, other=0.0) if HAS_ALIBI else q_pos

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for kb in range(0, tl.cdiv(tl.minimum(q0 + BLOCK_M, T), BLOCK_N)):
        if tl.load(KMAX + kb) > q0:
            k0 = kb * BLOCK_N
            if HAS_WINDOW:
                dq = _bwd_dq_tile(
                    dq, q, do, lse, delta, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
                    D, BLOCK_N, BLOCK_D, PRECISION, True, True, HAS_ALIBI,
                )  # fmt: skip
            elif _is_full(q0, k0, tl.load(KMIN + kb), BLOCK_M, BLOCK_N):
                dq = _bwd_dq_tile(
                    dq, q, do, lse, delta, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
                    D, BLOCK_N, BLOCK_D, PRECISION, False, False, HAS_ALIBI,
                )  # fmt: skip
            else:
                dq = _bwd_dq_tile(
                    dq, q, do, lse, delta, K, V, SEND, POS, q_pos, WINDOW, AB, q_ab, offs_m, k0, T, qk_scale,
                    D, BLOCK_N, BLOCK_D, PRECISION, True, False, HAS_ALIBI,
                )  # fmt: skip
    _store_rows(DQ + h * T * D, offs_m, dq * sm_scale, T, D, BLOCK_D)


# ------------------------------------------------------------------------------------------------
# Host side.
# ------------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


def _block_bounds(mask: TreeMask, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block ``min`` and ``max`` of ``subtree_end``, ``[cdiv(T, block_n)]`` int32 each."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(x.to(torch.int32) for x in block_bounds(mask.subtree_end, block_n))

    return mask.cached(("triton_block_bounds", block_n), build)


# (fp32 inputs, D > 64) -> (BLOCK_M, BLOCK_N, num_warps) on CUDA. Untuned (not benchmarked yet): tiles
# for which ptxas reports no register spills on sm_90 (fp32 with D > 64: 16 bytes in the forward).
# fp32 runs exact ("ieee") dots, which need smaller tiles.
_CUDA_CONFIGS = {
    (False, False): (64, 64, 4),
    (False, True): (32, 32, 8),
    (True, False): (32, 32, 8),
    (True, True): (16, 32, 4),
}


def _config(q: torch.Tensor) -> tuple[int, int, int]:
    """Default ``(BLOCK_M, BLOCK_N, num_warps)`` for ``q``'s device, dtype and head dim."""
    if not q.is_cuda:
        return 32, 32, 4  # the interpreter: fewer, larger numpy tiles run faster
    return _CUDA_CONFIGS[q.dtype == torch.float32, q.shape[-1] > 64]


def _launch_args(
    q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int, window=None, alibi: bool = False
) -> dict:
    D = q.shape[-1]
    return dict(
        HAS_WINDOW=window is not None,
        HAS_ALIBI=alibi,
        GROUP=q.shape[0] // k.shape[0],
        D=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact: no tf32
        num_warps=_config(q)[2],
    )


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: TreeMask, scale: float, block_m: int, block_n: int, window, sinks, alibi):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        end = mask.subtree_end.contiguous()
        # ALiBi's bias in the scores' log2 units, fp32 (unread without alibi)
        ab = end if alibi is None else (alibi.to(torch.float32) * _LOG2E).contiguous()
        pos = end if window is None else mask.window_positions(window).contiguous()  # unread if no window
        w = 0 if window is None else int(window)
        k_min, k_max = _block_bounds(mask, block_n)
        Hq, T, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(Hq, T, device=q.device, dtype=torch.float32)
        args = _launch_args(q, k, block_m, block_n, window, alibi is not None)
        grid = (triton.cdiv(T, block_m), Hq)
        _fwd_kernel[grid](q, k, v, end, pos, w, ab, k_min, k_max, o, lse, T, scale * _LOG2E, **args)
        if sinks is not None:  # rescale by the sink's share; the backward kernels then see the sink's
            _, new_lse = add_sinks(o, lse / _LOG2E, sinks, inplace=True)  # probabilities through o', lse'
            lse = new_lse * _LOG2E
        ctx.save_for_backward(q, k, v, o, lse, end, pos, ab, k_min, k_max, sinks)
        ctx.scale, ctx.block_m, ctx.block_n, ctx.window = scale, block_m, block_n, window
        ctx.alibi = alibi is not None
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, end, pos, ab, k_min, k_max, sinks = ctx.saved_tensors
        do = do.contiguous()
        (Hq, T, _), Hkv = q.shape, k.shape[0]
        args = _launch_args(q, k, ctx.block_m, ctx.block_n, ctx.window, ctx.alibi)
        w = 0 if ctx.window is None else int(ctx.window)
        qk_scale = ctx.scale * _LOG2E

        delta = torch.empty_like(lse)
        m_blocks = triton.cdiv(T, ctx.block_m)
        _bwd_delta_kernel[(m_blocks, Hq)](
            o, do, delta, T, D=args["D"], BLOCK_M=ctx.block_m, BLOCK_D=args["BLOCK_D"]
        )
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        _bwd_dkdv_kernel[(triton.cdiv(T, ctx.block_n), Hkv)](
            q, k, v, do, lse, delta, end, pos, w, ab, k_min, k_max, dk, dv, T, qk_scale, ctx.scale, **args
        )
        dq = torch.empty_like(q)
        _bwd_dq_kernel[(m_blocks, Hq)](
            q, k, v, do, lse, delta, end, pos, w, ab, k_min, k_max, dq, T, qk_scale, ctx.scale, **args
        )
        ds = None
        if sinks is not None and ctx.needs_input_grad[8]:
            ds = sink_grad(delta, lse / _LOG2E, sinks)
        return dq, dk, dv, None, None, None, None, None, ds, None


def triton_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TreeMask,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention through the fused Triton kernels, differentiable in ``q``, ``k``, ``v``.

    Shapes: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` with ``Hq % Hkv == 0`` (GQA); returns ``[Hq, T, D]``.
    fp32 / fp16 / bf16 inputs, fp32 accumulation. ``block_m`` / ``block_n`` (powers of two >= 16) are
    the query / key tile sizes (defaults: ``_CUDA_CONFIGS`` on CUDA, 32 under the interpreter).
    ``window``: sliding window along each path (``pos[q] - pos[k] < window``; every visited tile is
    then masked). ``sinks [Hq]`` or ``[Hq, T]``: sink logits per head (GPT-OSS) or per head and query
    (Inkling2) (:mod:`.sinks`), forward and gradient.
    ``alibi [Hq, T]``: ALiBi's bias at each token's path position (:mod:`.alibi`): one more ``[BLOCK_N]``
    load per tile. ``softcap`` and Inkling's ``rel_bias`` are not supported (refused by name through
    ``attention.FEATURES`` before a model calls it).
    """
    if softcap is not None:
        raise ValueError(
            f"attention logit softcapping ({softcap}) is not supported by the triton backend; "
            "use attention backend 'flex' (CUDA) or 'dense'"
        )
    check_inputs("triton_tree_attention", q, k, v, mask, sinks, alibi)
    if triton is None:
        raise RuntimeError("the triton attention backend needs the triton package")
    default_m, default_n, _ = _config(q)
    block_m, block_n = block_m or default_m, block_n or default_n
    for b in (block_m, block_n):
        if b < 16 or b & (b - 1):
            raise ValueError(f"triton_tree_attention: block sizes must be powers of two >= 16, got {b}")
    return _TreeAttention.apply(q, k, v, mask, scale, block_m, block_n, window, sinks, alibi)
