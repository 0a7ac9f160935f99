"""Recurrent-layer routing along the tree (Gated DeltaNet); a no-op for attention-only models.

:func:`patch_recurrent_layers` gives every Gated DeltaNet module of a Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next model an instance-level ``forward``: when the decoder layer passes ``packed_tree`` (as
``tree_forward`` does, through the layers' ``**kwargs``) the layer runs along the tree
(:mod:`treetrain.models.gdn`); otherwise it calls the class's own ``forward`` unchanged. No
transformers file or class is modified, and the patch survives ``copy.deepcopy``.

The tree forward reuses the module's own projections, norm and output layer, and replaces only
the two sequence mixers: the causal conv1d (a gather along each token's path) and the chunked
gated delta rule (level by level, each node starting from its parent's final state).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from treetrain.models.gdn import (
    TreeLevels,
    build_levels,
    conv_window_index,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)
from treetrain.trees.packing import PackedTree

__all__ = ["patch_recurrent_layers", "tree_gdn_forward"]

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


# Exact class names whose forward is known to match the routing here (checked against transformers
# 5.x); any other recurrent layer raises instead of silently leaking state across branches.
_LAYOUTS: dict[str, Projections] = {
    "Qwen3_5GatedDeltaNet": _project_qwen3_5,
    "Qwen3_5MoeGatedDeltaNet": _project_qwen3_5,
    "Qwen3NextGatedDeltaNet": _project_qwen3_next,
}
_UNSUPPORTED = re.compile(
    r"GatedDeltaNet|DeltaAttention|LinearAttention|Mamba2?Mixer|MambaLayer|ShortConv|Rwkv"
)


def _layout(module: nn.Module) -> Projections | None:
    """The projections of a supported layer; looks through subclasses (FSDP2 wraps a module's
    class in a ``FSDP<Name>`` subclass)."""
    return next((_LAYOUTS[c.__name__] for c in type(module).__mro__ if c.__name__ in _LAYOUTS), None)


def _levels(packed: PackedTree, tree_mask, device) -> TreeLevels:
    build = lambda: build_levels(packed.node_start, packed.node_end, packed.node_parent, device=device)  # noqa: E731
    return tree_mask.cached(("gdn.levels", str(device)), build) if tree_mask is not None else build()


def _window(packed: PackedTree, tree_mask, width: int, device) -> torch.Tensor:
    build = lambda: conv_window_index(packed.prev.to(device), width)  # noqa: E731
    return tree_mask.cached(("gdn.window", width, str(device)), build) if tree_mask is not None else build()


def tree_gdn_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """A Gated DeltaNet layer over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``.

    ``tree_mask`` (a ``TreeMask``, optional) caches the level schedule and the conv windows for
    the other layers of the same forward.
    """
    project = _layout(module) or _unsupported(module)
    if hidden_states.ndim != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            f"tree forward takes one packed forest [1, T, hidden], got {tuple(hidden_states.shape)}"
        )
    T = packed.num_tokens
    if hidden_states.shape[1] != T:
        raise ValueError(f"hidden states have {hidden_states.shape[1]} tokens, the packed tree {T}")
    x, dev = hidden_states[0], hidden_states.device
    mixed, z, b, a = project(module, x)

    w = module.conv1d.weight[:, 0]  # [C, width]
    conv = tree_causal_conv1d(
        mixed.to(w.dtype), w, module.conv1d.bias, _window(packed, tree_mask, w.shape[1], dev)
    )
    if module.activation is not None:
        conv = ACT2FN[module.activation](conv)
    conv = conv.to(x.dtype)
    q, k, v = conv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim))
    v = v.unflatten(-1, (-1, module.head_v_dim))

    beta = b.sigmoid()
    # as the layer, at least float32 (HF: ``.float()``, so half types don't overflow), but a float64
    # model stays float64 here and in the rule (HF's own rule computes in float32 even then)
    up = torch.promote_types(x.dtype, torch.float32)
    g = -module.A_log.to(up).exp() * F.softplus(a.to(up) + module.dt_bias)
    core = tree_gated_delta_rule(q, k, v, g, beta, _levels(packed, tree_mask, dev))  # [T, Hv, Dv]
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, T, -1))


def _unsupported(module: nn.Module) -> NoReturn:
    raise ValueError(
        f"recurrent layer {type(module).__name__} has no tree routing: its state would leak across "
        f"branches. Supported: {', '.join(sorted(_LAYOUTS))}"
    )


def _tree_aware_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Instance ``forward`` of a patched layer: along the tree when ``packed_tree`` is given.

    Other arguments pass through as the caller gave them: the cache is ``cache`` in recent transformers
    and ``cache_params`` in older ones (passing the old name to a new layer is a FutureWarning).
    """
    packed = kwargs.get("packed_tree")
    if packed is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    if cache is not None:
        raise ValueError("a tree forward takes no cache (use_cache=False): states are routed per node")
    mask = kwargs.get("tree_mask")
    if mask is not None and "cp" in mask.cache:  # context parallel: this rank holds a chunk of the tree
        return mask.cache["cp"].recurrent_forward(self, hidden_states, packed, mask)
    return tree_gdn_forward(self, hidden_states, packed, mask)


def patch_recurrent_layers(model: nn.Module) -> int:
    """Make every recurrent layer tree-aware. Returns how many layers were patched.

    Idempotent. Raises ``ValueError`` for a recurrent layer type without tree routing.
    """
    n = 0
    for module in model.modules():
        if _layout(module) is not None:
            if not isinstance(module.__dict__.get("forward"), types.MethodType):
                module.forward = types.MethodType(_tree_aware_forward, module)
            n += 1
        elif _UNSUPPORTED.search(type(module).__name__):
            _unsupported(module)
    return n
