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
from dataclasses import dataclass

import torch
from torch import nn

from treetrain.integrations.flat import FlatBatch, FlatPart, score_packed, score_parts
from treetrain.models.hf import prepare_model
from treetrain.models.moe import record_router_logits

__all__ = ["REQUEST_KWARG", "WrappedScores", "install_tree_scoring", "wrapped_flat_logprobs", "wrapped_score"]

REQUEST_KWARG = "treetrain_request"


class _Request:
    """One tree forward, carried to the causal LM as a keyword argument. With ``record_router``, the MoE
    router logits of the forward are kept in ``router_logits`` (``[T, experts]`` per MoE layer)."""

    def __init__(self, part: FlatPart, record_router: bool = False, **options):
        self.part, self.options, self.record_router = part, options, record_router
        self.router_logits: list[torch.Tensor] | None = None

    def run(self, causal_lm: nn.Module, inner=None, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``inner``: the forward the request replaced; ``args``/``kwargs``: the call's other arguments
        (unused here; requests of other trainers read them)."""
        if not self.record_router:
            return score_packed(causal_lm, self.part.packed, self.part.needed, **self.options)
        with record_router_logits(causal_lm) as logits:
            out = score_packed(causal_lm, self.part.packed, self.part.needed, **self.options)
        self.router_logits = list(logits)
        return out


def install_tree_scoring(causal_lm: nn.Module) -> None:
    """Let ``causal_lm.forward`` take ``treetrain_request=`` (idempotent); registers tree attention.

    A request is any object with ``run(causal_lm, inner, *args, **kwargs)``: it gets the model, the
    forward it replaces and the call's other arguments, and returns what the call returns.
    """
    if getattr(causal_lm, "_treetrain_scoring", False):
        return
    prepare_model(causal_lm)
    inner = causal_lm.forward

    @functools.wraps(type(causal_lm).forward)  # generate() validates kwargs against this signature
    def forward(self, *args, **kwargs):
        request = kwargs.pop(REQUEST_KWARG, None)
        if request is None:
            return inner(*args, **kwargs)
        return request.run(self, inner, *args, **kwargs)

    causal_lm.forward = types.MethodType(forward, causal_lm)
    causal_lm._treetrain_scoring = True


@dataclass(eq=False)
class WrappedScores:
    """What :func:`wrapped_score` ran: the batch as a tree, its forwards (``parts``), and per part the
    log-probs and entropies ``[T_k]`` and, when recorded, the router logits (``[T_k, E]`` per layer)."""

    batch: FlatBatch
    parts: list[FlatPart]
    logps: list[torch.Tensor]
    ents: list[torch.Tensor]
    router_logits: list[list[torch.Tensor]] | None


def wrapped_score(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int | None = None,
    score_mask: torch.Tensor | None = None,
    max_tokens: int | None = None,
    autocast=None,
    record_router: bool = False,
    images=None,
    **options,
) -> WrappedScores:
    """Each tree forward of the padded batch called as ``model(...)`` (see :func:`wrapped_flat_logprobs`);
    ``record_router`` also keeps every forward's MoE router logits; ``images``: per row its
    ``ImageInput``s (vision-language models). ``options``: ``score_packed``'s."""
    requests = []

    def score(part):
        requests.append(_Request(part, record_router=record_router, **options))
        with autocast() if autocast is not None else contextlib.nullcontext():
            return model(**{REQUEST_KWARG: requests[-1]})

    batch, parts, logps, ents = score_parts(
        input_ids, attention_mask, logits_to_keep, score_mask, max_tokens, score, model, images
    )
    routers = [r.router_logits for r in requests] if record_router else None
    return WrappedScores(batch, parts, logps, ents, routers)


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
    s = wrapped_score(
        model, input_ids, attention_mask, logits_to_keep=logits_to_keep, score_mask=score_mask,
        max_tokens=max_tokens, autocast=autocast, temperature=temperature, entropy=return_entropy,
        backend=backend, chunk=chunk, head_fp32=head_fp32,
    )  # fmt: skip
    out = s.batch.scatter(s.parts, s.logps, device=input_ids.device)
    return out, s.batch.scatter(s.parts, s.ents, device=input_ids.device)
