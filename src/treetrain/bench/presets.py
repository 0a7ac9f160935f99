"""``treetrain bench``'s presets (model and case sizes) and the run time a preset takes, estimated
from its FLOPs (``--estimate``) at a quiet 2-core CPU's measured rate.
"""

from __future__ import annotations

# model and case sizes; every flag left unset takes its preset's value (``--preset``)
PRESETS: dict[str, dict] = {
    "tiny": dict(  # a check that the command and its noise report work: seconds, not a measurement
        hidden=16,
        layers=1,
        heads=2,
        vocab=64,
        paths=4,
        path_len=16,
        por=[0.5],
        turns=0,
        turn_len=8,
        one_path=0,
        repeats=3,
        sample_trees=1,
        capacity=64,
        matmul_size=128,
    ),
    "small": dict(
        hidden=512,
        layers=2,
        heads=4,
        vocab=4096,
        paths=16,
        path_len=256,
        por=[0.5, 0.8, 0.92],
        turns=0,
        turn_len=32,
        one_path=1024,
        repeats=4,
        sample_trees=1,
        capacity=4096,
        matmul_size=2048,
    ),
    "mid": dict(
        hidden=1024,
        layers=8,
        heads=8,
        vocab=32000,
        paths=4,
        path_len=2048,
        por=[0.5],
        turns=8,
        turn_len=512,
        one_path=4096,
        repeats=2,
        sample_trees=2,
        capacity=8192,
        matmul_size=2048,
    ),
    # realistic shapes (random init): a real vocabulary and depth, sized to a quiet 2-core CPU's time
    # (`treetrain bench --preset P --estimate`; benchmarks/QUIET_RUNS.md)
    "qwen3-0.6b": dict(  # Qwen3-0.6B's shape: 16/8 heads of 128, MLP 3072, vocab 151,936, 28 layers
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=3072,
        vocab=151936,
        paths=4,
        path_len=512,
        por=[0.6],
        turns=4,
        turn_len=160,
        one_path=0,
        repeats=2,
        sample_trees=1,
        capacity=2048,
        matmul_size=2048,
    ),
    "smollm2-135m": dict(  # SmolLM2-135M's shape: 30 layers, 9/3 heads of 64, MLP 1536, vocab 49,152
        hidden=576,
        layers=30,
        heads=9,
        kv_heads=3,
        head_dim=64,
        intermediate=1536,
        vocab=49152,
        paths=8,
        path_len=512,
        por=[0.8],
        turns=8,
        turn_len=128,
        one_path=1024,
        repeats=3,
        sample_trees=1,
        capacity=4096,
        matmul_size=2048,
    ),
}
# FLOP/s of training steps on the quiet 2-core AMD EPYC (MFU ~0.8 of its 195-200 GFLOP/s matmul rate,
# benchmarks/results/treetrain_bench_*): what --estimate divides a preset's FLOPs by
QUIET_RATE = 155e9


def estimate(args, cases: list, cost=None) -> int:
    """Print the run's time on a quiet 2-core CPU from the FLOPs of its ``cases`` (``[(name, trees)]``,
    as ``command._cases`` builds them): per case ``repeats`` + a warm-up
    step of both modes, the log-prob check (~0.4 step) and the live-memory step, at
    :data:`QUIET_RATE` (``--memory``'s fresh processes not counted). ``cost``: a
    :class:`~treetrain.trees.flops.CostModel` (a ``--model``'s, its vision tower too) instead of the
    one the sizes in ``args`` give."""
    from types import SimpleNamespace

    from treetrain.bench.cases import case_capacity, case_flops
    from treetrain.trees.flops import CostModel

    kv, head_dim = args.kv_heads or max(1, args.heads // 2), args.head_dim or args.hidden // args.heads
    config = SimpleNamespace(
        hidden_size=args.hidden, num_hidden_layers=args.layers, vocab_size=args.vocab,
        num_attention_heads=args.heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=args.intermediate or 3 * args.hidden,
    )  # fmt: skip
    cost = cost or CostModel.from_config(config)
    total = 0.0
    for name, trees in cases:
        b, t, _ = case_flops(trees, case_capacity(trees, args.capacity), cost, args.vocab)
        flops = (args.repeats + 2.4) * (b + t)
        total += flops
        step = f"baseline {b / 1e12:.2f}, tree {t / 1e12:.2f} TFLOP per step"
        print(f"  {name}: {step}; {flops / QUIET_RATE:.0f} s")
    run = f"--data {args.data}" if getattr(args, "data", None) else f"--preset {args.preset}"
    print(
        f"estimate: `treetrain bench {run}`: about {total / QUIET_RATE / 60:.0f} min "
        f"({total / QUIET_RATE:,.0f} s) at {QUIET_RATE / 1e9:.0f} GFLOP/s (a quiet 2-core EPYC; FLOPs only: "
        "model building and fixed costs come on top)"
    )
    return 0
