"""Hypothesis strategies for random trees of token paths."""

from __future__ import annotations

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
