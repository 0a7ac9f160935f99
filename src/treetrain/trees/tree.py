"""``TrajectoryTree``: a compressed prefix tree (trie) of token paths, stored in DFS order.

The tree *is* its DFS serialization: ``tokens[t]`` is the t-th distinct token in depth-first
order, a node is a contiguous range ``[node_start, node_end)`` of it, and a node's subtree is the
contiguous range ``[node_start, node_subtree_end)``. Several roots (paths that share no first
token) make a forest, which needs nothing extra.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]``::

    tokens          A B C D E F G H
    positions       0 1 2 3 2 3 1 2
    nodes           [A] [B] [C D] [E F] [G H]        (A has children B and G; B has C D and E F)
    node_parent     -1   0    1     1     0
    path_index[1] = [0, 1, 4, 5]                   (DFS index of every token of path 1)

Building sorts the paths (big-endian bytes compare like token lists), so paths sharing a prefix are
adjacent, and takes each path's longest common prefix (LCP) with its predecessor: Python work is per
path, token work is numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from treetrain.trees.images import ImageInput, ImageTable, keyed_paths, resolve_keys

__all__ = ["TrajectoryTree"]

PER_TOKEN_FIELDS = ("loss_masks", "advantages")  # one value per path token: len(path)
PER_TARGET_FIELDS = ("old_logprobs", "ref_logprobs")  # one value per predicted token: len(path) - 1
PER_PATH_SCALARS = ("weights", "margins", "rewards")  # one number per path (margins: preference pairs)
PER_PATH_IMAGES = "images"  # per path: its ImageInputs, in order of their placeholders (trees.images)


def _as_path(path, i: int) -> np.ndarray:
    """Validate path ``i`` and return it as int64 ``[L]``."""
    try:
        arr = np.asarray(path)
    except (ValueError, TypeError) as e:
        raise ValueError(f"path {i}: not a flat sequence of token ids ({e})") from None
    if arr.ndim != 1:
        raise ValueError(f"path {i}: expected a flat list of token ids, got an array of shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"path {i}: empty path; every path needs at least one token")
    if arr.dtype.kind not in "iu":
        bad = next((x for x in np.asarray(path, dtype=object).ravel() if not _is_int(x)), None)
        raise ValueError(f"path {i}: token ids must be integers, got {bad!r} ({type(bad).__name__})")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        j = int(np.argmax(arr < 0))
        raise ValueError(f"path {i}: token ids must be >= 0, got {int(arr[j])} at position {j}")
    return arr.astype(np.int64, copy=False)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _flatten(paths: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Validated paths -> ``flat [N]`` int64 and ``offsets [P + 1]``. Errors name the path."""
    lengths = np.fromiter((len(p) if hasattr(p, "__len__") else -1 for p in paths), np.int64, len(paths))
    if (lengths <= 0).any():
        i = int(np.argmax(lengths <= 0))
        return np.concatenate([_as_path(paths[i], i)]), lengths  # raises with the reason
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if all(type(p) is list for p in paths):  # fast path: one conversion for all tokens
        try:
            flat = np.array(list(itertools.chain.from_iterable(paths)))
        except (ValueError, TypeError):
            flat = None
        if flat is not None and flat.ndim == 1 and flat.dtype.kind in "iu":
            if flat.dtype.kind == "i" and flat.size and int(flat.min()) < 0:
                i = int(np.searchsorted(offsets, int(np.argmax(flat < 0)), side="right")) - 1
                _as_path(paths[i], i)  # raises: names the path and position
            return flat.astype(np.int64, copy=False), offsets
    return np.concatenate([_as_path(p, i) for i, p in enumerate(paths)]), offsets


