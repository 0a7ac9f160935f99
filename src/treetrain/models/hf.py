"""Run a Hugging Face decoder-only model over a ``PackedTree``.

Tree attention is registered under the name ``treetrain`` in transformers' public
``AttentionInterface`` (and ``AttentionMaskInterface``). The model receives:

- ``attention_mask = subtree_end.view(1, 1, 1, T)``: a 4D tensor, which transformers passes through
  untouched, so it never builds a mask of its own nor guesses packed-sequence boundaries from the
  position ids (tree positions jump back at branch points);
- ``tree_mask`` (a ``TreeMask``: ``subtree_end``, the backend, a per-forward cache) and
  ``packed_tree`` as keyword arguments, which transformers forwards to every attention and
  recurrent layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import TreeMask, default_backend, get_backend
from ..packing import PackedTree

ATTN_NAME = "treetrain"
_registered = False


def _tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: ``query [1, Hq, T, D]`` -> ``([1, T, Hq, D], None)``."""
    mask: TreeMask | None = kwargs.get("tree_mask")
    if mask is None:  # an ordinary (non-tree) call of a prepared model: plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported with tree attention; set it to 0")
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes batch size 1 (a packed forest), got {query.shape[0]}")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    dev = query.device.type
    if torch.is_autocast_enabled(dev):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if mask.cached("one_sequence", lambda: bool((mask.subtree_end == mask.num_tokens).all())):
        # one plain causal sequence (e.g. a one-path tree): SDPA's causal kernel, as the HF model runs
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs = {k: v for k, v in kwargs.items() if k not in ("tree_mask", "packed_tree", "is_causal")}
        return sdpa_attention_forward(
            module, query, key, value, None, scaling=scaling, is_causal=True, **kwargs
        )
    out = get_backend(mask.backend)(query[0], key[0], value[0], mask, scaling)
    return out.transpose(0, 1).unsqueeze(0), None


def _sdpa_mask(*args, **kwargs):
    """Tree calls bring their mask ready-made; ordinary calls get transformers' SDPA mask."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the ``treetrain`` attention (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _tree_attention)
    AttentionMaskInterface.register(ATTN_NAME, _sdpa_mask)
    _registered = True


def _check_supported(config) -> None:
    text = getattr(config, "text_config", None) or config
    if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
        raise ValueError(
            "sliding-window attention is not supported with tree attention yet: "
            "set config.use_sliding_window = False"
        )
    if getattr(text, "final_logit_softcapping", None):
        raise ValueError("final_logit_softcapping is not supported by treetrain's log-prob head")


def prepare_model(model: nn.Module) -> nn.Module:
    """Switch a model's attention to ``treetrain`` and route its recurrent layers along the tree.

    Called without a tree, the model still works as an ordinary model (plain SDPA). Returns it.
    """
    register()
    _check_supported(model.config)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    from .recurrent import patch_recurrent_layers

    patch_recurrent_layers(model)
    return model


def tree_forward(model: nn.Module, packed: PackedTree, backend: str | None = None) -> torch.Tensor:
    """Final hidden states of the decoder over a packed forest: ``[T, hidden]``.

    ``model`` is a ``...ForCausalLM``; its decoder (``model.base_model``) runs once over all distinct
    tokens. ``backend`` picks the attention kernel (default: by device). A model sharded by
    ``treetrain.distributed.shard_model`` has a root-level ``treetrain_decoder`` entry point that
    runs the same decoder inside FSDP's root hooks; it is used when present.
    """
    prepare_model(model)
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    T = packed.num_tokens
    mask = TreeMask(packed.subtree_end, backend=backend or default_backend(device))
    decoder = getattr(model, "treetrain_decoder", None) or model.base_model
    out = decoder(
        input_ids=packed.input_ids[None],
        position_ids=packed.position_ids[None],
        attention_mask=packed.subtree_end.view(1, 1, 1, T),
        tree_mask=mask,
        packed_tree=packed,
        use_cache=False,
    )
    return out.last_hidden_state[0]
