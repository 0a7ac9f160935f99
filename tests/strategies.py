"""Random trees: hypothesis strategies of token paths, and forests given by parent links in DFS order."""

from __future__ import annotations

import random

import torch
from hypothesis import strategies as st


@st.composite
def tree_paths(draw, vocab: int = 20, max_paths: int = 6, max_len: int = 12, min_len: int = 1):
    """Paths that share prefixes: each new path copies a prefix of an earlier one, then diverges.

    Small vocabularies make accidental sharing, duplicates and prefix paths common.
    """
    n = draw(st.integers(1, max_paths))
    tok = st.integers(0, vocab - 1)
    paths = [draw(st.lists(tok, min_size=min_len, max_size=max_len))]
    for _ in range(n - 1):
        base = paths[draw(st.integers(0, len(paths) - 1))]
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(tok, min_size=max(0, min_len - cut), max_size=max_len))
        path = base[:cut] + tail
        paths.append(path if path else [draw(tok)])
    return paths


def subtree_end_from_parents(parent: list[int]) -> torch.Tensor:
    """``[T]`` int64 ``subtree_end`` of a forest given in DFS order (``parent[t] < t``, -1 for roots)."""
    end = list(range(1, len(parent) + 1))
    for t in reversed(range(len(parent))):
        if parent[t] >= 0:
            end[parent[t]] = max(end[parent[t]], end[t])
    return torch.tensor(end, dtype=torch.int64)


def tree_from_parents(parent: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DFS-ordered ``parent`` (-1: a root) -> ``subtree_end [T]``, ``position_ids [T]`` (each token's
    depth along its path)."""
    pos: list[int] = []
    for p in parent:
        pos.append(pos[p] + 1 if p >= 0 else 0)
    return subtree_end_from_parents(parent), torch.tensor(pos)


def random_parents(n: int, rng: random.Random, p_continue: float = 0.7) -> list[int]:
    """A random forest in DFS order: each token is a child of the previous one (probability
    ``p_continue``), else a child of one of the previous token's ancestors, or a new root."""
    parent, path = [], []  # path: the previous token and its ancestors, root first
    for t in range(n):
        if path and rng.random() > p_continue:
            del path[rng.randint(0, len(path) - 1) :]
        parent.append(path[-1] if path else -1)
        path.append(t)
    return parent
