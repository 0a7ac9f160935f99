"""Tree scoring through a model's wrappers (DDP, accelerate, PEFT), for trainers that hold one.

A wrapper hooks its own ``forward``: DDP prepares the gradient all-reduce there, accelerate enters
autocast, PEFT switches adapters. Calling the inner ``...ForCausalLM`` directly would skip them
(under DDP: gradients silently not synchronized). So the tree forward is *requested* through the
outermost model: :func:`install_tree_scoring` patches the causal LM's ``forward`` (on the instance,
as TRL patches its fused head) to take a ``treetrain_request=`` keyword, which every wrapper passes
down unchanged; without it, the forward is what it was (generation is unchanged).

    install_tree_scoring(model)                    # once, on the unwrapped ...ForCausalLM
    ddp = DistributedDataParallel(model)
    logp = wrapped_flat_logprobs(ddp, input_ids, attention_mask, logits_to_keep=C)
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

from treetrain.integrations.flat import FlatPart, score_packed, score_parts
from treetrain.models.hf import prepare_model

__all__ = ["REQUEST_KWARG", "install_tree_scoring", "wrapped_flat_logprobs"]

REQUEST_KWARG = "treetrain_request"


class _Request:
    """One tree forward, carried to the causal LM as a keyword argument."""

    def __init__(self, part: FlatPart, **options):
        self.part, self.options = part, options

    def run(self, causal_lm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return score_packed(causal_lm, self.part.packed, self.part.needed, **self.options)


def install_tree_scoring(causal_lm: nn.Module) -> None:
    """Let ``causal_lm.forward`` take ``treetrain_request=`` (idempotent); registers tree attention."""
    if getattr(causal_lm, "_treetrain_scoring", False):
        return
    prepare_model(causal_lm)
    inner = causal_lm.forward

    @functools.wraps(type(causal_lm).forward)  # generate() validates kwargs against this signature
    def forward(self, *args, **kwargs):
        request = kwargs.pop(REQUEST_KWARG, None)
        if request is None:
            return inner(*args, **kwargs)
        return request.run(self)

    causal_lm.forward = types.MethodType(forward, causal_lm)
    causal_lm._treetrain_scoring = True


def wrapped_flat_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int | None = None,
    score_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    max_tokens: int | None = None,
    backend: str | None = None,
    chunk: int | None = None,
    head_fp32: bool = False,
    autocast=None,
):
    """:func:`treetrain.integrations.flat.flat_logprobs`, each tree forward called as ``model(...)``.

    ``model``: the outermost wrapper, whose causal LM had :func:`install_tree_scoring`. ``autocast``:
    a context-manager factory entered around each call (e.g. ``accelerator.autocast``). Same results,
    same layout; the entropies are all zeros unless ``return_entropy``.
    """
    options = dict(temperature=temperature, entropy=return_entropy, backend=backend, chunk=chunk,
                   head_fp32=head_fp32)  # fmt: skip

    def score(part):
        with autocast() if autocast is not None else contextlib.nullcontext():
            return model(**{REQUEST_KWARG: _Request(part, **options)})

    batch, parts, logps, ents = score_parts(
        input_ids, attention_mask, logits_to_keep, score_mask, max_tokens, score
    )
    out = batch.scatter(parts, logps, device=input_ids.device)
    return out, batch.scatter(parts, ents, device=input_ids.device)
