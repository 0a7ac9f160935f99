"""``TreeDPOTrainer`` and ``TreeRewardTrainer``: TRL's preference trainers with each pair as one tree.

TRL batches a preference pair as two padded rows, ``[chosen rows; rejected rows]``, each the prompt
followed by its completion, so the prompt runs twice (and twice more for DPO's reference). Here the
rows of a batch become one prefix tree: the prompt once, chosen and rejected as its branches (and any
prompts the pairs share, once). Only the forward changes: the subclasses pass a request to the model
call TRL already makes, and the model answers it from the tree in exactly the output TRL expects:

- DPO calls its fused LM head, ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``,
  for the policy and the reference; :class:`FusedTreeRequest` returns the same ``FusedCausalLMOutput``
  (per-token log-probs, entropy, mean logit, top-1 flag, WPO's ``log_sum_sq_probs``, the MoE aux loss)
  computed by TRL's own chunked LM-head kernel on the tree's hidden states. Every DPO loss type, the
  WPO weights, ``ld_alpha`` and every metric stay TRL's.
- The reward trainer calls its sequence classifier, ``model(input_ids, attention_mask)``;
  :class:`RewardTreeRequest` returns the score head at the token transformers pools (the rightmost
  non-pad token of each row), read from the tree's hidden states.

Swap the class, change nothing else::

    trainer = TreeDPOTrainer(model="Qwen/Qwen3-0.6B", args=DPOConfig(...), train_dataset=pairs)
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from trl import DPOTrainer, RewardTrainer
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, FusedCausalLMOutput

from treetrain.integrations.flat import FlatBatch
from treetrain.integrations.flat_images import IMAGE_FIELDS, TOKEN_TYPE_FIELDS, row_images
from treetrain.integrations.trl.shared import check_trl, refuse_untreeable, router_aux_loss
from treetrain.integrations.wrapped import REQUEST_KWARG, WrappedScores, install_tree_scoring
from treetrain.models.head import lm_head, unwrap
from treetrain.models.hf import tree_forward
from treetrain.models.moe import record_router_logits

__all__ = ["FusedTreeRequest", "RewardTreeRequest", "TreeDPOTrainer", "TreeRewardTrainer"]


def _refuse_kwargs(name: str, args: tuple, kwargs: dict, known: set[str]) -> None:
    given = sorted(k for k, v in kwargs.items() if v is not None and k not in known)
    if args or given:
        raise ValueError(
            f"{name}: the tree forward takes input_ids, attention_mask and (DPO) image inputs only; got "
            f"{given or f'{len(args)} positional arguments'} (these model inputs are not supported: use the "
            "TRL trainer for them)"
        )


class FusedTreeRequest:
    """Answer TRL's fused-LM-head call from a prefix tree of the batch's rows (other calls: unchanged).

    ``outputs``: the per-token fields to compute (TRL's names); ``backend``: the tree attention
    kernel (default by device). The head is TRL's ``add_fused_lm_head`` as ``DPOTrainer`` installs
    it: temperature 1, no float32 cast.
    """

    def __init__(self, name: str, outputs: tuple[str, ...], backend: str | None = None):
        self.name, self.outputs, self.backend = name, outputs, backend

    def run(self, lm, inner, *args, fused_lm_head=False, labels=None, shift_labels=None, **kwargs):
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return inner(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if shift_labels is not None:
            raise ValueError(
                f"{self.name}: pre-shifted labels (context or sequence parallelism) are not supported by the "
                "tree forward"
            )
        input_ids, attention_mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask", None)
        router = kwargs.pop("output_router_logits", None)
        kwargs.pop("use_cache", None)
        image_fields = {k: kwargs.pop(k) for k in IMAGE_FIELDS + TOKEN_TYPE_FIELDS if k in kwargs}
        _refuse_kwargs(self.name, args, kwargs, set())
        try:  # DPO's collator gives no images per row: the placeholders say whose they are
            images = row_images(lm, input_ids, attention_mask, **image_fields)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        text = lm.config.get_text_config()
        router = bool(getattr(text, "output_router_logits", False) if router is None else router)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = labels[:, 1:] != -100  # [B, L-1]: TRL's label mask, label j+1 scored at column j
        real = attention_mask.bool()
        if (mask & ~(real[:, 1:] & real[:, :-1])).any() or (
            labels[:, 1:][mask] != input_ids[:, 1:][mask]
        ).any():
            raise ValueError(
                f"{self.name}: every scored label must be the input token itself, on a real token whose "
                "previous token is real too (the tree scores a row's tokens given its own real prefix)"
            )
        score_mask = torch.zeros_like(real)
        score_mask[:, 1:] = mask
        batch = FlatBatch.build(input_ids, attention_mask, score_mask=score_mask, model=lm, images=images)
        parts = batch.parts()
        fields, routers = [], []
        for part in parts:
            with record_router_logits(lm) if router else contextlib.nullcontext() as logits:
                hidden = tree_forward(lm, part.packed, self.backend)
            routers.append(list(logits) if router else None)
            fields.append(self._head(lm, hidden, part))
        names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # the kernel's order
        out = {
            name: batch.scatter(parts, [f[i] for f in fields], device=input_ids.device)[:, 1:]
            if fields and fields[0][i] is not None
            else None
            for i, name in enumerate(names)
        }
        if out["log_probs"] is None:  # no row has a real token
            out["log_probs"] = torch.zeros(mask.shape, device=input_ids.device)
        if out["is_top1"] is not None:
            out["is_top1"] = out["is_top1"].bool()
        log_probs = out["log_probs"]
        loss = -log_probs.sum() / (
            mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        )
        aux = None
        if router:
            aux = router_aux_loss(
                WrappedScores(batch, parts, [], [], routers), input_ids.size(0), text.num_experts_per_tok
            )
            loss = loss + getattr(text, "router_aux_loss_coef", 0.0) * aux
        return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux, **out)

    def _head(self, lm: nn.Module, hidden: torch.Tensor, part) -> list[torch.Tensor | None]:
        """TRL's chunked LM-head kernel at the part's targets: 5 fields ``[T]`` (None if not asked)."""
        packed = part.packed.to(hidden.device)
        targets = torch.nonzero((packed.prev >= 0) & part.needed.to(hidden.device))[:, 0]
        head = lm_head(lm)  # the exact head, as TRL's kernel takes it: one scale before the cap
        assert head.bias is None or head.hidden_scale == 1.0, "a hidden scale with a bias: not one scale"
        rows = hidden.index_select(0, packed.prev[targets]).to(head.weight.device)
        per_target = ChunkedLogProbFunction.apply(
            rows, head.weight, head.bias, packed.input_ids[targets], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
            head.softcap, head.hidden_scale * head.logit_scale, self.outputs,
        )  # fmt: skip
        T = packed.num_tokens
        return [None if x is None else x.new_zeros(T).index_copy(0, targets, x) for x in per_target]


class RewardTreeRequest:
    """Answer a sequence classifier's call (``model(input_ids, attention_mask)``) from a prefix tree:
    the score head at the token transformers pools, the rightmost token that is not ``pad_token_id``."""

    def __init__(self, name: str, backend: str | None = None):
        self.name, self.backend = name, backend

    def run(self, model, inner, *args, **kwargs):
        input_ids, attention_mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask", None)
        kwargs.pop("use_cache", None)
        kwargs.pop("margin", None)  # TRL's pair margin rides along in the model call; the model ignores it
        _refuse_kwargs(self.name, args, kwargs, set())
        head = getattr(model, "score", None)
        if not isinstance(head, nn.Module):
            raise ValueError(f"{self.name}: expected a ...ForSequenceClassification with a `score` head")
        B, L = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pad = model.config.get_text_config().pad_token_id
        if pad is None:
            last = torch.full((B,), L - 1, device=input_ids.device)
        else:
            last = (torch.arange(L, device=input_ids.device) * (input_ids != pad)).argmax(-1)
        rows = torch.arange(B, device=input_ids.device)
        if not attention_mask[rows, last].bool().all():
            raise ValueError(f"{self.name}: a row's pooled token (its last non-pad token) is padding")
        score_mask = torch.zeros_like(attention_mask, dtype=torch.bool)
        score_mask[rows, last] = True
        batch = FlatBatch.build(input_ids, attention_mask, score_mask=score_mask, model=model)
        if batch.out_pos.size < B:
            raise ValueError(f"{self.name}: every row needs at least two real tokens")
        pooled = None
        for part in batch.parts():
            hidden = tree_forward(model, part.packed, self.backend)
            logits = head(hidden.index_select(0, torch.from_numpy(part.dfs).to(hidden.device)))
            if pooled is None:
                pooled = logits.new_zeros(B * L, logits.shape[-1])
            pooled = pooled.index_copy(0, torch.from_numpy(batch.out_pos[part.sel]).to(logits.device), logits)
        return SequenceClassifierOutputWithPast(logits=pooled.view(B, L, -1)[rows, last])


class TreeDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` whose policy and reference forwards run each batch's pairs as one prefix tree.

    Same constructor and ``DPOConfig``, plus ``tree_backend``; causal LMs and the vision-language models
    treetrain runs exactly, with TRL's image datasets (each row's images read from its placeholders:
    :func:`treetrain.integrations.flat_images.row_images`); Liger kernels raise a ``ValueError``.
    """

    def __init__(self, *args, tree_backend: str | None = None, **kwargs):
        check_trl(type(self).__name__, DPOTrainer, "_compute_loss")
        self.tree_backend = tree_backend
        super().__init__(*args, **kwargs)
        refuse_untreeable(type(self).__name__, self.model, self.args)

    def _tree_request(self) -> FusedTreeRequest:
        """Installed on first use (TRL may score the reference inside its constructor, before
        ``__init__`` returns: ``precompute_ref_log_probs``)."""
        install_tree_scoring(unwrap(self.model))
        if self.ref_model is not None:
            install_tree_scoring(unwrap(self.ref_model))
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
        outputs += ("log_sum_sq_probs",) if getattr(self, "use_weighting", False) else ()
        return FusedTreeRequest(type(self).__name__, outputs, backend=self.tree_backend)

    def _compute_loss(self, model, inputs, return_outputs):
        return super()._compute_loss(model, {**inputs, REQUEST_KWARG: self._tree_request()}, return_outputs)

    def compute_ref_log_probs(self, model, inputs):
        return super().compute_ref_log_probs(model, {**inputs, REQUEST_KWARG: self._tree_request()})


class TreeRewardTrainer(RewardTrainer):
    """``trl.RewardTrainer`` whose forward runs each batch's chosen and rejected sequences as one prefix
    tree. Same constructor and ``RewardConfig``, plus ``tree_backend``."""

    def __init__(self, *args, tree_backend: str | None = None, **kwargs):
        check_trl(type(self).__name__, RewardTrainer, "compute_loss")
        super().__init__(*args, **kwargs)
        refuse_untreeable(type(self).__name__, self.model, self.args)
        install_tree_scoring(unwrap(self.model))
        self._tree_request = RewardTreeRequest(type(self).__name__, tree_backend)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {**inputs, REQUEST_KWARG: self._tree_request}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