def _sorted_lcps(
    flat: np.ndarray, offsets: np.ndarray, groups: np.ndarray | None = None
) -> tuple[list[int], np.ndarray]:
    """Paths in lexicographic order (by group first) and each one's LCP with its predecessor (0 for
    the first, and for the first of a group).

    Vectorized over all tokens: for consecutive pairs, compare positions ``[0, min(len))`` at once
    and take the first mismatch per pair.
    """
    P = offsets.size - 1
    be = flat.astype(">i8").tobytes()  # big-endian bytes of ids >= 0 compare like token lists
    keys = [be[8 * offsets[i] : 8 * offsets[i + 1]] for i in range(P)]
    if groups is not None:  # group ranks (>= 0) as a big-endian prefix: groups sort first
        rank = np.unique(groups, return_inverse=True)[1].astype(">i8").tobytes()
        keys = [rank[8 * i : 8 * i + 8] + k for i, k in enumerate(keys)]
    order = sorted(range(P), key=keys.__getitem__)
    if P == 1:
        return order, np.zeros(1, dtype=np.int64)
    o = np.asarray(order)
    start, length = offsets[o], offsets[o + 1] - offsets[o]
    m = np.minimum(length[:-1], length[1:])  # >= 1: paths are non-empty
    seg = np.repeat(np.arange(P - 1), m)
    j = np.arange(seg.size) - np.repeat(np.cumsum(m) - m, m)
    differ = flat[start[:-1][seg] + j] != flat[start[1:][seg] + j]
    first = np.minimum.reduceat(np.where(differ, j, m[seg]), np.cumsum(m) - m)
    if groups is not None:  # paths of different groups share nothing
        first = np.where(groups[o[1:]] == groups[o[:-1]], first, 0)
    return order, np.concatenate([[0], first])


