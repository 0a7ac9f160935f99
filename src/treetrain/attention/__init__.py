"""Tree attention backends over one mask representation (``subtree_end``).

Every backend is ``fn(q [Hq, T, D], k [Hkv, T, D], v [Hkv, T, D], mask: TreeMask, scale) -> [Hq, T, D]``.

May import: trees.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

import torch

from treetrain.attention.dense import dense_attention
from treetrain.attention.mask import TreeMask, block_classes, dense_tree_mask

__all__ = [
    "BACKENDS",
    "FEATURES",
    "check_features",
    "TreeMask",
    "backend_for",
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


# what each backend computes besides the tree mask (keyword arguments it takes)
FEATURES: dict[str, frozenset[str]] = {
    "dense": frozenset({"window", "softcap", "sinks", "alibi", "rel_bias", "key_start", "selection"}),
    "blocksparse": frozenset({"window", "sinks", "alibi", "rel_bias", "key_start"}),
    "flex": frozenset({"window", "softcap", "sinks", "alibi", "rel_bias", "key_start"}),
    "triton": frozenset({"window", "sinks", "alibi"}),
    "cp": frozenset(),
    "depth_first": frozenset(),
}
_FEATURE_NAMES = {
    "window": "sliding-window attention",
    "softcap": "attention logit softcapping",
    "sinks": "attention sinks",
    "alibi": "ALiBi position bias",
    "rel_bias": "a learned relative position bias per query and path distance",
    "key_start": "bidirectional attention inside image blocks",
    "selection": "a sparse attention's per-query key selection (an indexer's top-k keys or blocks)",
}


def check_features(name: str, features) -> None:
    """``ValueError`` naming the first of ``features`` that backend ``name`` cannot compute and the
    backends that can."""
    for f in sorted(features):
        if f not in FEATURES.get(name, frozenset()):
            can = [b for b, fs in FEATURES.items() if f in fs and b not in ("cp", "depth_first")]
            raise ValueError(
                f"attention backend {name!r} does not support {_FEATURE_NAMES.get(f, f)} ({f}), which "
                f"this model uses; use attention backend {' or '.join(repr(b) for b in can)}"
            )


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: unknown, choose one of {sorted(BACKENDS)}")
    module, fn = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here: {e}") from None


def _unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here (None: it can)."""
    if name == "triton":
        try:
            from treetrain.attention.triton_kernel import triton_available
        except ImportError as e:
            return str(e)
        return None if triton_available() else "triton is not installed or has no CUDA device here"
    try:
        get_backend(name)
    except ValueError as e:
        return str(e)
    return None


_announced: set[tuple[str, str]] = set()


def _fallback(chosen: str, preferred: str, why: str) -> str:
    """Say once per process which backend runs instead of the preferred one, and why."""
    if (chosen, preferred) not in _announced:
        _announced.add((chosen, preferred))
        cost = ": it builds the T x T mask, O(T^2) time and memory" if chosen == "dense" else ""
        warnings.warn(
            f"tree attention runs the {chosen!r} backend{cost}, because {preferred!r} is unavailable "
            f"({why}); pass backend={chosen!r} explicitly to silence this",
            RuntimeWarning,
            stacklevel=3,
        )
    return chosen


def default_backend(device: torch.device | str) -> str:
    """``triton`` (else ``flex``) on CUDA, ``blocksparse`` (else ``dense``) elsewhere; a fallback
    warns once, naming the backend that runs and why the preferred one cannot."""
    if torch.device(device).type == "cuda":
        why = _unavailable("triton")
        return "triton" if why is None else _fallback("flex", "triton", why)
    why = _unavailable("blocksparse")
    return "blocksparse" if why is None else _fallback("dense", "blocksparse", why)


def backend_for(device: torch.device | str, features=()) -> str:
    """The backend to run a model that uses ``features`` (names of :data:`FEATURES`) on ``device``:
    :func:`default_backend` when it computes all of them, else the first that does in the device's
    order (CUDA: ``flex``, then ``dense``; elsewhere ``dense``). E.g. Gemma 2's ``softcap`` on CUDA,
    where the default ``triton`` has none: ``flex``."""
    name = default_backend(device)
    wanted = frozenset(features)
    order = ("flex", "dense") if torch.device(device).type == "cuda" else ("dense",)
    for b in (name, *order):
        if wanted <= FEATURES[b]:
            return b
    check_features(name, wanted)  # raises, naming the feature
    return name
