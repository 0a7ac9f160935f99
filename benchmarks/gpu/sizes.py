"""What the suite runs at: the full GPU sizes, and the tiny CPU sizes of ``--dry-run``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Qwen3-0.6B's shape (tied embeddings), random init: no download
QWEN3_0_6B = dict(
    hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936, tied=True
)
TINY_QWEN3 = dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=256, tied=False)
# a Qwen3.5 Gated DeltaNet layer (transformers' Qwen3_5TextConfig defaults): grouped value heads
QWEN3_5_GDN = dict(hk=16, hv=32, dk=128, dv=128)
ATTN_HEADS = ((16, 8, 128), (8, 2, 64))  # (Hq, Hkv, D): Qwen3-0.6B's, and head dim 64 with GQA 4

# seconds per part; 1950 s of work fits 35 minutes of device time with the interpreter starts of
# three calls (each under 10 minutes). Correctness gets the most: FlexAttention compiles once per
# size and dtype, and FLA autotunes its kernels on first use.
# verl: two main_ppo runs of two steps each (Ray, vLLM and three engines start in each) and a compare
BUDGETS = {"correctness": 540.0, "kernels": 390.0, "e2e": 390.0, "verl": 600.0, "report": 30.0}


@dataclass
class Sizes:
    device: torch.device
    # part 1
    attn_cases: tuple[tuple[int, tuple[int, int, int], str], ...]  # (T, (Hq, Hkv, D), dtype)
    attn_backends: dict[str, list[str]]  # dtype -> backends checked in it
    ref_elems: int  # float64 reference scores [Hq, rows, T] stay under this many elements
    gdn_T: tuple[int, ...]
    gdn_shape: dict
    gdn_dtype: str
    model: dict
    model_T: int
    model_dtype: str
    model_ref_dtype: str
    model_backends: list[str]
    model_trees: tuple[str, ...]  # of correctness.MODEL_TREES
    # part 2
    kernel_T: tuple[int, ...]
    kernel_heads: tuple[tuple[int, int, int], ...]
    kernel_dtype: str
    kernel_backends: list[str]
    kernel_reps: int
    sweep_T: int | None
    sweep_blocks: tuple[tuple[int, int], ...] = ()
    # part 3
    e2e_model: dict = field(default_factory=dict)
    e2e_trees: tuple = ()  # ("per-turn", turns, turn_len) | ("group", por, paths, length)
    e2e_capacity: int = 0
    e2e_repeats: int = 0
    e2e_backend: str | None = None
    matmul_size: int = 8192
    profile_below: float = 0.95  # profile the e2e cases whose efficiency is below this


def gpu_sizes() -> Sizes:
    both = ["triton", "flex"]
    return Sizes(
        device=torch.device("cuda"),
        # bf16 at every size, fp16 at one (each new size and dtype costs FlexAttention a compile);
        # odd sizes too: partial tiles at the end
        attn_cases=tuple((T, h, "bfloat16") for T in (1000, 16461, 65536) for h in ATTN_HEADS)
        + tuple((16461, h, "float16") for h in ATTN_HEADS),
        attn_backends={"bfloat16": both, "float16": both},
        ref_elems=2**28,  # 2 GiB float64 scores: 256 rows at 64k tokens and 16 heads
        gdn_T=(1024, 8192),
        gdn_shape=QWEN3_5_GDN,
        gdn_dtype="bfloat16",
        model=QWEN3_0_6B,
        model_T=4096,
        model_dtype="bfloat16",
        model_ref_dtype="float32",
        model_backends=both,
        model_trees=("group", "per-turn", "random"),
        kernel_T=(4096, 8192, 16384, 32768, 65536),
        kernel_heads=((16, 8, 128),),
        kernel_dtype="bfloat16",
        kernel_backends=both,
        kernel_reps=10,
        sweep_T=16384,
        sweep_blocks=((64, 64), (128, 64), (64, 128), (128, 128)),
        e2e_model=QWEN3_0_6B,
        e2e_trees=(("per-turn", 16, 1024), ("group", 0.5, 16, 2048), ("group", 0.9, 16, 8192)),
        e2e_capacity=32768,
        e2e_repeats=3,
        e2e_backend=None,  # the library's CUDA default (triton)
        matmul_size=8192,
    )


def dry_run_sizes(triton_interpreter: bool) -> Sizes:
    """Tiny CPU sizes: the dense backend in bf16 (and the Triton kernel in float32 under the
    interpreter, which has no bf16 dot)."""
    return Sizes(
        device=torch.device("cpu"),
        attn_cases=((150, (4, 2, 16), "bfloat16"),)
        + (((150, (4, 2, 16), "float32"),) if triton_interpreter else ()),
        attn_backends={"bfloat16": ["dense"], "float32": ["dense", "triton"]},
        ref_elems=2**20,
        gdn_T=(48,),
        gdn_shape=dict(hk=2, hv=4, dk=8, dv=8),
        gdn_dtype="float32",
        model=TINY_QWEN3,
        model_T=64,
        model_dtype="bfloat16",
        model_ref_dtype="float64",
        model_backends=["dense"],
        model_trees=("group", "per-turn", "random"),
        kernel_T=(128, 256),
        kernel_heads=((4, 2, 16),),
        kernel_dtype="float32",
        kernel_backends=["dense"],
        kernel_reps=2,
        sweep_T=None,
        e2e_model=TINY_QWEN3,
        e2e_trees=(("group", 0.5, 4, 32),),
        e2e_capacity=4096,
        e2e_repeats=1,
        e2e_backend=None,
        matmul_size=128,
    )
