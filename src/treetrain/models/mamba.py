"""Mamba (selective scan) mixers along a packed tree: Mamba, FalconMamba, Jamba and Zamba.

The layer forward (:func:`tree_mamba_forward`) reuses the module's own ``in_proj``, ``x_proj``,
``dt_proj``, B/C/dt norms (FalconMamba, Jamba) and ``out_proj``, and replaces only the two sequence
mixers: the depthwise causal conv1d (a gather along each token's path,
:mod:`treetrain.models.pathconv`) and the selective scan, run by
:func:`treetrain.models.scan.tree_scan`, every node starting from its parent's final state
``[D, N]``. The scan is the model's own recurrence (transformers' ``mamba_selective_scan``, PyTorch
path) with an initial state, which transformers' does not take: mamba-ssm's ``selective_scan_fn``
takes none either, so this runs the PyTorch recurrence on every device.

Padding is exact for free: ``dt`` is computed per token before the scan (bias and softplus), so a
padded step has ``dt = 0``: decay ``exp(A * 0) = 1``, input ``dt * B * x = 0``.

Zamba's mixer has ``H`` heads with their own ``x_proj`` / ``dt_proj``; a head's B and C serve its
``D / H`` channels. The scan takes B, C ``[T, H, N]`` (``H = 1`` for the others). Example, channel
``d`` of head ``h`` of one node ``[t0 t1]`` whose parent ended in state ``s`` (``[N]``)::

    s_t0 = exp(A_d dt_t0,d) * s    + dt_t0,d x_t0,d B_t0,h      y_t0,d = s_t0 . C_t0,h
    s_t1 = exp(A_d dt_t1,d) * s_t0 + dt_t1,d x_t1,d B_t1,h      y_t1,d = s_t1 . C_t1,h
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from treetrain.models.classes import required_class
from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.scan import TreeLevels, tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["MAMBA_LAYOUTS", "selective_scan", "tree_mamba_forward", "tree_selective_scan"]


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    init: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of ``n`` sequences from initial states: ``(y [n, L, D], final [n, D, N])``.

    x, dt ``[n, L, D]`` (dt after bias and softplus); A ``[D, N]``; B, C ``[n, L, H, N]``, head ``h``
    serving channels ``h * D / H ... (h + 1) * D / H``; init ``[n, D, N]`` or None (zeros).
    Step for step transformers' PyTorch ``mamba_selective_scan`` (its dtypes included: the decay and
    input in float32, the state read out in the input dtype), without the ``D`` skip and the gate.
    """
    n, L, Dm = x.shape
    H, N = B.shape[2], B.shape[3]
    dA = torch.exp(A * dt[..., None])  # [n, L, D, N]
    dB = (dt.unflatten(-1, (H, -1))[..., None] * B.float()[..., None, :]).flatten(2, 3)
    dBx = dB * x.float()[..., None]
    state = init if init is not None else x.new_zeros(n, Dm, N)
    states = []
    # unbind, not dA[:, t]: a slice's backward writes into a zero tensor of the whole input, so L
    # slices cost O(L^2) in backward; unbind's backward is one stack
    for a_t, b_t in zip(dA.unbind(1), dBx.unbind(1)):
        state = a_t * state + b_t
        states.append(state)
    hs = torch.stack(states, dim=1).to(x.dtype).unflatten(2, (H, -1))  # [n, L, H, D / H, N]
    y = (hs @ C.to(x.dtype)[..., None]).flatten(2)  # [n, L, D]
    return y, state


def tree_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, levels: TreeLevels
) -> torch.Tensor:
    """:func:`selective_scan` over a packed forest, level by level: ``[T, D]`` (shapes as there, with
    ``T`` DFS tokens for ``n, L``). Each node starts from its parent's final state."""

    def scan(xs, init, valid):
        xg, dtg, Bg, Cg = xs  # padded steps are zero rows: dt = 0, an identity step
        return selective_scan(xg, dtg, A, Bg, Cg, init)

    return tree_scan((x, dt, B, C), levels, scan)


# ---- the layers ---------------------------------------------------------------------------------

