"""A GUI agent's episode as a tree: screenshots in most observations, several samples per turn; the
tree vs the per-path baseline and vs TRL's GRPOTrainer on its best configuration.

The preset: a Qwen2.5-VL-shaped model (random init) whose vision tower has Qwen2.5-VL's width and
patching (1280 wide, MLP 3420, 14-pixel patches, 2 x 2 merge, windowed and full-attention blocks)
with ``--vision-layers`` layers (Qwen2.5-VL has 32; a 2-core CPU step allows 1, full attention), and a
text model of ``--hidden`` x ``--layers`` (512 x 2; Qwen2.5-VL-3B's is 2048 x 36: reduced to fit the
CPU, the tower's FLOPs dominate either way) with Qwen's 151,936-token vocabulary. An episode of
``--turns`` turns (6, over an hour on the quiet CPU; 8: ``--estimate`` says 92 minutes): a task prompt,
then per turn a tool result carrying a screenshot of about a thousand vision tokens (``--grid``:
62 x 64 patches = 992 tokens after the merge) and the assistant's action; per-turn training samples
with ``--samples`` actions sampled at each turn, so path (k, j) holds screenshots 1..k+1 and action j
of turn k. The per-path baseline runs every path alone, its screenshots encoded once per path; the tree
encodes each screenshot once.

Both modes run one SFT training step through the library (:func:`treetrain.bench.cases.run_case`:
warm-up, interleaved repeats, best/median/spread, the machine's load and the noise verdict, the
log-prob difference between modes, live peak memory). The baseline runs one path per forward (as TRL
does; ``--search``: the fastest of that, the tree's budget and the longest path's, 3 baseline steps
each, doubling the run). The FLOP bound counts the vision tower
(:func:`treetrain.trees.flops.image_patches`; every patch through every tower layer, each image's
patch pairs at full attention: an upper count for the windowed layers, the same in both modes).

TRL (``benchmarks/trl_grpo.py``'s comparison, on images): ``trl.GRPOTrainer``'s own scoring,
``_get_per_token_logps_and_entropies``, on its fastest settings for this batch: one path per forward
(a row alone: no padding), the path's screenshots' pixels and grids, its fused chunked head on the
action's tokens only (compact, as on CUDA: ``trl_compact_head``), gradient checkpointing off (on by
default in ``GRPOConfig``), no entropies; the same token-mean loss, backward, timed interleaved with
the tree's step. Its bound counts the baseline's work plus its head's recomputation in backward.

Usage::

    python benchmarks/gui_agent.py --estimate          # the run's FLOPs and time on a quiet 2-core CPU
    python benchmarks/gui_agent.py --quick             # seconds: checks the code, no figure
    python benchmarks/gui_agent.py --write             # the recorded run (over an hour on the quiet CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
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
from treetrain.trees.flops import CostModel, Work, baseline_work, tree_work  # noqa: E402
from treetrain.trees.images import ImageInput  # noqa: E402
from treetrain.trees.tree import TrajectoryTree  # noqa: E402

IMAGE, VISION_START, VISION_END = 151655, 151652, 151653  # Qwen2.5-VL's token ids
QUICK = dict(vision_layers=1, vision_width=64, hidden=64, layers=1, vocab=2048, grid=(8, 8), turns=3,
             samples=2, text=8, repeats=1)  # fmt: skip
# FLOP/s of this preset's steps on the quiet 2-core EPYC (2026-11-28, glibc-cached, 6 turns): a baseline step
# (one path per forward) 368.6 s of 32.93 TFLOP, a tree step 74.7 s of 4.94 TFLOP, the search's packed
# budgets 682-720 s a step. (treetrain bench's 155 GFLOP/s, used before, made a 2-hour run read 62 min.)
RATES = {"baseline": 89e9, "tree": 66e9, "packed": 47e9}


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


def episode_paths(a, dtype=torch.float32) -> tuple[list, list, list]:
    """``(paths, each path's screenshots, loss masks)`` of one episode (see the module docstring)."""
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
    return paths, path_images, masks


def episode(a, dtype=torch.float32) -> TrajectoryTree:
    """Per-turn samples of one episode as one tree."""
    paths, path_images, masks = episode_paths(a, dtype)
    return TrajectoryTree.from_paths(paths, images=path_images, loss_masks=masks)


# ---- TRL: GRPOTrainer's own scoring, one path per forward ------------------------------------------


def trl_trainer(model, workdir: str):
    """A ``trl.GRPOTrainer`` (treetrain's subclass; only TRL's own scoring is timed) over ``model`` on its
    fastest settings for this batch: activation (gradient) checkpointing off (GRPOConfig's default is
    on), fp32."""
    from benchmarks.trl_grpo import online_trainer

    return online_trainer("GRPO", model, 2, "cpu", torch.float32, workdir, activation_checkpointing=False)


def trl_rows(a, dtype=torch.float32) -> list[dict]:
    """Each path as TRL's batch of one row: no padding (TRL pads rows to the longest; one row a forward
    pads nothing), its screenshots' pixels and grids, and the action's ``a.text`` tokens scored."""
    paths, path_images, _ = episode_paths(a, dtype)
    return [
        {
            "input_ids": torch.tensor([p]),
            "attention_mask": torch.ones(1, len(p), dtype=torch.long),
            "pixel_values": torch.cat([im.tensors["pixel_values"] for im in images]),
            "image_grid_thw": torch.cat([im.tensors["image_grid_thw"] for im in images]),
            "num_images": [len(images)],
        }
        for p, images in zip(paths, path_images)
    ]


def trl_step(trainer, rows: list[dict], keep: int) -> float:
    """One training step of TRL's scoring: ``GRPOTrainer._get_per_token_logps_and_entropies`` per path
    (its fused chunked head on the ``keep`` action positions, compact as on CUDA:
    :func:`benchmarks.trl_grpo.trl_compact_head`; no entropies, as the tree's SFT step computes none),
    the token-mean log-prob loss, backward; returns the loss."""
    from trl import GRPOTrainer

    from benchmarks.trl_grpo import trl_compact_head

    model, total = trainer.model, 0.0
    targets = keep * len(rows)
    with trl_compact_head(True):
        for r in rows:
            row = {k: v for k, v in r.items() if k not in ("input_ids", "attention_mask")}
            lp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, model, r["input_ids"], r["attention_mask"], keep, **row
            )
            loss = -lp.sum() / targets
            loss.backward()
            total += float(loss.detach())
    return total


