"""Part 1, correctness: every low-precision path against a high-precision reference, its error
bounded by a multiple of the error that a trusted low-precision computation of the same quantity
makes (so the bound scales with the dtype and the problem, never a hand-picked absolute number).

- **attention**: each backend's forward and backward on a random tree, against float64 attention
  on a sample of query rows (all up to ~4k tokens; 1-2k at 16k, 256-512 at 64k): the upstream gradient is zero
  off those rows, so ``dq``, ``dk``, ``dv`` are exact comparisons over the whole tensors; the error
  scale is SDPA in the same dtype on the same rows (PyTorch's fused kernels). Then the two backends
  against each other on every row, so no tile goes unchecked.
- **gdn**: the gated delta rule along the tree (level by level; ``fla`` and ``torch`` kernels)
  against the node-by-node rule in float64; the error scale is the same kernel run on every path
  alone (what a per-path trainer computes), its gradient weighted so its loss equals the tree's.
- **model**: per-path log-probs and every parameter gradient of a Qwen3-shaped model run as a tree,
  against per-path forwards of the unmodified Hugging Face model in high precision; the error scale
  is those per-path forwards in the low dtype.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from tests.reference import float64_casts, grad_err, grads, reference_logprobs
from treetrain.attention import get_backend
from treetrain.attention.mask import TreeMask
from treetrain.logprobs import path_logprobs
from treetrain.models.gdn import _fla_rule, _torch_rule, tree_gated_delta_rule, tree_gated_delta_rule_nodewise
from treetrain.models.scan import build_levels
from treetrain.trees.packing import pack

from .trees import group_tree, mask_tensors, per_turn_tree, random_tree

# A kernel passes when its error is at most this multiple of the error scale. Attention compares
# max-abs errors of one kernel call, an extreme-value statistic of a few million rounding errors:
# 3x leaves room for a different summation order (FlashAttention-2/3 report errors within ~1-2x of
# a low-precision baseline) while a wrong mask or state gives errors of order 1, 100x and more.
KERNEL_FACTOR = 3.0
# Model-level errors average over many layers and parameters; two independent low-precision runs
# of the same math differ by about sqrt(2) in their error, so 2x separates noise from a defect.
MODEL_FACTOR = 2.0


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _floor(dtype: torch.dtype) -> float:
    """The unit roundoff: an error scale of 0 (e.g. float32 SDPA on a tiny case) still allows it."""
    return torch.finfo(dtype).eps / 2


def rel_max(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (max-norm relative error)."""
    den = ref.abs().max().item()
    num = (x.double() - ref.double()).abs().max().item()
    return num / den if den > 0 else num


def _verdict(errs: dict[str, float], scale: dict[str, float], factor: float, floor) -> dict:
    """``ok`` iff every error is at most ``factor`` x its scale (floored at ``floor``: a float, or
    one per quantity)."""
    floors = floor if isinstance(floor, dict) else dict.fromkeys(errs, floor)
    bound = {k: factor * max(scale[k], floors[k]) for k in errs}
    ok = all(errs[k] <= bound[k] for k in errs)
    return {"ok": ok, "err": errs, "scale": scale, "bound": bound}


# ---- attention ------------------------------------------------------------------------------------


def sample_rows(T: int, n: int, seed: int, device) -> torch.Tensor:
    """``n`` sorted query rows (all when ``n >= T``), always the first and the last."""
    if n >= T:
        return torch.arange(T, device=device)
    pick = np.random.default_rng(seed).choice(np.arange(1, T - 1), size=n - 2, replace=False)
    return torch.from_numpy(np.sort(np.concatenate([[0, T - 1], pick]))).to(device)


