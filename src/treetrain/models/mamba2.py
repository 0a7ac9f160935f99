"""Mamba2 (SSD) mixers along a packed tree: Mamba2, Bamba, Falcon-H1, Granite 4.0-H
(``granitemoehybrid``), Nemotron-H and Zamba2.

The layer forward (:func:`tree_mamba2_forward`) reuses the module's own ``in_proj``, gated norm and
``out_proj`` (and Falcon-H1's ``ssm_in_multiplier`` and ``mup_vector``), and replaces only the two
sequence mixers: the depthwise causal conv1d (a gather along each token's path,
:mod:`treetrain.models.pathconv`) and the SSD recurrence, run by
:func:`treetrain.models.scan.tree_scan` with the model's own chunked scan (``mamba2_chunk_scan`` of
its transformers module), every node starting from its parent's final state ``[H, P, N]``.

Padding is exact for free: ``dt`` is computed per token before the scan (bias, softplus, the
``time_step_limit`` clamp, as the model does inside its scan), so a padded step has ``dt = 0``:
decay ``exp(A * 0) = 1`` and input ``dt * x = 0``, the state passes through unchanged.

On CUDA with mamba-ssm installed the scan is its fused ``mamba_chunk_scan_combined`` (as
transformers dispatches it; per-row ``initial_states``, ``return_final_states``), and ``dt`` is
computed in float32 as that kernel does inside. Not tested here (no CUDA in CI).

Example, head ``h`` of one node ``[t0 t1]`` whose parent ended in state ``S``::

    S_t0 = exp(A_h dt_t0) S   + dt_t0 x_t0 B_t0^T        y_t0 = S_t0 C_t0 + D_h x_t0
    S_t1 = exp(A_h dt_t1) S_t0 + dt_t1 x_t1 B_t1^T       y_t1 = S_t1 C_t1 + D_h x_t1
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from treetrain.models.classes import required_class
from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.scan import TreeLevels, balanced_chunk, tree_levels, tree_scan
from treetrain.trees.packing import PackedTree

__all__ = ["MAMBA2_LAYERS", "chunk_scan_of", "tree_mamba2_forward", "tree_ssd"]

# exact class name of every Mamba2 mixer of transformers 5.x (their forwards are one code path;
# Falcon-H1 adds multipliers and an optional norm, read from the module)
MAMBA2_LAYERS = (
    "Mamba2Mixer",
    "BambaMixer",
    "FalconH1Mixer",
    "GraniteMoeHybridMambaLayer",
    "NemotronHMamba2Mixer",
    "Zamba2MambaMixer",
)


def _layer_class(module: nn.Module) -> type:
    """The transformers class of a routed layer; looks through subclasses (FSDP2's ``FSDP<Name>``)."""
    return required_class(module, MAMBA2_LAYERS, "Mamba2 mixer")


def chunk_scan_of(module: nn.Module, device: torch.device) -> tuple[Callable, bool]:
    """``(scan, fused)``: the layer's own chunked SSD scan (``mamba2_chunk_scan`` of its transformers
    module), and whether it is mamba-ssm's fused kernel.

    On CUDA with mamba-ssm installed, the dispatching function (mamba-ssm's
    ``mamba_chunk_scan_combined``); otherwise the PyTorch scan itself (``inspect.unwrap``: past the
    dispatch and its fallback warning).
    """
    hf = sys.modules[_layer_class(module).__module__]
    fn = getattr(hf, "mamba2_chunk_scan", None)
    if fn is None:
        import transformers

        raise ValueError(
            f"{type(module).__name__}: transformers {transformers.__version__} has no mamba2_chunk_scan in "
            f"{hf.__name__}, the scan treetrain routes Mamba2 mixers through; use transformers >= 5.24"
        )
    fused = torch.device(device).type == "cuda" and importlib.util.find_spec("mamba_ssm") is not None
    return (fn if fused else inspect.unwrap(fn)), fused


def tree_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    levels: TreeLevels,
    chunk_scan: Callable,
    chunk_size: int,
    shrink_chunks: bool = True,
) -> torch.Tensor:
    """The SSD recurrence over a packed forest, level by level: ``[T, H, P]``.

    x ``[T, H, P]``; dt ``[T, H]`` (after bias, softplus and clamp; ``>= 0``); A, D ``[H]``;
    B, C ``[T, G, N]``; all in DFS order. ``chunk_scan`` is a transformers ``mamba2_chunk_scan``
    (or anything with its signature); each node starts from its parent's final state ``[H, P, N]``.
    ``shrink_chunks``: a group runs in chunks of :func:`~treetrain.models.scan.balanced_chunk` size
    (at most ``chunk_size``, the least padding: the PyTorch scan pads every sequence to whole chunks).
    """

    def scan(xs, init, valid):
        xg, dtg, Bg, Cg = xs  # padded steps are zero rows: dt = 0, an identity step
        chunk = balanced_chunk(xg.shape[1], chunk_size) if shrink_chunks else chunk_size
        kw = dict(chunk_size=chunk, D=D, initial_states=init, return_final_states=True)
        return chunk_scan(xg, dtg, A, Bg, Cg, **kw)

    return tree_scan((x, dt, B, C), levels, scan)


def tree_mamba2_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """A Mamba2 mixer over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``, as the mixer's own
    forward computes it on each path (its chunked-scan branch, no cache).

    ``tree_mask`` (a ``TreeMask``, optional) caches the level schedule and the conv windows for the
    other layers of the same forward.
    """
    m = module
    dtype, dev = hidden_states.dtype, hidden_states.device
    falcon = _layer_class(m).__name__ == "FalconH1Mixer"  # input multiplier, per-channel mup vector
    x = hidden_states * m.ssm_in_multiplier if falcon else hidden_states
    proj = m.in_proj(x)
    if falcon:
        proj = proj * m.mup_vector
    gate, xBC, dt = proj[0].split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)

    w = m.conv1d.weight[:, 0]  # [C, width]
    window = path_window(packed, w.shape[1], tree_mask, dev)
    conv = tree_causal_conv1d(xBC.to(w.dtype), w, m.conv1d.bias, window)
    conv = ACT2FN[m.activation](conv).to(xBC.dtype)
    gn = m.n_groups * m.ssm_state_size
    xs, B, C = conv.split([m.intermediate_size, gn, gn], dim=-1)

    A = -torch.exp(m.A_log.float())
    scan, fused = chunk_scan_of(m, dev)
    if fused:  # the kernel adds the bias and takes the softplus in float32
        dt = dt.to(torch.promote_types(dt.dtype, torch.float32))
    dt = F.softplus(dt + m.dt_bias.to(dt.dtype))  # as the scan does it, before the steps
    dt = torch.clamp(dt, min=m.time_step_limit[0], max=m.time_step_limit[1])
    y = tree_ssd(
        xs.unflatten(-1, (-1, m.head_dim)), dt, A,
        B.unflatten(-1, (m.n_groups, -1)), C.unflatten(-1, (m.n_groups, -1)), m.D,
        tree_levels(packed, tree_mask, dev), scan, m.chunk_size, shrink_chunks=not fused,
    )  # fmt: skip
    y = y.reshape(1, packed.num_tokens, -1)
    if falcon and not m.mamba_rms_norm:
        y = y * F.silu(gate[None])
    else:
        y = m.norm(y, gate[None])
    return m.out_proj(y.to(dtype))
