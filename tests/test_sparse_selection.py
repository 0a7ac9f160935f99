"""Sparse attention's key selection on trees (treetrain.models.sparse_select, treetrain.attention.selected).

Every sparse-attention type (DeepSeek Sparse Attention: deepseek_v32, glm_moe_dsa and hy_v4 with a layer
reusing the previous one's selection, axk2, dots3_note_text; MiniMax-M3's sparse layers) on paths of
24-26 tokens, 4 to 6 times what the selection keeps, branching at positions 3, 7, 15 and 19 (inside
the ranges the selection picks from, odd: a block of 2 mixes a shared and a branch token): tree
log-probs, every parameter gradient and ``flat_logprobs`` equal each path's own HF forward in float64,
with the queries in several chunks. The tests check that the selection drops keys and that no tie sits
at HF's top-k boundary (where torch.topk's pick is implementation-defined). Small hand-written trees
pin the ancestor-only semantics.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers

from treetrain.attention import selected
from treetrain.attention.mask import TreeMask
from treetrain.attention.selected import KeySelection, selected_attention, visible_keys
from treetrain.integrations.flat import flat_logprobs
from treetrain.logprobs import path_logprobs
from treetrain.models.sparse_select import (
    BLOCK_INDEXERS,
    DSA_INDEXERS,
    PendingSelection,
    top_blocks,
    top_keys,
)

from . import zoo
from .hybrid_models import float64_everywhere
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err
from .zoo import causal_lm_types, zoo_model

# float64 end to end: summation order only (measured at most 4.6e-16 log-probs, 7.4e-15 gradients)
LOGP_TOL = 1e-12
GRAD_TOL = 1e-10

DSA = dict(index_topk=4)  # 4 of a path's 24-26 keys
# MiniMax-M3: its own block of 2 and the best other (4 keys); its own block of 3, the one before it
# (local blocks) and no other (6 keys)
BLOCKS = dict(index_block_size=2, index_topk_blocks=2, index_local_blocks=1)
LOCAL = dict(index_block_size=3, index_topk_blocks=2, index_local_blocks=2)
CASES = [
    ("deepseek_v32", DSA),
    ("glm_moe_dsa", DSA),
    ("axk2", DSA),
    ("hy_v4", DSA),
    ("dots3_note_text", DSA),
    ("minimax_m3_vl_text", BLOCKS),
    ("minimax_m3_vl_text", LOCAL),
]


def long_paths(seed: int = 5) -> list[list[int]]:
    """Five paths of 24-26 tokens, branching at positions 3, 7, 15 and 19."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, zoo.VOCAB, (n,), generator=g).tolist()  # noqa: E731
    base = draw(15)
    first = base + draw(11)
    return [first, base + draw(9), base[:7] + draw(18), base[:3] + draw(22), first[:19] + draw(6)]


def _indexers(model):
    return [m for m in model.modules() if type(m).__name__ in (*DSA_INDEXERS, *BLOCK_INDEXERS)]


@contextlib.contextmanager
def recorded_topk(model, record: list):
    """Record the ``(scores, top-k)`` of every ``Tensor.topk`` an unprepared model's indexers call."""
    real = torch.Tensor.topk

    def wrap(forward):
        def run(*args, **kwargs):
            def topk(x, *a, **k):
                out = real(x, *a, **k)
                record.append((x.detach().clone(), out.values.shape[-1]))
                return out

            torch.Tensor.topk = topk
            try:
                return forward(*args, **kwargs)
            finally:
                torch.Tensor.topk = real

        return run

    ixs = _indexers(model)
    for m in ixs:
        m.forward = wrap(m.forward)
    try:
        yield
    finally:
        for m in ixs:
            del m.forward


def boundary_ties(record: list) -> tuple[int, int]:
    """``(ties, dropping)``: query rows whose k-th and (k+1)-th best scores are equal while the (k+1)-th
    is a key it sees (a tie straddling the top-k boundary), and rows with more keys than k."""
    ties = dropping = 0
    for scores, k in record:
        if scores.shape[-1] <= k:
            continue
        ranked = scores.sort(dim=-1, descending=True).values
        seen = ranked[..., k] > torch.finfo(scores.dtype).min / 2  # eager's masked keys: score + min
        ties += int(((ranked[..., k - 1] == ranked[..., k]) & seen).sum())
        dropping += int(seen.sum())
    return ties, dropping