def rows_attention(q, k, v, subtree_end, rows, scale, do_rows, fused: bool):
    """Attention of query ``rows`` over all keys under the tree mask, and its gradients for the
    upstream gradient ``do_rows [Hq, R, D]``: ``(o [Hq, R, D], dq [Hq, T, D], dk, dv [Hkv, T, D])``.

    ``fused``: PyTorch's SDPA in the inputs' dtype (the error scale); else plain float64 matmuls
    (the reference). GQA by repeating key/value heads (autograd sums their gradients back).
    """
    dtype = q.dtype if fused else torch.float64
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    rep = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    keys = torch.arange(k.shape[1], device=k.device)
    allowed = (keys[None, :] <= rows[:, None]) & (rows[:, None] < subtree_end[None, :])  # [R, T]
    qr = q[:, rows]
    if fused:
        o = F.scaled_dot_product_attention(qr[None], kk[None], vv[None], attn_mask=allowed, scale=scale)[0]
    else:
        s = (qr @ kk.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        o = torch.softmax(s, dim=-1) @ vv
    o.backward(do_rows.to(dtype))
    return o.detach(), q.grad, k.grad, v.grad


def backend_attention(name, q, k, v, subtree_end, position_ids, rows, scale, do):
    """The backend on the whole tree: ``(o[:, rows], dq, dk, dv)``."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    mask = TreeMask(subtree_end, backend=name, position_ids=position_ids)
    o = get_backend(name)(q, k, v, mask, scale)
    o.backward(do)
    return o.detach()[:, rows], q.grad, k.grad, v.grad


def attention_case(T: int, heads: tuple[int, int, int], dtype: str, backends: list[str], sizes) -> dict:
    """One random tree of ``T`` tokens, ``heads = (Hq, Hkv, D)``, every backend in ``dtype``."""
    hq, hkv, d = heads
    dev, dt = sizes.device, _dtype(dtype)
    seed = T * 7 + d
    se, pos = mask_tensors(random_tree(T, vocab=T, seed=seed), dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(hq, T, d, device=dev, generator=g).to(dt)
    k, v = (torch.randn(hkv, T, d, device=dev, generator=g).to(dt) for _ in range(2))
    # rows: the float64 scores [Hq, R, T] stay under sizes.ref_elems
    rows = sample_rows(T, max(2, min(T, sizes.ref_elems // (hq * T))), seed, dev)
    do = torch.zeros(hq, T, d, device=dev, dtype=dt)
    do[:, rows] = torch.randn(hq, rows.numel(), d, device=dev, generator=g).to(dt)
    scale = d**-0.5
    names = ("o", "dq", "dk", "dv")
    ref = rows_attention(q, k, v, se, rows, scale, do[:, rows], fused=False)
    lowp = rows_attention(q, k, v, se, rows, scale, do[:, rows], fused=True)
    scale_err = {n: rel_max(x, r) for n, x, r in zip(names, lowp, ref)}
    out = {"T": T, "hq": hq, "hkv": hkv, "d": d, "dtype": dtype, "rows": rows.numel(), "backends": {}}
    for b in backends:
        try:
            got = backend_attention(b, q, k, v, se, pos, rows, scale, do)
            errs = {n: rel_max(x, r) for n, x, r in zip(names, got, ref)}
            out["backends"][b] = _verdict(errs, scale_err, KERNEL_FACTOR, _floor(dt))
        except Exception as e:  # one backend's failure must not hide the others' results
            out["backends"][b] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if len(backends) >= 2:
        out["backends"] |= cross_check(backends[:2], q, k, v, se, pos, scale, scale_err, g)
    return _summarize(out)


def cross_check(pair, q, k, v, subtree_end, position_ids, scale, scale_err, gen) -> dict:
    """Two backends against each other on every query row, a random upstream gradient on all of
    them: the float64 reference covers sampled rows only at large ``T``, this covers every tile.
    Each backend is within ``KERNEL_FACTOR`` x the error scale of the truth, so their difference
    is within twice that."""
    a, b = pair
    every = torch.arange(q.shape[1], device=q.device)
    do = torch.randn(q.shape, device=q.device, generator=gen).to(q.dtype)
    try:
        got_a, got_b = (
            backend_attention(x, q, k, v, subtree_end, position_ids, every, scale, do) for x in pair
        )
        errs = {n: rel_max(x, y) for n, x, y in zip(("o", "dq", "dk", "dv"), got_a, got_b)}
        return {f"{a} vs {b}, all rows": _verdict(errs, scale_err, 2 * KERNEL_FACTOR, _floor(q.dtype))}
    except Exception as e:
        return {f"{a} vs {b}, all rows": {"ok": False, "error": f"{type(e).__name__}: {e}"}}


def _summarize(out: dict) -> dict:
    checks = out["backends"]
    out["status"] = "ok" if all(c.get("ok") for c in checks.values()) else "fail"
    parts = []
    for b, c in checks.items():
        if "err" in c:
            worst = max(c["err"][n] / c["bound"][n] for n in c["err"])
            parts.append(f"{b} {'ok' if c['ok'] else 'FAIL'} (worst err/bound {worst:.2f})")
        else:
            parts.append(f"{b} {c.get('unavailable') and 'unavailable' or 'ERROR'}")
    out["headline"] = ", ".join(parts)
    return out


# ---- Gated DeltaNet -------------------------------------------------------------------------------


def _gdn_inputs(T: int, hk: int, hv: int, dk: int, dv: int, dtype, device, seed: int):
    """q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]`` and beta ``[T, Hv]`` in ``dtype``; g (log decay)
    ``[T, Hv]`` float32, as a Qwen3.5 layer computes them."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(T, hk, dk, device=device, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, hv, dv, device=device, generator=g).to(dtype)
    beta = torch.rand(T, hv, device=device, generator=g).to(dtype)
    decay = -F.softplus(torch.randn(T, hv, device=device, generator=g) - 2.0)  # mostly near 0, as trained
    return q, k, v, decay, beta


