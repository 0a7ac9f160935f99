"""Rotary embeddings whose table depends on the forward's length: dynamic NTK and longrope.

Hugging Face's ``dynamic_rope_update`` picks the rotary table of a forward from its longest position,
``seq_len = max(position_ids) + 1``:

- ``rope_type="dynamic"`` (Llama, Qwen2, ... configs): up to ``max_position_embeddings`` the plain
  table; beyond it a table recomputed for ``seq_len`` itself, so every longer length has its own;
- ``rope_type="longrope"`` (Phi-3, Phi-3.5, Phi-4-mini): the short factors up to
  ``original_max_position_embeddings``, the long ones beyond.

A path's own forward is rotated by its own length's table, so a token in a shared prefix is rotated
differently depending on which path reads it, and in a tree forward the longest path would decide
for everyone. Two pieces make the tree exact:

- :func:`split_regimes` splits a tree's paths by *regime* (paths whose lengths give the same table)
  before packing (``TrajectoryTree.split_by``): a prefix shared by paths of two regimes is repeated
  once per regime. Cost: those repeated prefix tokens; nothing else.
- In the forward, every length-dependent rotary module (patched by :func:`patch_rotary`) rotates
  each token with its own regime's table: HF's own rotary code is called once per regime present,
  from a fresh state, with a position appended that makes its ``seq_len`` the regime's length (and
  dropped from the output). One forward serves every regime, whatever the packing, context-parallel
  chunking or depth-first node order; the cost is one rotary call per regime (elementwise).

"A path's own forward" means a fresh model's: HF's dynamic module is stateful (``inv_freq`` and
``max_seq_len_cached`` only grow, until a forward shorter than ``max_position_embeddings`` resets
them), so the same path scored after a longer one gets the longer one's table. treetrain gives each
path the table a fresh model gives it, and leaves the module's own state as it found it.
Length-independent scalings (default, linear, yarn, llama3, ministral3's) have no regime: nothing is
split or patched.

Example: longrope with ``original_max_position_embeddings = 20``, paths of 18 and 39 tokens sharing 12:
two regimes, the 12 shared tokens computed twice (30 + 27 tokens, where one tree would hold 45).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from treetrain.trees.packing import PackedTree
from treetrain.trees.tree import TrajectoryTree

__all__ = ["LengthRule", "length_rules", "patch_rotary", "regime_keys", "rotary_lengths", "split_regimes"]


@dataclass(frozen=True)
class LengthRule:
    """How one rotary table depends on the forward's length ``L``: ``dynamic`` (one table up to
    ``threshold``, one per length beyond) or ``longrope`` (short up to ``threshold``, long beyond)."""

    kind: str
    threshold: int


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def length_rules(config) -> tuple[LengthRule, ...]:
    """The length dependencies of a model config's rotary tables (empty: none), one per rope
    parameter set (per layer type when the config has several)."""
    config = _text_config(config)
    params = getattr(config, "rope_parameters", None) or {}
    per_type = [v for v in params.values() if isinstance(v, dict)] or [params]  # per layer type?
    rules = []
    for p in per_type:
        rope_type = (p or {}).get("rope_type", "default") or "default"
        if "dynamic" in rope_type:  # HF's test: any rope type containing "dynamic"
            rules.append(LengthRule("dynamic", int(config.max_position_embeddings)))
        elif rope_type == "longrope":
            rules.append(LengthRule("longrope", int(p["original_max_position_embeddings"])))
        if getattr(config, "model_type", None) == "phimoe" and rope_type != "default":
            # PhiMoE scales cos/sin by short_mscale or long_mscale, switching where longrope does,
            # for every scaled rope type (dynamic included)
            rules.append(LengthRule("longrope", int(p["original_max_position_embeddings"])))
    return tuple(dict.fromkeys(rules))


def regime_keys(rules: tuple[LengthRule, ...], lengths: torch.Tensor) -> torch.Tensor:
    """One key per forward length ``L`` (``[n]`` int64 in, ``[n]`` out): equal keys, equal tables.

    The key is the shortest length of ``L``'s regime: thresholds cut the lengths into intervals
    (``(t_{i-1}, t_i]``), and past a ``dynamic`` threshold every length is its own regime.
    Example: longrope at 20: ``[5, 20, 21, 39] -> [1, 1, 21, 21]``; dynamic at 7: ``[6, 7, 8, 9] ->
    [1, 1, 8, 9]``.
    """
    bounds = torch.tensor(sorted({r.threshold for r in rules}), dtype=torch.int64, device=lengths.device)
    below = torch.searchsorted(bounds, lengths, right=False)  # thresholds < L
    keys = torch.where(below > 0, bounds[(below - 1).clamp(min=0)] + 1, torch.ones_like(lengths))
    dynamic = [r.threshold for r in rules if r.kind == "dynamic"]
    if dynamic:
        keys = torch.where(lengths > min(dynamic), lengths, keys)
    return keys


def _config_of(model_or_config):
    """A model's HF config (also inside DDP / FSDP / PEFT wrappers), or the config itself."""
    if not isinstance(model_or_config, nn.Module):
        return model_or_config
    configs = (m.__dict__.get("config") for m in model_or_config.modules())
    return next((c for c in configs if hasattr(c, "to_dict")), None)