# Params: module, conv output x [T, D] -> (time_step [T, D] before bias, B, C [T, H, N])
Params = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _split_gate(m: nn.Module, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba layout: ``in_proj`` gives ``[x | gate]``."""
    return proj.chunk(2, dim=-1)


def _split_gate_interleaved(m: nn.Module, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zamba layout: ``in_proj`` channels alternate ``x_0 gate_0 x_1 gate_1 ...``."""
    both = proj.unflatten(-1, (-1, 2))
    return both[..., 0], both[..., 1]


def _params(m: nn.Module, x: torch.Tensor, norms: bool) -> tuple[torch.Tensor, ...]:
    """Mamba / FalconMamba / Jamba: one ``x_proj`` and ``dt_proj`` (FalconMamba and Jamba: RMS norms
    on dt, B and C first, as their forwards do)."""
    ts, B, C = m.x_proj(x).split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    if norms:
        ts, B, C = m.dt_layernorm(ts), m.b_layernorm(B), m.c_layernorm(C)
    if norms and hasattr(m.config, "_is_quantized"):  # their own way round a quantized dt_proj
        ts = m.dt_proj(ts) - m.dt_proj.bias
    else:
        ts = ts @ m.dt_proj.weight.T
    return ts, B[:, None], C[:, None]


def _params_zamba(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zamba: per-head ``x_proj_weight [H, R + 2N, D/H]`` and ``dt_proj_weight [H, D/H, R]``."""
    xh = x.unflatten(-1, (m.n_mamba_heads, -1)).transpose(0, 1)  # [H, T, D/H]
    p = xh @ m.x_proj_weight.transpose(1, 2)  # [H, T, R + 2N]
    ts, B, C = p.split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    ts = ts @ m.dt_proj_weight.transpose(1, 2)  # [H, T, D/H]
    return ts.transpose(0, 1).flatten(1), B.transpose(0, 1), C.transpose(0, 1)


def _dt_bias(m: nn.Module) -> torch.Tensor | None:
    bias = m.dt_proj.bias if hasattr(m, "dt_proj") else m.dt_proj_bias
    return None if bias is None else bias.float().flatten()


# exact class name -> (gate split, dt/B/C from the conv output) (checked against transformers 5.x)
MAMBA_LAYOUTS: dict[str, tuple[Callable, Params]] = {
    "MambaMixer": (_split_gate, lambda m, x: _params(m, x, norms=False)),
    "FalconMambaMixer": (_split_gate, lambda m, x: _params(m, x, norms=True)),
    "JambaMambaMixer": (_split_gate, lambda m, x: _params(m, x, norms=True)),
    "ZambaMambaMixer": (_split_gate_interleaved, _params_zamba),
}


def _layout(module: nn.Module) -> tuple[Callable, Params]:
    """The layout of a Mamba layer; looks through subclasses (FSDP2's ``FSDP<Name>``)."""
    return MAMBA_LAYOUTS[required_class(module, MAMBA_LAYOUTS, "Mamba mixer").__name__]


def tree_mamba_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """A Mamba mixer over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``, as the mixer's own
    forward computes it on each path (its PyTorch scan, no cache).

    ``tree_mask`` (a ``TreeMask``, optional) caches the level schedule and the conv windows for the
    other layers of the same forward.
    """
    m = module
    split_gate, params = _layout(m)
    dtype, dev = hidden_states.dtype, hidden_states.device
    x, gate = split_gate(m, m.in_proj(hidden_states)[0])

    w = m.conv1d.weight[:, 0]  # [D, width]
    window = path_window(packed, w.shape[1], tree_mask, dev)
    conv = tree_causal_conv1d(x.to(w.dtype), w, m.conv1d.bias, window)
    x = ACT2FN[m.activation](conv).to(x.dtype)

    ts, B, C = params(m, x)
    bias = _dt_bias(m)
    dt = F.softplus(ts if bias is None else ts + bias.to(ts.dtype))
    A = -torch.exp(m.A_log.float()).flatten(0, -2)  # [D, N] (Zamba: [H, D/H, N])
    y = tree_selective_scan(x, dt, A, B, C, tree_levels(packed, tree_mask, dev))
    y = (y + x * m.D.float().flatten()) * F.silu(gate)
    return m.out_proj(y[None].to(dtype))
