"""Part 3, end to end: one training step (forward + backward, SFT) of a Qwen3-0.6B-shaped model,
tree vs the library's per-path baseline, through ``treetrain.bench.cases.run_case`` (the code
behind ``treetrain bench``): the same model, loss and strategies, best of ``repeats`` steps after a
warm-up, modes alternating; the FLOP bound of what each mode computes (``treetrain.trees.flops``),
efficiency = speedup / bound, MFU against this GPU's measured dense bf16 matmul rate, the
allocator's peak memory per mode, and the largest log-prob difference between the modes.

The model is sharded with FSDP2 (``treetrain.parallel.fsdp.shard_model``) in a one-rank process
group, with bf16 mixed precision on CUDA (float32 master weights, bf16 compute): the setup a
multi-GPU run has, on one GPU. A case below ``--profile-below`` (default 0.95, the issue's goal) of
its bound also gets a profile of one step of each mode (``e2e/profile-<case>.txt``: the top
operators by device time), to show where the gap is.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict
from pathlib import Path

import torch

from treetrain.bench.cases import (
    case_capacity,
    group_tree,
    matmul_rate,
    per_turn_tree,
    prepare,
    run_case,
    train_step,
)
from treetrain.trees.flops import CostModel

from .correctness import build_qwen3, total_model_params


def _one_rank_group() -> None:
    """The environment ``torchrun --nproc_per_node 1`` would set, for ``init_distributed``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    ).items():
        os.environ.setdefault(key, str(value))


class Model:
    """The sharded model, built on first use and shared by the part's cases."""

    def __init__(self, sizes):
        self.sizes = sizes
        self.model = None
        self.rate = 0.0

    def get(self):
        if self.model is None:
            from treetrain.models.hf import prepare_model
            from treetrain.parallel.fsdp import init_distributed, shard_model

            dev = self.sizes.device
            _one_rank_group()
            init_distributed("cuda" if dev.type == "cuda" else "cpu")
            model = build_qwen3(self.sizes.e2e_model, torch.float32, dev)
            prepare_model(model)
            self.model = shard_model(model, mixed_precision=dev.type == "cuda")
            # the compute dtype's dense matmul rate, at a size that reaches the GPU's peak
            compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
            self.rate = matmul_rate(compute, dev, size=self.sizes.matmul_size)
        return self.model

    def close(self) -> None:
        from treetrain.parallel.fsdp import destroy

        if self.model is not None:
            destroy()
        self.model = None


def profile_steps(model, trees, sizes, path: Path) -> None:
    """One training step of each mode under ``torch.profiler``; the top operators to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = sizes.device.type == "cuda"
    capacity = case_capacity(trees, sizes.e2e_capacity)
    text = []
    for mode in ("tree", "sequence"):
        micro = prepare(mode, trees, capacity)
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            train_step(mode, model, trees, micro, sizes.e2e_backend)
            if cuda:
                torch.cuda.synchronize()
        sort = "device_time_total" if cuda else "cpu_time_total"
        text += [
            f"# {mode} step, top operators by {sort}",
            prof.key_averages().table(sort_by=sort, row_limit=30),
        ]
    model.zero_grad(set_to_none=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(text) + "\n")


def e2e_case(name: str, trees, shared: Model, sizes, out: Path) -> dict:
    model = shared.get()
    cost = CostModel.from_config(model.config)
    dev = sizes.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    r = run_case(
        name, model, None, trees, sizes.e2e_capacity, sizes.e2e_repeats, sizes.e2e_backend, cost,
        shared.rate, memory=dev.type == "cuda",  # CPU peak memory needs a fresh process per mode
    )  # fmt: skip
    rec = asdict(r) | {
        "backend": sizes.e2e_backend or "default",
        "tree_tokens_per_s": r.computed_tokens / r.tree_s,
        "baseline_tokens_per_s": r.baseline_tokens / r.baseline_s,
        "path_tokens_per_s_tree": r.baseline_tokens / r.tree_s,  # the baseline's tokens, at the tree's pace
        "params_m": total_model_params(sizes.e2e_model) / 1e6,
        "matmul_tflops": shared.rate / 1e12,
    }
    if r.efficiency < sizes.profile_below:
        path = out / "e2e" / f"profile-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}.txt"
        profile_steps(model, trees, sizes, path)
        rec["profile"] = path.name
    rec["headline"] = (
        f"speedup {r.speedup:.2f}x, bound {r.flop_bound:.2f}x, efficiency {r.efficiency:.2f}; "
        f"MFU base {r.baseline_mfu:.2f} tree {r.tree_mfu:.2f}; max log-prob diff {r.max_logprob_diff:.1e}"
    )
    return rec


def e2e_trees(sizes) -> dict[str, list]:
    """The cases: the library bench's per-turn and group trees at ``sizes.e2e_trees``."""
    vocab = sizes.e2e_model["vocab"]
    out = {}
    for spec in sizes.e2e_trees:
        if spec[0] == "per-turn":
            _, turns, turn_len = spec
            out[f"per-turn {turns}x{turn_len}"] = [per_turn_tree(turns, turn_len, vocab)]
        else:
            _, por, paths, length = spec
            out[f"group POR {por:.0%} {paths}x{length}"] = [group_tree(por, paths, length, vocab)]
    return out


def plan(sizes, shared: Model, out: Path) -> list:
    from .runner import Case

    return [Case(f"e2e {name}", lambda n=name, t=trees: e2e_case(n, t, shared, sizes, out))
            for name, trees in e2e_trees(sizes).items()]  # fmt: skip
