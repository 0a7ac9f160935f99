"""Training FLOPs of what each mode computes: the tree and its per-path baseline.

Three kinds of work, counted for each mode from what it actually runs (:class:`Work`):

- ``tokens``: tokens through the decoder's linear layers (every matmul of every layer) and, in a
  hybrid, through its recurrent layers' state updates and causal convolutions (``CostModel.recurrent``,
  :func:`mixer_cost`: a cost per token like the linear layers', so it pulls the bound toward the
  token ratio);
- ``pairs``: allowed (query, key) attention pairs; a token at path position ``i`` attends ``i + 1``
  keys in the tree and in the baseline alike;
- ``targets``: targets scored by the LM head. Both modes score only targets some path trains on
  (``loss_masks``; all targets when a tree has none): the tree each distinct (context, target)
  once, the baseline once per path through it;
- ``vision_tokens`` and ``vision_pairs``: a vision-language model's tower runs every patch of an
  image (``CostModel.vision_linear`` each: its patch embedding, layers and merger) and attends each patch to
  every patch of its image (``vision_pair`` each): the tree once per distinct image of each part it
  runs, the baseline once per image of every path (:func:`image_patches`).

Training = forward + backward = 3 x forward (model FLOPs: the head's recomputation in backward,
the elementwise work outside the recurrences and the padding of a padded scan are not counted; a
vision tower's patch embedding, whose pixels need no gradient, is counted at 3 x too: 2 x is what runs).
Example, paths ``[A B C]``, ``[A B D]``, every target trained::

    tree      tokens 4 (A B C D)   pairs 1+2+3+3 = 9    targets 3 (B, C, D)
    baseline  tokens 6             pairs 6+6 = 12       targets 4 (B C, B D)

The bound on the tree's speedup is ``baseline FLOPs / tree FLOPs`` of those counts; a tree larger
than a micro-batch is partitioned and its parts' recomputed prefixes are counted
(:func:`tree_work` of the parts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from treetrain.trees.tree import TrajectoryTree

__all__ = [
    "QWEN3_0_6B",
    "CostModel",
    "Work",
    "baseline_pairs",
    "baseline_work",
    "flop_bound",
    "image_patches",
    "layer_kinds",
    "mixer_cost",
    "recomputed_targets",
    "token_bound",
    "train_flops",
    "tree_cost",
    "tree_pairs",
    "tree_work",
]


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs per decoder token (``linear``), per allowed attention pair (``per_pair``), per
    target scored by the LM head (``head = 2 * hidden * vocab``) and per token in the recurrent
    layers' state updates and convolutions (``recurrent``, :func:`mixer_cost`; 0 without any).
    ``checkpointed``: the linear FLOPs per token that activation checkpointing recomputes in backward
    (torch's non-reentrant checkpoint stops once backward has what it needs: every matmul of a layer
    but the MLP's down projection, whose output backward does not use)."""

    linear: float
    per_pair: float
    head: float = 0.0
    recurrent: float = 0.0
    checkpointed: float = 0.0
    vision_linear: float = 0.0  # per patch through the vision tower's layers (0: no tower)
    vision_pair: float = 0.0  # per (patch, patch) pair of one image, summed over the tower's layers
    vision_patch: int = 14  # pixels per patch side: an image's patch count from its pixels

    @property
    def per_token(self) -> float:
        """A token that runs the decoder and is scored: ``linear + recurrent + head``."""
        return self.linear + self.recurrent + self.head

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
        linear = 2 * layers * (attn_proj + mlp)
        per_pair = 4 * heads * head_dim * n_attn  # QK^T and PV, 2 FLOPs per multiply-add
        checkpointed = 2 * layers * (attn_proj + 2 * h * inter)  # all but the down projection
        vision = _vision_costs(getattr(config, "vision_config", None))
        return cls(
            float(linear), float(per_pair), float(2 * h * vocab), checkpointed=float(checkpointed), **vision
        )