@dataclass(eq=False)
class TrajectoryTree:
    """A prefix tree of token paths with per-path metadata. Build with :meth:`from_paths`.

    Arrays (``T`` distinct tokens, ``N`` nodes, ``P`` paths):
      tokens, positions [T]; node_start, node_end, node_parent, node_subtree_end [N] (nodes in DFS
      order); path_leaf [P] (the node a path ends in); path_index: P arrays, ``[len(path)]`` each.
    Per-path metadata: ``loss_masks`` (P arrays ``[len]`` of 0/1), ``weights [P]``, ``advantages``
    (``[P]`` scalars or P arrays ``[len]``), ``old_logprobs``/``ref_logprobs`` (P arrays ``[len-1]``),
    ``path_ids [P]`` (index of each path in the tree it was cut from, for partitions);
    ``path_groups [P]`` or None: paths in different groups share no token (:meth:`split_by`).
    """

    tokens: np.ndarray
    positions: np.ndarray
    node_start: np.ndarray
    node_end: np.ndarray
    node_parent: np.ndarray
    node_subtree_end: np.ndarray
    path_leaf: np.ndarray
    path_index: list[np.ndarray]
    path_ids: np.ndarray
    fields: dict = field(default_factory=dict)
    path_groups: np.ndarray | None = None  # [P] int64: paths of different groups share no token
    image_table: ImageTable | None = None  # the images of the tree's tokens (None: text only)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_paths(
        cls,
        paths: Sequence[Sequence[int]],
        *,
        loss_masks: Sequence[Sequence[int]] | None = None,
        weights: Sequence[float] | None = None,
        advantages=None,
        old_logprobs: Sequence[Sequence[float]] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
        path_ids: Sequence[int] | None = None,
        margins: Sequence[float] | None = None,
        rewards: Sequence[float] | None = None,
        groups: Sequence[int] | None = None,
        images: Sequence[Sequence[ImageInput] | None] | None = None,
    ) -> TrajectoryTree:
        """Merge token paths into a prefix tree. Duplicates and prefix paths are kept as paths.

        ``paths[i]`` is a list (or 1-D array/tensor) of non-negative token ids. ``margins`` (a
        preference pair's margin, on both of its paths) and ``rewards`` are one number per path.
        ``groups`` (one int per path): paths of different groups share no token, not even a common
        prefix (each group its own trees, in group order); see :meth:`split_by`.
        ``images`` (one list of :class:`~treetrain.trees.images.ImageInput` per path, in the order of
        their placeholder tokens; None or ``[]`` for a text-only path): a placeholder token is keyed
        by its image's content hash and feature row, so paths with different pixels part at the image
        and the same image reached by several paths is one set of tokens (``trees.images``).
        """
        if not isinstance(paths, Sequence) or isinstance(paths, (str, bytes)) or len(paths) == 0:
            raise ValueError("paths: expected a non-empty list of token-id lists")
        table = None
        if images is not None:
            if not isinstance(images, Sequence) or len(images) != len(paths):
                n = len(images) if isinstance(images, Sequence) else type(images).__name__
                raise ValueError(f"images: expected one list of images per path ({len(paths)}), got {n}")
            images = [list(x) if x is not None else [] for x in images]
            if any(images):
                flat, offsets = _flatten(paths)
                keyed, table = keyed_paths(np.split(flat, offsets[1:-1]), images)
                paths = keyed
            else:
                images = None
        flat, offsets = _flatten(paths)
        fields = _validate_fields(
            np.diff(offsets).tolist(),
            loss_masks=loss_masks,
            weights=weights,
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            margins=margins,
            rewards=rewards,
        )
        group_arr = None
        if groups is not None:
            group_arr = np.asarray(groups, dtype=np.int64)
            if group_arr.shape != (len(paths),):
                raise ValueError(f"groups: expected one int per path ({len(paths)}), got {group_arr.shape}")
        tree = _build(flat, offsets, group_arr)
        if table is not None:
            tree.tokens, tree.image_table = resolve_keys(tree.tokens, table)
            fields["images"] = images
        tree.fields = fields
        tree.path_groups = group_arr
        if path_ids is not None:
            tree.path_ids = np.asarray(path_ids, dtype=np.int64)
            assert tree.path_ids.shape == (len(paths),)
        return tree

    @classmethod
    def from_nodes(
        cls,
        parents: Sequence[int],
        segments: Sequence[Sequence[int]],
        **path_fields,
    ) -> TrajectoryTree:
        """Build from an explicit tree: node ``i`` has token segment ``segments[i]`` and parent
        ``parents[i]`` (``-1`` for a root; parents must come before children). Every leaf becomes
        one path (root-to-leaf, in node order); ``path_fields`` are per-leaf, as in
        :meth:`from_paths`.
        """
        if len(parents) != len(segments) or len(parents) == 0:
            raise ValueError(
                f"tree: need one parent per node and at least one node, got {len(parents)} parents "
                f"and {len(segments)} segments"
            )
        has_child = np.zeros(len(parents), dtype=bool)
        for i, p in enumerate(parents):
            if not _is_int(p) or not -1 <= p < i:
                raise ValueError(
                    f"node {i}: parent must be -1 (root) or the index of an earlier node, got {p!r}"
                )
            if p >= 0:
                has_child[p] = True
        segs = []
        for i, s in enumerate(segments):
            if len(s) == 0 and parents[i] == -1:
                raise ValueError(f"node {i}: a root node needs at least one token")
            segs.append(_as_path(s, i) if len(s) else np.zeros(0, dtype=np.int64))
        prefix: list[np.ndarray] = []
        for i, p in enumerate(parents):
            prefix.append(segs[i] if p == -1 else np.concatenate([prefix[p], segs[i]]))
        paths = [prefix[i] for i in range(len(parents)) if not has_child[i]]
        return cls.from_paths(paths, **path_fields)

    # ---- sizes and statistics -----------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Distinct tokens: what the tree forward computes."""
        return int(self.tokens.size)

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def num_paths(self) -> int:
        return len(self.path_index)

    @property
    def path_lengths(self) -> np.ndarray:
        return np.array([p.size for p in self.path_index], dtype=np.int64)

    @property
    def num_path_tokens(self) -> int:
        """Sum of path lengths: what the per-path baseline computes."""
        return int(self.path_lengths.sum())

    @property
    def por(self) -> float:
        """Potential overlap ratio, ``1 - tree_tokens / baseline_tokens``."""
        return 1.0 - self.num_tokens / self.num_path_tokens

    def path(self, i: int) -> np.ndarray:
        """Tokens of path ``i`` (input order)."""
        return self.tokens[self.path_index[i]]

    def paths(self) -> list[np.ndarray]:
        return [self.path(i) for i in range(self.num_paths)]

    @property
    def node_depth(self) -> np.ndarray:
        """Node level in the node tree (roots are 0) ``[N]``; parents precede children."""
        depth = np.zeros(self.num_nodes, dtype=np.int64)
        for n in range(self.num_nodes):  # nodes are in DFS order: a parent is always seen first
            p = self.node_parent[n]
            if p >= 0:
                depth[n] = depth[p] + 1
        return depth

    def path_counts(self) -> np.ndarray:
        """How many paths run through each distinct token ``[T]`` (the baseline's reuse count)."""
        return np.bincount(np.concatenate(self.path_index), minlength=self.num_tokens)

    def subset(self, path_ids: Sequence[int]) -> TrajectoryTree:
        """A new tree of the given paths (indices into this tree), with their metadata and groups."""
        ids = [int(i) for i in path_ids]
        sub = {k: _take(v, ids) for k, v in self.fields.items()}
        groups = None if self.path_groups is None else self.path_groups[ids]
        return TrajectoryTree.from_paths(
            [self.path(i) for i in ids], path_ids=self.path_ids[ids], groups=groups, **sub
        )

    def split_by(self, keys: Sequence[int]) -> TrajectoryTree:
        """This tree with paths of different ``keys`` (one int per path) sharing no token.

        Every path, its position in the path order, ``path_ids`` and metadata stay as they are; a
        prefix shared by paths of several keys is repeated once per key (each key's paths form trees
        of their own). ``keys`` become :attr:`path_groups` (combined with groups the tree already
        has). Rebuilds only when some token is shared across keys.

        Example: paths ``[1 2 3]``, ``[1 2 4]``, ``[1 5]`` with keys ``[0, 1, 0]``: 7 tokens
        (``1 2 3 5`` and ``1 2 4``) instead of 5; ``path(1)`` is still ``[1 2 4]``.
        """
        keys = np.asarray(keys, dtype=np.int64)
        if keys.shape != (self.num_paths,):
            raise ValueError(f"keys: expected one int per path ({self.num_paths}), got {keys.shape}")
        if self.path_groups is not None and not np.array_equal(self.path_groups, keys):
            keys = np.unique(np.stack([self.path_groups, keys], 1), axis=0, return_inverse=True)[1].ravel()
        index = np.concatenate(self.path_index)
        per_token = np.repeat(keys, self.path_lengths)
        lo = np.full(self.num_tokens, np.iinfo(np.int64).max)
        hi = np.full(self.num_tokens, np.iinfo(np.int64).min)
        np.minimum.at(lo, index, per_token)
        np.maximum.at(hi, index, per_token)
        if (lo == hi).all():  # no token is shared across keys: the same trie
            return dataclasses.replace(self, path_groups=keys)
        sub = {k: _take(v, list(range(self.num_paths))) for k, v in self.fields.items()}
        return TrajectoryTree.from_paths(self.paths(), path_ids=self.path_ids, groups=keys, **sub)

    # ---- display ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"TrajectoryTree(paths={self.num_paths}, nodes={self.num_nodes}, tokens={self.num_tokens}, "
            f"path_tokens={self.num_path_tokens}, por={self.por:.1%})"
        )

    def render(self, max_tokens: int = 8, decode=None) -> str:
        """Indented text drawing of the node tree, one node a line, paths ending there in brackets."""
        ends: dict[int, list[int]] = {}
        for p, leaf in enumerate(self.path_leaf):
            ends.setdefault(int(leaf), []).append(p)
        depth = self.node_depth
        lines = [repr(self)]
        for n in range(self.num_nodes):
            seg = self.tokens[self.node_start[n] : self.node_end[n]].tolist()
            shown = decode(seg) if decode else " ".join(map(str, seg[:max_tokens]))
            more = "" if decode or len(seg) <= max_tokens else f" ... (+{len(seg) - max_tokens})"
            tail = f"  [path {', '.join(map(str, ends[n]))}]" if n in ends else ""
            lines.append(f"{'  ' * int(depth[n])}- {shown}{more}{tail}")
        return "\n".join(lines)


