"""Which architectures treetrain runs exactly, and a clear refusal for every other one.

A model is accepted only when (1) its model type is on :data:`EXACT`, the list the model-zoo test
(``tests/test_model_zoo.py``) verifies against per-path Hugging Face forwards in float64, log-probs
and every parameter gradient, with the scalings and attention extras set away from their defaults;
and (2) none of its modules is a state-carrying layer that treetrain does not route along the tree
(:data:`STATEFUL`), whatever its model type: a recurrence run over the packed tree as if it were
one sequence would carry state from one branch into its sibling. Everything else raises a
``ValueError`` naming the model type or the layer, and why; nothing runs silently different.

The list, with the reasons for what is refused, is ``docs/architectures.md``.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["EXACT", "REFUSED", "STATEFUL", "check_model", "refusal"]

# model type -> what it has that treetrain handles (beyond decoder self-attention with RoPE or
# learned positions); every entry is checked by tests/test_model_zoo.py
EXACT: dict[str, str] = {
    "llama": "",
    "cohere": "",
    "cohere2": "",
    "granite": "",
    "granitemoe": "",
    "gemma2": "",
    "gemma3_text": "",
    "vaultgemma": "",
    "hyperclovax": "",
    "minicpm3": "",
    "gpt_oss": "",
    "qwen3": "",
}

# model type -> why it is refused (a type on neither list is refused as not verified)
REFUSED: dict[str, str] = {}

# layer class name pattern -> what the layer carries (checked along the class's MRO)
STATEFUL: dict[str, str] = {
    r"Mamba\w*Mixer|MambaLayer|BambaMixer|FalconH1Mixer": "a Mamba/Mamba2 state-space recurrence",
    r"GatedDeltaNet|DeltaAttention": "a Gated DeltaNet recurrence",
    r"LinearAttention|LightningAttention": "a linear-attention recurrence",
    r"ShortConv": "a short causal convolution over the previous tokens",
    r"Rwkv": "an RWKV recurrence",
    r"xLSTM|mLSTM|sLSTM": "an xLSTM recurrence",
    r"Rglru|RecurrentBlock": "an RG-LRU recurrence",
}
_STATEFUL = [(re.compile(p), what) for p, what in STATEFUL.items()]

# stateful layers treetrain routes along the tree (models.recurrent), by exact class name
ROUTED = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"})

_DOCS = "docs/architectures.md lists what runs exactly and why the rest is refused"


def _names(module: nn.Module) -> list[str]:
    return [c.__name__ for c in type(module).__mro__]


def _stateful_layer(model: nn.Module) -> tuple[str, str] | None:
    """``(class name, what it carries)`` of the first state-carrying layer without tree routing."""
    for module in model.modules():
        names = _names(module)
        if any(n in ROUTED for n in names):
            continue
        for pattern, what in _STATEFUL:
            if pattern.search(names[0]):
                return names[0], what
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def refusal(model: nn.Module) -> str | None:
    """Why treetrain refuses ``model``, or None when it runs it exactly."""
    model = _unwrap(model)
    layer = _stateful_layer(model)
    if layer is not None:
        name, what = layer
        return (
            f"recurrent layer {name} ({what}) has no tree routing: its state would leak across "
            f"branches of the tree. Routed: {', '.join(sorted(ROUTED))}; {_DOCS}"
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in EXACT:
        return None
    why = REFUSED.get(model_type, "not verified exact by treetrain's model-zoo test")
    return f"model type {model_type!r} ({type(model).__name__}) is not supported: {why}; {_DOCS}"


def check_model(model: nn.Module) -> None:
    """Raise ``ValueError`` unless treetrain runs ``model`` exactly (see the module docstring)."""
    why = refusal(model)
    if why is not None:
        raise ValueError(why)