def _vision_costs(v) -> dict:
    """A vision tower's forward FLOPs per patch (its patch embedding, the attention projections and MLP
    of every layer, and Qwen-VL's patch mergers) and per (patch, patch) pair, and its patch size; ``{}``
    without a tower.

    Example: Qwen2.5-VL's (width 1280, 32 layers, MLP 3420 gated, 3 x 2 x 14 x 14 pixels a patch, a
    2 x 2 merger 5120 -> 5120 -> 2048): per patch ``2 * 32 * (4 * 1280^2 + 3 * 1280 * 3420) = 1.26e9``
    in the layers, ``2 * 1176 * 1280 = 3.0e6`` in the embedding and ``2 * (5120^2 + 5120 * 2048) / 4 =
    1.8e7`` in the merger; per pair ``4 * 1280 * 32 = 163840``. (The layers dominate at full depth;
    in benchmarks/gui_agent.py's one-layer tower, merging to 512, the merger is a quarter of the work.)"""
    if v is None:
        return {}

    def get(*names, default=None):
        return next((getattr(v, n) for n in names if isinstance(getattr(v, n, None), (int, float))), default)

    width = get("embed_dim", "hidden_size")  # Qwen2-VL: embed_dim the tower's, hidden_size the merger's
    layers = get("depth", "num_hidden_layers", "n_layers", default=0)
    inter = get("intermediate_size") or int(width * get("mlp_ratio", default=4))
    gated = 3 if "silu" in str(getattr(v, "hidden_act", "")) else 2
    patch = getattr(v, "patch_size", 14)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    pixels = get("in_channels", "num_channels", "in_chans", default=3) * get("temporal_patch_size", default=1)
    per_patch = 2 * layers * (4 * width * width + gated * width * inter) + 2 * pixels * patch * patch * width
    merge = get("spatial_merge_size")
    out = get("out_hidden_size") or (get("hidden_size") if hasattr(v, "embed_dim") else None)
    if merge and out:  # Qwen-VL's mergers: merge x merge patches -> one token (Qwen3-VL: deepstack too)
        hidden = width * merge * merge
        mergers = 1 + len(getattr(v, "deepstack_visual_indexes", None) or ())
        per_patch += mergers * 2 * (hidden * hidden + hidden * out) // (merge * merge)
    return {
        "vision_linear": float(per_patch),
        "vision_pair": float(4 * width * layers),
        "vision_patch": int(patch),
    }


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


# ---- hybrids: which mixer each layer has, and what it costs --------------------------------------

# model type -> the family of its recurrent layers (those of config.layer_types that are not
# attention, MLP or MoE; every layer where a config has no layer_types)
RECURRENT_FAMILY = dict.fromkeys(
    ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid"), "gdn"
)
RECURRENT_FAMILY |= dict.fromkeys(("kimi_linear",), "kda")
RECURRENT_FAMILY |= dict.fromkeys(("lfm2", "lfm2_moe"), "shortconv")
RECURRENT_FAMILY |= dict.fromkeys(("nemotron_h", "mamba2"), "mamba2")
RECURRENT_FAMILY |= dict.fromkeys(("jamba", "mamba", "falcon_mamba"), "mamba")
RECURRENT_FAMILY |= {"minimax": "lightning", "recurrent_gemma": "rglru", "rwkv": "rwkv", "xlstm": "mlstm"}
_ATTENTION = ("full_attention", "sliding_attention", "attention")
_NO_MIXER = ("mlp", "moe")