def _take(value, ids: list[int]):
    if isinstance(value, np.ndarray):
        return value[ids]
    return [value[i] for i in ids]


def _validate_fields(lengths: list[int], **given) -> dict:
    """Check per-path metadata lengths; errors name the field and the path."""
    P = len(lengths)
    out = {}
    for name, value in given.items():
        if value is None:
            continue
        if len(value) != P:
            raise ValueError(f"{name}: expected one entry per path ({P}), got {len(value)}")
        if name in PER_PATH_SCALARS:
            out[name] = np.asarray(value, dtype=np.float64)
            if out[name].shape != (P,) or not np.isfinite(out[name]).all():
                raise ValueError(f"{name}: expected one finite number per path, got {value}")
            continue
        if name == "advantages" and all(np.ndim(a) == 0 for a in value):
            out[name] = np.asarray(value, dtype=np.float64)
            continue
        per = []
        for i, (v, L) in enumerate(zip(value, lengths)):
            want = L - 1 if name in PER_TARGET_FIELDS else L
            arr = np.asarray(v, dtype=np.float64)
            if arr.ndim != 1 or arr.size != want:
                rule = "len(path) - 1 (one per predicted token)" if want == L - 1 else "len(path)"
                raise ValueError(
                    f"{name}[{i}]: expected {want} values ({rule}), got shape {tuple(arr.shape)}"
                )
            if name == "loss_masks" and not np.isin(arr, (0.0, 1.0)).all():
                raise ValueError(f"loss_masks[{i}]: values must be 0 or 1")
            per.append(arr)
        out[name] = per
    return out