def trl_work(work: dict) -> Work:
    """What TRL's per-path step computes: the baseline's decoder, attention and tower work, its fused head
    on the same scored targets, every one recomputed in backward (found for TRL's head,
    ``benchmarks/trl_grpo.py --flops``)."""
    return dataclasses.replace(work["baseline"], recomputed=work["baseline"].targets)


def time_vs_trl(trainer, rows, keep: int, tree_step, repeats: int) -> dict:
    """TRL's step and the tree's, interleaved (order alternating) after a warm-up round: each mode's
    best, median and spread, and the load while they ran."""
    from treetrain.bench import noise

    steps = {"trl": lambda: trl_step(trainer, rows, keep), "tree": tree_step}
    times: dict[str, list[float]] = {m: [] for m in steps}
    losses: dict[str, float] = {}
    monitor = noise.Monitor()
    for r in range(repeats + 1):
        if r == 1:
            monitor.start()
        for m in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            trainer.model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = steps[m]()
            dt = time.perf_counter() - t0
            times[m].append(dt) if r else losses.setdefault(m, loss)
            print(f"  vs TRL: {bench.step_line(m, r, repeats, dt)}", file=sys.stderr, flush=True)
    trainer.model.zero_grad(set_to_none=True)
    load = monitor.stop() if repeats else None
    stats = {m: noise.summary(v) for m, v in times.items()}
    return {
        "trl_s": min(times["trl"]), "tree_s": min(times["tree"]), "stats": stats, "load": load,
        "loss_diff": abs(losses["trl"] - losses["tree"]),
    }  # fmt: skip


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
    p.add_argument("--turns", type=int, default=6, help="turns of the episode (6: over an hour)")
    p.add_argument("--samples", type=int, default=2, help="actions sampled per turn")
    p.add_argument("--text", type=int, default=32, help="tokens of an action (a turn's text: half)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--search",
        action="store_true",
        help="search the baseline's micro-batch budget (the tree's, the longest path's, one path per "
        "forward; 3 baseline steps each) instead of one path per forward, as TRL runs it",
    )
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


