"""FLOP accounting of what each mode computes, on hand-written trees with the numbers spelled out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treetrain import TrajectoryTree
from treetrain.trees.flops import (
    CostModel,
    Work,
    baseline_work,
    flop_bound,
    layer_kinds,
    mixer_cost,
    tree_work,
)
from treetrain.trees.partition import partition

from .reference import tiny_model

# paths [A B C D], [A B E F], [A G H] (DFS A B C D E F G H, positions 0 1 2 3 2 3 1 2)
PATHS = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]
# a tiny shape: attention projections 8 * 4 * (2*2 + 2*1) = 192, MLP 3 * 8 * 16 = 384 per layer
COST = CostModel.from_config(
    SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        vocab_size=10,
        num_attention_heads=2,
        head_dim=4,
        num_key_value_heads=1,
        intermediate_size=16,
    )
)


def test_cost_model_of_a_tiny_shape():
    assert COST.linear == 2 * 2 * (192 + 384) == 2304  # 2 FLOPs per multiply-add, 2 layers
    assert COST.per_pair == 4 * 2 * 4 * 2 == 64  # QK^T and PV, 2 heads x 4 dims, 2 layers
    assert COST.head == 2 * 8 * 10 == 160
    assert COST.per_token == 2304 + 160


def test_linear_flops_are_twice_the_decoder_matmul_parameters():
    model = tiny_model("qwen3", dtype=torch.float32)
    cost = CostModel.from_config(model.config)
    layers = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n)
    assert cost.linear == 2.0 * layers
    assert cost.head == 2.0 * model.lm_head.weight.numel()


def test_work_of_every_target_trained():
    tree = TrajectoryTree.from_paths(PATHS)
    # tree: 8 tokens; pairs sum(position + 1) = 1+2+3+4+3+4+2+3 = 22; targets: every DFS token but
    # the root's first (B C D E F G H) = 7
    assert tree_work([tree]) == Work(tokens=8, pairs=22, targets=7)
    # baseline: 4 + 4 + 3 = 11 tokens; pairs 10 + 10 + 6 = 26; targets 3 + 3 + 2 = 8
    assert baseline_work([tree]) == Work(tokens=11, pairs=26, targets=8)
    assert Work(8, 22, 7).flops(COST) == 3 * (8 * 2304 + 22 * 64 + 7 * 160) == 62880
    assert Work(11, 26, 8).flops(COST) == 3 * (11 * 2304 + 26 * 64 + 8 * 160) == 84864
    assert flop_bound([tree], COST) == pytest.approx(84864 / 62880)


def test_head_counts_only_trained_targets():
    # path 0 trains C D, path 1 trains B E F, path 2 trains nothing
    masks = [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0]]
    tree = TrajectoryTree.from_paths(PATHS, loss_masks=masks)
    # tree: distinct trained targets C D B E F = 5 (B trained by path 1 only, scored once)
    assert tree_work([tree]) == Work(tokens=8, pairs=22, targets=5)
    # baseline: 2 + 3 + 0 = 5 targets, each path scores its own
    assert baseline_work([tree]) == Work(tokens=11, pairs=26, targets=5)
    # a prefix both paths train on is scored once by the tree, twice by the baseline
    both = TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4]], loss_masks=[[0, 1, 1], [0, 1, 1]])
    assert tree_work([both]).targets == 3 and baseline_work([both]).targets == 4


def test_partitioned_tree_counts_its_parts():
    tree = TrajectoryTree.from_paths(PATHS)
    # capacity 6: parts {P0, P1} = A B C D E F (6 tokens) and {P2} = A G H (3 tokens)
    parts = partition(tree, 6)
    assert sorted(p.num_tokens for p in parts) == [3, 6]
    # pairs 1+2+3+4+3+4 = 17 and 1+2+3 = 6; targets 5 and 2
    assert tree_work(parts) == Work(tokens=9, pairs=23, targets=7)
    assert flop_bound([tree], COST, capacity=6) == pytest.approx(84864 / Work(9, 23, 7).flops(COST))


def test_recomputed_head_and_checkpointing_are_priced():
    # a head that recomputes its logits in backward: one more forward head matmul per such target
    assert Work(8, 22, 7, recomputed=7).flops(COST) == Work(8, 22, 7).flops(COST) + 7 * 160
    # checkpointing: every layer's forward again but the MLP's down projection (2 * 8 * 16 per
    # layer), and every attention pair again
    assert COST.checkpointed == 2 * 2 * (192 + 2 * 8 * 16) == 1792
    assert Work(8, 22, 7).flops(COST, checkpointing=True) == Work(8, 22, 7).flops(COST) + 8 * 1792 + 22 * 64
    assert Work(8, 22, 7).forward_flops(COST) == 8 * 2304 + 22 * 64 + 7 * 160
    # treetrain's head keeps a call's logits up to the budget, all or none
    from treetrain.trees.flops import recomputed_targets

    assert recomputed_targets([10, 30], vocab=10, keep_bytes=800) == 30  # 400 bytes kept, 1,200 not


def _config(model_type, **kw):
    return SimpleNamespace(model_type=model_type, hidden_size=8, num_attention_heads=2, head_dim=4, **kw)


def test_recurrent_and_pair_flops_per_family():
    """Each family's formula (trees/flops.py: 5 per state element and token, 7 for the delta rule,
    2 for RG-LRU's add-only write; conv 2 * channels * width) on hand-worked shapes; per pair
    2 * heads * (d_qk + d_v) per attention layer (here 2 * 2 * (4 + 4) = 32)."""
    hybrid = ["linear_attention", "full_attention"]
    gdn = _config(
        "qwen3_5_text", layer_types=hybrid, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=3,
    )  # fmt: skip
    # 4 value heads of an [8, 4] state: 7 * 4 * 8 * 4 = 896; conv over q, k (2 * 2 * 8) and v (4 * 4)
    assert mixer_cost(gdn) == (896 + 2 * (32 + 16) * 3, 32)
    kda = _config(
        "kimi_linear", layer_types=["linear_attention"] * 2 + ["full_attention"], linear_num_heads=2,
        linear_head_dim=4, linear_conv_kernel_dim=4, qk_nope_head_dim=3, qk_rope_head_dim=1, v_head_dim=4,
    )  # fmt: skip
    # per KDA layer 7 * 2 * 4 * 4 = 224 plus a conv over q, k, v (3 * 8 channels, width 4) = 192
    assert mixer_cost(kda) == (2 * (224 + 192), 32)
    nemotron = _config(
        "nemotron_h", layer_types=["linear_attention", "mlp", "full_attention"], mamba_num_heads=2,
        mamba_head_dim=4, ssm_state_size=8, n_groups=1, conv_kernel=4,
    )  # fmt: skip
    assert layer_kinds(nemotron) == ["mamba2", "none", "attention"]
    assert mixer_cost(nemotron) == (5 * 2 * 4 * 8 + 2 * (8 + 2 * 8) * 4, 32)  # 320 + 192
    jamba = _config("jamba", layer_types=hybrid, mamba_expand=2, mamba_d_state=4, mamba_d_conv=3)
    assert mixer_cost(jamba) == (5 * 16 * 4 + 2 * 16 * 3, 32)  # inner 16 channels x state 4: 320 + 96
    mamba = _config("mamba", num_hidden_layers=2, intermediate_size=16, state_size=4, conv_kernel=3)
    assert layer_kinds(mamba) == ["mamba", "mamba"] and mixer_cost(mamba) == (2 * 416, 0)
    assert mixer_cost(_config("lfm2", layer_types=["conv", "full_attention"], conv_L_cache=3)) == (48, 32)
    assert mixer_cost(_config("minimax", layer_types=hybrid)) == (5 * 2 * 4 * 4, 32)
    gemma = _config(
        "recurrent_gemma", layer_types=["linear_attention", "linear_attention", "sliding_attention"],
        lru_width=8, conv1d_width=4,
    )  # fmt: skip
    assert mixer_cost(gemma) == (2 * (2 * 8 + 2 * 8 * 4), 32)  # two blocks of 16 + 64
    rwkv = _config("rwkv", num_hidden_layers=2, attention_hidden_size=8)
    assert mixer_cost(rwkv) == (2 * 5 * 2 * 8, 0)  # numerator and denominator per channel
    xlstm = _config(
        "xlstm", num_hidden_layers=2, embedding_dim=8, num_heads=2, qk_dim_factor=0.5, v_dim_factor=1
    )
    assert mixer_cost(xlstm) == (2 * 5 * 2 * (2 * 4 + 2), 0)  # per head C [2, 4] and n [2]
    qwen3 = _config("qwen3", num_hidden_layers=3)
    assert mixer_cost(qwen3) == (0, 3 * 32)
    with pytest.raises(ValueError, match="no FLOP formula for its 'linear_attention' layers"):
        layer_kinds(_config("bamba", layer_types=hybrid))


def test_recurrent_flops_count_per_token():
    cost = CostModel(COST.linear, COST.per_pair, COST.head, recurrent=100.0)
    assert cost.per_token == 2304 + 100 + 160
    assert Work(8, 22, 7).flops(cost) == 3 * (8 * 2404 + 22 * 64 + 7 * 160)


def test_vision_work_counts_each_distinct_image_once_in_the_tree():
    """Paths ``1 P P 2`` (image a), ``1 P P 3`` (a again), ``4 P P`` (b): the tree encodes a and b
    once each, the baseline a twice and b once; 4 patches each (a 28 x 28 image of 14-pixel patches),
    16 patch pairs each. With a tower of 2 FLOPs per patch and 1 per pair the vision FLOPs are
    ``2 * (2 * 4 + 16)`` for the tree and ``3 * (2 * 4 + 16)`` for the baseline."""
    import torch

    from treetrain.trees.flops import CostModel, Work, baseline_work, image_patches, tree_work
    from treetrain.trees.images import ImageInput

    a = ImageInput({"pixel_values": torch.zeros(1, 3, 28, 28)}, 2, 9)
    b = ImageInput({"pixel_values": torch.ones(1, 3, 28, 28)}, 2, 9)
    tree = TrajectoryTree.from_paths([[1, 9, 9, 2], [1, 9, 9, 3], [4, 9, 9]], images=[[a], [a], [b]])
    assert image_patches(a) == 4
    t, base = tree_work([tree]), baseline_work([tree])
    assert (t.images, t.vision_tokens, t.vision_pairs) == (2, 8, 32)
    assert (base.images, base.vision_tokens, base.vision_pairs) == (3, 12, 48)
    vision_only = CostModel(0.0, 0.0, vision_linear=2.0, vision_pair=1.0)
    assert Work(vision_tokens=8, vision_pairs=32).forward_flops(vision_only) == 2 * (2 * 4 + 16)
    assert base.forward_flops(vision_only) == 3 * (2 * 4 + 16)


def test_image_patches_of_every_layout():
    import torch

    from treetrain.trees.flops import image_patches
    from treetrain.trees.images import ImageInput

    def patches(**tensors):
        return image_patches(ImageInput(tensors, 1, 9), patch=4)

    assert patches(pixel_values=torch.zeros(24, 96), image_grid_thw=torch.tensor([[1, 4, 6]])) == 24
    assert patches(pixel_values=torch.zeros(1, 3, 3, 32, 32)) == 3 * 64  # three crops
    mask = torch.tensor([[True] * 6 + [False] * 10])
    assert patches(pixel_values=torch.zeros(1, 16, 48), pixel_attention_mask=mask) == 6  # padded patches
    pos = torch.full((1, 16, 2), -1)
    pos[0, :5] = 0
    assert patches(pixel_values=torch.zeros(1, 16, 48), image_position_ids=pos) == 5
    stack = torch.zeros(1, 2, 3, 16, 16)  # sub-images with a pixel mask
    assert patches(pixel_values=stack, pixel_attention_mask=torch.ones(1, 2, 16, 16)) == 32


def test_cost_model_reads_the_vision_tower():
    from types import SimpleNamespace

    from treetrain.trees.flops import CostModel

    text = dict(hidden_size=8, num_hidden_layers=1, vocab_size=10, num_attention_heads=2)
    vision = SimpleNamespace(hidden_size=32, depth=2, intermediate_size=64, hidden_act="silu", patch_size=14)
    c = CostModel.from_config(SimpleNamespace(**text, text_config=None, vision_config=vision))
    assert c.vision_linear == 2 * 2 * (4 * 32 * 32 + 3 * 32 * 64) + 2 * 3 * 14 * 14 * 32  # + patch embedding
    assert (c.vision_pair, c.vision_patch) == (4 * 32 * 2, 14)
    assert CostModel.from_config(SimpleNamespace(**text)).vision_linear == 0.0


KNOBS = {  # the patching options away from Qwen-VL's defaults (3 channels, 2 frames, 2 x 2 merge)
    "defaults": dict(spatial_merge_size=2, temporal_patch_size=2),
    "1 frame, 4 channels, no merge": dict(spatial_merge_size=1, temporal_patch_size=1, in_channels=4),
}


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_cost_is_what_the_tower_computes(family, knobs):
    """``vision_linear`` per patch and ``vision_pair`` per (patch, patch) pair of an image equal the
    matmul and attention FLOPs torch's FlopCounterMode counts in a tiny tower's forward: patch
    embedding, every layer (full attention), the mergers (Qwen3-VL's deepstack ones too); two images of
    different sizes; the patching's defaults and options away from them."""

    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=14) | KNOBS[knobs]
    vision |= {
        "qwen2_vl": dict(embed_dim=32, hidden_size=24, mlp_ratio=2),  # MLP 64, not gated
        "qwen2_5_vl": dict(
            intermediate_size=48, out_hidden_size=24, window_size=56, fullatt_block_indexes=[0, 1]
        ),
        "qwen3_vl": dict(intermediate_size=48, out_hidden_size=24, deepstack_visual_indexes=[0],
                         num_position_embeddings=16),
    }[family]  # fmt: skip
    text = dict(hidden_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, vocab_size=64)  # fmt: skip
    cls = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[family]
    counted, expected = _tower_flops(cls, text, vision)
    assert counted == expected


