"""DFS packing: one or more trees (a forest) -> the ``PackedTree`` tensors a forward pass reads.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``::

    DFS          A  B  C  D  E  F  G  H
    position_ids 0  1  2  3  2  3  1  2
    subtree_end  8  6  4  4  6  6  8  8
    prev        -1  0  1  2  1  4  0  6     (hidden row that predicts each token; -1: none)
    path_index   [0 1 2 3 | 0 1 4 5 | 0 6 7],  path_offsets [0, 4, 8, 11]

Path ``p``'s log-prob of its token ``j+1`` is the tree's log-prob at DFS index
``path_index[path_offsets[p] + j + 1]``: that is the whole expansion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treetrain.trees.tree import TrajectoryTree

__all__ = ["PackedTree", "pack"]


@dataclass(eq=False)
class PackedTree:
    """Tensors for one forward over a forest of trees (``T`` tokens, ``N`` nodes, ``P`` paths).

    input_ids, position_ids, subtree_end, prev: ``[T]`` int64 (DFS order).
    node_start, node_end, node_parent: ``[N]`` int64 (DFS order; parent ``-1`` for roots).
    path_index ``[sum len(p)]``, path_offsets ``[P + 1]``: DFS index of every path position.
    trees: the packed trees; paths are numbered tree by tree in input order.
    images: each tree's distinct images (``trees.images.ImageInput``, by content hash), and for every
    DFS token ``image_index [T]`` (into ``images``; -1 for text) and ``image_row [T]`` (its feature
    row in that image; -1 for text); ``image_index`` is None for a text-only forest.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    prev: torch.Tensor
    node_start: torch.Tensor
    node_end: torch.Tensor
    node_parent: torch.Tensor
    path_index: torch.Tensor
    path_offsets: torch.Tensor
    trees: tuple[TrajectoryTree, ...]
    image_index: torch.Tensor | None = None
    image_row: torch.Tensor | None = None
    images: tuple = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_paths(self) -> int:
        return self.path_offsets.numel() - 1

    @property
    def path_lengths(self) -> torch.Tensor:
        return self.path_offsets.diff()

    def target_index(self) -> torch.Tensor:
        """DFS index of the target of every path log-prob, path by path: ``[sum (len(p) - 1)]``."""
        keep = torch.ones_like(self.path_index, dtype=torch.bool)
        keep[self.path_offsets[:-1]] = False  # a path's first token is never a target
        return self.path_index[keep]

    def path_images(self, p: int) -> list:
        """Path ``p``'s images (``ImageInput``), in the order of its placeholders ([] if none)."""
        for tree in self.trees:
            if p < tree.num_paths:
                return list((tree.fields.get("images") or [[]] * tree.num_paths)[p])
            p -= tree.num_paths
        raise IndexError(p)

    def to(self, device) -> PackedTree:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return PackedTree(**moved)


def _tree_arrays(tree: TrajectoryTree) -> dict[str, np.ndarray]:
    T = tree.num_tokens
    prev = np.arange(-1, T - 1, dtype=np.int64)
    parent = tree.node_parent
    prev[tree.node_start] = np.where(parent >= 0, tree.node_end[np.maximum(parent, 0)] - 1, -1)
    subtree_end = np.repeat(tree.node_subtree_end, tree.node_end - tree.node_start)
    return {
        "input_ids": tree.tokens,
        "position_ids": tree.positions,
        "subtree_end": subtree_end,
        "prev": prev,
        "node_start": tree.node_start,
        "node_end": tree.node_end,
        "node_parent": parent,
        "path_index": np.concatenate(tree.path_index),
    }


def pack(trees: TrajectoryTree | Sequence[TrajectoryTree]) -> PackedTree:
    """Serialize trees into one forest. Each tree's indices are shifted by the tokens before it."""
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    if len(trees) == 0:
        raise ValueError("pack: need at least one tree")
    parts = [_tree_arrays(t) for t in trees]
    tok_off = np.cumsum([0] + [t.num_tokens for t in trees])
    node_off = np.cumsum([0] + [t.num_nodes for t in trees])
    shifted = {
        "input_ids": [p["input_ids"] for p in parts],
        "position_ids": [p["position_ids"] for p in parts],
        "subtree_end": [p["subtree_end"] + o for p, o in zip(parts, tok_off)],
        "prev": [np.where(p["prev"] >= 0, p["prev"] + o, -1) for p, o in zip(parts, tok_off)],
        "node_start": [p["node_start"] + o for p, o in zip(parts, tok_off)],
        "node_end": [p["node_end"] + o for p, o in zip(parts, tok_off)],
        "node_parent": [
            np.where(p["node_parent"] >= 0, p["node_parent"] + o, -1) for p, o in zip(parts, node_off)
        ],
        "path_index": [p["path_index"] + o for p, o in zip(parts, tok_off)],
    }
    lengths = np.concatenate([t.path_lengths for t in trees])
    out = {k: torch.from_numpy(np.concatenate(v).astype(np.int64, copy=False)) for k, v in shifted.items()}
    out["path_offsets"] = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return PackedTree(**out, trees=tuple(trees), **_forest_images(trees))


def _forest_images(trees: Sequence[TrajectoryTree]) -> dict:
    """The forest's images, tree by tree, and each DFS token's index into them and feature row.

    Each tree's distinct images are its own: a forest of several trees (partition parts, a
    micro-batch of records, the per-path baseline's one-path trees) encodes an image once per tree
    that holds it, as the parts or paths run alone would, never once for all of them."""
    if all(t.image_table is None for t in trees):
        return {}
    images, index, row = [], [], []
    for t in trees:
        table = t.image_table
        if table is None:
            index.append(np.full(t.num_tokens, -1, dtype=np.int64))
            row.append(np.full(t.num_tokens, -1, dtype=np.int64))
            continue
        index.append(np.where(table.image >= 0, table.image + len(images), -1))
        row.append(table.row)
        images.extend(table.images)
    return {
        "image_index": torch.from_numpy(np.concatenate(index)),
        "image_row": torch.from_numpy(np.concatenate(row)),
        "images": tuple(images),
    }
