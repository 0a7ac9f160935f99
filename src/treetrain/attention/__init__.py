"""Tree attention backends over one mask representation (``subtree_end``).

Every backend is ``fn(q [Hq, T, D], k [Hkv, T, D], v [Hkv, T, D], mask: TreeMask, scale) -> [Hq, T, D]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .dense import dense_attention
from .mask import TreeMask, block_classes, dense_tree_mask

__all__ = [
    "BACKENDS",
    "TreeMask",
    "block_classes",
    "default_backend",
    "dense_attention",
    "dense_tree_mask",
    "get_backend",
]

# name -> (module, function); imported on first use so optional dependencies stay optional
BACKENDS: dict[str, tuple[str, str]] = {
    "dense": ("treetrain.attention.dense", "dense_attention"),
    "blocksparse": ("treetrain.attention.blocksparse", "blocksparse_attention"),
    "flex": ("treetrain.attention.flex", "flex_tree_attention"),
    "triton": ("treetrain.attention.triton_kernel", "triton_tree_attention"),
    "cp": ("treetrain.parallel.cp", "cp_attention"),  # context parallel (inside parallel.cp only)
    "depth_first": ("treetrain.parallel.depth_first", "stack_attention"),  # inside parallel.depth_first
}


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: unknown, choose one of {sorted(BACKENDS)}")
    module, fn = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here: {e}") from None


def _importable(name: str) -> bool:
    try:
        get_backend(name)
        return True
    except ValueError:
        return False


def _triton_ok() -> bool:
    try:
        from .triton_kernel import triton_available
    except ImportError:
        return False
    return triton_available()


def default_backend(device: torch.device | str) -> str:
    """``triton`` (else ``flex``) on CUDA, ``blocksparse`` (else ``dense``) elsewhere."""
    if torch.device(device).type == "cuda":
        return "triton" if _triton_ok() else "flex"
    return "blocksparse" if _importable("blocksparse") else "dense"
