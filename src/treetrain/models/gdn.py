"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) along a packed tree: the layer's forward and
its gated delta rule.

The layer forward (:func:`tree_gdn_forward`) reuses the module's own projections, norm and output
layer, and replaces only the two sequence mixers: the causal conv1d (a gather along each token's
path, :mod:`treetrain.models.pathconv`) and the chunked gated delta rule.

The delta rule's state after a node is the state its children start from: the rule runs level by
level through :func:`treetrain.models.scan.tree_scan`, the nodes of a level batched into one call
(or a few, by length), each node starting from its parent's final state. Padding a node to its
group's longest appends steps with ``q = k = v = 0``, ``beta = 0`` and ``g = 0``:
``S <- exp(0) * S (I - 0) + 0 = S``, so a padded node's final state is its last real step's (the
chunked kernel pads to its chunk size the same way).

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (nodes ``[A] [B] [C D] [E F] [G H]``)::

    levels: 0: [A]    1: [G H] [B]    2: [C D] [E F]
      level 2, padded [2 nodes, 2 steps]: [[2 3] [4 5]], both start from B's final state
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from treetrain.models.classes import required_class
from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.scan import TreeLevels, chunked_rule_scan, tree_levels, tree_scan, tree_scan_varlen
from treetrain.trees.packing import PackedTree

__all__ = [
    "GDN_LAYOUTS",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_nodewise",
    "tree_gdn_forward",
    "use_fla",
]


def _torch_rule():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return inspect.unwrap(torch_chunk_gated_delta_rule)  # the PyTorch rule, past the kernel dispatch


