"""Run a Hugging Face decoder-only model over a ``PackedTree``.

Tree attention is registered under the name ``treetrain`` in transformers' public
``AttentionInterface`` (and ``AttentionMaskInterface``). The model receives:

- ``attention_mask = subtree_end.view(1, 1, 1, T)``: a 4D tensor, which transformers passes through
  untouched, so it never builds a mask of its own nor guesses packed-sequence boundaries from the
  position ids (tree positions jump back at branch points);
- ``tree_mask`` (a ``TreeMask``: ``subtree_end``, the tokens' path positions, the backend, a
  per-forward cache) and ``packed_tree`` as keyword arguments, which transformers forwards to every
  attention and recurrent layer.

Sliding-window layers pass ``sliding_window`` to the attention function (Mistral, Qwen2, Gemma 2/3:
``None`` on global layers); it reaches the backend as ``window``, measured along each path.
Gemma 2's ``softcap`` reaches it as ``softcap``; its ``scaling`` (``query_pre_attn_scalar``) as
every model's does. GPT-OSS's ``s_aux`` (per-head sink logits) reaches it as ``sinks``. A backend
that lacks a feature the model uses is refused, naming the feature and the backends that can.
"""

from __future__ import annotations

import torch
from torch import nn

from treetrain.attention import FEATURES, check_features, default_backend, get_backend
from treetrain.attention.mask import TreeMask
from treetrain.models.inkling import attention_features
from treetrain.models.support import check_model
from treetrain.trees.packing import PackedTree

ATTN_NAME = "treetrain"
_registered = False


def _tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: ``query [1, Hq, T, D]`` -> ``([1, T, Hq, D], None)``."""
    mask: TreeMask | None = kwargs.get("tree_mask")
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
    window = _effective_window(mask, kwargs.get("sliding_window"))
    if window is not None:
        extra["window"] = window
    if softcap is not None:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
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
    pos = mask.window_positions(window)
    longest = mask.cached("max_position", lambda: int(pos.max()) + 1 if pos.numel() else 0)
    return window if window < longest else None


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
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    from treetrain.models.alibi import patch_own_attention
    from treetrain.models.recurrent import patch_recurrent_layers

    patch_recurrent_layers(model)
    patch_own_attention(model)  # ALiBi decoders (BLOOM, MPT, Falcon): their own attention classes
    return model


def auto_backend(model: nn.Module, device: torch.device) -> str:
    """The device's default backend, or one that supports the model's attention softcap (Gemma 2)
    or relative bias (Inkling): ``dense`` on CPU, ``flex`` on CUDA, where the default (blocksparse,
    triton) lacks it."""
    name = default_backend(device)
    softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if softcap and name in ("blocksparse", "triton"):
        return "flex" if torch.device(device).type == "cuda" else "dense"
    if attention_features(model) - FEATURES[name]:  # Inkling's relative bias: not in triton
        return "flex" if torch.device(device).type == "cuda" else "dense"
    return name


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder of a ``...ForCausalLM``, also inside a ``peft.PeftModel`` (LoRA)."""
    get_base = getattr(model, "get_base_model", None)  # PeftModel: base_model is PEFT's LoraModel
    return (get_base() if callable(get_base) else model).base_model


def tree_forward(model: nn.Module, packed: PackedTree, backend: str | None = None) -> torch.Tensor:
    """Final hidden states of the decoder over a packed forest: ``[T, hidden]``.

    ``model`` is a ``...ForCausalLM``; its decoder (``model.base_model``) runs once over all distinct
    tokens. ``backend`` picks the attention kernel (default: by device). A model sharded by
    ``treetrain.parallel.fsdp.shard_model`` has a root-level ``treetrain_decoder`` entry point that
    runs the same decoder inside FSDP's root hooks; it is used when present.
    """
    prepare_model(model)
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    T = packed.num_tokens
    mask = TreeMask(
        packed.subtree_end, backend=backend or auto_backend(model, device), position_ids=packed.position_ids
    )
    decoder = getattr(model, "treetrain_decoder", None) or decoder_of(model)
    out = decoder(
        input_ids=packed.input_ids[None],
        position_ids=packed.position_ids[None],
        attention_mask=packed.subtree_end.view(1, 1, 1, T),
        tree_mask=mask,
        packed_tree=packed,
        use_cache=False,
    )
    return out.last_hidden_state[0]