def baseline_budgets(tree: TrajectoryTree, capacity: int) -> tuple[int, ...]:
    """The baseline's budgets ``--search`` times (the tree's, the longest path's, one path per
    forward), one per distinct cut of the paths into micro-batches (``fastest_capacity`` times each)."""
    cuts: dict[tuple, int] = {}
    for c in (capacity, int(tree.path_lengths.max()), bench.ONE_PATH):
        cuts.setdefault(tuple(p.num_tokens for p in bench.prepare("sequence", [tree], c)), c)
    return tuple(cuts.values())


def run_flops(repeats: int, budgets: int, base: float, tree: float, trl: float) -> float:
    """FLOPs of the whole run: per mode of ``run_case`` a warm-up, ``repeats`` timed steps, the live-peak
    step and the no-grad log-prob check (~0.4 step); the baseline's search, 3 steps per budget
    (``budgets``: 0 without ``--search``); then TRL's and the tree's warm-up and ``repeats`` steps."""
    return (repeats + 2.4 + 3 * budgets) * base + (2 * repeats + 3.4) * tree + (repeats + 1) * trl


def run_seconds(repeats: int, budgets: int, base: float, tree: float, trl: float) -> float:
    """:func:`run_flops`'s steps at this preset's measured rates (``RATES``): the search's budgets other
    than one path per forward pack several paths a forward and run at the packed rate."""
    steps = run_flops(repeats, 0, 1.0, 0.0, 0.0), run_flops(repeats, 0, 0.0, 1.0, 0.0)
    seconds = steps[0] * base / RATES["baseline"] + steps[1] * tree / RATES["tree"]
    seconds += (repeats + 1) * trl / RATES["baseline"]
    if budgets:
        seconds += 3 * base / RATES["baseline"] + 3 * (budgets - 1) * base / RATES["packed"]
    return seconds


def trl_line(v: dict, bound: float) -> str:
    """The vs-TRL table's row: times, speedup, bound, efficiency, spreads, the loss difference."""
    speed = v["trl_s"] / v["tree_s"]
    spread = f"{v['stats']['trl']['spread']:.0%} / {v['stats']['tree']['spread']:.0%}"
    return (
        f"| {v['trl_s']:.1f} | {v['tree_s']:.1f} | {speed:.2f}x | {bound:.2f}x | **{speed / bound:.2f}** "
        f"| {spread} | {v['loss_diff']:.1e} |"
    )


def record(a, text: str, data: dict) -> None:
    """Print the result; with ``--write`` (over)write it under benchmarks/results/ (+ .json)."""
    print("\n" + text, flush=True)
    if a.write:
        path = result_path("gui_agent")
        path.write_text(text)
        path.with_suffix(".json").write_text(json.dumps(data, indent=1))
        print(f"wrote {path} (+ .json)", flush=True)


