"""Part 2, kernel speed: tree attention forward + backward per backend, per tree kind and size.

FLOPs follow FlashAttention's convention: a forward is ``4 * D * Hq`` per computed (query, key)
pair (``QK^T`` and ``PV``), the backward 2.5 forwards, so forward + backward is ``14 * D * Hq`` per
pair. A tree kernel is credited with the pairs its mask **allows** only (``trees.flops.tree_pairs``),
so its TFLOP/s is useful work. Rows per case:

- ``triton``, ``flex``: the library's backends on the tree (the ``TreeMask`` is built once, outside
  the timing, as one forward shares it over every layer);
- ``sdpa causal``: PyTorch's fused causal attention on one sequence of ``T`` tokens, credited with
  its causal pairs: the dense-attention peak of this GPU, which each tree row is a fraction of;
- ``sdpa per path`` and ``flash-attn varlen`` (when ``flash_attn`` imports): what training without
  tree attention computes, every root-to-leaf path alone with its prefix duplicated, credited with
  the path pairs it computes; its time beside the tree rows is the kernel-level saving.

A block sweep times the Triton kernel with other tile sizes on one size per tree kind: the numbers
a tuning pass starts from.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from treetrain.attention import get_backend
from treetrain.attention.mask import TreeMask
from treetrain.trees.flops import baseline_pairs, tree_pairs

from .trees import group_tree, mask_tensors, per_turn_tree

FWD_BWD_PER_PAIR = 14  # x D x Hq FLOPs: forward 4, backward 2.5 forwards (FlashAttention's count)
TREES = {"per-turn": per_turn_tree, "group": group_tree}


def time_ms(fn, leaves, device, reps: int) -> float:
    """Median milliseconds of ``fn()`` (which runs forward and backward), gradients of ``leaves``
    reset between calls. CUDA: ``triton.testing.do_bench`` (L2 flushed between calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(25, reps), rep=max(100, 10 * reps), grad_to_none=leaves,
                              return_mode="median"))  # fmt: skip
    fn()  # warm-up
    times = []
    for _ in range(reps):
        for x in leaves:
            x.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _fwd_bwd(attn, do):
    def run():
        attn().backward(do)

    return run


def kernel_case(kind: str, T: int, heads: tuple[int, int, int], sizes, blocks=None) -> dict:
    """Every backend on one tree of ``kind`` and ``T`` tokens; ``blocks``: a Triton tile sweep
    ``[(block_m, block_n), ...]`` instead of the backend rows."""
    hq, hkv, d = heads
    dev, dt = sizes.device, getattr(torch, sizes.kernel_dtype)
    tree = TREES[kind](T, vocab=T)
    se, pos = mask_tensors(tree, dev)
    pairs, causal = tree_pairs(tree), T * (T + 1) // 2  # a token at path position i sees i + 1 keys
    g = torch.Generator(device=dev).manual_seed(T)
    q = torch.randn(hq, T, d, device=dev, generator=g).to(dt).requires_grad_()
    k, v = (torch.randn(hkv, T, d, device=dev, generator=g).to(dt).requires_grad_() for _ in range(2))
    do = torch.randn(hq, T, d, device=dev, generator=g).to(dt)
    scale, per_pair = d**-0.5, FWD_BWD_PER_PAIR * d * hq
    rows: list[dict] = []

    def add(name: str, attn, leaves, d_out, n_pairs: int) -> None:
        """Time one row; an error is recorded in its place (the other rows still run)."""
        try:
            ms = time_ms(_fwd_bwd(attn, d_out), leaves, dev, sizes.kernel_reps)
            rows.append({"name": name, "ms": ms, "pairs": n_pairs, "tflops": n_pairs * per_pair / ms / 1e9})
        except Exception as e:
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    if blocks:
        for bm, bn in blocks:
            mask = TreeMask(se, backend="triton", position_ids=pos)
            attn = functools.partial(get_backend("triton"), q, k, v, mask, scale, block_m=bm, block_n=bn)
            add(f"triton {bm}x{bn}", attn, [q, k, v], do, pairs)
    else:
        add("sdpa causal", *_causal(q, k, v, scale), do, causal)
        for b in sizes.kernel_backends:
            mask = TreeMask(se, backend=b, position_ids=pos)
            add(b, functools.partial(get_backend(b), q, k, v, mask, scale), [q, k, v], do, pairs)
        idx = [torch.as_tensor(p, device=dev) for p in tree.path_index]
        path_pairs = baseline_pairs(tree)
        add("sdpa per path", *_per_path(q, k, v, idx, scale, g), path_pairs)
        varlen = _flash_varlen(q, k, v, idx, scale, g)
        if varlen is not None:
            add("flash-attn varlen", *varlen, path_pairs)
        peak = next((r["tflops"] for r in rows if r["name"] == "sdpa causal" and "tflops" in r), None)
        for r in rows:
            if peak and "tflops" in r:
                r["of_peak"] = r["tflops"] / peak
    out = {"tree": kind, "T": T, "hq": hq, "hkv": hkv, "d": d, "dtype": sizes.kernel_dtype,
           "paths": tree.num_paths, "allowed_pairs": pairs, "causal_pairs": causal, "rows": rows}  # fmt: skip
    out["headline"] = ", ".join(
        f"{r['name']} {r['ms']:.2f} ms" if "ms" in r else f"{r['name']} ERROR" for r in rows
    )
    ms = {r["name"]: r.get("ms") for r in rows}
    if ms.get("triton") and ms.get("flex"):
        out["triton_speedup_over_flex"] = ms["flex"] / ms["triton"]  # >= 1: Triton at least as fast
    out["status"] = "ok" if all("ms" in r for r in rows) else "error"
    return out


