"""A GUI agent's episode as a tree: screenshots in most observations, several samples per turn.

The preset: a Qwen2.5-VL-shaped model (random init) whose vision tower has Qwen2.5-VL's width and
patching (1280 wide, MLP 3420, 14-pixel patches, 2 x 2 merge, windowed and full-attention blocks)
with ``--vision-layers`` layers (Qwen2.5-VL has 32; a 2-core CPU step allows 1), and a text model of
``--hidden`` x ``--layers`` with Qwen's 151,936-token vocabulary. An episode of ``--turns`` turns:
a task prompt, then per turn a tool result carrying a screenshot of about a thousand vision tokens
(``--grid``: 62 x 64 patches = 992 tokens after the merge) and the assistant's action; per-turn
training samples with ``--samples`` actions sampled at each turn, so path (k, j) holds screenshots
1..k+1 and action j of turn k. The per-path baseline runs every path alone, its screenshots
encoded once per path; the tree encodes each screenshot once.

Both modes run one SFT training step through the library (:func:`treetrain.bench.cases.run_case`:
warm-up, interleaved repeats, best/median/spread, the machine's load and the noise verdict, the
log-prob difference between modes, live peak memory). The baseline's micro-batch budget is searched
(the tree's, the longest path, one path per forward). The FLOP bound counts the vision tower
(:func:`treetrain.trees.flops.image_patches`; every patch through every tower layer, each image's
patch pairs at full attention: an upper count for the windowed layers, the same in both modes).

Usage::

    python benchmarks/gui_agent.py --estimate          # the run's FLOPs and time on a quiet 2-core CPU
    python benchmarks/gui_agent.py --quick             # seconds: checks the code, no figure
    python benchmarks/gui_agent.py --write             # the recorded run
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    add_allocator_flag,
    estimate_line,
    machine_before,
    noise_section,
    provenance,
    result_path,
    table_head,
    use_allocator,
)
from treetrain.bench import cases as bench  # noqa: E402
from treetrain.trees.flops import CostModel, baseline_work, tree_work  # noqa: E402
from treetrain.trees.images import ImageInput  # noqa: E402
from treetrain.trees.tree import TrajectoryTree  # noqa: E402

IMAGE, VISION_START, VISION_END = 151655, 151652, 151653  # Qwen2.5-VL's token ids
QUICK = dict(vision_layers=1, vision_width=64, hidden=64, layers=1, vocab=2048, grid=(8, 8), turns=3,
             samples=2, text=8, repeats=1)  # fmt: skip
QUIET_RATE = 155e9  # FLOP/s of a training step on the quiet 2-core EPYC (treetrain bench --estimate)


def gui_model(a, dtype=torch.float32):
    """The Qwen2.5-VL-shaped model of the preset (random init, seed 0)."""
    import transformers

    heads = max(1, a.hidden // 128)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _sections(a.hidden // heads)}
    text = dict(
        vocab_size=max(a.vocab, IMAGE + 8), hidden_size=a.hidden, intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        rope_parameters=rope,
    )  # fmt: skip
    vision = dict(
        depth=a.vision_layers, hidden_size=a.vision_width, intermediate_size=int(a.vision_width * 2.67),
        num_heads=max(1, a.vision_width // 80), out_hidden_size=a.hidden, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=112, fullatt_block_indexes=[a.vision_layers - 1],
    )  # fmt: skip
    ids = dict(image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.float32).to(dtype)


def _sections(head_dim: int) -> list[int]:
    """Qwen2.5-VL's mRoPE split (16, 24, 24 of 64) for another head size."""
    half = head_dim // 2
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def screenshot(grid: tuple[int, int], seed: int, dtype) -> ImageInput:
    """A random screenshot of ``grid`` 14-pixel patches (Qwen's flattened patches, 2 frames)."""
    h, w = grid
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(h * w, 3 * 2 * 14 * 14, generator=g).to(dtype)
    return ImageInput(
        {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h, w]])}, h * w // 4, IMAGE
    )


