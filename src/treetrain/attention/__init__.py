"""Tree attention backends over one mask representation (``subtree_end``)."""

from .dense import dense_attention
from .mask import TreeMask, dense_tree_mask

__all__ = ["TreeMask", "dense_attention", "dense_tree_mask"]