def _path_rule(kernel: str):
    """The kernel on one sequence ``[1, L, H, D]`` from a zero state: ``out [1, L, Hv, Dv]``."""
    if kernel == "torch":
        rule = _torch_rule()
        return lambda q, k, v, g, b: rule(q, k, v, g=g, beta=b, use_qk_l2norm_in_kernel=True)[0]
    fla = _fla_rule()

    def run(q, k, v, g, b):
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return fla(q, k, v, g.float(), b, use_qk_l2norm_in_kernel=True)[0]

    return run


def per_path_gdn(kernel: str, inputs, path_index: list[np.ndarray], counts: torch.Tensor, d_out):
    """Every path alone from a zero state. Returns (the paths' outputs concatenated, the gradients
    of ``sum_p sum_t out_p[t] * d_out[t] / count[t]`` w.r.t. the DFS inputs): that loss equals the
    tree's ``sum(out * d_out)`` in exact arithmetic, so the gradients compare one to one."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    rule, outs, loss = _path_rule(kernel), [], 0.0
    for idx in path_index:
        i = torch.from_numpy(idx).to(d_out.device)
        o = rule(*(x[i][None] for x in leaves))[0]
        outs.append(o.detach())
        loss = loss + (o.float() * d_out[i].float() / counts[i, None, None]).sum()
    loss.backward()
    return torch.cat(outs), [x.grad for x in leaves]


def tree_gdn(kernel: str, inputs, levels, d_out):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    if kernel == "reference":
        out = tree_gated_delta_rule_nodewise(*leaves, *levels)
    else:
        out = tree_gated_delta_rule(*leaves, levels, kernel=kernel)
    (out.float() * d_out.float()).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def gdn_kernels_available(device) -> dict[str, str | None]:
    """kernel -> None if it can run here, else why not."""
    fla = None
    if device.type != "cuda":
        fla = "FLA (flash-linear-attention) runs on CUDA only"
    elif _fla_rule() is None:
        fla = "flash-linear-attention is not installed (pip install fla-core; offline: carry its wheel)"
    return {"torch": None, "fla": fla}


def gdn_case(T: int, shape: dict, dtype: str, sizes) -> dict:
    """The tree rule (``torch`` and ``fla`` kernels) on a random tree, ``shape``: hk, hv, dk, dv."""
    dev, dt = sizes.device, _dtype(dtype)
    seed = T + 11
    tree = random_tree(T, vocab=T, seed=seed, mean_node=max(4, T // 64))
    packed = pack(tree).to(dev)
    inputs = _gdn_inputs(T, shape["hk"], shape["hv"], shape["dk"], shape["dv"], dt, dev, seed)
    d_out = torch.randn(
        T, shape["hv"], shape["dv"], device=dev, generator=torch.Generator(device=dev).manual_seed(1)
    )
    nodes = (packed.node_start, packed.node_end, packed.node_parent)
    with float64_casts():  # the reference: node by node, in float64 throughout
        ref_out, ref_grads = tree_gdn("reference", [x.double() for x in inputs], nodes, d_out.double())
    levels = build_levels(*nodes, device=dev)
    path_index = [np.asarray(p) for p in tree.path_index]
    flat = torch.from_numpy(np.concatenate(path_index)).to(dev)
    counts = torch.from_numpy(tree.path_counts()).to(dev).float()
    names = ("out", "dq", "dk", "dv", "dg", "dbeta")
    out = {"T": T, **shape, "dtype": dtype, "nodes": tree.num_nodes, "paths": tree.num_paths, "backends": {}}
    for kernel, why in gdn_kernels_available(dev).items():
        if why is not None:
            out["backends"][kernel] = {"ok": None, "unavailable": why}
            continue
        try:
            t_out, t_grads = tree_gdn(kernel, inputs, levels, d_out)
            p_out, p_grads = per_path_gdn(kernel, inputs, path_index, counts, d_out)
            errs = {"out": rel_max(t_out, ref_out)} | {
                n: rel_max(g, r) for n, g, r in zip(names[1:], t_grads, ref_grads)
            }
            scale = {"out": rel_max(p_out, ref_out[flat])} | {
                n: rel_max(g, r) for n, g, r in zip(names[1:], p_grads, ref_grads)
            }
            out["backends"][kernel] = _verdict(errs, scale, KERNEL_FACTOR, _floor(dt))
        except Exception as e:
            out["backends"][kernel] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    checks = [c for c in out["backends"].values() if c.get("ok") is not None]
    rec = _summarize(out)
    rec["status"] = "ok" if checks and all(c["ok"] for c in checks) else "fail"
    if any("unavailable" in c for c in out["backends"].values()):
        rec["unavailable"] = {k: c["unavailable"] for k, c in out["backends"].items() if "unavailable" in c}
    return rec


# ---- the model --------------------------------------------------------------------------------------


def build_qwen3(shape: dict, dtype: torch.dtype, device, seed: int = 0):
    """A random-init Qwen3 model of ``shape`` (hidden, layers, heads, kv_heads, head_dim, ffn, vocab)."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=65536,
        tie_word_embeddings=shape.get("tied", False),
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def per_path_run(model, paths, n_targets: int) -> tuple[list[torch.Tensor], dict]:
    """The unmodified model on every path alone: log-probs and the gradients of the SFT loss
    (sum of log-probs / ``n_targets``), one path's forward and backward at a time."""
    model.zero_grad(set_to_none=True)
    lps = []
    for p in paths:
        (lp,) = reference_logprobs(model, [p])
        (-lp.float().sum() / n_targets).backward()
        lps.append(lp.detach().double())
    out = grads(model)
    model.zero_grad(set_to_none=True)  # copies of the model carry no gradients
    return lps, out


