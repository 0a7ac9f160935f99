"""treetrain: train LLMs on tree-structured agent trajectories."""

from .logprobs import expand_to_paths, path_logprobs, tree_logprobs
from .packing import PackedTree, pack
from .tree import TrajectoryTree

__version__ = "0.1.0"

__all__ = ["PackedTree", "TrajectoryTree", "expand_to_paths", "pack", "path_logprobs", "tree_logprobs"]