def _build(flat: np.ndarray, offsets: np.ndarray, groups: np.ndarray | None = None) -> TrajectoryTree:
    """Compressed trie from validated paths, in one pass over the paths in sorted order.

    A stack holds the current root-to-leaf chain of nodes. For each path (sorted), nodes deeper than
    its LCP with the previous path are closed; a node straddling the LCP is split (its upper part
    becomes a new node, so ids held by paths ending in the lower part stay valid); the path's new
    suffix becomes one new node.
    """
    P = offsets.size - 1
    order, lcps = _sorted_lcps(flat, offsets, groups)
    lcps = lcps.tolist()
    offs = offsets.tolist()
    # node fields, in creation order (remapped to DFS order at the end)
    n_start: list[int] = []
    n_end: list[int] = []
    n_d0: list[int] = []  # depth (path position) of the node's first token
    n_parent: list[int] = []
    n_sub: list[int] = []
    new_src: list[int] = []  # flat offsets of each path's new suffix
    new_len: list[int] = []
    path_leaf = [0] * P
    path_index: list[np.ndarray] = [None] * P  # type: ignore[list-item]
    stack: list[int] = []
    T = 0
    prev_index = np.zeros(0, dtype=np.int64)

    for i, lcp in zip(order, lcps):
        size = offs[i + 1] - offs[i]
        while stack and n_d0[stack[-1]] >= lcp:
            n_sub[stack.pop()] = T
        if stack and n_d0[stack[-1]] + (n_end[stack[-1]] - n_start[stack[-1]]) > lcp:
            low = stack.pop()  # keeps its id: it is [lcp, end), a new upper node takes [d0, lcp)
            cut = n_start[low] + lcp - n_d0[low]
            up = len(n_start)
            n_start.append(n_start[low])
            n_end.append(cut)
            n_d0.append(n_d0[low])
            n_parent.append(n_parent[low])
            n_sub.append(-1)
            n_start[low], n_d0[low], n_parent[low], n_sub[low] = cut, lcp, up, T
            stack.append(up)
        if size > lcp:
            node = len(n_start)
            n_start.append(T)
            n_end.append(T + size - lcp)
            n_d0.append(lcp)
            n_parent.append(stack[-1] if stack else -1)
            n_sub.append(-1)
            stack.append(node)
            new_src.append(offs[i] + lcp)
            new_len.append(size - lcp)
            index = np.concatenate([prev_index[:lcp], np.arange(T, T + size - lcp)])
            T += size - lcp
        else:  # a duplicate of, or a prefix of, the previous path: it ends where a node ends
            index = prev_index[:size]
        path_leaf[i] = stack[-1]
        path_index[i] = index
        prev_index = index
    for n in stack:
        n_sub[n] = T

    src, ln = np.array(new_src, dtype=np.int64), np.array(new_len, dtype=np.int64)
    tokens = flat[np.repeat(src - (np.cumsum(ln) - ln), ln) + np.arange(T)]
    start = np.array(n_start, dtype=np.int64)
    dfs = np.argsort(start, kind="stable")
    rank = np.empty_like(dfs)
    rank[dfs] = np.arange(dfs.size)
    parent = np.array(n_parent, dtype=np.int64)[dfs]
    parent = np.where(parent >= 0, rank[np.maximum(parent, 0)], -1)
    node_start = start[dfs]
    node_end = np.array(n_end, dtype=np.int64)[dfs]
    positions = np.repeat(np.array(n_d0, dtype=np.int64)[dfs] - node_start, node_end - node_start)
    positions += np.arange(T)
    return TrajectoryTree(
        tokens=tokens,
        positions=positions,
        node_start=node_start,
        node_end=node_end,
        node_parent=parent,
        node_subtree_end=np.array(n_sub, dtype=np.int64)[dfs],
        path_leaf=rank[np.array(path_leaf, dtype=np.int64)],
        path_index=path_index,
        path_ids=np.arange(P, dtype=np.int64),
    )