def episode(a, dtype=torch.float32) -> TrajectoryTree:
    """Per-turn samples of one episode (see the module docstring)."""
    rng = np.random.default_rng(0)
    words = lambda n: rng.integers(100, 20000, n).tolist()  # noqa: E731
    shots = [screenshot(a.grid, 1 + k, dtype) for k in range(a.turns)]
    prefix, images, paths, path_images, masks = words(4 * a.text), [], [], [], []
    for shot in shots:
        prefix = prefix + words(a.text // 2) + [VISION_START] + [IMAGE] * shot.num_tokens + [VISION_END]
        images = images + [shot]
        for _ in range(a.samples):
            paths.append(prefix + words(a.text))
            path_images.append(list(images))
            masks.append([0] * len(prefix) + [1] * a.text)  # SFT on the sampled action
        prefix = paths[-1]  # the episode goes on from the last sample's action
    return TrajectoryTree.from_paths(paths, images=path_images, loss_masks=masks)


def case_line(r, work: dict, cost: CostModel) -> str:
    vision = CostModel(0.0, 0.0, vision_linear=cost.vision_linear, vision_pair=cost.vision_pair)
    share = work["baseline"].flops(vision) / work["baseline"].flops(cost)
    budget = "one path" if r.baseline_capacity == bench.ONE_PATH else f"{r.baseline_capacity:,} tokens"
    return (
        f"| {r.name} | {r.paths} | {work['baseline'].images} / {work['tree'].images} | {share:.0%} "
        f"| {r.speedup:.2f}x | {r.flop_bound:.2f}x | **{r.efficiency:.2f}** | {r.baseline_s:.1f} ({budget}) "
        f"| {r.tree_s:.1f} "
        f"| {r.baseline_spread:.0%} / {r.tree_spread:.0%} "
        f"| {r.baseline_live_mb:,.0f} / {r.tree_live_mb:,.0f} "
        f"| {r.max_logprob_diff:.1e} |"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--vision-layers", type=int, default=1)
    p.add_argument("--vision-width", type=int, default=1280)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--grid", type=int, nargs=2, default=(62, 64), help="patches per screenshot (h w)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--samples", type=int, default=2, help="actions sampled per turn")
    p.add_argument("--text", type=int, default=32, help="tokens of an action (a turn's text: half)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default=None)
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the code")
    p.add_argument("--estimate", action="store_true")
    p.add_argument("--write", action="store_true", help="record under benchmarks/results/")
    add_allocator_flag(p)
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    a.grid = tuple(a.grid)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    model = gui_model(a)
    cost = CostModel.from_config(model.config)
    tree = episode(a)
    capacity = tree.num_tokens
    work = {"baseline": baseline_work([tree], 14), "tree": tree_work([tree], 14)}
    vocab = model.config.get_text_config().vocab_size
    base_f, tree_f, _ = bench.case_flops([tree], capacity, cost, vocab)
    print(
        f"episode: {tree.num_paths} paths, "
        f"{tree.num_path_tokens:,} baseline / {tree.num_tokens:,} tree tokens, "
        f"images {work['baseline'].images} / {work['tree'].images}; step {base_f / 1e12:.2f} / "
        f"{tree_f / 1e12:.2f} TFLOP; FLOP bound {base_f / tree_f:.2f}x",
        flush=True,
    )
    if a.estimate:
        print(
            estimate_line(
                "gui_agent.py", argv, (a.repeats + 6.4) * (base_f + tree_f) / QUIET_RATE, QUIET_RATE
            )
        )
        return 0
    use_allocator(a)
    before = machine_before()
    rate = bench.matmul_rate(torch.float32, torch.device("cpu"), 2048)
    r = bench.run_case(
        f"GUI agent, {a.turns} turns x {a.samples} samples",
        model, None, [tree], capacity, a.repeats, a.backend, cost, rate, False,
        baseline_capacities=(int(tree.path_lengths.max()), bench.ONE_PATH),
    )  # fmt: skip
    head = table_head(
        ["case", "paths", "images baseline / tree", "vision share of the baseline's FLOPs", "speedup",
         "FLOP bound", "efficiency", "baseline s (budget)", "tree s", "spread b / t", "live peak MiB b / t",
         "max log-prob diff"]
    )  # fmt: skip
    text = (
        "# GUI agent: screenshots in a tree\n\n"
        + provenance(__file__, argv, "cpu")
        + f"\n\nModel: Qwen2.5-VL-shaped, vision tower {a.vision_width} wide x {a.vision_layers} layers "
        f"(Qwen2.5-VL: 32; what a 2-core CPU step allows), 14-pixel patches, 2x2 merge; text {a.hidden} x "
        f"{a.layers} layers, vocab {model.config.get_text_config().vocab_size:,}; screenshots of "
        f"{a.grid[0]}x{a.grid[1]} patches ({a.grid[0] * a.grid[1] // 4} tokens); float32; matmul rate "
        f"{rate / 1e9:.0f} GFLOP/s.\n\n"
        + head
        + case_line(r, work, cost)
        + "\n\n"
        + noise_section(before, [(r.name, r.untrusted)])
    )
    print("\n" + text)
    if a.write:
        path = result_path("gui_agent")
        path.write_text(text)
        path.with_suffix(".json").write_text(json.dumps(asdict(r), indent=1))
        print(f"wrote {path} (+ .json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
