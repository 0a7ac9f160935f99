"""Inkling (``inkling_text``) and Inkling2 (``inkling2_text``, ``inkling2_loop_text``) over a packed tree.

Two parts of these models read along the sequence, and both follow each token's own path here:

- **Short convolutions**, four per layer (keys, values, after the attention, after the MLP). Each is
  a residual depthwise conv of the last ``L`` inputs along the token's path
  (:mod:`treetrain.models.pathconv`), in float32 as the model computes it::

      Inkling:   y = x + conv(x)
      Inkling2:  y = (x + conv(x)) / sqrt(L + 1)
      Inkling2 full-attention keys and values (dynamic):
                 y_t = (x_t + sum_lag (static[lag] + W h_t)[head, lag] * x_{t - lag}) / sqrt(2 L + 1)

  The dynamic taps come from the projection's input ``h_t`` at the output token, so they need no
  routing; the window does. Inkling's decoder layer passes its convolutions only ``conv_mask``, so
  it hands the tree down in it (:data:`treetrain.models.recurrent.FORWARDS`); Inkling2 passes the
  tree's keyword arguments on, and its dynamic convolution takes the projection input as a second
  argument, so its whole key/value projection is the routed layer.

- **Attention** (no rotary): a learned bias per query and backward distance,
  ``rel[h, q, d] = (relative_states[q, h] @ proj)[d]`` for ``d < E`` (``E``: ``rel_extent``, the
  window on sliding layers), which the models index with ``arange`` distances in the packed sequence;
  Inkling's full layers scale queries and bias by ``tau = 1 + alpha log(max((pos + 1) / n_floor, 1))``
  at ``arange`` positions; Inkling2 adds a sink logit per head *and query*, ``sink_proj(h_q)``, and
  scales inside its projections from ``position_ids``. The attention modules get an instance forward
  (:data:`ATTENTIONS`, patched by :func:`treetrain.models.alibi.patch_own_attention`): on a tree call
  they run their own projections, norms and bias table, take ``tau`` at the path position, and
  attend through the tree backend with ``rel_bias`` at path distances and per-query ``sinks``
  (:mod:`treetrain.attention.relbias`, :mod:`treetrain.attention.sinks`). A backend without them
  (``triton``, ``cp``, ``depth_first``) is refused by name before anything runs.

Both are exact: a tree-visible key is an ancestor on the query's path, at the distance the path's
own forward sees, and every bias row, sink, tap and ``tau`` is a function of the query's own state
and path position. Inkling2's decoder still builds its (unused) ``[T, T]`` int64 distance matrices.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``, ``L = 3``, ``E = 2``: the key conv of G
reads ``_ A G``; query G adds ``rel[h, G, 1]`` to key A and ``rel[h, G, 0]`` to itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from treetrain.attention import check_features, get_backend
from treetrain.attention.mask import TreeMask
from treetrain.models.classes import own_class
from treetrain.models.pathconv import path_window, tree_causal_conv1d
from treetrain.models.scan import TreeArgs
from treetrain.trees.packing import PackedTree

__all__ = [
    "ATTENTIONS",
    "CONVS",
    "KV_PROJECTIONS",
    "attention_features",
    "hand_down_as_conv_mask",
    "tree_inkling2_kv_forward",
]


# ---- the short convolutions -----------------------------------------------------------------------


def _path_conv(module: nn.Module, x: torch.Tensor, packed: PackedTree, tree_mask) -> torch.Tensor:
    """``x [T, C]`` (float) -> ``x + conv(x)`` along each path, the conv in its weight's dtype."""
    w = module.conv1d.weight[:, 0]  # [C, L]
    window = path_window(packed, w.shape[1], tree_mask, x.device)
    return tree_causal_conv1d(x.to(w.dtype), w, module.conv1d.bias, window).to(x.dtype) + x


def tree_inkling_conv_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
):
    """``InklingShortConvolution``: ``[1, T, C] -> [1, T, C]``, ``x + conv(x)`` in float32."""
    x = hidden_states[0].float()
    return _path_conv(module, x, packed, tree_mask).to(hidden_states.dtype)[None]