def _tower_flops(cls: str, text: dict, vision: dict) -> tuple[int, float]:
    """(FLOPs torch's FlopCounterMode counts in the tower's forward over two images of 24 and 4
    patches, what ``CostModel`` prices for them)."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from treetrain.trees.flops import CostModel

    cfg = getattr(transformers, f"{cls}Config")(text_config=text, vision_config=vision)
    cfg._attn_implementation = "eager"  # attention as matmuls, which the counter counts (not CPU SDPA)
    tower = getattr(transformers, f"{cls}Model")(cfg).visual.eval()
    grids = torch.tensor([[1, 4, 6], [1, 2, 2]])  # two images: 24 and 4 patches
    patches = [int(g.prod()) for g in grids]
    v = cfg.vision_config
    pixels = torch.randn(sum(patches), v.in_channels * v.temporal_patch_size * 14 * 14)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grids)
    cost = CostModel.from_config(cfg)
    return counter.get_total_flops(), sum(patches) * cost.vision_linear + sum(
        n * n for n in patches
    ) * cost.vision_pair


def test_windowed_vision_layers_are_priced_at_full_attention():
    """Qwen2.5-VL's windowed layers (here layer 0 of 2, windows of 2 x 2 merged tokens) attend fewer
    pairs than the price, which counts every layer at full attention: an upper count, the same in
    both modes. The linear work is exact, so the gap is only the pairs the windows skip."""
    text = dict(hidden_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, vocab_size=64)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, intermediate_size=48, out_hidden_size=24)  # fmt: skip
    full, priced_full = _tower_flops(
        "Qwen2_5_VL", text, vision | dict(window_size=56, fullatt_block_indexes=[0, 1])
    )
    windowed, priced = _tower_flops(
        "Qwen2_5_VL", text, vision | dict(window_size=56, fullatt_block_indexes=[1])
    )
    assert priced == priced_full == full  # the price ignores windows; with none it is exact
    assert windowed < full  # the windows skip pairs
    pair = 4 * 32  # one layer's attention FLOPs per (patch, patch) pair
    assert (full - windowed) % pair == 0 and 0 < (full - windowed) // pair < 24 * 24 + 4 * 4