def native_chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule in the inputs' own dtype (transformers' PyTorch rule always
    computes in float32): what a float64 model runs, so float64 stays float64.

    Shapes as transformers' ``torch_chunk_gated_delta_rule``: q, k ``[B, L, Hk, Dk]``, v
    ``[B, L, Hv, Dv]``, g, beta ``[B, L, Hv]``, state ``[B, Hv, Dk, Dv]`` -> out ``[B, L, Hv, Dv]``,
    final state. The recurrence, per step: ``S <- exp(g) S``, ``d = beta (v - S^T k)``,
    ``S <- S + k d^T``, ``o = S^T q`` (q, k l2-normalized, q scaled by ``Dk^-1/2``). Within a chunk,
    with ``G`` the cumulative log decay and ``Gam[i, j] = exp(G_i - G_j)`` (``i >= j``), the steps'
    ``d`` solve the unit lower-triangular system ``(I + strictly_lower(beta_i k_i.k_j Gam)) d =
    beta (V - exp(G) K S0)``; then ``O = exp(G) Q S0 + tril(Q K^T Gam) d`` and ``S = exp(G_C) S0 +
    (exp(G_C - G) K)^T d``. Every exponent is <= 0 (``g <= 0``): nothing overflows.
    """
    rep = v.shape[2] // q.shape[2]
    if rep > 1:  # grouped value heads: each q/k head serves `rep` consecutive value heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    B, L, H, Dk = q.shape
    Dv, C = v.shape[-1], chunk_size
    pad = (-L) % C
    # [B, H, chunks, C, D]; padded steps (q = k = v = beta = g = 0) leave the state as it is
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, C)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)).unflatten(2, (-1, C)) for x in (g, beta))
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    gam = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    m = ((beta[..., None] * (k @ k.transpose(-1, -2))) * gam).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(eye + m, rhs, upper=False, unitriangular=True)  # noqa: E731
    u = solve(beta[..., None] * v)  # d = u - w S0
    w = solve((beta * G.exp())[..., None] * k)
    p = (q @ k.transpose(-1, -2)) * gam
    qg, kg = q * G.exp()[..., None], k * (G[..., -1:] - G).exp()[..., None]
    state = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for c in range(q.shape[2]):
        d = u[:, :, c] - w[:, :, c] @ state
        outs.append(qg[:, :, c] @ state + p[:, :, c] @ d)
        state = G[:, :, c, -1, None, None].exp() * state + kg[:, :, c].transpose(-1, -2) @ d
    out = torch.stack(outs, 2).flatten(2, 3)[:, :, :L].transpose(1, 2)
    return out, (state if output_final_state else None)


def _fla_rule():
    """FLA's varlen chunked kernel, or None (not installed)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def use_fla(x: torch.Tensor) -> bool:
    """FLA on CUDA for half types (its chunk kernel rejects float32); the PyTorch rule otherwise."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _fla_rule() is not None


def _value_heads(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[T, Hk, Dk]`` -> ``[T, heads, Dk]``: with grouped value heads each q/k head serves
    ``heads // Hk`` consecutive value heads. Repeated here, as the layers do before their rule:
    transformers 5.10's ``torch_chunk_gated_delta_rule`` and FLA's kernel take equal head counts
    (5.24's rule repeats them itself, a no-op then)."""
    rep = heads // q.shape[1]
    if rep == 1:
        return q, k
    return q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    levels: TreeLevels,
    *,
    use_qk_l2norm: bool = True,
    max_chunk: int = 64,
    kernel: str | None = None,
) -> torch.Tensor:
    """The gated delta rule over a packed forest, level by level: ``[T, Hv, Dv]``.

    q, k ``[T, Hk, Dk]``; v ``[T, Hv, Dv]``; g (log decay), beta ``[T, Hv]``; all in DFS order.
    Every node starts from its parent's final state (roots from zeros). ``kernel``: ``"torch"``
    (padded levels through transformers' ``torch_chunk_gated_delta_rule``, which computes in
    float32; float64 inputs through :func:`native_chunk_rule`, the same rule in float64), ``"fla"``
    (unpadded levels through FLA's ``chunk_gated_delta_rule`` with ``cu_seqlens``; CUDA, half
    types), or None to pick by device and dtype.
    """
    kernel = kernel or ("fla" if use_fla(q) else "torch")
    q, k = _value_heads(q, k, v.shape[1])
    if kernel == "fla":
        return _tree_rule_fla(q, k, v, g, beta, levels, use_qk_l2norm)
    if kernel != "torch":
        raise ValueError(f"kernel {kernel!r}: choose 'torch' or 'fla'")
    rule = native_chunk_rule if q.dtype == torch.float64 else _torch_rule()
    scan = chunked_rule_scan(rule, max_chunk, use_qk_l2norm=use_qk_l2norm)
    return tree_scan((q, k, v, g, beta), levels, scan)


def _tree_rule_fla(q, k, v, g, beta, levels: TreeLevels, use_qk_l2norm: bool) -> torch.Tensor:
    """FLA varlen: one call per level over its unpadded tokens, one initial state per node.

    Untested here (no CUDA in CI): mirrors the documented FLA API, ``initial_state [N, H, K, V]``
    and ``output_final_state`` with ``cu_seqlens`` (batch 1).
    """
    rule = _fla_rule()

    def scan(xs, init, cu_seqlens):
        qg, kg, vg, gg, bg = (x[None] for x in xs)
        out, final = rule(
            qg, kg, vg, gg.float(), bg, initial_state=init, output_final_state=True, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )  # fmt: skip
        return out[0], final

    return tree_scan_varlen((q, k, v, g, beta), levels, scan)


def tree_gated_delta_rule_nodewise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    node_start: torch.Tensor,
    node_end: torch.Tensor,
    node_parent: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Reference: the same recurrence, one node at a time in DFS order (shapes as
    :func:`tree_gated_delta_rule`). For tests and the benchmark baseline."""
    rule = _torch_rule()
    q, k = _value_heads(q, k, v.shape[1])
    states: list[torch.Tensor | None] = []
    outs = []
    for s, e, p in zip(node_start.tolist(), node_end.tolist(), node_parent.tolist()):
        out, st = rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g=g[None, s:e], beta=beta[None, s:e],
            initial_state=states[p] if p >= 0 else None, output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )  # fmt: skip
        states.append(st)
        outs.append(out[0])
    return torch.cat(outs)


# ---- the layer ----------------------------------------------------------------------------------

# Projections: module, hidden [T, H] -> mixed_qkv [T, 2 Hk Dk + Hv Dv], z [T, Hv, Dv], b, a [T, Hv]
Projections = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, ...]]


def _project_qwen3_5(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3.5 layout: separate ``in_proj_qkv / in_proj_z / in_proj_b / in_proj_a``."""
    return m.in_proj_qkv(x), m.in_proj_z(x).unflatten(-1, (-1, m.head_v_dim)), m.in_proj_b(x), m.in_proj_a(x)