def layer_kinds(config) -> list[str]:
    """The sequence mixer of each decoder layer: ``"attention"``, ``"none"`` (an MLP-only layer, as
    Nemotron-H has) or the model's recurrent family (:data:`RECURRENT_FAMILY`).

    Example: a Qwen3.5 config with ``layer_types = [linear_attention, full_attention]`` ->
    ``["gdn", "attention"]``; RWKV (no layer types) -> ``["rwkv"] * num_hidden_layers``.
    """
    c = getattr(config, "text_config", None) or config
    family = RECURRENT_FAMILY.get(getattr(c, "model_type", None))
    types = getattr(c, "layer_types", None)
    if not types:
        return [family or "attention"] * c.num_hidden_layers
    kinds = ["attention" if t in _ATTENTION else "none" if t in _NO_MIXER else family for t in types]
    if None in kinds:
        other = types[kinds.index(None)]
        kind = getattr(c, "model_type", "?")
        raise ValueError(
            f"model type {kind!r}: no FLOP formula for its {other!r} layers; "
            f"add its family to treetrain.trees.flops.RECURRENT_FAMILY ({', '.join(RECURRENT_FAMILY)})"
        )
    return kinds


def _first(c, *names: str):
    return next(getattr(c, n) for n in names if getattr(c, n, None) is not None)


def _state_flops(c, family: str) -> float:
    """Forward FLOPs per token of one recurrent layer of ``family``: its state update in the recurrent
    form, plus its causal conv (``2 * channels * width``).

    A state element costs 5 per token: the decay (1 multiply), the write (an outer product added:
    2) and the read (a contraction: 2); the delta rule (GDN, KDA) reads the state once more to erase
    (2 more: 7). RG-LRU's state is written by an add (2 in all); RWKV's per channel state is a
    numerator and a denominator (2 elements); Mamba's per-channel decays cost as Mamba2's scalar ones.
    """
    if family in ("gdn", "kda"):
        if family == "gdn":
            hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
            dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        else:
            hk = hv = c.linear_num_heads
            dk = dv = c.linear_head_dim
        return 7.0 * hv * dk * dv + 2.0 * (2 * hk * dk + hv * dv) * c.linear_conv_kernel_dim
    if family == "mamba2":
        h, p = _first(c, "mamba_num_heads", "num_heads"), _first(c, "mamba_head_dim", "head_dim")
        n, g = _first(c, "ssm_state_size", "state_size"), c.n_groups
        return 5.0 * h * p * n + 2.0 * (h * p + 2 * g * n) * c.conv_kernel
    if family == "mamba":
        if c.model_type == "jamba":
            d, n, w = c.mamba_expand * c.hidden_size, c.mamba_d_state, c.mamba_d_conv
        else:
            d, n, w = c.intermediate_size, c.state_size, c.conv_kernel
        return 5.0 * d * n + 2.0 * d * w
    if family == "shortconv":
        return 2.0 * c.hidden_size * c.conv_L_cache
    if family == "lightning":
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 5.0 * c.num_attention_heads * d * d
    if family == "rglru":
        return 2.0 * c.lru_width + 2.0 * c.lru_width * c.conv1d_width
    if family == "rwkv":
        return 5.0 * 2 * (c.attention_hidden_size or c.hidden_size)
    if family == "mlstm":
        h = c.num_heads
        dk, dv = int(c.embedding_dim * c.qk_dim_factor) // h, int(c.embedding_dim * c.v_dim_factor) // h
        return 5.0 * h * (dk * dv + dk)
    raise ValueError(f"no state FLOP formula for the recurrent family {family!r}")


def _pair_flops(c) -> float:
    """Forward FLOPs per allowed pair in one attention layer: ``2 * heads * (d_qk + d_v)`` (QK^T and
    PV); multi-head latent attention (Kimi Linear) with its own query/key and value widths."""
    heads = c.num_attention_heads
    if getattr(c, "qk_nope_head_dim", None):
        d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    else:
        d_qk = d_v = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2.0 * heads * (d_qk + d_v)