def _every_key(model_type: str, over: dict, monkeypatch):
    """The same model with a selection that keeps every key of the paths."""
    with monkeypatch.context() as m:
        for key in ("index_topk", "index_topk_blocks"):
            m.setitem(zoo.AWAY, key, 1000)
        return zoo_model(model_type)


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "over"), CASES, ids=lambda c: c if isinstance(c, str) else "")
def test_long_paths_exact(model_type, over, monkeypatch):
    if model_type not in causal_lm_types():
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    for key, value in over.items():
        monkeypatch.setitem(zoo.AWAY, key, value)
    monkeypatch.setattr(selected, "CHUNK_ELEMENTS", 4096)  # several chunks of queries (and of checkpoints)
    chosen: list[tuple[TreeMask, KeySelection]] = []
    tree_selection = PendingSelection.tree

    def recording(self, mask):
        out = tree_selection(self, mask)
        chosen.append((mask, out))
        return out

    monkeypatch.setattr(PendingSelection, "tree", recording)
    paths = long_paths()
    coeffs = random_coeffs(paths, seed=3)
    record: list = []
    with float64_everywhere():
        ref = zoo_model(model_type)
        tree = copy.deepcopy(ref)
        with recorded_topk(ref, record):
            want = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
        got = path_logprobs(tree, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
        L = max(map(len, paths))
        ids = torch.tensor([p + [0] * (L - len(p)) for p in paths])
        am = torch.tensor([[1] * len(p) + [0] * (L - len(p)) for p in paths])
        with torch.no_grad():
            flat = flat_logprobs(tree, ids, am)
            every_key = reference_logprobs(_every_key(model_type, over, monkeypatch), paths)
    ties, dropping = boundary_ties(record)
    assert ties == 0 and dropping > 0.7 * sum(map(len, paths)) * len(_indexers(ref))
    assert max(rel_err(a, b) for a, b in zip(got, want)) < LOGP_TOL
    g_tree, g_ref = grads(tree), grads(ref)
    assert grad_err(g_tree, g_ref) < GRAD_TOL
    # HF's indexers give their parameters no gradient (no_grad; integer indices): neither does the tree
    indexer_params = {n for n, _ in ref.named_parameters() if "indexer" in n}
    assert indexer_params and not indexer_params & (set(g_ref) | set(g_tree))
    assert max(rel_err(flat[b, 1 : len(p)], want[b].detach()) for b, p in enumerate(paths)) < LOGP_TOL
    assert max(rel_err(a, b) for a, b in zip(every_key, want)) > 1e-3  # the selection matters
    # the tree's selection keeps fewer keys than a query sees for most queries of every layer
    assert chosen
    for mask, sel in chosen:
        T = mask.num_tokens
        seen = visible_keys(mask, 0, T)
        kept = (seen & sel.keys(0, T)).sum(-1)  # [G, T]
        assert (kept < seen.sum(-1)).float().mean() > 0.7
        assert (kept >= 1).all()


def _two_branches() -> TreeMask:
    """Paths ``[A B C D]`` and ``[A B E F]``, DFS ``A B C D E F``."""
    return TreeMask(torch.tensor([6, 6, 4, 4, 6, 6]), position_ids=torch.tensor([0, 1, 2, 3, 2, 3]))


def test_top_keys_are_each_querys_own_ancestors():
    """DSA's top 2 by index score (the same per key for every query: A 5, B 1, C 4, D 3, E 2, F 0):
    E and F keep A and E, not C (better, but on the other branch)."""
    mask = _two_branches()
    index = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0, 0.0]).expand(6, 6)
    picked = top_keys(index, visible_keys(mask, 0, 6), 2)
    want = [{0}, {0, 1}, {0, 2}, {0, 2}, {0, 4}, {0, 4}]  # A, B, C, D, E, F
    assert [set(row) - {-1} for row in picked.tolist()] == want
    # the attention over them: each query's softmax over its kept keys, nothing else
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sel = KeySelection(picked[None], torch.arange(6))
    out = selected_attention(q, k[:1], v[:1], mask, 0.5, sel)
    for i, keys in enumerate(want):
        keys = sorted(keys)
        probs = torch.softmax((q[:, i] @ k[0, keys].T) * 0.5, dim=-1)
        # float64: the same few terms summed in another order
        torch.testing.assert_close(out[:, i], probs @ v[0, keys], rtol=1e-12, atol=1e-12)


def test_top_blocks_pool_each_querys_own_path():
    """MiniMax-M3's blocks of 2 along each path: ``[A B C D E F]`` and ``[A B C G H]`` (DFS ``A B C D E
    F G H``); ``[C G]`` is block 1 of the second path, a shared and a branch token. Key scores A 4, B 0,
    C 1, D 9, E 3, F 0, G 0, H 0; each query keeps its own block and the best other (2 blocks): F
    picks ``[C D]`` (9), H picks ``[A B]`` (4 beats ``[C G]``'s 1: D is not on its path)."""
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4])
    mask = TreeMask(torch.tensor([8, 8, 8, 6, 6, 6, 8, 8]), position_ids=pos)
    block = pos // 2
    scores = torch.tensor([4.0, 0.0, 1.0, 9.0, 3.0, 0.0, 0.0, 0.0]).expand(1, 8, 8)
    picked = top_blocks(scores, visible_keys(mask, 0, 8), block, block, 3, 2, 1)
    want = [{0}, {0}, {0, 1}, {0, 1}, {1, 2}, {1, 2}, {0, 1}, {0, 2}]  # A B C D E F G H
    assert [set(row) - {-1} for row in picked[0].tolist()] == want
    kept = visible_keys(mask, 0, 8) & KeySelection(picked, block).keys(0, 8)[0]
    assert kept[7].nonzero().flatten().tolist() == [0, 1, 7]  # H: A, B and itself
    assert kept[5].nonzero().flatten().tolist() == [2, 3, 4, 5]  # F: C, D, E, F
    assert kept[6].nonzero().flatten().tolist() == [0, 1, 2, 6]  # G: its blocks [A B] and [C G]


@pytest.mark.parametrize("backend", ["blocksparse", "flex", "triton", "cp", "depth_first"])
def test_backends_without_a_key_selection_are_refused(backend):
    model = zoo_model("deepseek_v32")
    with pytest.raises(ValueError, match=f"'{backend}' does not support a sparse attention's per-query key"):
        path_logprobs(model, long_paths()[:2], backend=backend)
