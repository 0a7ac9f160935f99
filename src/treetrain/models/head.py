"""The exact map from a causal LM's last hidden state to its logits, derived from the model once.

Hugging Face's ``...ForCausalLM.forward`` applies, between the decoder's last hidden state ``h``
and the logits, more than the output projection on some architectures. Every scoring path of
treetrain (per-path and flat log-probs, the baseline, context parallel, depth-first) reads the head
from :func:`lm_head` so none of them can miss one::

    logits = post * softcap(logit_scale * ((hidden_scale * h) @ W[:vocab].T + b[:vocab]))

(``softcap(z) = c * tanh(z / c)``, the identity without a cap; ``post`` is a caller's extra factor,
e.g. TRL's ``1 / temperature``.) What each architecture sets, read from the installed transformers'
``ForCausalLM.forward``:

========================================  ============================================================
Cohere, Cohere2, Cohere2-MoE, Compass     ``logit_scale = model.logit_scale`` (``logits * logit_scale``;
                                          Compass's vision model: where not None)
Aya Vision (VLM)                          ``logit_scale = text_config.logit_scale`` where its forward
                                          applies it (transformers >= 5.25; read from its source)
Granite, Granite-SWA, GraniteMoE (+SWA,   ``logit_scale = 1 / config.logits_scaling``
shared, hybrid), Granite Docling and
Granite 4 Vision (VLMs)
HyperCLOVA X (+ Vision V2)                ``logit_scale = config.logits_scaling``
Falcon-H1                                 ``logit_scale = model.model.lm_head_multiplier``
MiniCPM3                                  ``hidden_scale = 1 / config.logits_scaling``
Gemma 2/3/3n/4, VaultGemma, NanoChat,     ``softcap = config.final_logit_softcapping``
Beam
RecurrentGemma                            ``softcap = config.logits_soft_cap``
xLSTM                                     ``softcap = config.output_logit_soft_cap``
Inkling (+ its VLM, inkling_mm_model)     ``hidden_scale = 1 / config.logits_mup_width_multiplier``;
                                          ``vocab = config.unpadded_vocab_size`` (the rows kept)
Inkling2, Inkling2-Loop                   ``softcap = config.final_logit_softcapping``
Muse Glimmer (VLM)                        ``logit_scale = text_config.output_multiplier``;
                                          ``softcap = text_config.final_logit_softcapping``
Dory                                      ``weight = W * (lm_head.logit_scale * logit_scale_factor)[:, None]``
                                          (a learned logit scale per vocabulary entry)
========================================  ============================================================

Any other architecture on the allow-list (:mod:`treetrain.models.support`) has the plain
projection; one that is not on it is refused before it runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from treetrain.models.classes import class_entry, own_class

__all__ = ["LMHead", "lm_head", "unwrap"]


@dataclass(frozen=True)
class LMHead:
    """The output head of a causal LM: ``weight [V, H]``, ``bias [V]`` or None, and its transforms.

    ``hidden_scale`` multiplies the hidden rows before the projection, ``logit_scale`` the logits
    after it (before the cap), ``softcap`` caps them (``softcap * tanh(z / softcap)``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    hidden_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full logits ``[N, V]`` of ``hidden [N, H]`` in HF's order of operations (a reference,
        for small inputs: the scoring paths use the chunked :func:`treetrain.logprobs.head_logprobs`)."""
        z = nn.functional.linear(hidden * self.hidden_scale, self.weight, self.bias) * self.logit_scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def unwrap(model: nn.Module) -> nn.Module:
    """The ``...ForCausalLM`` inside a ``peft.PeftModel`` (LoRA), else ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _cfg(model: nn.Module):
    return model.config.get_text_config()


def _logit_scale_attr(model: nn.Module) -> dict:
    return {"logit_scale": float(model.logit_scale)}


def _optional_logit_scale_attr(model: nn.Module) -> dict:
    return {} if model.logit_scale is None else _logit_scale_attr(model)


@cache
def _forward_reads(cls: type, name: str) -> bool:
    """Whether ``cls.forward``'s source mentions ``name`` (unreadable source: assume it does, as the
    newest transformers' forwards of the types asked about do)."""
    try:
        return name in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True


def _text_logit_scale_if_applied(model: nn.Module) -> dict:
    """Aya Vision: ``logits * text_config.logit_scale`` where its forward applies it (transformers
    5.25 added it; 5.24 and older return the plain projection)."""
    cls = own_class(model, {"AyaVisionForConditionalGeneration"})
    return {"logit_scale": float(_cfg(model).logit_scale)} if _forward_reads(cls, "logit_scale") else {}


def _divide_by_logits_scaling(model: nn.Module) -> dict:
    return {"logit_scale": 1.0 / float(_cfg(model).logits_scaling)}


def _multiply_by_logits_scaling(model: nn.Module) -> dict:
    return {"logit_scale": float(_cfg(model).logits_scaling)}


def _falcon_h1(model: nn.Module) -> dict:
    return {"logit_scale": float(model.model.lm_head_multiplier)}


def _hidden_divided_by_logits_scaling(model: nn.Module) -> dict:
    return {"hidden_scale": 1.0 / float(_cfg(model).logits_scaling)}