def tree_run(model, tree, n_targets: int, backend: str) -> tuple[list[torch.Tensor], dict]:
    model.zero_grad(set_to_none=True)
    lps = path_logprobs(model, tree, backend=backend)
    (-torch.cat(lps).float().sum() / n_targets).backward()
    return [lp.detach().double() for lp in lps], grads(model)


def lp_err(lps, ref) -> float:
    """Largest |log-prob - reference| over every path position (nats)."""
    return max((a - b).abs().max().item() for a, b in zip(lps, ref) if b.numel())


MODEL_TREES = {
    "group": lambda T, vocab: group_tree(T, vocab, paths=8),
    "per-turn": lambda T, vocab: per_turn_tree(T, vocab, turns=8),
    "random": lambda T, vocab: random_tree(T, vocab, mean_node=max(2, T // 16)),
}


def model_case(kind: str, backends: list[str], sizes) -> dict:
    """Log-probs and gradients of the tree forward vs per-path forwards, on one tree."""
    dev, shape = sizes.device, sizes.model
    hi, lo = _dtype(sizes.model_ref_dtype), _dtype(sizes.model_dtype)
    T = sizes.model_T
    tree = MODEL_TREES[kind](T, shape["vocab"])
    paths = tree.paths()
    n_targets = int(sum(len(p) - 1 for p in paths))
    ref_model = build_qwen3(shape, hi, dev)
    ref_lp, ref_g = per_path_run(ref_model, paths, n_targets)
    low_model = copy.deepcopy(ref_model).to(lo)
    del ref_model
    base_lp, base_g = per_path_run(copy.deepcopy(low_model), paths, n_targets)
    scale = {"logprobs": lp_err(base_lp, ref_lp), "grads": grad_err(base_g, ref_g)}
    out = {
        "tree": kind,
        "T": tree.num_tokens,
        "paths": tree.num_paths,
        "path_tokens": tree.num_path_tokens,
        "dtype": sizes.model_dtype,
        "reference_dtype": sizes.model_ref_dtype,
        "backends": {},
    }
    floor = {"logprobs": _floor(lo) * max(b.abs().max().item() for b in ref_lp), "grads": _floor(lo)}
    for b in backends:
        try:
            lps, g = tree_run(copy.deepcopy(low_model), tree, n_targets, b)
            errs = {"logprobs": lp_err(lps, ref_lp), "grads": grad_err(g, ref_g)}
            out["backends"][b] = _verdict(errs, scale, MODEL_FACTOR, floor)
        except Exception as e:
            out["backends"][b] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return _summarize(out)


def total_model_params(shape: dict) -> float:
    """Parameters of the model shape (for the log line)."""
    h, f, layers = shape["hidden"], shape["ffn"], shape["layers"]
    attn = h * shape["head_dim"] * (2 * shape["heads"] + 2 * shape["kv_heads"])
    return layers * (attn + 3 * h * f) + shape["vocab"] * h * (1 if shape.get("tied") else 2)


def plan(sizes) -> list:
    """The correctness cases of ``sizes`` (see ``gpu_suite.Sizes``)."""
    from .runner import Case

    # the model and GDN checks first: they need no per-size compile, and reach the most code
    cases = []
    params = total_model_params(sizes.model) / 1e6
    for kind in sizes.model_trees:
        cid = f"model {kind} T={sizes.model_T} ({params:.3g}M params) {sizes.model_dtype}"
        cases.append(Case(cid, lambda kind=kind: model_case(kind, sizes.model_backends, sizes)))
    for T in sizes.gdn_T:
        cid = f"gdn T={T} {sizes.gdn_dtype}"
        cases.append(Case(cid, lambda T=T: gdn_case(T, sizes.gdn_shape, sizes.gdn_dtype, sizes)))
    for T, heads, dtype in sizes.attn_cases:
        backends = sizes.attn_backends[dtype]
        cid = f"attention T={T} Hq={heads[0]} Hkv={heads[1]} D={heads[2]} {dtype}"
        cases.append(Case(cid, lambda T=T, h=heads, d=dtype, b=backends: attention_case(T, h, d, b, sizes)))
    return cases
