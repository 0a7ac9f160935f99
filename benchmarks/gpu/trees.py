"""Trees of exactly ``T`` distinct tokens for the GPU suite (token ids distinct, so no prefix merges
by accident: the tree's shape is the one built).

- ``random_tree``: nodes of random lengths hung under random earlier nodes (deep and bushy mixes);
- ``group_tree``: one prompt and ``paths`` sampled continuations (a GRPO group);
- ``per_turn_tree``: a conversation's per-turn samples with the reasoning stripped from earlier
  turns: each turn adds ``user`` tokens to the spine, a leaf ``think + answer``, and the stripped
  ``answer`` to the spine (without stripping, per-turn samples nest into one chain: causal).
"""

from __future__ import annotations

import numpy as np
import torch

from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree


def _ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    if vocab < n:
        raise ValueError(f"need a vocabulary of at least {n} ids for {n} distinct tokens, got {vocab}")
    return rng.choice(vocab, size=n, replace=False)


def _from_nodes(lengths: list[int], parents: list[int], vocab: int, seed: int) -> TrajectoryTree:
    """Nodes ``i`` of ``lengths[i]`` tokens under ``parents[i]`` (``-1``: root, parents first):
    one path per leaf."""
    ids = _ids(np.random.default_rng(seed), sum(lengths), vocab)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    toks = [ids[starts[i] : starts[i + 1]] for i in range(len(lengths))]
    has_child = set(parents)
    paths = []
    for leaf in (i for i in range(len(lengths)) if i not in has_child):
        chain, n = [], leaf
        while n >= 0:
            chain.append(toks[n])
            n = parents[n]
        paths.append(np.concatenate(chain[::-1]))
    return TrajectoryTree.from_paths(paths)


def random_tree(T: int, vocab: int, seed: int = 0, mean_node: int = 0) -> TrajectoryTree:
    """``T`` tokens in nodes of geometric length (mean ``mean_node``, default ``T / 40``), each
    under a random earlier node, recent ones likelier (so both deep chains and wide fans occur)."""
    rng = np.random.default_rng(seed)
    mean = mean_node or max(2, T // 40)
    lengths, parents, total = [], [], 0
    while total < T:
        n = min(int(rng.geometric(1 / mean)), T - total)
        k = len(lengths)
        parents.append(-1 if k == 0 else int(k - 1 - min(k - 1, rng.geometric(0.3) - 1)))
        lengths.append(n)
        total += n
    return _from_nodes(lengths, parents, vocab, seed)


def group_tree(
    T: int, vocab: int, paths: int = 16, prompt_share: float = 0.25, seed: int = 0
) -> TrajectoryTree:
    """A prompt of about ``prompt_share * T`` tokens and ``paths`` continuations, ``T`` in all."""
    branch = max(1, round(T * (1 - prompt_share) / paths))
    prompt = T - paths * branch
    if prompt < 1:
        raise ValueError(f"group tree: {T} tokens cannot hold {paths} paths and a prompt")
    return _from_nodes([prompt] + [branch] * paths, [-1] + [0] * paths, vocab, seed)


def per_turn_tree(T: int, vocab: int, turns: int = 16, seed: int = 0) -> TrajectoryTree:
    """``turns`` turns of user 30%, think 40%, answer 15% (in the leaf and again on the spine)."""
    per = T // turns
    user, think, answer = int(0.3 * per), int(0.4 * per), int(0.15 * per)  # floors: at most T in all
    if min(user, think, answer) < 1:
        raise ValueError(f"per-turn tree: {T} tokens are too few for {turns} turns (need {7 * turns})")
    lengths, parents, spine = [], [], -1
    for _ in range(turns):
        lengths += [user, think + answer, answer]
        parents += [spine, len(lengths) - 3, len(lengths) - 3]
        spine = len(lengths) - 1
    lengths[0] += T - sum(lengths)  # the remainder: the first user turn (a system prompt)
    return _from_nodes(lengths, parents, vocab, seed)


def mask_tensors(tree: TrajectoryTree, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``subtree_end [T]`` and ``position_ids [T]`` (int64) on ``device``."""
    packed = pack(tree)
    return packed.subtree_end.to(device), packed.position_ids.to(device)
