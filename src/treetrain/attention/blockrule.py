"""The block and fanout of the CPU block-sparse tree attention (:mod:`.blocksparse`), chosen from
the tree's shape.

Large tiles run nearer the CPU flash kernel's long-sequence rate; small ones mask fewer pairs of a
tree of short branches. The shape is read as the token-weighted mean length of the tree's segments
(:func:`segment_mean`), and :data:`BLOCK_RULE` maps it to ``(block, fanout)``; on the 2-core EPYC one
size served every shape measured. Any block and fanout give the exact result; only speed depends on
them.
"""

from __future__ import annotations

import torch

FANOUT = 4  # row blocks per parent block; 4 ~ 8 > 2, 16 (benchmarks/results/attention_cpu_*)

# The block and fanout a tree gets (``choose_block``): the first row whose threshold its token-weighted
# mean segment length reaches. Set from ``benchmarks/attention_cpu.py --sweep`` on the quiet 2-core EPYC
# (results/attention_cpu_sweep_amd-epyc-2-cores_2026-11-26.md: 8 configurations x 15 trees, 1k-10k
# tokens, segment means 113-7310): 128 / 4 was the best, or within 1.8% of it, on every tree, short
# branches and long prompts alike (the provisional 256 / 8 for long prompts was 1-5% slower than it,
# 64 / 4 for short ones up to 4% slower). No threshold separated shapes by more than the run's noise,
# so the rule has one row; the shape-reading stays, for hardware where the sweep finds one.
BLOCK_RULE: tuple[tuple[int, int, int], ...] = ((0, 128, FANOUT),)  # (min segment mean, block, fanout)


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
    """``(block, fanout)`` for a tree, by :data:`BLOCK_RULE` on its :func:`segment_mean` (one row
    today: 128 / 4 for every shape, as measured on the 2-core EPYC).

    >>> choose_block(torch.full((4096,), 4096))  # one chain of 4096 tokens
    (128, 4)
    >>> choose_block(torch.tensor([8, 6, 4, 4, 6, 6, 8, 8]))
    (128, 4)
    """
    mean = segment_mean(subtree_end)
    return next((block, fanout) for least, block, fanout in BLOCK_RULE if mean >= least)


def block_and_fanout(subtree_end: torch.Tensor, block: int | None, fanout: int | None) -> tuple[int, int]:
    """The ``(block, fanout)`` given, each None filled in by :func:`choose_block`.

    >>> block_and_fanout(torch.full((4096,), 4096), None, 8)
    (128, 8)
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
