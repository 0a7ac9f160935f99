"""``TreeGRPOTrainer`` and ``TreeRLOOTrainer``: TRL's online trainers, every scoring forward a prefix tree.

TRL scores a generation batch three ways (policy with gradients, old policy when
``num_iterations > 1``, reference when ``beta > 0``), all through
``_get_per_token_logps_and_entropies``, each time as a padded ``[B, P + C]`` batch in which the
``G`` completions of a prompt recompute that prompt ``G`` times. These subclasses override only that
method: the rows become one tree (the prompt once, each completion a branch; multi-turn rows from
``tools=[...]``, ``environment_factory=...`` or a ``rollout_func`` branch where their histories
part, so turns shared by several rows also run once), which runs once and returns TRL's
``[B, logits_to_keep]`` layout, so every TRL loss type, metric and mask downstream runs unchanged.

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

import warnings

import numpy as np
import torch
import trl
from torch import nn
from trl import GRPOTrainer, RLOOTrainer

from treetrain.integrations.wrapped import WrappedScores, install_tree_scoring, wrapped_score
from treetrain.models.head import unwrap
from treetrain.models.moe import balancing_loss, load_balancing_stats

__all__ = ["TESTED_TRL", "TreeGRPOTrainer", "TreeRLOOTrainer", "check_trl", "router_aux_loss"]

TESTED_TRL = "1.16.0"


def check_trl(cls_name: str, base: type, method: str) -> None:
    """Refuse a TRL without the method the subclass overrides (else it would silently be TRL's own);
    warn on a version other than the tested one."""
    if not hasattr(base, method):
        raise ImportError(
            f"{cls_name} needs trl=={TESTED_TRL} (this trl {trl.__version__} has no "
            f"{base.__name__}.{method} to override): pip install 'treetrain[trl]'"
        )
    if trl.__version__ != TESTED_TRL:
        warnings.warn(
            f"{cls_name} is tested with trl=={TESTED_TRL}, this is trl {trl.__version__}: check that its "
            f"losses match trl.{base.__name__}'s (tests/test_integrations_trl*.py)",
            stacklevel=3,
        )


def refuse_untreeable(cls_name: str, model: nn.Module, args) -> None:
    """Features the tree forward cannot run: a clear error naming each, never a silent fallback."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(
            f"{cls_name}: prompt-learning PEFT adapters (prefix/prompt tuning) add virtual tokens "
            "the tree forward does not run; use an adapter such as LoRA, or the TRL trainer"
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            f"{cls_name}: use_liger_kernel=True (Liger's kernels and fused loss) is not supported by the "
            "tree forward (Liger patches the model's layers and loss, which the tree forward is not "
            "verified with); set use_liger_kernel=False or use the TRL trainer"
        )


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


def router_aux_loss(scores: WrappedScores, chunk_rows: int, top_k: int) -> torch.Tensor:
    """The MoE load-balancing loss TRL's scoring returns, from the tree forwards' router logits.

    TRL runs the ``B`` rows in chunks of ``chunk_rows`` rows (one chunk unless it passes a
    ``batch_size``); each chunk's forward gives transformers' ``load_balancing_loss_func`` over the
    chunk's real (attention-mask) tokens, and TRL returns the mean over chunks. Here each distinct tree
    token is weighted, per chunk, by the number of the chunk's rows through it: the same sums, so the
    same loss and gradient. Sums over several tree forwards (a token budget) add.
    """
    batch = scores.batch
    B = batch.shape[0]
    chunk_of_path = batch.rows // chunk_rows
    n_chunks = -(-B // chunk_rows)
    acc: list[tuple | None] = [None] * n_chunks
    for part, logits in zip(scores.parts, scores.router_logits):
        packed = part.packed
        paths = packed.trees[0].path_ids  # batch path ids of the part's paths
        pos_chunk = torch.from_numpy(np.repeat(chunk_of_path[paths], packed.path_lengths.cpu().numpy()))
        chunks = torch.unique(pos_chunk)
        # [chunks, T]: each distinct token weighted by the chunk's paths through it
        weights = torch.zeros(len(chunks), packed.num_tokens, dtype=torch.long)
        at = (torch.searchsorted(chunks, pos_chunk), packed.path_index.cpu())
        weights.index_put_(at, torch.ones_like(pos_chunk), accumulate=True)
        for c, stats in zip(chunks.tolist(), zip(*load_balancing_stats(logits, weights, top_k))):
            acc[c] = stats if acc[c] is None else tuple(a + s for a, s in zip(acc[c], stats))
    for c, stats in enumerate(acc):
        if stats is None:
            raise ValueError(
                f"MoE aux loss: rows {c * chunk_rows}..{min(B, (c + 1) * chunk_rows) - 1} have no real "
                "tokens (the padded forward's loss would be NaN)"
            )
    return torch.stack([balancing_loss(*stats) for stats in acc]).mean()


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

        ``batch_size`` (rows per forward in TRL, to bound memory) becomes a token budget of
        ``batch_size * L`` distinct tokens per tree forward; a longer row still runs whole. The aux
        loss is TRL's mean over its ``batch_size``-row chunks all the same.
        """
        name = type(self).__name__
        given = sorted(k for k, v in multimodal.items() if v is not None)
        unknown = sorted(set(multimodal) - set(_MULTIMODAL))
        if unknown:
            raise TypeError(f"{name}: unexpected scoring arguments {unknown} (tested with TRL {TESTED_TRL})")
        if given:
            raise ValueError(
                f"{name} scores text-only batches; got {given}. Vision-language models (image inputs) are "
                f"not supported yet: use trl.{self._trl_base.__name__} for them."
            )
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
    included); two optional keywords: ``tree_backend`` and ``tree_chunk``. Text-only causal LMs:
    vision inputs and Liger kernels raise a ``ValueError``.
    """

    _trl_base = GRPOTrainer


class TreeRLOOTrainer(_TreeScoring, RLOOTrainer):
    """``trl.RLOOTrainer`` whose policy, old-policy and reference scoring run as prefix trees (the
    ``G`` samples of a prompt share it). Same constructor and ``RLOOConfig``, plus ``tree_backend`` and
    ``tree_chunk``; text-only causal LMs."""

    _trl_base = RLOOTrainer
