"""Routing of state-carrying layers along the tree; a no-op for attention-only models.

:data:`ROUTES` maps a layer class (by exact name) to its family's tree forward,
``fn(module, hidden [1, T, hidden], packed, tree_mask) -> [1, T, hidden]``, in which every tree
node starts from its parent's final state and every convolution window follows the token's own path
(:mod:`treetrain.models.scan`, :mod:`treetrain.models.pathconv`). A family supplies only that
function (and, when the layer's forward returns more than its output, its :data:`OUTPUTS` entry);
:func:`patch_recurrent_layers` gives each routed module an instance-level ``forward``: when
the decoder layer passes ``packed_tree`` (as ``tree_forward`` does, through the layers' ``**kwargs``)
the layer runs along the tree; otherwise it calls the class's own ``forward`` unchanged. No
transformers file or class is modified, and the patch survives ``copy.deepcopy``.

Some transformers modules do not pass the tree's keyword arguments on to their routed layers. They
get an instance forward of their own (:data:`FORWARDS`) that hands the tree down as a
:class:`~treetrain.models.scan.TreeArgs` through an argument they do pass on, which only a patched
layer reads: Mamba's and FalconMamba's decoders and Jamba's Mamba layer in place of
``attention_mask``, Inkling's decoder layer in place of ``conv_mask``, RWKV's and xLSTM's decoders as
the layers' ``state``. It reaches the layer through
the calls transformers makes, gradient-checkpoint replays included.

A state-carrying layer that is not routed is refused before any forward
(:func:`treetrain.models.support.check_model`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from treetrain.models.gdn import GDN_LAYOUTS, tree_gdn_forward
from treetrain.models.inkling import CONVS, KV_PROJECTIONS, hand_down_as_conv_mask, tree_inkling2_kv_forward
from treetrain.models.kda import KDA_LAYOUTS, tree_kda_forward
from treetrain.models.lightning import tree_lightning_forward
from treetrain.models.mamba import MAMBA_LAYOUTS, tree_mamba_forward
from treetrain.models.mamba2 import MAMBA2_LAYERS, tree_mamba2_forward
from treetrain.models.rglru import tree_rglru_block_forward
from treetrain.models.rwkv import rwkv_decoder_forward, tree_rwkv_ffn_forward, tree_rwkv_time_mix_forward
from treetrain.models.scan import TreeArgs
from treetrain.models.shortconv import SHORTCONV_LAYERS, tree_shortconv_forward
from treetrain.models.xlstm import tree_xlstm_layer_forward, xlstm_backend_forward, xlstm_decoder_forward
from treetrain.trees.packing import PackedTree

__all__ = [
    "FORWARDS",
    "OUTPUTS",
    "ROUTES",
    "TreeForward",
    "patch_recurrent_layers",
    "route",
    "tree_layer_forward",
]

TreeForward = Callable[..., torch.Tensor]  # (module, hidden [1, T, H], packed, tree_mask) -> [1, T, H]

# exact layer class name -> its tree forward (each checked against transformers 5.x)
ROUTES: dict[str, TreeForward] = dict.fromkeys(GDN_LAYOUTS, tree_gdn_forward)
ROUTES |= dict.fromkeys(SHORTCONV_LAYERS, tree_shortconv_forward)
ROUTES |= dict.fromkeys(KDA_LAYOUTS, tree_kda_forward)
ROUTES |= dict.fromkeys(MAMBA2_LAYERS, tree_mamba2_forward)
ROUTES |= dict.fromkeys(MAMBA_LAYOUTS, tree_mamba_forward)
ROUTES["MiniMaxLightningAttention"] = tree_lightning_forward
ROUTES["RecurrentGemmaRecurrentBlock"] = tree_rglru_block_forward
ROUTES["RwkvSelfAttention"] = tree_rwkv_time_mix_forward
ROUTES["RwkvFeedForward"] = tree_rwkv_ffn_forward
ROUTES["xLSTMLayer"] = tree_xlstm_layer_forward
ROUTES |= CONVS  # Inkling's and Inkling2's short convolutions (models.inkling)
ROUTES |= dict.fromkeys(KV_PROJECTIONS, tree_inkling2_kv_forward)  # returns [1, Hkv, T, D], as the layer

# a routed layer whose forward returns more than its output: exact class name ->
# (output [1, T, H], the call's args, kwargs) -> what the layer's own forward returns
OUTPUTS: dict[str, Callable[..., Any]] = {
    "MiniMaxLightningAttention": lambda out, args, kwargs: (out, None),  # (output, its state: none)
    "RecurrentGemmaRecurrentBlock": lambda out, args, kwargs: (out, None),
    "RwkvSelfAttention": lambda out, args, kwargs: (out, kwargs["state"]),  # the tree, passed on
    "RwkvFeedForward": lambda out, args, kwargs: (out, kwargs["state"]),
    "xLSTMLayer": lambda out, args, kwargs: (out, args[0] if args else kwargs["state"]),
}



def _hand_down_as_attention_mask(self: nn.Module, *args, **kwargs):
    """Instance ``forward`` of a module that passes its layers only ``attention_mask`` (unused by
    them): in a tree forward, that argument becomes the tree."""
    packed = kwargs.get("packed_tree")
    if packed is not None:
        kwargs["attention_mask"] = TreeArgs(packed, kwargs.get("tree_mask"))
    return type(self).forward(self, *args, **kwargs)


# other modules of a routed family that get an instance forward: exact class name -> that forward.
# Modules that pass their layers no keyword arguments hand them the tree as a TreeArgs (Mamba's
# `attention_mask`, Inkling's `conv_mask`, RWKV's and xLSTM's `state`); xLSTM's kernel backend receives
# it as its initial state.
FORWARDS: dict[str, Callable[..., Any]] = {
    "MambaModel": _hand_down_as_attention_mask,
    "FalconMambaModel": _hand_down_as_attention_mask,
    "JambaMambaDecoderLayer": _hand_down_as_attention_mask,
    "InklingDecoderLayer": hand_down_as_conv_mask,
    "RwkvModel": rwkv_decoder_forward,
    "xLSTMModel": xlstm_decoder_forward,
    "xLSTMBackend": xlstm_backend_forward,
}


def route(module: nn.Module) -> TreeForward | None:
    """The tree forward of a routed layer, else None; looks through subclasses (FSDP2 wraps a
    module's class in a ``FSDP<Name>`` subclass)."""
    return next((ROUTES[c.__name__] for c in type(module).__mro__ if c.__name__ in ROUTES), None)


def tree_layer_forward(
    module: nn.Module, hidden_states: torch.Tensor, packed: PackedTree, tree_mask=None
) -> torch.Tensor:
    """A routed layer over a packed forest: ``[1, T, hidden] -> [1, T, hidden]``."""
    fn = route(module)
    if fn is None:
        raise ValueError(
            f"recurrent layer {type(module).__name__} has no tree routing: its state would leak across "
            f"branches. Routed: {', '.join(sorted(ROUTES))}"
        )
    if hidden_states.ndim != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            f"tree forward takes one packed forest [1, T, hidden], got {tuple(hidden_states.shape)}"
        )
    if hidden_states.shape[1] != packed.num_tokens:
        n, T = hidden_states.shape[1], packed.num_tokens
        raise ValueError(f"hidden states have {n} tokens, the packed tree {T}")
    return fn(module, hidden_states, packed, tree_mask)


