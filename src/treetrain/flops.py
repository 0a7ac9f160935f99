"""Training FLOPs of a tree and of its per-path baseline: the honest bound on tree speedup.

Linear layers cost per token; attention costs per allowed (query, key) pair. A token at path
position ``i`` attends ``i + 1`` keys in the tree and in the baseline alike, so::

    tree pairs     = sum over distinct tokens of (position + 1)
    baseline pairs = sum over paths of L (L + 1) / 2

Training = forward + backward ~ 3 x forward. Example: paths ``[A B C]``, ``[A B D]``: tree tokens
4, pairs 1+2+3+3 = 9; baseline tokens 6, pairs 12; with attention negligible the bound is 6/4.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .tree import TrajectoryTree


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs per token (linear layers + LM head) and per allowed attention pair."""

    per_token: float
    per_pair: float

    @classmethod
    def from_config(cls, config) -> CostModel:
        c = getattr(config, "text_config", None) or config
        h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or h // heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        inter = getattr(c, "intermediate_size", 4 * h)
        types = getattr(c, "layer_types", None) or ["full_attention"] * layers
        n_attn = sum(t == "full_attention" for t in types)
        attn_proj = h * head_dim * (2 * heads + 2 * kv)  # q, o and k, v projections
        mlp = 3 * h * inter
        per_token = 2 * (layers * (attn_proj + mlp) + h * vocab)
        per_pair = 4 * heads * head_dim * n_attn  # QK^T and PV, 2 FLOPs per multiply-add
        return cls(float(per_token), float(per_pair))


# A Qwen3-0.6B-shaped model: the reference shape when no model is given.
QWEN3_0_6B = CostModel.from_config(
    SimpleNamespace(
        hidden_size=1024,
        num_hidden_layers=28,
        vocab_size=151936,
        num_attention_heads=16,
        head_dim=128,
        num_key_value_heads=8,
        intermediate_size=3072,
    )
)


def tree_pairs(tree: TrajectoryTree) -> int:
    return int((tree.positions + 1).sum())


def baseline_pairs(tree: TrajectoryTree) -> int:
    L = tree.path_lengths
    return int((L * (L + 1) // 2).sum())


def train_flops(tokens: int, pairs: int, cost: CostModel) -> float:
    return 3.0 * (tokens * cost.per_token + pairs * cost.per_pair)


def flop_bound(trees: list[TrajectoryTree], cost: CostModel = QWEN3_0_6B) -> float:
    """Baseline training FLOPs / tree training FLOPs over a batch of trees."""
    base = sum(train_flops(t.num_path_tokens, baseline_pairs(t), cost) for t in trees)
    tree = sum(train_flops(t.num_tokens, tree_pairs(t), cost) for t in trees)
    return base / tree


def tree_cost(tree: TrajectoryTree, cost: CostModel = QWEN3_0_6B) -> float:
    """Training FLOPs of one tree forward+backward (for balancing work across ranks)."""
    return train_flops(tree.num_tokens, tree_pairs(tree), cost)


def token_bound(trees: list[TrajectoryTree]) -> float:
    return float(np.sum([t.num_path_tokens for t in trees]) / np.sum([t.num_tokens for t in trees]))
