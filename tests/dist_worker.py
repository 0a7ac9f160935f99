"""A few AdamW steps of a tiny Qwen3 on a few trees, single-process or under ``torchrun``.

    python tests/dist_worker.py OUT.pt [--ckpt DIR]                      # one process
    torchrun --standalone --nproc_per_node 2 tests/dist_worker.py OUT.pt  # FSDP2, gloo on CPU

Each step's trees are assigned to ranks by FLOP cost (``assign_to_ranks``); the SFT loss is divided
by the number of targets of the WHOLE step batch on every rank, so per-rank losses sum to the global
loss. Every rank runs as many forward/backward passes as the busiest rank, padding with zero-weight
idle passes (one step has a single tree, so a rank is idle there). Rank 0 saves the per-step
losses, grad norms and the full final weights to OUT.pt.

With ``--ckpt DIR``, a checkpoint is saved after step ``CKPT_STEP``; after the run, a fresh model
(other init) and optimizer load it and redo the remaining steps, whose losses and final weights are
saved too (``resumed_*``), to be compared with the uninterrupted run.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.reference` when run as a script

from tests.reference import tiny_model  # noqa: E402
from treetrain import TrajectoryTree, path_logprobs  # noqa: E402
from treetrain.objectives.interface import TrainObjective  # noqa: E402
from treetrain.parallel import fsdp as D  # noqa: E402
from treetrain.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

STEP_TREES = [[0, 1, 2], [3, 4], [5], [6, 0, 3]]  # tree indices of each step; step 3 idles a rank
CKPT_STEP = 2
LR = 1e-2


def make_trees(n: int = 7, seed: int = 0, vocab: int = 97) -> list[TrajectoryTree]:
    """Trees of different shapes and sizes: paths that share prefixes, then diverge."""
    rng = random.Random(seed)
    trees = []
    for i in range(n):
        prefix = [rng.randrange(vocab) for _ in range(rng.randint(4, 12 + 4 * i))]
        paths = [
            prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            for _ in range(rng.randint(1, 4))
        ]
        masks = [[0] * len(prefix) + [1] * (len(p) - len(prefix)) for p in paths]
        trees.append(TrajectoryTree.from_paths(paths, loss_masks=masks))
    return trees


def targets(tree: TrajectoryTree) -> int:
    return int(sum(m[1:].sum() for m in tree.fields["loss_masks"]))


def tree_loss(model, tree: TrajectoryTree, normalizer: float) -> torch.Tensor:
    lps = path_logprobs(model, tree)
    masks = [torch.as_tensor(m[1:], dtype=lp.dtype) for m, lp in zip(tree.fields["loss_masks"], lps)]
    return -sum((lp * m).sum() for lp, m in zip(lps, masks)) / normalizer


def build(seed: int):
    model = D.shard_model(tiny_model("qwen3", dtype=torch.float32, seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train_step(model, opt, sched, trees: list[TrajectoryTree], info: D.DistInfo) -> tuple[float, float]:
    normalizer = float(sum(targets(t) for t in trees))  # the whole batch, identical on every rank
    costs = [D.tree_cost(t, model.config) for t in trees]
    plan = D.assign_to_ranks(costs, info.world_size)
    mine = plan[info.rank]
    local = torch.zeros((), dtype=torch.float64)
    for i in range(max(len(p) for p in plan)):  # same number of passes on every rank
        if i < len(mine):
            loss = tree_loss(model, trees[mine[i]], normalizer)
            local += loss.detach()
        else:
            loss = TrainObjective().idle_loss(model)
        loss.backward()
    grad_norm = D.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return float(D.all_reduce_sum(local)), float(grad_norm)


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def run(steps: range, model, opt, sched, trees, info, ckpt: Path | None = None):
    losses, norms = [], []
    for s in steps:
        loss, norm = train_step(model, opt, sched, [trees[i] for i in STEP_TREES[s]], info)
        losses.append(loss)
        norms.append(norm)
        if ckpt is not None and s + 1 == CKPT_STEP:
            save_checkpoint(ckpt, s + 1, model, opt, sched, {"trees_consumed": s + 1})
    return losses, norms


def experiment(ckpt: Path | None) -> dict:
    """The run (and, with ``ckpt``, the resumed run); every rank returns the same record."""
    info = D.init_distributed()
    torch.manual_seed(1234)
    trees = make_trees()
    model, opt, sched = build(seed=0)
    losses, norms = run(range(len(STEP_TREES)), model, opt, sched, trees, info, ckpt)
    result = {
        "world_size": info.world_size,
        "metric_sums": D.all_reduce_sum_dict({"a": 1.0, f"rank{info.rank}": info.rank + 1.0}),
        "losses": losses,
        "grad_norms": norms,
        "state": full_state(model),
    }
    if ckpt is not None:
        model, opt, sched = build(seed=1)  # different init: everything must come from the checkpoint
        step, data = load_checkpoint(ckpt, model, opt, sched)
        assert step == CKPT_STEP and data == {"trees_consumed": CKPT_STEP}, (step, data)
        result["resumed_losses"], _ = run(range(step, len(STEP_TREES)), model, opt, sched, trees, info)
        result["resumed_state"] = full_state(model)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--ckpt", type=Path)
    args = ap.parse_args()
    result = experiment(args.ckpt)
    if D.init_distributed().is_main:
        torch.save(result, args.out)
    D.destroy()


if __name__ == "__main__":
    main()
    D.exit_rank(0)  # no interpreter teardown (treetrain.parallel.fsdp.exit_rank)