def _flash_only(device):
    """On CUDA, SDPA's flash kernel or an error (never a silent fall back to the T x T math path)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


def _causal(q, k, v, scale):
    """One causal sequence of all ``T`` tokens: (attention, its leaves)."""
    rep = q.shape[0] // k.shape[0]
    kk, vv = (x.detach().repeat_interleave(rep, 0).requires_grad_() for x in (k, v))

    def attn():
        with _flash_only(q.device):
            return F.scaled_dot_product_attention(q[None], kk[None], vv[None], is_causal=True, scale=scale)[0]

    return attn, [q, kk, vv]


def _per_path(q, k, v, idx, scale, g):
    """Every path alone, its tokens gathered beforehand (a per-path trainer's own sequences):
    (attention, leaves, upstream gradient ``[Hq, sum len, D]``)."""
    rep = q.shape[0] // k.shape[0]
    qs = [q.detach()[:, i].requires_grad_() for i in idx]
    ks, vs = ([x.detach()[:, i].repeat_interleave(rep, 0).requires_grad_() for i in idx] for x in (k, v))

    def attn():
        with _flash_only(q.device):
            outs = [F.scaled_dot_product_attention(a[None], b[None], c[None], is_causal=True, scale=scale)[0]
                    for a, b, c in zip(qs, ks, vs)]  # fmt: skip
        return torch.cat(outs, dim=1)

    total = sum(len(i) for i in idx)
    d_out = torch.randn(q.shape[0], total, q.shape[2], device=q.device, generator=g).to(q.dtype)
    return attn, qs + ks + vs, d_out


def _flash_varlen(q, k, v, idx, scale, g):
    """flash-attn's varlen kernel over every path (prefixes duplicated), or None if not importable."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    flat = torch.cat(idx)
    lens = torch.tensor([0] + [len(i) for i in idx], device=q.device)
    cu, longest = lens.cumsum(0).to(torch.int32), int(lens.max())
    qc, kc, vc = (x.detach()[:, flat].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v))

    def attn():
        return flash_attn_varlen_func(qc, kc, vc, cu, cu, longest, longest, softmax_scale=scale, causal=True)

    d_out = torch.randn(qc.shape, device=q.device, generator=g).to(q.dtype)
    return attn, [qc, kc, vc], d_out


def plan(sizes) -> list:
    from .runner import Case

    cases = []
    for kind in TREES:
        for T in sizes.kernel_T:
            for heads in sizes.kernel_heads:
                cid = f"{kind} T={T} Hq={heads[0]} Hkv={heads[1]} D={heads[2]}"
                cases.append(Case(cid, lambda kind=kind, T=T, h=heads: kernel_case(kind, T, h, sizes)))
    for kind in TREES if sizes.sweep_T else ():
        heads = sizes.kernel_heads[0]
        cid = f"triton block sweep {kind} T={sizes.sweep_T}"
        cases.append(
            Case(
                cid, lambda kind=kind, h=heads: kernel_case(kind, sizes.sweep_T, h, sizes, sizes.sweep_blocks)
            )
        )
    return cases