def split_regimes(model_or_config, tree: TrajectoryTree) -> TrajectoryTree:
    """``tree`` with paths of different rope regimes (of a model, or its config) sharing no token
    (``TrajectoryTree.split_by``); the tree itself when the rope does not depend on length (or
    ``model_or_config`` is None)."""
    config = _config_of(model_or_config) if model_or_config is not None else None
    rules = length_rules(config) if config is not None else ()
    if not rules:
        return tree
    keys = regime_keys(rules, torch.from_numpy(tree.path_lengths))
    return tree.split_by(keys.numpy())


def token_lengths(config, packed: PackedTree) -> torch.Tensor | None:
    """Per DFS token, the length of the longest path through it (``[T]``), which names its regime;
    None when the rope does not depend on length. Raises ``ValueError`` when a token is shared by
    paths of different regimes (the tree was packed without :func:`split_regimes`)."""
    rules = length_rules(config)
    if not rules:
        return None
    lengths = packed.path_lengths
    per_pos = torch.repeat_interleave(lengths, lengths)
    T = packed.num_tokens
    hi = lengths.new_zeros(T).scatter_reduce(0, packed.path_index, per_pos, "amax", include_self=False)
    lo = lengths.new_zeros(T).scatter_reduce(0, packed.path_index, per_pos, "amin", include_self=False)
    mixed = regime_keys(rules, hi) != regime_keys(rules, lo)
    if bool(mixed.any()):
        t = int(torch.nonzero(mixed)[0, 0])
        raise ValueError(
            f"token {t} of the packed tree is shared by paths of {int(lo[t])} and {int(hi[t])} tokens, "
            f"which the model's length-dependent rope ({', '.join(r.kind for r in rules)} at "
            f"{', '.join(str(r.threshold) for r in rules)} tokens) rotates with different tables: split "
            "the tree by regime before packing (treetrain.models.rope.split_regimes(model.config, tree); "
            "path_logprobs, flat_logprobs, the trainer and the integrations do)"
        )
    return hi


# ---- the rotary modules ---------------------------------------------------------------------------

_ACTIVE: list[torch.Tensor] = []  # per decoder call: each token's path length ([n], or empty: none)


@contextlib.contextmanager
def rotary_lengths(lengths: torch.Tensor | None) -> Iterator[None]:
    """Inside, patched rotary modules rotate token ``i`` of a call with the table of a forward of
    ``lengths[i]`` tokens (``[n]``, the call's tokens). ``None``: HF's own behaviour."""
    if lengths is None:
        yield
        return
    _ACTIVE.append(lengths)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _wrapper_code():
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _length_dependent(module: nn.Module) -> bool:
    """A rotary module whose forward is HF's ``dynamic_rope_update`` wrapper, with a dynamic or
    longrope table."""
    fn, code = type(module).forward, _wrapper_code()
    while getattr(fn, "__code__", None) is not code:  # through other decorators (torch.no_grad)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    rope_type = getattr(module, "rope_type", None)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


