"""Run a Hugging Face decoder-only model over a ``PackedTree``.

Tree attention is registered under the name ``treetrain`` in transformers' public
``AttentionInterface`` (and ``AttentionMaskInterface``). The model receives:

- ``attention_mask``: an all-ones ``[1, T]`` padding mask (:mod:`treetrain.models.layer_masks`).
  While the forward runs, the model builds its masks through the registered ``treetrain`` mask
  function, which hands each layer a marked mask carrying the
  layer's sliding window exactly as the model decided it (config, layer types, its own code), so
  transformers never builds a T x T mask nor guesses packed-sequence boundaries from the position
  ids (tree positions jump back at branch points);
- ``tree_mask`` (a ``TreeMask``: ``subtree_end``, the tokens' path positions, the backend, a
  per-forward cache) and ``packed_tree`` as keyword arguments, which transformers forwards to every
  attention and recurrent layer.

The window reaches the backend as ``window``, measured along each path. A ``sliding_window=``
keyword of the attention call is not read: HF's eager and SDPA attention apply only the mask (the
keyword is for flash-attention), and Qwen2-MoE and PhiMoE never pass one. Gemma 2's ``softcap``
reaches the backend as ``softcap``; its ``scaling`` (``query_pre_attn_scalar``) as every model's
does. GPT-OSS's ``s_aux`` (per-head sink logits) reaches it as ``sinks``. A sparse attention's key
selection (``indices`` / ``block_indices``: DSA, MiniMax-M3) reaches it as ``selection``, evaluated on
each query's own path (:mod:`treetrain.models.sparse_select`). A backend that lacks a feature the model
uses is refused, naming the feature and the backends that can.
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.attention import backend_for, check_features, get_backend
from treetrain.attention.mask import TreeMask
from treetrain.models.head import unwrap
from treetrain.models.inkling import attention_features as inkling_features
from treetrain.models.layer_masks import layer_bidirectional, layer_window, mask_interface, padding_mask
from treetrain.models.rope import patch_rotary, rotary_lengths, token_lengths
from treetrain.models.sparse_select import patch_indexers, pending_selection, uses_selection
from treetrain.models.support import check_model
from treetrain.models.vision import image_blocks_may_be_bidirectional, vision_inputs, vision_runs
from treetrain.models.vision_legacy import features_through_forward
from treetrain.trees.packing import PackedTree

ATTN_NAME = "treetrain"
_registered = False


def _tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: ``query [1, Hq, T, D]`` -> ``([1, T, Hq, D], None)``."""
    mask: TreeMask | None = kwargs.get("tree_mask")
    selection = pending_selection(module, kwargs)  # a sparse attention's indexer call (DSA, MiniMax-M3)
    if mask is None and selection is not None:  # an ordinary call: HF's selection, folded as HF does
        attention_mask = selection.fold(attention_mask, query, key)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")  # GPT-OSS: per-head sink logits [Hq]
    if mask is None and (softcap is not None or sinks is not None):  # SDPA has neither: HF's eager
        return _eager_attention(query, key, value, attention_mask, scaling, softcap, sinks), None
    if mask is None and kwargs.get("sinks") is not None:  # Inkling2's per-query sinks: the model's eager
        additive = _additive_mask(attention_mask, query, key)
        eager = _models_eager(module)
        return eager(module, query, key, value, additive, dropout=dropout, scaling=scaling, **kwargs)
    if mask is None:  # an ordinary (non-tree) call of a prepared model: plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported with tree attention; set it to 0")
    for extra in ("position_bias", "sinks"):  # computed by the caller from packed-sequence indices
        if kwargs.get(extra) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {extra} to tree attention, which would drop it: its "
                "attention needs a tree forward of its own (models.inkling, models.alibi)"
            )
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes batch size 1 (a packed forest), got {query.shape[0]}")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    dev = query.device.type
    if torch.is_autocast_enabled(dev):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    extra = {}
    window = _effective_window(mask, layer_window(attention_mask, mask, type(module).__name__))
    if window is not None:
        extra["window"] = window
    if layer_bidirectional(attention_mask):
        extra["key_start"] = mask.key_start
    if softcap is not None:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
    if selection is not None:
        check_features(mask.backend, {"selection"})  # before the indexer runs
        extra["selection"] = selection.tree(mask)
    if not extra and mask.backend not in ("cp", "depth_first") and _one_sequence(mask):
        # one plain causal sequence (e.g. a one-path tree): SDPA's causal kernel, as the HF model runs
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs = {k: v for k, v in kwargs.items() if k not in ("tree_mask", "packed_tree", "is_causal")}
        return sdpa_attention_forward(
            module, query, key, value, None, scaling=scaling, is_causal=True, **kwargs
        )
    check_features(mask.backend, extra)
    out = get_backend(mask.backend)(query[0], key[0], value[0], mask, scaling, **extra)
    return out.transpose(0, 1).unsqueeze(0), None