def tree_inkling2_conv_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
):
    """``Inkling2ShortConvolution``: ``[1, T, C] -> [1, T, C]``, ``(x + conv(x)) / sqrt(L + 1)``."""
    x = hidden_states[0].float()
    out = _path_conv(module, x, packed, tree_mask) / math.sqrt(module.conv_kernel_size + 1)
    return out.to(hidden_states.dtype)[None]


def _dynamic_conv(module: nn.Module, x: torch.Tensor, taps_input: torch.Tensor, packed, tree_mask):
    """``Inkling2DynamicShortConvolution``: ``x [T, C]``, ``taps_input [T, hidden]`` -> ``[T, C]``.

    Token ``t``'s taps ``[heads, L]`` (lag 0: the token itself) are the static ones plus its own
    projection, shared by the channels of a key/value head; its window is its path's last ``L``.
    """
    L, heads = module.conv_kernel_size, module.num_heads
    T, C = x.shape
    taps = module.weight_proj(taps_input).float().view(T, heads, 1, L)
    taps = module.static_weight.float().T.view(heads, -1, L) + taps  # [T, heads, C / heads, L]
    h = x.float()
    back = path_window(packed, L, tree_mask, x.device).flip(1)  # [T, L]: column lag = lag steps back
    windows = torch.cat([h, h.new_zeros(1, C)])[back]  # [T, L, C]; row T: before the path start
    windows = windows.transpose(1, 2).reshape(T, heads, -1, L)
    out = (windows * taps).sum(-1).reshape(T, C)
    return ((out + h) / math.sqrt(2 * L + 1)).to(x.dtype)


def tree_inkling2_kv_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
):
    """Inkling2's key/value projection (linear, short conv along each path, norm):
    ``[1, T, hidden] -> [1, Hkv, T, D]``, what its own forward returns."""
    states = module.linear(hidden_states)
    conv = module.sconv
    if hasattr(conv, "static_weight"):  # Inkling2DynamicShortConvolution
        states = _dynamic_conv(conv, states[0], hidden_states[0], packed, tree_mask)[None]
    else:
        states = tree_inkling2_conv_forward(conv, states, packed, tree_mask)
    states = states.view(*states.shape[:-1], -1, module.head_dim)
    return module.norm(states).transpose(1, 2)


# exact class name -> tree forward (checked against transformers 5.24)
CONVS: dict[str, Callable] = {
    "InklingShortConvolution": tree_inkling_conv_forward,
    "Inkling2ShortConvolution": tree_inkling2_conv_forward,
    "Inkling2LoopShortConvolution": tree_inkling2_conv_forward,
}
KV_PROJECTIONS = ("Inkling2KeyValueProjection", "Inkling2LoopKeyValueProjection")


def hand_down_as_conv_mask(self: nn.Module, *args, **kwargs):
    """Instance ``forward`` of Inkling's decoder layer, which passes its convolutions only
    ``conv_mask`` (unused in a tree forward): that argument becomes the tree."""
    packed = kwargs.get("packed_tree")
    if packed is not None:
        kwargs["conv_mask"] = TreeArgs(packed, kwargs.get("tree_mask"))
    return type(self).forward(self, *args, **kwargs)


# ---- the attentions -------------------------------------------------------------------------------


def _tree_call(m: nn.Module, kwargs: dict, sinks: bool) -> tuple[TreeMask, PackedTree]:
    """The mask and tree of an attention call, after the checks that must pass before it runs."""
    mask: TreeMask = kwargs["tree_mask"]
    packed: PackedTree | None = kwargs.get("packed_tree")
    if packed is None or mask.position_ids is None:
        raise ValueError(f"{type(m).__name__}: a tree call needs packed_tree and the path positions")
    if kwargs.get("cache") is not None:
        raise ValueError("a tree forward takes no cache (use_cache=False)")
    if m.training and m.attention_dropout:
        raise ValueError(
            f"attention dropout ({m.attention_dropout}) of {type(m).__name__} is not supported with tree "
            "attention; set it to 0 or run the model in eval mode"
        )
    needs = {"rel_bias"} | ({"sinks"} if sinks else set()) | ({"window"} if m.sliding_window else set())
    check_features(mask.backend, needs)
    return mask, packed