def _tree_aware_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Instance ``forward`` of a patched layer: along the tree when ``packed_tree`` is given.

    Other arguments pass through as the caller gave them: the cache is ``cache`` in recent transformers
    and ``cache_params`` in older ones (passing the old name to a new layer is a FutureWarning).
    """
    packed, mask = kwargs.get("packed_tree"), kwargs.get("tree_mask")
    carried = next((a for a in (*args, *kwargs.values()) if isinstance(a, TreeArgs)), None)
    if carried is not None:  # handed on by a FORWARDS decoder
        packed, mask = carried.packed, carried.mask
    if packed is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    if cache is not None and cache is not carried:
        raise ValueError("a tree forward takes no cache (use_cache=False): states are routed per node")
    if mask is not None and "cp" in mask.cache:  # context parallel: this rank holds a chunk of the tree
        out = mask.cache["cp"].recurrent_forward(self, hidden_states, packed, mask)
    else:
        out = tree_layer_forward(self, hidden_states, packed, mask)
    wrap = next((OUTPUTS[c.__name__] for c in type(self).__mro__ if c.__name__ in OUTPUTS), None)
    return out if wrap is None else wrap(out, args, kwargs)


def patch_recurrent_layers(model: nn.Module) -> int:
    """Make every routed layer tree-aware. Returns how many layers were patched. Idempotent."""
    n = 0
    for module in model.modules():
        own = next((FORWARDS[c.__name__] for c in type(module).__mro__ if c.__name__ in FORWARDS), None)
        if own is not None:
            _patch(module, own)
        if route(module) is not None:
            _patch(module, _tree_aware_forward)
            n += 1
    return n


def _patch(module: nn.Module, forward: Callable) -> None:
    if not isinstance(module.__dict__.get("forward"), types.MethodType):
        module.forward = types.MethodType(forward, module)