def _project_qwen3_next(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next layout: fused, head-grouped ``in_proj_qkvz / in_proj_ba``, untangled by the
    module's own ``fix_query_key_value_ordering`` (which wants a batch dim)."""
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x[None]), m.in_proj_ba(x[None]))
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    return mixed[0], z[0], b[0], a[0]


def _project_olmo_hybrid(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """OLMo Hybrid layout: separate ``q_proj / k_proj / v_proj``, the gate ``g_proj`` as ``z``,
    ``b_proj / a_proj`` (its ``o_norm / o_proj`` and ``allow_neg_eigval``: see :func:`tree_gdn_forward`)."""
    mixed = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
    return mixed, m.g_proj(x).unflatten(-1, (-1, m.head_v_dim)), m.b_proj(x), m.a_proj(x)


# exact class name -> its projections (checked against transformers 5.x)
GDN_LAYOUTS: dict[str, Projections] = {
    "Qwen3_5GatedDeltaNet": _project_qwen3_5,
    "Qwen3_5MoeGatedDeltaNet": _project_qwen3_5,
    "Qwen3NextGatedDeltaNet": _project_qwen3_next,
    "LaraMiniGatedDeltaNet": _project_qwen3_5,
    "Qwen4ExpTextGatedDeltaNet": _project_qwen3_5,
    "OlmoHybridGatedDeltaNet": _project_olmo_hybrid,
}


def _layout(module: nn.Module) -> Projections:
    """The projections of a GDN layer; looks through subclasses (FSDP2 wraps a module's class in a
    ``FSDP<Name>`` subclass)."""
    return GDN_LAYOUTS[required_class(module, GDN_LAYOUTS, "Gated DeltaNet layout").__name__]


def tree_gdn_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """A Gated DeltaNet layer over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``.

    ``tree_mask`` (a ``TreeMask``, optional) caches the level schedule and the conv windows for
    the other layers of the same forward.
    """
    project = _layout(module)
    T = packed.num_tokens
    x, dev = hidden_states[0], hidden_states.device
    mixed, z, b, a = project(module, x)

    w = module.conv1d.weight[:, 0]  # [C, width]
    conv = tree_causal_conv1d(
        mixed.to(w.dtype), w, module.conv1d.bias, path_window(packed, w.shape[1], tree_mask, dev)
    )
    if module.activation is not None:
        conv = ACT2FN[module.activation](conv)
    conv = conv.to(x.dtype)
    q, k, v = conv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim))
    v = v.unflatten(-1, (-1, module.head_v_dim))

    beta = b.sigmoid()
    if getattr(module, "allow_neg_eigval", False):  # OLMo Hybrid: beta in [0, 2]
        beta = beta * 2.0
    # as the layer, at least float32 (HF: ``.float()``, so half types don't overflow), but a float64
    # model stays float64 here and in the rule (HF's own rule computes in float32 even then)
    up = torch.promote_types(x.dtype, torch.float32)
    g = -module.A_log.to(up).exp() * F.softplus(a.to(up) + module.dt_bias)
    core = tree_gated_delta_rule(q, k, v, g, beta, tree_levels(packed, tree_mask, dev))  # [T, Hv, Dv]
    norm, out = (module.norm, module.out_proj) if hasattr(module, "norm") else (module.o_norm, module.o_proj)
    core = norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return out(core.reshape(1, T, -1))
