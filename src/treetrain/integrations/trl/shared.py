"""What the TRL drop-ins share: the tested TRL version and its check, the policy inside a PEFT
wrapper, the refusals of what a tree forward cannot run, and the MoE load-balancing loss from the
tree forwards' router logits (the value TRL's padded forwards give).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import trl
from torch import nn

from treetrain.integrations.wrapped import WrappedScores
from treetrain.models.moe import load_balancing_stats

__all__ = ["TESTED_TRL", "causal_lm", "check_trl", "refuse_untreeable", "router_aux_loss"]

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


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``...ForCausalLM`` inside a PEFT model (adapters injected in place), or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


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
        pos_chunk = np.repeat(chunk_of_path[paths], packed.path_lengths.cpu().numpy())
        index = packed.path_index.cpu()
        for c in np.unique(pos_chunk):
            sel = torch.from_numpy(np.flatnonzero(pos_chunk == c))
            weights = torch.bincount(index[sel], minlength=packed.num_tokens)
            stats = load_balancing_stats(logits, weights, top_k)
            acc[c] = stats if acc[c] is None else tuple(a + s for a, s in zip(acc[c], stats))
    losses = []
    for c, stats in enumerate(acc):
        if stats is None:
            raise ValueError(
                f"MoE aux loss: rows {c * chunk_rows}..{min(B, (c + 1) * chunk_rows) - 1} have no real "
                "tokens (the padded forward's loss would be NaN)"
            )
        counts, probs, rows = stats
        losses.append(probs.shape[0] * ((counts / rows) * (probs / rows)).sum())
    return torch.stack(losses).mean()
