"""``TreeGRPOTrainer``: TRL's ``GRPOTrainer`` with every scoring forward run as a prefix tree.

TRL scores a generation batch three ways (policy with gradients, old policy when
``num_iterations > 1``, reference when ``beta > 0``), all through
``GRPOTrainer._get_per_token_logps_and_entropies``, each time as a padded ``[B, P + C]`` batch in
which the ``G`` completions of a prompt recompute that prompt ``G`` times. This subclass overrides
only that method: the rows become one tree (the prompt once, each completion a branch, multi-turn
rows branching where their histories part), which runs once and returns TRL's ``[B, logits_to_keep]``
layout, so every TRL loss type, metric and mask downstream runs unchanged.

Swap the class, change nothing else::

    trainer = TreeGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward, args=GRPOConfig(...),
                              train_dataset=dataset)

Tested against TRL 1.16.0 (the ``trl`` extra pins it): the override relies on that version's
``_get_per_token_logps_and_entropies`` (arguments, 3-value return). The tree forward is requested
through the model TRL passes in (``treetrain.integrations.wrapped``), so accelerate's autocast,
DDP's gradient sync and PEFT's adapter switching (the reference of a LoRA policy) stay in effect.
"""

from __future__ import annotations

import warnings

import trl
from torch import nn
from trl import GRPOTrainer

from treetrain.integrations.wrapped import install_tree_scoring, wrapped_flat_logprobs

__all__ = ["TESTED_TRL", "TreeGRPOTrainer"]

TESTED_TRL = "1.16.0"


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``...ForCausalLM`` inside a PEFT model (adapters injected in place), or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class TreeGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy, old-policy and reference scoring run as prefix trees.

    Same constructor and ``GRPOConfig``; two optional keywords: ``tree_backend`` (attention kernel,
    default by device) and ``tree_chunk`` (LM-head rows per chunk). Text-only causal LMs; vision
    inputs and MoE router aux losses raise a ``ValueError``.
    """

    def __init__(self, *args, tree_backend: str | None = None, tree_chunk: int | None = None, **kwargs):
        if not hasattr(GRPOTrainer, "_get_per_token_logps_and_entropies"):  # else: silently TRL's own
            raise ImportError(
                f"TreeGRPOTrainer needs trl=={TESTED_TRL} (this trl {trl.__version__} has no "
                "GRPOTrainer._get_per_token_logps_and_entropies to override): pip install 'treetrain[trl]'"
            )
        if trl.__version__ != TESTED_TRL:
            warnings.warn(
                f"TreeGRPOTrainer is tested with trl=={TESTED_TRL}, this is trl {trl.__version__}: check "
                "that its losses match trl.GRPOTrainer's (tests/test_integrations_trl.py)",
                stacklevel=2,
            )
        super().__init__(*args, **kwargs)
        peft_config = getattr(self.model, "active_peft_config", None)
        if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
            raise ValueError(
                "TreeGRPOTrainer: prompt-learning PEFT adapters (prefix/prompt tuning) add virtual tokens "
                "the tree forward does not run; use an adapter such as LoRA, or trl.GRPOTrainer"
            )
        self.tree_backend, self.tree_chunk = tree_backend, tree_chunk
        install_tree_scoring(_causal_lm(self.model))
        if self.ref_model is not None:
            install_tree_scoring(_causal_lm(self.ref_model))

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

        ``batch_size`` (rows per forward in TRL, to bound memory) becomes a token budget of
        ``batch_size * L`` distinct tokens per tree forward; a longer row still runs whole.
        """
        given = sorted(k for k, v in multimodal.items() if v is not None)
        unknown = sorted(set(multimodal) - set(_MULTIMODAL))
        if unknown:
            raise TypeError(
                f"TreeGRPOTrainer: unexpected scoring arguments {unknown} (tested with TRL 1.16.0)"
            )
        if given:
            raise ValueError(
                f"TreeGRPOTrainer scores text-only batches; got {given}. Vision-language models are not "
                "supported yet: use trl.GRPOTrainer for them."
            )
        if compute_aux_loss:
            raise ValueError(
                "TreeGRPOTrainer: the MoE router aux loss (output_router_logits) is not supported yet; set "
                "model.config.output_router_logits = False or use trl.GRPOTrainer"
            )
        logps, entropies = wrapped_flat_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep=logits_to_keep,
            temperature=self.temperature,
            return_entropy=compute_entropy,
            max_tokens=None if batch_size is None else batch_size * input_ids.size(1),
            backend=self.tree_backend,
            chunk=self.tree_chunk,
            head_fp32=self.args.cast_lm_head_to_fp32,
            autocast=self.accelerator.autocast,
        )
        return logps, (entropies if compute_entropy else None), None