def _attend(mask: TreeMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **extra):
    """``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` -> ``[Hq, T, D]`` through the mask's backend."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(dev)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return get_backend(mask.backend)(q, k, v, mask, scale, **extra)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[1, T, H, D]`` -> ``[1, H, T, D]``."""
    return x.transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """``[H, T, D]`` -> ``[1, T, H * D]``."""
    return x.transpose(0, 1).reshape(1, x.shape[1], -1)


def _inkling_attention(m: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """``InklingAttention`` over the tree: ``(out [1, T, hidden], None)``."""
    mask, packed = _tree_call(m, kwargs, sinks=False)
    pos = mask.position_ids
    T = hidden_states.shape[1]
    shape = (1, T, -1, m.head_dim)
    down = TreeArgs(packed, mask)
    q = _heads_first(m.q_norm(m.q_proj(hidden_states).view(shape)))
    k = _heads_first(m.k_norm(m.k_sconv(m.k_proj(hidden_states), conv_mask=down).view(shape)))
    v = _heads_first(m.v_sconv(m.v_proj(hidden_states), conv_mask=down).view(shape))
    relative = m.r_proj(hidden_states).view(1, T, m.num_heads, -1)
    rel = (relative @ m.rel_logits_proj.proj).transpose(1, 2)  # [1, H, T, E]
    cfg = m.config
    if not m.is_sliding and cfg.log_scaling_n_floor is not None:  # as the model, at the path position
        n = ((pos + 1).float() / cfg.log_scaling_n_floor).clamp(min=1.0)
        tau = (1.0 + cfg.log_scaling_alpha * torch.log(n)).view(1, 1, -1, 1)
        q = (q.float() * tau).to(q.dtype)
        rel = (rel.float() * tau).to(rel.dtype)
    extra = {"window": m.sliding_window} if m.sliding_window else {}
    out = _attend(mask, q[0], k[0], v[0], m.scaling, rel_bias=rel[0], **extra)
    return m.o_proj(_merge(out)), None


def _inkling2_attention(
    m: nn.Module,
    hidden_states: torch.Tensor,
    *args,
    key_hidden_states=None,
    value_hidden_states=None,
    **kwargs,
):
    """Inkling2's sliding and full attention over the tree: ``(out [1, T, hidden], None)``."""
    mask, packed = _tree_call(m, kwargs, sinks=True)
    position_ids = kwargs["position_ids"]  # [1, T]: the path positions (tree_forward's)
    keys = hidden_states if key_hidden_states is None else key_hidden_states
    values = hidden_states if value_hidden_states is None else value_hidden_states
    q = m.q_proj(hidden_states, position_ids)  # [1, H, T, D]
    k = m.k_proj(keys, packed_tree=packed, tree_mask=mask)
    v = m.v_proj(values, packed_tree=packed, tree_mask=mask)
    bias = m.relative_position_bias
    relative = bias.linear(hidden_states).view(*hidden_states.shape[:-1], bias.num_heads, -1)
    rel = (bias.norm(relative, position_ids) @ bias.proj).transpose(1, 2)  # [1, H, T, E]
    sinks = m.sink_proj(hidden_states).transpose(1, 2)  # [1, H, T]
    extra = {"window": m.sliding_window} if m.sliding_window else {}
    out = _attend(mask, q[0], k[0], v[0], m.scaling, rel_bias=rel[0], sinks=sinks[0], **extra)
    return m.o_proj(_merge(out), hidden_states), None


# exact attention class name -> its tree attention (checked against transformers 5.24)
ATTENTIONS: dict[str, Callable] = {
    "InklingAttention": _inkling_attention,
    "Inkling2SlidingAttention": _inkling2_attention,
    "Inkling2FullAttention": _inkling2_attention,
    "Inkling2LoopSlidingAttention": _inkling2_attention,
    "Inkling2LoopFullAttention": _inkling2_attention,
}
_FEATURES = {"InklingAttention": {"rel_bias"}}


def attention_features(model: nn.Module) -> set[str]:
    """The attention features an Inkling model needs of a backend (empty for any other model)."""
    needs: set[str] = set()
    for c in {own_class(m, ATTENTIONS) for m in model.modules()} - {None}:
        needs |= _FEATURES.get(c.__name__, {"rel_bias", "sinks"})
    return needs