def mixer_cost(config) -> tuple[float, float]:
    """``(recurrent, per_pair)``: forward FLOPs per token of every recurrent layer's state update and
    conv (:func:`_state_flops`), and per allowed (query, key) pair summed over the attention layers.

    Example: Qwen3.5 with 2 key / 4 value heads of 64, conv width 4, layers ``[gdn, attention]`` with
    4 heads of 64: recurrent ``7 * 4 * 64 * 64 + 2 * (2 * 128 + 256) * 4 = 118784``, per pair
    ``2 * 4 * 128 = 1024``.
    """
    c = getattr(config, "text_config", None) or config
    kinds = layer_kinds(c)
    recurrent = sum(_state_flops(c, k) for k in kinds if k not in ("attention", "none"))
    attention = kinds.count("attention")
    return float(recurrent), attention * _pair_flops(c) if attention else 0.0


@dataclass(frozen=True)
class Work:
    """What one mode computes: decoder tokens, attention pairs, LM-head targets, and the targets
    whose logits backward recomputes (one more head matmul each)."""

    tokens: int = 0
    pairs: int = 0
    targets: int = 0
    recomputed: int = 0
    vision_tokens: int = 0
    vision_pairs: int = 0
    images: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def flops(self, cost: CostModel, checkpointing: bool = False) -> float:
        """Training FLOPs (3 x forward, plus the recomputed head matmuls; with ``checkpointing`` the
        decoder layers' forward recomputed in backward: ``cost.checkpointed`` per token, the
        recurrent layers' state updates and convs, and every attention pair again)."""
        recompute = self.recomputed * cost.head
        if checkpointing:
            recompute += self.tokens * (cost.checkpointed + cost.recurrent) + self.pairs * cost.per_pair
        return 3.0 * self.forward_flops(cost) + recompute

    def forward_flops(self, cost: CostModel) -> float:
        """FLOPs of the forward alone (no-grad scoring: a reference model, old log-probs)."""
        per_token = cost.linear + cost.recurrent
        vision = self.vision_tokens * cost.vision_linear + self.vision_pairs * cost.vision_pair
        return self.tokens * per_token + self.pairs * cost.per_pair + self.targets * cost.head + vision


def _trained(tree: TrajectoryTree, p: int) -> np.ndarray:
    """Path ``p``'s targets that train: bool ``[len(p) - 1]``."""
    masks = tree.fields.get("loss_masks")
    n = int(tree.path_lengths[p]) - 1
    return np.ones(n, dtype=bool) if masks is None else np.asarray(masks[p])[1:] > 0


def tree_pairs(tree: TrajectoryTree) -> int:
    return int((tree.positions + 1).sum())


