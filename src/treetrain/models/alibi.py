"""ALiBi decoders (BLOOM, MPT, Falcon) over a packed tree.

These models attend in their own attention classes, not through transformers' attention interface,
and their decoders build the ALiBi bias from positions ``0 .. T-1`` of one sequence. In a tree the
bias must come from each token's position along its own path (``PackedTree.position_ids``): query
``q`` and key ``k`` get ``slope_h * (pos[k] - pos[q])`` (:mod:`treetrain.attention.alibi`).

Two instance-level ``forward`` patches (:func:`patch_own_attention`; no transformers file or class is
modified, and the patches survive ``copy.deepcopy``) do it:

- the decoder's: on a tree call (``tree_mask=`` given, as ``tree_forward`` does) it runs the model's
  own embedding, blocks and final norm, computing the bias once, ``[H, T]``, with the model's own
  bias function at the path positions (so its slopes and roundings are the model's), and hands each
  block a :class:`TreeCall` as its ``attention_mask``, which the block passes on to its attention;
- the attention's: given a :class:`TreeCall`, it projects with the module's own layers, runs the tree
  backend (``alibi=`` the bias; Falcon's rotary variant: rotary at the path positions, no bias) and
  applies the module's own output projection.

Any other call runs the class's ``forward`` unchanged. A backend without ALiBi (``cp``,
``depth_first``) is refused by name before anything runs.

Inkling's attention modules (:mod:`treetrain.models.inkling`) attend in their own way too (a learned
bias per query and distance, per-query sinks) but their decoders pass the tree on as keyword
arguments: they share the attention patch, which runs their tree attention when ``tree_mask`` is
given.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``: positions ``0 1 2 3 2 3 1 2``; BLOOM's bias
for head ``h`` is ``slope_h * [0 1 2 3 2 3 1 2]``, and query E sees keys A B E at ``-2 -1 0`` slopes.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.attention import check_features, get_backend
from treetrain.attention.mask import TreeMask
from treetrain.models.classes import class_entry
from treetrain.models.inkling import ATTENTIONS as INKLING_ATTENTIONS

__all__ = ["ATTENTIONS", "DECODERS", "TreeCall", "patch_own_attention", "tree_bias"]


@dataclass(frozen=True, eq=False)
class TreeCall:
    """What a block's attention gets as ``attention_mask`` on a tree call: the tree mask and the
    ALiBi bias ``[H, T]`` at each token's path position (None: no bias, Falcon's rotary variant)."""

    mask: TreeMask
    bias: torch.Tensor | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias=None):
        """``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` -> ``[Hq, T, D]`` through the mask's backend."""
        dev = q.device.type
        if torch.is_autocast_enabled(dev):  # as SDPA under autocast: q, k, v in the autocast dtype
            dtype = torch.get_autocast_dtype(dev)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        bias = self.bias if bias is None else bias
        extra = {} if bias is None else {"alibi": bias}
        return get_backend(self.mask.backend)(q, k, v, self.mask, scale, **extra)


def _no_dropout(module: nn.Module, p: float) -> None:
    if module.training and p:
        raise ValueError(
            f"attention dropout ({p}) of {type(module).__name__} is not supported with tree attention; "
            "set it to 0 or run the model in eval mode"
        )


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[1, T, heads * D]`` or ``[1, T, heads, D]`` -> ``[heads, T, D]``."""
    return x.reshape(x.shape[1], heads, -1).transpose(0, 1)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """``[H, T, D]`` -> ``[1, T, H * D]``."""
    return x.transpose(0, 1).reshape(1, x.shape[1], -1)


# ---- the biases: each model's own function, evaluated at the path positions ----------------------


def _table_at(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[H, 1, P]`` (one sequence's bias at positions ``0 .. P-1``) -> ``[H, T]`` at ``pos``."""
    return table[:, 0, :].index_select(1, pos)


def _ones(pos: torch.Tensor) -> torch.Tensor:
    """A one-sequence attention mask ``[1, P]`` covering every path position."""
    return torch.ones(1, int(pos.max()) + 1 if pos.numel() else 1, dtype=torch.long, device=pos.device)


def _bloom_bias(decoder: nn.Module, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # slope_h * p in float32, then the model's dtype (BloomModel.build_alibi_tensor)
    return _table_at(decoder.build_alibi_tensor(_ones(pos), decoder.num_heads, dtype), pos)


def _mpt_bias(decoder: nn.Module, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # slope_h * (p - P + 1): a per-head constant away from slope_h * p, which the softmax ignores.
    # As MptModel.forward, without config.attn_config.alibi_bias_max (transformers 5.x always uses 8).
    P = _ones(pos).shape[1]
    if decoder.config.max_seq_len < P:
        raise ValueError(
            f"MPT: a path of {P} tokens is longer than max_seq_len={decoder.config.max_seq_len}, "
            "its ALiBi table (the model's own forward fails there too); raise max_seq_len"
        )
    return _table_at(decoder.build_mpt_alibi_tensor(decoder.num_heads, P, device=pos.device), pos)


def _falcon_bias(decoder: nn.Module, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    if not decoder.use_alibi:
        return None
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    # slopes rounded to bfloat16, then the model's dtype; the model's mask holds alibi / sqrt(head_dim)
    alibi = _table_at(build_alibi_tensor(_ones(pos), decoder.num_heads, dtype), pos)
    root = math.sqrt(decoder.config.hidden_size // decoder.num_heads)
    bias = alibi / root
    if decoder.config._attn_implementation == "eager":
        # transformers' eager FalconAttention adds the bias once more, (scores + alibi) / sqrt(head_dim),
        # on top of that mask (its SDPA path adds it once): the tree matches the model as configured
        bias = bias + alibi * (1.0 / root)
    return bias


# ---- the attentions: the module's own projections around the tree backend ------------------------


def _bloom_attention(m, hidden_states, residual, *args, attention_mask: TreeCall, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    _no_dropout(m, m.attention_dropout.p)
    q, k, v = m._reshape(m.query_key_value(hidden_states))  # [1, H, T, D] each
    bias = attention_mask.bias * m.beta  # as baddbmm(beta=beta): the bias scaled by beta (1.0)
    ctx = _merge(attention_mask.attend(q[0], k[0], v[0], m.inv_norm_factor, bias))
    if m.pretraining_tp > 1 and m.slow_but_exact:  # as the model: slice by slice, without dense.bias
        n = m.hidden_size / m.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(m.pretraining_tp):
            cols = slice(int(i * n), int((i + 1) * n))
            out = out + F.linear(ctx[:, :, cols], m.dense.weight[:, cols])
    else:
        out = m.dense(ctx)
    return dropout_add(out, residual, m.hidden_dropout, m.training), None


def _mpt_attention(m, hidden_states, *args, attention_mask: TreeCall, **kwargs):
    _no_dropout(m, m.attn_dropout_p)
    mixed = m.Wqkv(hidden_states)
    if m.clip_qkv:
        mixed = mixed.clamp(min=-m.clip_qkv, max=m.clip_qkv)
    q, k, v = (_heads(x, m.n_heads) for x in mixed.chunk(3, dim=2))
    return m.out_proj(_merge(attention_mask.attend(q, k, v, m.softmax_scale))), None


def _falcon_qkv(m, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Falcon's fused projection ``[1, T, (H + 2 Hkv) D]`` -> queries ``[1, T, H, D]``, keys and values
    ``[1, T, Hkv, D]``, in each layout its attention reads: per key/value group its queries then its key
    and value (new decoder architecture), one shared key and value (multi-query), or query, key and
    value interleaved per head (transformers 5.25 splits it so in the forward; older ones in
    ``_split_heads``, which broadcast the grouped keys to every query head: the same attention)."""
    t, d = fused.shape[1], m.head_dim
    if m.new_decoder_architecture:
        grouped = fused.view(1, t, m.num_kv_heads, -1, d)
        return grouped[..., :-2, :].flatten(2, 3), grouped[..., -2, :], grouped[..., -1, :]
    if m.multi_query:
        return fused.view(1, t, -1, d).split([m.num_heads, 1, 1], dim=2)
    return fused.view(1, t, m.num_heads, 3, d).unbind(3)


def _falcon_attention(m, hidden_states, *args, attention_mask: TreeCall, position_embeddings=None, **kwargs):
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    q, k, v = _falcon_qkv(m, m.query_key_value(hidden_states))  # [1, T, H or Hkv, D]
    q, k, v = _heads(q, m.num_heads), _heads(k, k.shape[2]), _heads(v, v.shape[2])
    if attention_mask.bias is None:  # rotary at the path positions (the decoder's position_ids)
        cos, sin = position_embeddings
        q, k = (x[0] for x in apply_rotary_pos_emb(q[None], k[None], cos, sin))
    else:
        dropout = m.attention_dropout  # a Dropout module before transformers 5.25, its rate since
        _no_dropout(m, getattr(dropout, "p", dropout))  # the model drops out only its ALiBi probabilities
    return m.dense(_merge(attention_mask.attend(q, k, v, m.inv_norm_factor))), None


# exact attention class name -> its tree attention (checked against transformers 5.x)
ATTENTIONS: dict[str, Callable] = {
    "BloomAttention": _bloom_attention,
    "MptAttention": _mpt_attention,
    "FalconAttention": _falcon_attention,  # and FalconFlashAttention2, its subclass
}
# attentions whose decoder passes the tree on as keyword arguments (``tree_mask``): Inkling's
ATTENTIONS |= INKLING_ATTENTIONS


# ---- the decoders ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Decoder:
    embed: str  # the decoder's attributes: token embedding, blocks, final norm
    blocks: str
    final_norm: str
    bias: Callable[[nn.Module, torch.Tensor, torch.dtype], torch.Tensor | None]
    # decoder, TreeCall, hidden [1, T, H], position_ids [1, T] -> the block's keyword arguments
    block_kwargs: Callable[..., dict]
    embed_norm: str | None = None  # a norm right after the embedding (BLOOM's)


def _falcon_block_kwargs(decoder, call: TreeCall, hidden, position_ids) -> dict:
    rotary = None if call.bias is not None else decoder.rotary_emb(hidden, position_ids=position_ids)
    return dict(alibi=None, attention_mask=call, position_ids=position_ids, position_embeddings=rotary)


# exact decoder class name -> how its tree forward runs (checked against transformers 5.x)
DECODERS: dict[str, _Decoder] = {
    "BloomModel": _Decoder(
        embed="word_embeddings",
        blocks="h",
        final_norm="ln_f",
        bias=_bloom_bias,
        block_kwargs=lambda d, call, h, pos: dict(alibi=None, attention_mask=call),
        embed_norm="word_embeddings_layernorm",
    ),
    "MptModel": _Decoder(
        embed="wte",
        blocks="blocks",
        final_norm="norm_f",
        bias=_mpt_bias,
        block_kwargs=lambda d, call, h, pos: dict(position_bias=None, attention_mask=call),
    ),
    "FalconModel": _Decoder(
        embed="word_embeddings",
        blocks="h",
        final_norm="ln_f",
        bias=_falcon_bias,
        block_kwargs=_falcon_block_kwargs,
    ),
}


def tree_bias(decoder: nn.Module, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The ALiBi bias ``[H, T]`` of an ALiBi decoder at path positions ``position_ids [T]`` (None for
    a decoder without one)."""
    spec = class_entry(decoder, DECODERS)
    assert spec is not None, type(decoder).__name__
    bias = spec.bias(decoder, position_ids, dtype)
    return None if bias is None else bias.detach()


_ACCEPTED = {"attention_mask", "packed_tree", "use_cache", "cache", "past_key_values", "return_dict"}


def _tree_decoder_forward(decoder: nn.Module, tree_mask: TreeMask, **kw):
    """The decoder over a packed forest: ``last_hidden_state [1, T, hidden]``."""
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    spec = class_entry(decoder, DECODERS)
    ids, embeds = kw.pop("input_ids", None), kw.pop("inputs_embeds", None)
    position_ids = kw.pop("position_ids", None)
    if kw.get("use_cache") or kw.get("cache") is not None or kw.get("past_key_values") is not None:
        raise ValueError("a tree forward takes no cache (use_cache=False)")
    unknown = sorted(k for k, v in kw.items() if k not in _ACCEPTED and v)
    if unknown:
        raise ValueError(f"{type(decoder).__name__} tree forward: unsupported arguments {unknown}")
    if position_ids is None or (ids is None) == (embeds is None):
        raise ValueError("a tree forward needs position_ids [1, T] and one of input_ids, inputs_embeds")
    hidden = getattr(decoder, spec.embed)(ids) if embeds is None else embeds
    if spec.embed_norm is not None:
        hidden = getattr(decoder, spec.embed_norm)(hidden)
    bias = tree_bias(decoder, position_ids[0], hidden.dtype)
    check_features(tree_mask.backend, () if bias is None else ("alibi",))
    call = TreeCall(tree_mask, bias)
    for block in getattr(decoder, spec.blocks):
        hidden = block(hidden, **spec.block_kwargs(decoder, call, hidden, position_ids))[0]
    hidden = getattr(decoder, spec.final_norm)(hidden)
    return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)


def _decoder_forward(self: nn.Module, *args, **kwargs):
    """Instance ``forward`` of a patched decoder: over the tree when ``tree_mask`` is given."""
    mask = kwargs.pop("tree_mask", None)
    if mask is None:
        return type(self).forward(self, *args, **kwargs)
    if args:
        raise ValueError("a tree forward takes keyword arguments only")
    return _tree_decoder_forward(self, mask, **kwargs)


def _attention_forward(self: nn.Module, *args, **kwargs):
    """Instance ``forward`` of a patched attention: the tree attention when its ``attention_mask`` is
    a :class:`TreeCall` (the tree decoder's) or ``tree_mask`` is given, else the class's own."""
    if isinstance(kwargs.get("attention_mask"), TreeCall) or kwargs.get("tree_mask") is not None:
        return class_entry(self, ATTENTIONS)(self, *args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def patch_own_attention(model: nn.Module) -> int:
    """Make every ALiBi decoder and its attentions, and Inkling's attentions, tree-aware. Returns how
    many modules were patched (0 for any other model). Idempotent."""
    n = 0
    for module in model.modules():
        if class_entry(module, DECODERS) is not None:
            forward = _decoder_forward
        elif class_entry(module, ATTENTIONS) is not None:
            forward = _attention_forward
        else:
            continue
        if not isinstance(module.__dict__.get("forward"), types.MethodType):
            module.forward = types.MethodType(forward, module)
        n += 1
    return n
