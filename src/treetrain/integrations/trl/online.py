"""``TreeGRPOTrainer`` and ``TreeRLOOTrainer``: TRL's online trainers, every scoring forward a prefix tree.

TRL scores a generation batch three ways (policy with gradients, old policy when
``num_iterations > 1``, reference when ``beta > 0``), all through
``_get_per_token_logps_and_entropies``, each time as a padded ``[B, P + C]`` batch in which the
``G`` completions of a prompt recompute that prompt ``G`` times. These subclasses override only that
method: the rows become one tree (the prompt once, each completion a branch; multi-turn rows from
``tools=[...]``, ``environment_factory=...`` or a ``rollout_func`` branch where their histories
part, so turns shared by several rows also run once), which runs once and returns TRL's
``[B, logits_to_keep]`` layout, so every TRL loss type, metric and mask downstream runs unchanged.

Vision-language policies: TRL passes the batch's image tensors (``pixel_values``, ``image_grid_thw``,
``num_images``, ``image_sizes``, token types, ...) to the same method; they are split into each row's
images (:func:`treetrain.integrations.flat_images.row_images`) and the tree encodes each distinct
image once (the ``G`` rows of a prompt carry the same image).

MoE policies: when TRL asks for the router load-balancing loss (``compute_aux_loss``: the config has
``output_router_logits`` and ``router_aux_loss_coef != 0``), the tree forward records the router
logits and returns the loss TRL's padded forwards give (:func:`router_aux_loss`); TRL then adds
``router_aux_loss_coef * aux`` and logs ``aux_loss`` as it does for its own.

Swap the class, change nothing else::

    trainer = TreeGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward, args=GRPOConfig(...),
                              train_dataset=dataset)

Tested against TRL 1.16.0 (the ``trl`` extra pins it): the override relies on that version's
``_get_per_token_logps_and_entropies`` (arguments, 3-value return). The tree forward is requested
through the model TRL passes in (``treetrain.integrations.wrapped``), so accelerate's autocast,
DDP's gradient sync and PEFT's adapter switching (the reference of a LoRA policy) stay in effect.
"""

from __future__ import annotations

from trl import GRPOTrainer, RLOOTrainer

from treetrain.integrations.flat_images import IMAGE_FIELDS, TOKEN_TYPE_FIELDS, row_images
from treetrain.integrations.trl.shared import TESTED_TRL, check_trl, refuse_untreeable, router_aux_loss
from treetrain.integrations.wrapped import install_tree_scoring, wrapped_score
from treetrain.models.head import unwrap

__all__ = ["TreeGRPOTrainer", "TreeRLOOTrainer"]


# TRL's image arguments of the scoring method (1.16): split per image per row, one tree of the rows
_MULTIMODAL = {*IMAGE_FIELDS, *TOKEN_TYPE_FIELDS, "num_images", "num_tiles"} - {"batch_num_images"}


class _TreeScoring:
    """The override shared by TRL's online trainers (GRPO, RLOO): same constructor, plus two optional
    keywords: ``tree_backend`` (attention kernel, default by device) and ``tree_chunk`` (LM-head rows
    per chunk)."""

    _trl_base: type

    def __init__(self, *args, tree_backend: str | None = None, tree_chunk: int | None = None, **kwargs):
        name = type(self).__name__
        check_trl(name, self._trl_base, "_get_per_token_logps_and_entropies")
        super().__init__(*args, **kwargs)
        refuse_untreeable(name, self.model, self.args)
        self.tree_backend, self.tree_chunk = tree_backend, tree_chunk
        install_tree_scoring(unwrap(self.model))
        if self.ref_model is not None:
            install_tree_scoring(unwrap(self.ref_model))

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's contract: ``(logps [B, K], entropies [B, K] or None, aux_loss or None)``.

        ``multimodal``: TRL's batched image inputs (``pixel_values``, ``image_grid_thw``, ``num_images``,
        ``image_sizes``, ``token_type_ids``, ...), split into each row's images
        (:func:`treetrain.integrations.flat_images.row_images`); a prompt's image is encoded once.

        ``batch_size`` (rows per forward in TRL, to bound memory) becomes a token budget of
        ``batch_size * L`` distinct tokens per tree forward; a longer row still runs whole. The aux
        loss is TRL's mean over its ``batch_size``-row chunks all the same.
        """
        name = type(self).__name__
        unknown = sorted(set(multimodal) - _MULTIMODAL)
        if unknown:
            raise TypeError(f"{name}: unexpected scoring arguments {unknown} (tested with TRL {TESTED_TRL})")
        try:
            images = row_images(self.model, input_ids, attention_mask, **multimodal)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        s = wrapped_score(
            model,
            input_ids,
            attention_mask,
            logits_to_keep=logits_to_keep,
            max_tokens=None if batch_size is None else batch_size * input_ids.size(1),
            autocast=self.accelerator.autocast,
            record_router=compute_aux_loss,
            temperature=self.temperature,
            entropy=compute_entropy,
            backend=self.tree_backend,
            chunk=self.tree_chunk,
            head_fp32=getattr(self.args, "cast_lm_head_to_fp32", False),
            images=images,
        )
        logps = s.batch.scatter(s.parts, s.logps, device=input_ids.device)
        entropies = s.batch.scatter(s.parts, s.ents, device=input_ids.device) if compute_entropy else None
        aux = None
        if compute_aux_loss:
            top_k = self.model.config.get_text_config().num_experts_per_tok
            aux = router_aux_loss(s, batch_size or input_ids.size(0), top_k)
        return logps, entropies, aux


class TreeGRPOTrainer(_TreeScoring, GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy, old-policy and reference scoring run as prefix trees.

    Same constructor and ``GRPOConfig`` (tools, environments, rollout functions, MoE policies
    included); two optional keywords: ``tree_backend`` and ``tree_chunk``. Causal LMs and the
    vision-language models treetrain runs exactly (``models.support_vision``), with TRL's image
    datasets; Liger kernels and tile-indexed images (InternVL, LFM2-VL) raise a ``ValueError``.
    """

    _trl_base = GRPOTrainer


class TreeRLOOTrainer(_TreeScoring, RLOOTrainer):
    """``trl.RLOOTrainer`` whose policy, old-policy and reference scoring run as prefix trees (the
    ``G`` samples of a prompt share it). Same constructor and ``RLOOConfig``, plus ``tree_backend`` and
    ``tree_chunk``; causal LMs and exact vision-language models, as ``TreeGRPOTrainer``."""

    _trl_base = RLOOTrainer
