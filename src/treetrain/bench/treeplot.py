"""``treetrain stats --plot out.png``: a picture of a dataset's trees.

Left: one tree drawn along token positions: each node a horizontal bar from its first to its last
token's position, stacked by leaf order, joined to its parent at the branch point; bar width and
colour grow with the number of paths that run through it (the shared tokens are the thick, dark
bars). Right: over every tree, path tokens (what a per-path baseline computes) and distinct tokens
(what the tree computes) at each position: the gap is the shared tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from treetrain.trees.tree import TrajectoryTree

__all__ = ["layout", "plot_trees", "tree_shape"]


def tree_shape(tree: TrajectoryTree) -> dict[str, float]:
    """Depth (longest path, tokens), node levels, branching (children per inner node), sharing.

    >>> tree_shape(TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 5]]))["max_branching"]
    2
    """
    children = np.bincount(tree.node_parent[tree.node_parent >= 0], minlength=tree.num_nodes)
    inner = children[children > 0]
    return {
        "depth": int(tree.path_lengths.max()),
        "levels": int(tree.node_depth.max()) + 1,
        "max_branching": int(children.max(initial=0)),
        "mean_branching": float(inner.mean()) if inner.size else 0.0,
        "shared_tokens": int((tree.path_counts() > 1).sum()),
        "por": tree.por,
    }


def layout(tree: TrajectoryTree) -> np.ndarray:
    """Row of each node ``[N]``: leaves 0, 1, ... in DFS order; an inner node at its children's mean.

    >>> layout(TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4]])).tolist()  # nodes [1 2], [3], [4]
    [0.5, 0.0, 1.0]
    """
    n = tree.num_nodes
    parent = tree.node_parent
    has_child = np.zeros(n, dtype=bool)
    has_child[parent[parent >= 0]] = True
    y = np.zeros(n)
    y[~has_child] = np.arange(int((~has_child).sum()))
    total, count = np.zeros(n), np.zeros(n)
    for node in range(n - 1, -1, -1):  # DFS order: children after their parent
        if has_child[node]:
            y[node] = total[node] / count[node]
        if parent[node] >= 0:
            total[parent[node]] += y[node]
            count[parent[node]] += 1
    return y


def plot_trees(trees: Sequence[TrajectoryTree], out: str | Path, index: int = 0) -> Path:
    """Draw tree ``index`` and the dataset's per-position sharing into ``out`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'treetrain[plot]'") from None
    if not 0 <= index < len(trees):
        raise ValueError(f"--plot-tree {index}: the data has {len(trees)} trees")
    tree = trees[index]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})

    y, counts = layout(tree), tree.path_counts()
    cmap = plt.get_cmap("viridis_r")
    top = max(int(counts.max()), 2)
    for node in range(tree.num_nodes):
        s, e = int(tree.node_start[node]), int(tree.node_end[node])
        if e == s:  # an empty node (a path that ends at a branch point)
            continue
        x0, x1 = int(tree.positions[s]), int(tree.positions[e - 1]) + 1
        c = int(counts[s])
        share = (c - 1) / (top - 1)  # 0: one path, 1: the most shared
        style = dict(color=cmap(share), linewidth=1 + 5 * share)
        ax.plot([x0, x1], [y[node], y[node]], solid_capstyle="butt", **style)
        if tree.node_parent[node] >= 0:
            ax.plot([x0, x0], [y[tree.node_parent[node]], y[node]], color="0.6", linewidth=0.8)
    shape = tree_shape(tree)
    ax.set_title(
        f"tree {index}: {tree.num_paths} paths, {tree.num_tokens:,} distinct / {tree.num_path_tokens:,} "
        f"path tokens (POR {tree.por:.0%})\ndepth {shape['depth']:,} tokens, {shape['levels']} levels, "
        f"branching up to {shape['max_branching']} (mean {shape['mean_branching']:.1f})",
        fontsize=10,
    )
    ax.set_xlabel("token position in the path")
    ax.set_ylabel("leaves (DFS order)")
    leaves = int(y.max()) + 1
    ax.set_ylim(leaves - 0.5, -0.5)  # leaf 0 on top
    ax.yaxis.get_major_locator().set_params(integer=True)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=matplotlib.colors.Normalize(1, top))
    fig.colorbar(sm, ax=ax, label="paths through the token")

    longest = max(int(t.path_lengths.max()) for t in trees)
    path_tok, tree_tok = np.zeros(longest), np.zeros(longest)
    for t in trees:
        path_tok += np.bincount(t.positions, weights=t.path_counts(), minlength=longest)
        tree_tok += np.bincount(t.positions, minlength=longest)
    x = np.arange(longest)
    ax2.fill_between(
        x, tree_tok, path_tok, step="post", alpha=0.4, label="shared (computed once by the tree)"
    )
    ax2.step(x, path_tok, where="post", label="path tokens (per-path baseline)")
    ax2.step(x, tree_tok, where="post", label="distinct tokens (tree)")
    base, distinct = path_tok.sum(), tree_tok.sum()
    ax2.set_title(
        f"all {len(trees)} trees: {distinct:,.0f} distinct / {base:,.0f} path tokens "
        f"(POR {1 - distinct / base:.0%})",
        fontsize=10,
    )
    ax2.set_xlabel("token position in the path")
    ax2.set_ylabel("tokens at that position")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