def main(argv=None) -> int:
    import tempfile

    from treetrain.bench import noise

    a = parse_args(argv)
    model = gui_model(a)
    cost = CostModel.from_config(model.config)
    tree = episode(a)
    capacity = tree.num_tokens
    work = {"baseline": baseline_work([tree], 14), "tree": tree_work([tree], 14)}
    vocab = model.config.get_text_config().vocab_size
    base_f, tree_f, _ = bench.case_flops([tree], capacity, cost, vocab)
    trl_f = trl_work(work).flops(cost)
    print(
        f"episode: {tree.num_paths} paths, "
        f"{tree.num_path_tokens:,} baseline / {tree.num_tokens:,} tree tokens, "
        f"images {work['baseline'].images} / {work['tree'].images}; step {base_f / 1e12:.2f} / "
        f"{tree_f / 1e12:.2f} TFLOP (TRL {trl_f / 1e12:.2f}); FLOP bound {base_f / tree_f:.2f}x "
        f"(vs TRL {trl_f / tree_f:.2f}x)",
        flush=True,
    )
    budgets = baseline_budgets(tree, capacity) if a.search else ()
    if a.estimate:
        flops = run_flops(a.repeats, len(budgets), base_f, tree_f, trl_f)
        seconds = run_seconds(a.repeats, len(budgets), base_f, tree_f, trl_f)
        print(estimate_line("gui_agent.py", argv, seconds, flops / seconds))
        return 0
    use_allocator(a)
    before = machine_before()
    rate = bench.matmul_rate(torch.float32, torch.device("cpu"), 2048)
    r = bench.run_case(
        f"GUI agent, {a.turns} turns x {a.samples} samples",
        model, None, [tree], capacity, a.repeats, a.backend, cost, rate, False,
        baseline_capacities=budgets, baseline_capacity=bench.ONE_PATH,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
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
        f"{a.layers} layers (Qwen2.5-VL-3B: 2048 x 36; reduced to fit the CPU), vocab "
        f"{model.config.get_text_config().vocab_size:,}; screenshots of "
        f"{a.grid[0]}x{a.grid[1]} patches ({a.grid[0] * a.grid[1] // 4} tokens); {a.turns} turns x "
        f"{a.samples} samples; {a.repeats} timed repeats; float32; matmul rate {rate / 1e9:.0f} GFLOP/s."
        "\n\n## Tree vs the per-path baseline (treetrain.bench.cases.run_case)\n\n"
        + head
        + case_line(r, work, cost)
    )
    # written at once: TRL's part takes another ~20 steps' time, and a run stopped in it keeps this part
    record(a, text + "\n\n## Tree vs TRL's GRPOTrainer\n\nNot measured: the run stopped before it.\n\n"
           + noise_section(before, [(r.name, r.untrusted)]), asdict(r))  # fmt: skip
    micro = bench.prepare("tree", [tree], capacity)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = trl_trainer(model, workdir)
        tree_step = lambda: bench.train_step("tree", model, [tree], micro, a.backend)  # noqa: E731
        vs = time_vs_trl(trainer, trl_rows(a), a.text, tree_step, a.repeats)
    bound_trl = trl_f / tree_f
    trl_untrusted = noise.verdict(vs["stats"], vs["load"], bound_trl, vs["trl_s"] / vs["tree_s"] / bound_trl)
    trl_head = table_head(
        ["TRL s", "tree s", "speedup vs TRL", "FLOP bound vs TRL", "efficiency", "spread TRL / tree",
         "loss diff (TRL - tree)"]
    )  # fmt: skip
    text += (
        "\n\n## Tree vs TRL's GRPOTrainer, its best configuration\n\n"
        "TRL's own scoring (`GRPOTrainer._get_per_token_logps_and_entropies`), one path per forward (no "
        "padding), its fused chunked head on the action's tokens only (compact, as TRL runs it on CUDA), "
        "gradient checkpointing off, no entropies; each screenshot encoded once per path that holds it. "
        "The same token-mean loss over the actions, backward; timed interleaved with the tree's step "
        "(warm-up round first). The bound counts TRL's work as the baseline's plus its head's "
        "recomputation in backward.\n\n"
        + trl_head
        + trl_line(vs, bound_trl)
        + "\n\n"
        + noise_section(before, [(r.name, r.untrusted), ("vs TRL", trl_untrusted)])
    )
    trl = {"trl_s": vs["trl_s"], "tree_s": vs["tree_s"], "bound": bound_trl, "loss_diff": vs["loss_diff"],
           "stats": vs["stats"], "untrusted": trl_untrusted}  # fmt: skip
    record(a, text, {**asdict(r), "vs_trl": trl})
    return 0


if __name__ == "__main__":
    sys.exit(main())
