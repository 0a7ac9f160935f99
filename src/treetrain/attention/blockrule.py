"""The block and fanout of the CPU block-sparse tree attention (:mod:`.blocksparse`), chosen from
the tree's shape.

A long chain (a 4k-token prompt) runs nearest the CPU flash kernel's long-sequence rate in large
tiles; a tree of short branches masks fewer pairs in small ones. The shape is read as the
token-weighted mean length of the tree's segments (:func:`segment_mean`), and :data:`BLOCK_RULE`
maps it to ``(block, fanout)``. Any block and fanout give the exact result; only speed depends on
them.
"""

from __future__ import annotations

import torch

FANOUT = 4  # row blocks per parent block; 4 ~ 8 > 2, 16 (benchmarks/results/attention_cpu_*)

# The block and fanout a tree gets (``choose_block``): the first row whose threshold its token-weighted
# mean segment length reaches. PROVISIONAL thresholds, to be set from ``benchmarks/attention_cpu.py
# --sweep`` on a quiet machine: block 256 / fanout 8 measured 1.01 of the causal kernel's per-pair rate
# on a 10k-token tree with a 4k-token prompt (segment mean ~1.9k) where 64 / 4 gave 0.93; on 2k-5k
# trees of short branches (segment means 100-650) 64 / 4 was best or within noise of best.
BLOCK_RULE: tuple[tuple[int, int, int], ...] = ((1024, 256, 8), (0, 64, FANOUT))  # (min mean, block, fanout)


def segment_mean(subtree_end: torch.Tensor) -> float:
    """Token-weighted mean length of the tree's segments (maximal chains of only children):
    ``sum(len**2) / T``, the length of the segment a random token lies in.

    Token ``t`` continues token ``t - 1``'s segment when it is ``t - 1``'s only child: inside its
    subtree (``end[t - 1] > t``) and covering all of it (``end[t] == end[t - 1]``).

    >>> segment_mean(torch.tensor([8, 6, 4, 4, 6, 6, 8, 8]))  # A | B | C D | E F | G H: 14 / 8
    1.75
    >>> segment_mean(torch.tensor([6, 6, 6, 4, 5, 6]))  # prompt of 3, branches of 1, 1, 1: (9 + 3) / 6
    2.0
    """
    end = subtree_end.detach().to("cpu", torch.int64)
    T = end.numel()
    if T == 0:
        return 0.0
    t = torch.arange(1, T)
    starts = torch.cat([torch.ones(1, dtype=torch.bool), ~((end[:-1] > t) & (end[1:] == end[:-1]))])
    first = torch.nonzero(starts).flatten()
    lengths = torch.diff(torch.cat([first, torch.tensor([T])])).double()
    return float((lengths**2).sum() / T)


def choose_block(subtree_end: torch.Tensor) -> tuple[int, int]:
    """``(block, fanout)`` for a tree, by :data:`BLOCK_RULE` on its :func:`segment_mean`: long
    chains (a long prompt) get large tiles near the kernel's long-sequence rate; trees of short
    branches small ones, which mask fewer pairs.

    >>> choose_block(torch.full((4096,), 4096))  # one chain of 4096 tokens
    (256, 8)
    >>> choose_block(torch.tensor([8, 6, 4, 4, 6, 6, 8, 8]))
    (64, 4)
    """
    mean = segment_mean(subtree_end)
    return next((block, fanout) for least, block, fanout in BLOCK_RULE if mean >= least)


def block_and_fanout(subtree_end: torch.Tensor, block: int | None, fanout: int | None) -> tuple[int, int]:
    """The ``(block, fanout)`` given, each None filled in by :func:`choose_block`.

    >>> block_and_fanout(torch.full((4096,), 4096), None, 4)
    (256, 4)
    """
    if block is not None and block < 1 or fanout is not None and fanout < 2:
        raise ValueError(f"blocksparse_attention: need block >= 1 and fanout >= 2, got {block}, {fanout}")
    if block is not None and fanout is not None:
        return block, fanout
    chosen_block, chosen_fanout = choose_block(subtree_end)
    return block or chosen_block, fanout or chosen_fanout


def level_sizes(T: int, block: int, fanout: int) -> list[int]:
    """Row-block sizes per level of the plan, ``block * fanout**j``, up to the first that covers ``T``.

    >>> level_sizes(1000, 64, 4)
    [64, 256, 1024]
    """
    sizes = [block]
    while sizes[-1] < T:
        sizes.append(sizes[-1] * fanout)
    return sizes