def patch_rotary(model: nn.Module) -> int:
    """Give every length-dependent rotary module an instance ``forward`` that, inside
    :func:`rotary_lengths`, rotates each token with its own regime's table. Idempotent; returns how
    many modules are patched. Raises ``ValueError`` when a dynamic module's threshold is not its
    config's ``max_position_embeddings`` (the regimes would not be HF's)."""
    n = 0
    for module in model.modules():
        if not _length_dependent(module):
            continue
        rules = length_rules(module.config)
        dynamic = [r.threshold for r in rules if r.kind == "dynamic"]
        if dynamic and getattr(module, "original_max_seq_len", None) not in dynamic:
            raise ValueError(
                f"{type(module).__name__}: dynamic rope from {module.original_max_seq_len} tokens, but its "
                f"config says max_position_embeddings={dynamic[0]}; treetrain cannot tell its regimes"
            )
        if not isinstance(module.__dict__.get("forward"), types.MethodType):
            module.forward = types.MethodType(_regime_forward, module)
        n += 1
    return n


def _regime_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """Patched rotary ``forward``: HF's own, once per regime of the call's tokens (see module doc)."""
    forward = type(self).forward
    if not _ACTIVE:
        return forward(self, x, position_ids, *args, **kwargs)
    lengths = _ACTIVE[-1].to(position_ids.device)
    n = position_ids.shape[-1]
    assert lengths.shape == (n,), (tuple(lengths.shape), n)
    keys = regime_keys(length_rules(self.config), lengths)
    saved = _snapshot(self)
    outs, rows = [], []
    try:
        for key in torch.unique(keys).tolist():
            idx = torch.nonzero(keys == key)[:, 0]
            pos = position_ids.index_select(-1, idx)
            last = torch.full_like(pos[..., :1], int(lengths[idx].max()) - 1)  # seq_len = the regime's
            _fresh(self)
            outs.append(forward(self, x, torch.cat([pos, last], dim=-1), *args, **kwargs))
            rows.append(idx)
    finally:
        _restore(self, saved)
    return _assemble(outs, rows, n)


def _assemble(outs: list, rows: list[torch.Tensor], n: int):
    """Per-regime outputs (tensors ``[..., n_g + 1, D]`` or tuples of them) -> ``[..., n, D]``."""
    first = outs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_assemble([o[i] for o in outs], rows, n) for i in range(len(first)))
    if len(outs) == 1:
        return first[..., :-1, :]
    full = first.new_empty(*first.shape[:-2], n, first.shape[-1])
    for out, idx in zip(outs, rows):
        full.index_copy_(full.dim() - 2, idx, out[..., :-1, :])
    return full


def _snapshot(m: nn.Module):
    """The module's table state: its buffers (objects and values) and cached lengths/scalings."""
    bufs = {k: (b, b.clone()) for k, b in m._buffers.items() if b is not None}
    attrs = {k: v for k, v in vars(m).items() if k.endswith(("max_seq_len_cached", "attention_scaling"))}
    return bufs, attrs


def _restore(m: nn.Module, saved) -> None:
    bufs, attrs = saved
    for k, (obj, value) in bufs.items():
        obj.copy_(value)
        m._buffers[k] = obj
    vars(m).update(attrs)


def _fresh(m: nn.Module) -> None:
    """The state a freshly built module has (HF's own reset): original tables, original length."""
    for k in [k for k in m._buffers if k.endswith("original_inv_freq")]:
        m._buffers[k[: -len("original_inv_freq")] + "inv_freq"] = m._buffers[k].clone()
    if hasattr(m, "original_max_seq_len"):
        for k in [k for k in vars(m) if k.endswith("max_seq_len_cached")]:
            setattr(m, k, m.original_max_seq_len)
