"""Gated DeltaNet along a packed tree: the causal conv1d and the gated delta rule, routed so every
token sees exactly the history of its own root-to-token path.

Two facts carry the whole construction:

- The short causal conv reads the last ``k`` *inputs* along a token's path, which do not depend on
  any recurrent state: it runs for all ``T`` tokens at once, as a gather of each token's ``k - 1``
  path predecessors (``PackedTree.prev`` chained; a parent shorter than ``k - 1`` is reached
  through, into the grandparents).
- The delta rule's state after a node is the state its children start from. Nodes at the same
  level are independent given their parents, so the recurrence runs level by level, the nodes of
  a level batched into one call (or a few, by length), each node starting from its parent's
  final state.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (nodes ``[A] [B] [C D] [E F] [G H]``)::

    DFS index           0  1  2  3  4  5  6  7
    token               A  B  C  D  E  F  G  H
    prev               -1  0  1  2  1  4  0  6
    conv window, k = 3  (T = 8 marks "before the path start", read as zeros)
      E (4):  [0 1 4] = A B E        G (6):  [8 0 6] = _ A G
    levels: 0: [A]    1: [G H] [B]    2: [C D] [E F]
      level 2, padded [2 nodes, 2 steps]: [[2 3] [4 5]], both start from B's final state

A level whose node lengths differ widely is split into a few groups of similar length (one call
each), so padding stays within about 2x. Padding a node to its group's longest appends steps with
``q = k = v = 0``, ``beta = 0`` and ``g = 0``: ``S <- exp(0) * S (I - 0) + 0 = S``, so a padded
node's final state is its last real step's (the chunked kernel pads to its chunk size the same
way).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "TreeLevels",
    "build_levels",
    "conv_window_index",
    "length_groups",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_nodewise",
]


# ---- the level schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """The ``n`` nodes of one tree level, in the order their final states are stacked.

    groups: per length group, ``token_index [n_g, L_g]`` int64: the DFS index of each node's
      steps, ``T`` (a zero row) past its end. Nodes of similar length share a group so padding stays
      bounded; each group is one kernel call.
    parent_row ``[n]`` int64: row of each node's parent among the previous level's nodes (level 0:
      zeros, unused).
    cu_seqlens ``[n + 1]``, flat_index ``[sum lengths]`` int64: the unpadded (varlen) layout.
    """

    groups: tuple[torch.Tensor, ...]
    parent_row: torch.Tensor
    cu_seqlens: torch.Tensor
    flat_index: torch.Tensor


@dataclass(frozen=True)
class TreeLevels:
    """Level-by-level schedule of a packed forest, shared by every recurrent layer of a forward.

    padded_row ``[T]``: row of each DFS token in the groups' padded outputs, flattened and
    concatenated (level by level, group by group); varlen_row ``[T]``: the same, unpadded.
    """

    levels: tuple[Level, ...]
    padded_row: torch.Tensor
    varlen_row: torch.Tensor
    num_tokens: int

    @property
    def num_padded(self) -> int:
        """Tokens the padded (PyTorch) path computes, padding included."""
        return sum(g.numel() for lv in self.levels for g in lv.groups)


def node_depth(parent: np.ndarray) -> np.ndarray:
    """Level of every node (roots 0) from ``parent [N]`` (``-1`` for roots) by pointer jumping.

    O(N log depth) vectorized steps: ``depth`` accumulates the hops to the current ``anc``,
    and ``anc`` jumps to its own ancestor, doubling the distance each round.
    """
    depth = (parent >= 0).astype(np.int64)
    anc = parent.copy()
    while (live := anc >= 0).any():
        a = anc[live]
        depth[live] += depth[a]
        anc[live] = anc[a]
    return depth


def length_groups(lengths: np.ndarray, slack: int | None) -> list[int]:
    """Split nodes sorted by decreasing length into runs that pad cheaply; returns the run sizes.

    A node joins the current run (padded to the run's longest, ``L``) if that at most doubles it
    (``2 * n >= L``), or if the run stays within ``slack`` padded tokens (small calls cost more in
    overhead than in padding). So padding is at most 2x outside runs of ``slack`` tokens, and a
    level takes about ``log2(longest / shortest)`` calls. ``slack=None``: one run.
    Example: lengths ``[500, 3, 2, 1, 1]``, slack 64 -> ``[1, 4]`` (5 rows of 500 would be 2500).
    """
    if slack is None or lengths.size == 0:
        return [int(lengths.size)]
    sizes, count, longest = [], 0, 0
    for n in lengths.tolist():
        if count and 2 * n < longest and (count + 1) * longest > slack:
            sizes.append(count)
            count = 0
        if count == 0:
            longest = n
        count += 1
    sizes.append(count)
    return sizes


def build_levels(
    node_start: torch.Tensor,
    node_end: torch.Tensor,
    node_parent: torch.Tensor,
    device=None,
    pad_slack: int | None = 256,
) -> TreeLevels:
    """The level schedule from ``PackedTree.node_start / node_end / node_parent`` (``[N]`` each).

    Within a level, nodes are ordered by decreasing length and split by :func:`length_groups`.
    Example (the module docstring's tree): ``node_start = [0 1 2 4 6]``, ``node_end = [1 2 4 6 8]``,
    ``node_parent = [-1 0 1 1 0]`` -> one group per level: ``[[0]]``, ``[[6 7] [1 8]]`` (G H, then
    B), ``[[2 3] [4 5]]`` with ``parent_row = [1 1]`` (B is row 1 of level 1).
    """
    start = node_start.detach().cpu().numpy().astype(np.int64)
    end = node_end.detach().cpu().numpy().astype(np.int64)
    parent = node_parent.detach().cpu().numpy().astype(np.int64)
    device = node_start.device if device is None else device
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    T = int(end.max()) if end.size else 0
    depth = node_depth(parent)
    lengths = end - start
    row_in_level = np.zeros(start.size, dtype=np.int64)
    padded_row = np.empty(T, dtype=np.int64)
    varlen_row = np.empty(T, dtype=np.int64)
    levels = []
    padded_off = varlen_off = 0
    for d in range(int(depth.max()) + 1 if depth.size else 0):
        nodes = np.flatnonzero(depth == d)
        nodes = nodes[np.argsort(-lengths[nodes], kind="stable")]  # longest first, then DFS order
        row_in_level[nodes] = np.arange(nodes.size)
        lens = lengths[nodes]
        groups, first = [], 0
        for size in length_groups(lens, pad_slack):
            sel = slice(first, first + size)
            steps = np.arange(max(int(lens[sel].max()), 1))
            index = np.where(steps < lens[sel, None], start[nodes[sel], None] + steps, T)
            real = index < T
            padded_row[index[real]] = padded_off + np.flatnonzero(real.ravel())
            padded_off += index.size
            groups.append(as_t(index))
            first += size
        flat_index = np.concatenate([np.arange(s, e) for s, e in zip(start[nodes], end[nodes])])
        varlen_row[flat_index] = varlen_off + np.arange(flat_index.size)
        varlen_off += flat_index.size
        parent_row = row_in_level[np.maximum(parent[nodes], 0)] if d else np.zeros(nodes.size, np.int64)
        levels.append(
            Level(
                groups=tuple(groups),
                parent_row=as_t(parent_row),
                cu_seqlens=as_t(np.concatenate([[0], np.cumsum(lens)])),
                flat_index=as_t(flat_index),
            )
        )
    return TreeLevels(
        levels=tuple(levels), padded_row=as_t(padded_row), varlen_row=as_t(varlen_row), num_tokens=T
    )


# ---- the causal conv1d along paths --------------------------------------------------------------


def conv_window_index(prev: torch.Tensor, width: int) -> torch.Tensor:
    """``[T, width]``: column ``width - 1`` is the token itself, column ``j`` its ``(width - 1 - j)``-th
    predecessor along its path; ``T`` where the path has no such token (read as a zero input).

    ``prev [T]`` is ``PackedTree.prev`` (``-1`` at a root's first token). Example (module docstring),
    ``width = 3``: row 4 (E) is ``[0 1 4]``, row 6 (G) is ``[8 0 6]``.
    """
    T = prev.numel()
    cols = [torch.arange(T, device=prev.device)]
    for _ in range(width - 1):
        last = cols[-1]
        nxt = prev.index_select(0, last.clamp(max=T - 1))
        cols.append(torch.where((last < T) & (nxt >= 0), nxt, T))
    return torch.stack(cols[::-1], dim=1)


class _TreeConv1d(torch.autograd.Function):
    """``out[t, c] = bias[c] + sum_j weight[c, j] * x[index[t, j], c]`` (``x[T] = 0``).

    Saves only ``x`` and the index (not the ``[T, width, C]`` windows); backward re-gathers one
    column at a time.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, index):
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])])
        out = x.new_zeros(x.shape) if bias is None else bias.expand_as(x).clone()
        for j in range(weight.shape[1]):
            out += xp.index_select(0, index[:, j]) * weight[:, j]
        ctx.save_for_backward(x, weight, index)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, index = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = x.new_zeros(x.shape[0] + 1, x.shape[1]) if need_x else None
        gw = torch.empty_like(weight) if need_w else None
        xp = torch.cat([x, x.new_zeros(1, x.shape[1])]) if need_w else None
        for j in range(weight.shape[1]):
            if need_x:
                gx.index_add_(0, index[:, j], g * weight[:, j])
            if need_w:
                gw[:, j] = (g * xp.index_select(0, index[:, j])).sum(0)
        gb = g.sum(0) if (need_b and ctx.has_bias) else None
        return (gx[:-1] if need_x else None), gw, gb, None


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal conv along each token's path, before the activation.

    x ``[T, C]`` (DFS order), weight ``[C, width]`` (``nn.Conv1d.weight[:, 0]``), bias ``[C]`` or
    None, window ``[T, width]`` from :func:`conv_window_index` -> ``[T, C]``. On a single path it is
    ``F.conv1d(x.T[None], weight[:, None], bias, padding=width - 1, groups=C)[..., :T]``.
    """
    if weight.shape[1] != window.shape[1]:
        raise ValueError(f"conv width {weight.shape[1]} does not match the window index {window.shape[1]}")
    return _TreeConv1d.apply(x, weight, bias, window)


# ---- the gated delta rule along the tree --------------------------------------------------------


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


def _pad_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


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
    if kernel == "fla":
        return _tree_rule_fla(q, k, v, g, beta, levels, use_qk_l2norm)
    if kernel != "torch":
        raise ValueError(f"kernel {kernel!r}: choose 'torch' or 'fla'")
    rule = native_chunk_rule if q.dtype == torch.float64 else _torch_rule()
    qp, kp, vp, gp, bp = (_pad_row(x) for x in (q, k, v, g, beta))
    outs, state = [], None
    for d, lv in enumerate(levels.levels):
        init = state.index_select(0, lv.parent_row) if d else None
        states, first = [], 0
        for idx in lv.groups:
            n, L = idx.shape
            out, st = rule(
                qp[idx], kp[idx], vp[idx], g=gp[idx], beta=bp[idx],
                chunk_size=min(max_chunk, L),  # a group of 1-token nodes is not padded to 64
                initial_state=None if init is None else init[first : first + n],
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
            )  # fmt: skip
            outs.append(out.flatten(0, 1))
            states.append(st)
            first += n
        state = torch.cat(states) if len(states) > 1 else states[0]
    return torch.cat(outs).index_select(0, levels.padded_row)


def _tree_rule_fla(q, k, v, g, beta, levels: TreeLevels, use_qk_l2norm: bool) -> torch.Tensor:
    """FLA varlen: one call per level over its unpadded tokens, one initial state per node.

    Untested here (no CUDA in CI): mirrors the documented FLA API, ``initial_state [N, H, K, V]``
    and ``output_final_state`` with ``cu_seqlens`` (batch 1).
    """
    rule = _fla_rule()
    rep = v.shape[1] // q.shape[1]
    if rep > 1:  # grouped value heads: each q/k head serves `rep` consecutive value heads
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    outs, state = [], None
    for d, lv in enumerate(levels.levels):
        idx = lv.flat_index
        init = state.index_select(0, lv.parent_row) if d else None
        out, state = rule(
            q[idx][None], k[idx][None], v[idx][None], g[idx][None].float(), beta[idx][None],
            initial_state=init, output_final_state=True, cu_seqlens=lv.cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )  # fmt: skip
        outs.append(out[0])
    return torch.cat(outs).index_select(0, levels.varlen_row)


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


def path_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One path's causal depthwise conv as transformers computes it: x ``[L, C]`` -> ``[L, C]``."""
    L, C = x.shape
    w = weight.shape[1]
    return F.conv1d(x.T[None], weight[:, None], bias, padding=w - 1, groups=C)[0, :, :L].T
