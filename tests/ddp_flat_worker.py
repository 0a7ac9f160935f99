"""torchrun worker: each rank scores its own padded batch through DistributedDataParallel with
``wrapped_flat_logprobs`` and saves its gradients (DDP must have averaged them across ranks)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.reference import tiny_model  # noqa: E402
from treetrain.integrations.wrapped import install_tree_scoring, wrapped_flat_logprobs  # noqa: E402

ROWS = {0: ([[3, 4, 5, 6, 7], [3, 4, 5, 8, 9], [0, 3, 4, 5, 6]], [1, 1, 0]),
        1: ([[10, 11, 12, 13, 14], [10, 11, 12, 15, 0], [10, 11, 12, 13, 14]], [1, 1, 1])}  # fmt: skip


def batch(rank: int):
    """``ids, mask [3, 5]`` for ``rank``: row 2 of rank 0 is left-padded, row 1 of rank 1 right-padded."""
    ids = torch.tensor(ROWS[rank][0])
    mask = (ids != 0).long()
    return ids, mask


def loss(logp: torch.Tensor, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(logp.shape, generator=g, dtype=logp.dtype) * logp).sum()


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_model("qwen3")  # the same seed on every rank: the same weights
    install_tree_scoring(model)
    ddp = DistributedDataParallel(model)
    ids, mask = batch(rank)
    logp, _ = wrapped_flat_logprobs(ddp, ids, mask, logits_to_keep=3, backend="dense")
    loss(logp, rank).backward()
    torch.save({n: p.grad for n, p in model.named_parameters()}, f"{out}.{rank}")
    # Orderly teardown: DDP's reducer holds the process group, so release it first, and let no rank
    # close its gloo connections while the other is still using them (a CI run once saw rank 1
    # abort in teardown, "terminate called without an active exception", after the work was done).
    del ddp
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    from treetrain.parallel.fsdp import exit_rank

    exit_rank(0)  # no interpreter teardown (see exit_rank)