def _inkling(model: nn.Module) -> dict:
    cfg = _cfg(model)
    out = {"hidden_scale": 1.0 / float(cfg.logits_mup_width_multiplier)}
    rows = cfg.unpadded_vocab_size
    if rows is not None and rows < model.lm_head.weight.shape[0]:  # the model drops the logits past it
        out["weight"] = model.lm_head.weight[:rows]
        out["bias"] = None if model.lm_head.bias is None else model.lm_head.bias[:rows]
    return out


def _per_token_logit_scale(model: nn.Module) -> dict:
    """Dory: ``logits * logit_scale * logit_scale_factor``, a learned scale per vocabulary entry, is
    the projection with each weight row scaled (its gradient reaches ``logit_scale`` through it)."""
    head = model.lm_head
    return {"weight": head.weight * (head.logit_scale * head.logit_scale_factor)[:, None]}


def _muse_glimmer(model: nn.Module) -> dict:
    cfg = _cfg(model)
    return {"logit_scale": float(cfg.output_multiplier), "softcap": float(cfg.final_logit_softcapping)}


def _final_softcap(model: nn.Module) -> dict:
    return {"softcap": getattr(_cfg(model), "final_logit_softcapping", None) or None}


# ForCausalLM (or vision-language ForConditionalGeneration) class name -> the transforms its forward
# applies (checked against transformers 5.24 and 5.25)
_TRANSFORMS: dict[str, Callable[[nn.Module], dict]] = {
    "CohereForCausalLM": _logit_scale_attr,
    "Cohere2ForCausalLM": _logit_scale_attr,
    "CohereCompassForConditionalGeneration": _optional_logit_scale_attr,
    "Cohere2MoeForCausalLM": _logit_scale_attr,
    "CohereCompassForCausalLM": _logit_scale_attr,
    "GraniteForCausalLM": _divide_by_logits_scaling,
    "GraniteSWAForCausalLM": _divide_by_logits_scaling,
    "GraniteMoeForCausalLM": _divide_by_logits_scaling,
    "GraniteMoeSWAForCausalLM": _divide_by_logits_scaling,
    "GraniteMoeSharedForCausalLM": _divide_by_logits_scaling,
    "GraniteMoeHybridForCausalLM": _divide_by_logits_scaling,
    "GraniteDoclingForConditionalGeneration": _divide_by_logits_scaling,
    "Granite4VisionForConditionalGeneration": _divide_by_logits_scaling,
    "HyperCLOVAXForCausalLM": _multiply_by_logits_scaling,
    "HyperCLOVAXVisionV2ForConditionalGeneration": _multiply_by_logits_scaling,
    "FalconH1ForCausalLM": _falcon_h1,
    "MiniCPM3ForCausalLM": _hidden_divided_by_logits_scaling,
    "Gemma2ForCausalLM": _final_softcap,
    "Gemma3ForCausalLM": _final_softcap,
    "VaultGemmaForCausalLM": _final_softcap,
    "NanoChatForCausalLM": _final_softcap,
    "BeamForCausalLM": _final_softcap,
    "Gemma3nForCausalLM": _final_softcap,
    "Gemma4ForCausalLM": _final_softcap,
    "Gemma4UnifiedForCausalLM": _final_softcap,
    "RecurrentGemmaForCausalLM": lambda model: {"softcap": float(_cfg(model).logits_soft_cap)},
    "xLSTMForCausalLM": lambda model: {"softcap": _cfg(model).output_logit_soft_cap},
    "InklingForCausalLM": _inkling,
    "DoryForCausalLM": _per_token_logit_scale,
    "Inkling2ForCausalLM": _final_softcap,
    "Inkling2LoopForCausalLM": _final_softcap,
    # vision-language models: their ForConditionalGeneration's own forward (checked against 5.24 and 5.25)
    "Gemma3nForConditionalGeneration": _final_softcap,
    "Gemma4ForConditionalGeneration": _final_softcap,
    "Gemma4UnifiedForConditionalGeneration": _final_softcap,
    "AyaVisionForConditionalGeneration": _text_logit_scale_if_applied,
    "MuseGlimmerForConditionalGeneration": _muse_glimmer,
    "MuseSparkForConditionalGeneration": _muse_glimmer,
    "InklingForConditionalGeneration": _inkling,
    "Inkling2ForConditionalGeneration": _final_softcap,
    "Inkling2LoopForConditionalGeneration": _final_softcap,
}


def _transforms(model: nn.Module) -> dict:
    """The transforms of ``model``'s class; looks through subclasses (FSDP2 wraps a model's class
    in an ``FSDP<Name>`` subclass)."""
    transform = class_entry(model, _TRANSFORMS)
    return {} if transform is None else transform(model)


def lm_head(model: nn.Module) -> LMHead:
    """The exact head of a ``...ForCausalLM`` (or a PEFT model around one).

    Raises ``ValueError`` when the output embedding is not an ``nn.Linear`` (a head treetrain
    cannot chunk).
    """
    model = unwrap(model)
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"output head must be an nn.Linear, got {type(head).__name__}")
    return LMHead(**{"weight": head.weight, "bias": head.bias, **_transforms(model)})