def baseline_pairs(tree: TrajectoryTree) -> int:
    L = tree.path_lengths
    return int((L * (L + 1) // 2).sum())


def tree_targets(tree: TrajectoryTree) -> int:
    """Distinct DFS tokens some path trains on as a target (what the tree's head scores)."""
    hit = [tree.path_index[p][1:][_trained(tree, p)] for p in range(tree.num_paths)]
    return int(np.unique(np.concatenate(hit)).size) if hit else 0


def path_targets(tree: TrajectoryTree) -> int:
    """Trained targets summed over paths (what the baseline's head scores)."""
    return int(sum(_trained(tree, p).sum() for p in range(tree.num_paths)))


def image_patches(image, patch: int = 14) -> int:
    """Patches the vision tower runs for one image (``trees.images.ImageInput``), read from its
    tensors: a ``(t, h, w)`` grid (Qwen-style), the valid entries of a padded patch sequence (a patch
    mask or positions), flattened patch rows, or pixels ``[..., C, H, W]`` cut into ``patch``-pixel
    squares (every crop of a tiled image).

    >>> import torch
    >>> from treetrain.trees.images import ImageInput
    >>> image_patches(ImageInput({"pixel_values": torch.zeros(1, 3, 28, 42)}, 6, 9), patch=14)
    6
    """
    t = image.tensors
    for grid in ("image_grid_thw", "video_grid_thw"):
        if grid in t:
            return int(t[grid].prod(-1).sum())
    if "image_position_ids" in t:
        return int((t["image_position_ids"][..., 0] >= 0).sum())
    pixels = t.get("pixel_values", t.get("pixel_values_videos"))
    mask = t.get("pixel_attention_mask")
    if mask is not None and pixels is not None and pixels.dim() == 3 and mask.dim() == 2:  # padded patches
        return int(mask.bool().sum())
    if pixels is None:
        return 0
    if pixels.dim() <= 3:  # flattened patches [(1,) N, D]
        return int(pixels.shape[-2])
    crops = int(np.prod(pixels.shape[:-3]))
    return crops * (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)


def _image_work(images, patch: int) -> Work:
    n = [image_patches(im, patch) for im in images]
    return Work(vision_tokens=sum(n), vision_pairs=sum(k * k for k in n), images=len(n))


def _tree_images(tree: TrajectoryTree) -> tuple:
    return () if tree.image_table is None else tree.image_table.images


def _path_images(tree: TrajectoryTree) -> list:
    return [im for ims in tree.fields.get("images") or () for im in ims]


def tree_work(parts: Sequence[TrajectoryTree], patch: int = 14) -> Work:
    """The tree mode's work over the trees (or partition parts) it runs, each once (each distinct
    image once per part)."""
    return sum(
        (
            Work(t.num_tokens, tree_pairs(t), tree_targets(t)) + _image_work(_tree_images(t), patch)
            for t in parts
        ),
        Work(),
    )


def baseline_work(trees: Sequence[TrajectoryTree], patch: int = 14) -> Work:
    """The per-path baseline's work: every path alone (every image of every path encoded)."""
    return sum(
        (
            Work(t.num_path_tokens, baseline_pairs(t), path_targets(t)) + _image_work(_path_images(t), patch)
            for t in trees
        ),
        Work(),
    )


def train_flops(tokens: int, pairs: int, cost: CostModel) -> float:
    """Training FLOPs of ``tokens`` decoder tokens all scored by the head and ``pairs`` pairs."""
    return 3.0 * (tokens * cost.per_token + pairs * cost.per_pair)


def flop_bound(
    trees: Sequence[TrajectoryTree], cost: CostModel = QWEN3_0_6B, capacity: int | None = None
) -> float:
    """Baseline training FLOPs / tree training FLOPs over a batch of trees, each mode's head on its
    trained targets; with ``capacity``, the tree side runs the partition's parts."""
    parts = list(trees)
    if capacity is not None:
        from treetrain.trees.partition import partition

        parts = [p for t in trees for p in partition(t, capacity)]
    patch = cost.vision_patch
    return baseline_work(trees, patch).flops(cost) / tree_work(parts, patch).flops(cost)


def tree_cost(tree: TrajectoryTree, cost: CostModel = QWEN3_0_6B) -> float:
    """Training FLOPs of one tree forward+backward, every token scored (an upper bound, for
    balancing work across ranks)."""
    return train_flops(tree.num_tokens, tree_pairs(tree), cost)


def recomputed_targets(targets_per_call, vocab: int, keep_bytes: int, bytes_per_logit: int = 4) -> int:
    """Targets whose logits a chunked head recomputes in backward: those of every head call whose
    ``targets x vocab`` logits exceed ``keep_bytes`` (treetrain's head keeps them all or none,
    ``treetrain.logprobs.LOGITS_KEEP_BYTES``).

    >>> recomputed_targets([1000, 3000], vocab=151936, keep_bytes=2**30)  # 0.6 GB kept, 1.8 GB not
    3000
    """
    return int(sum(n for n in targets_per_call if n * vocab * bytes_per_logit > keep_bytes))


def token_bound(trees: Sequence[TrajectoryTree]) -> float:
    return float(np.sum([t.num_path_tokens for t in trees]) / np.sum([t.num_tokens for t in trees]))
