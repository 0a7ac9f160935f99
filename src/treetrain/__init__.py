"""treetrain: train LLMs on tree-structured agent trajectories."""

from treetrain.logprobs import expand_to_paths, path_logprobs, tree_logprobs
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.tree import TrajectoryTree

__version__ = "0.1.0"

__all__ = ["PackedTree", "TrajectoryTree", "expand_to_paths", "pack", "path_logprobs", "tree_logprobs"]