def _longest_path(mask: TreeMask) -> int:
    """The longest path through the tree's queries (the whole tree when positions are not given)."""
    pos = mask.position_ids
    if pos is None:
        return mask.num_tokens
    return mask.cached("max_position", lambda: int(pos.max()) + 1 if pos.numel() else 0)


def _additive_mask(attention_mask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask an eager attention adds to its scores (0 / -inf): from SDPA's boolean mask (True =
    attend), or causal where SDPA's mask was skipped (None)."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask
    if attention_mask is None:
        tq, tk = query.shape[-2], key.shape[-2]
        attention_mask = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
    return torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~attention_mask, float("-inf")
    )


def _models_eager(module: nn.Module):
    """The ``eager_attention_forward`` of the transformers module that defines ``module``'s class."""
    import sys

    for c in type(module).__mro__:  # through FSDP2's FSDP<Name> subclass
        fn = getattr(sys.modules.get(c.__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn
    raise ValueError(f"{type(module).__name__} passes sinks, but its module has no eager attention to run")


def _one_sequence(mask: TreeMask) -> bool:
    """Whether the mask is one plain causal sequence (every key visible to every later query)."""
    return mask.cached("one_sequence", lambda: bool((mask.subtree_end == mask.num_tokens).all()))


def _effective_window(mask: TreeMask, window: int | None) -> int | None:
    """``window``, or None when no path is long enough for it to hide anything (a no-op mask)."""
    if window is None:
        return None
    mask.window_positions(window)  # raises when the path positions are not given
    return window if window < _longest_path(mask) else None


def _eager_attention(query, key, value, attention_mask, scaling, softcap=None, sinks=None):
    """HF's eager attention with a logit cap (Gemma 2) and/or sinks (GPT-OSS), for ordinary calls:
    ``[B, Hq, Tq, D]`` -> ``[B, Tq, Hq, D]``.

    ``attention_mask``: boolean (True = attend) or additive ``[B, 1, Tq, Tk]``, or None (causal).
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        tq, tk = scores.shape[-2:]
        attention_mask = torch.ones(tq, tk, dtype=torch.bool, device=scores.device).tril(tk - tq)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask[..., : key.shape[-2]]
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous()


def register() -> None:
    """Register the ``treetrain`` attention (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _tree_attention)
    AttentionMaskInterface.register(ATTN_NAME, mask_interface)
    _registered = True


def prepare_model(model: nn.Module) -> nn.Module:
    """Switch a model's attention to ``treetrain`` and route its recurrent layers along the tree.

    Called without a tree, the model still works as an ordinary model (plain SDPA). Returns it.
    Raises ``ValueError`` for a model treetrain cannot run exactly (:mod:`treetrain.models.support`:
    an architecture off the verified list, or a recurrent layer it does not route).
    """
    if not model.__dict__.get("_treetrain_checked"):
        check_model(model)
        model.__dict__["_treetrain_checked"] = True
    register()
    _set_tree_attention(model)
    from treetrain.models.alibi import patch_own_attention
    from treetrain.models.recurrent import patch_recurrent_layers

    patch_recurrent_layers(model)
    patch_indexers(model)  # sparse attention: the attention function evaluates the key selection
    model.__dict__["_treetrain_rotary"] = patch_rotary(model)
    patch_own_attention(model)  # ALiBi decoders (BLOOM, MPT, Falcon): their own attention classes
    return model


def _set_tree_attention(model: nn.Module) -> None:
    """Tree attention for the language model (and the multimodal model around it, whose forward builds
    the masks); a vision tower's (audio tower's) attention stays the implementation it has."""
    config = unwrap(model).config
    text = config.get_text_config()
    if text is config:
        if config._attn_implementation != ATTN_NAME:
            model.set_attn_implementation(ATTN_NAME)
        return
    key = next(k for k in config.sub_configs if getattr(config, k, None) is text)
    if config._attn_implementation != ATTN_NAME or text._attn_implementation != ATTN_NAME:
        model.set_attn_implementation({"": ATTN_NAME, key: ATTN_NAME})


def rope_lengths(model: nn.Module, packed: PackedTree) -> torch.Tensor | None:
    """Each DFS token's path length ``[T]`` for a prepared model's length-dependent rotary modules
    (:mod:`treetrain.models.rope`); None when it has none. Raises ``ValueError`` when a token is shared
    by paths of different rope regimes."""
    return token_lengths(model.config, packed) if model.__dict__.get("_treetrain_rotary") else None


def attention_features(model: nn.Module) -> frozenset[str]:
    """What the model's attention computes besides the tree mask, as ``attention.FEATURES`` names it:
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``), ``sinks`` (a ``sinks`` parameter: GPT-OSS),
    ``window`` (a ``sliding_window`` in the config), ``key_start`` (a vision-language model whose image
    blocks may attend bidirectionally), ``selection`` (a sparse attention's indexer), and Inkling's
    ``rel_bias`` and per-query sinks."""
    config = model.config.get_text_config()
    features = set()
    if getattr(config, "attn_logit_softcapping", None):
        features.add("softcap")
    if getattr(config, "sliding_window", None):
        features.add("window")
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        features.add("sinks")
    if image_blocks_may_be_bidirectional(model):
        features.add("key_start")
    if uses_selection(model):
        features.add("selection")
    return frozenset(features | inkling_features(model))


def auto_backend(model: nn.Module, device: torch.device) -> str:
    """The backend for ``model`` on ``device``: the device's default, or one that computes every
    attention feature the model uses (``attention.backend_for``; e.g. ``dense`` on CPU and ``flex``
    on CUDA for Gemma 2's attention softcap)."""
    features = model.__dict__.get("_treetrain_features")
    if features is None:
        features = model.__dict__["_treetrain_features"] = attention_features(model)
    return backend_for(device, features)


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder of a ``...ForCausalLM``, also inside a ``peft.PeftModel`` (LoRA)."""
    get_base = getattr(model, "get_base_model", None)  # PeftModel: base_model is PEFT's LoraModel
    return (get_base() if callable(get_base) else model).base_model


def tree_forward(model: nn.Module, packed: PackedTree, backend: str | None = None) -> torch.Tensor:
    """Final hidden states of the decoder over a packed forest: ``[T, hidden]``.

    ``model`` is a ``...ForCausalLM`` or a vision-language ``...ForConditionalGeneration``; its decoder
    (``model.base_model``) runs once over all distinct tokens. With images in the forest, each
    distinct image goes through the vision tower once (:mod:`treetrain.models.vision_encode`) and the
    tokens get the positions their paths' own forwards give them
    (:mod:`treetrain.models.vision_positions`). ``backend`` picks the attention kernel (default: by
    device). A model sharded by ``treetrain.parallel.fsdp.shard_model`` has a root-level
    ``treetrain_decoder`` entry point that runs the same decoder inside FSDP's root hooks; it is used
    when present.
    """
    prepare_model(model)
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    T = packed.num_tokens
    runs, key_start = vision_runs(packed)
    mask = TreeMask(
        packed.subtree_end,
        backend=backend or auto_backend(model, device),
        position_ids=packed.position_ids,
        key_start=key_start,
        vision_runs=runs,
    )
    positions, extra = vision_inputs(model, packed)
    rope = rope_lengths(model, packed)
    return run_decoder(model, packed, mask, 0, T, rope, positions=positions, packed_tree=packed, **extra)


def run_decoder(
    model: nn.Module,
    packed: PackedTree,
    mask: TreeMask,
    start: int,
    end: int,
    rope: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    **extra,
) -> torch.Tensor:
    """The decoder over DFS tokens ``[start, end)`` of ``packed``: final hidden states ``[end - start,
    hidden]``. The one decoder call of every tree forward (whole tree, a context-parallel chunk, a
    depth-first node): ``mask`` is its ``TreeMask``; ``rope`` the tokens' path lengths
    (:func:`rope_lengths`, all ``T`` of them); ``positions`` the model's own positions of all ``T``
    tokens (``[R, 1, T]``, 3D rotary; None: the path positions); ``extra`` more keywords for the
    decoder and its layers."""
    decoder = getattr(model, "treetrain_decoder", None) or decoder_of(model)
    device = packed.input_ids.device
    lengths = None if rope is None else rope[start:end]
    pos = packed.position_ids[None, start:end] if positions is None else positions[..., start:end]
    with (
        padding_mask(mask, end - start, device) as attention_mask,
        rotary_lengths(lengths),
        features_through_forward(decoder_of(model), extra) as extra,  # transformers < 5.24
    ):
        out = decoder(
            input_ids=packed.input_ids[None, start:end],
            position_ids=pos,
            attention_mask=attention_mask,
            tree_mask=mask,
            use_cache=False,
            **extra,
        )
    return out.last_hidden_state[0]
