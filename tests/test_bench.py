"""treetrain bench end to end on a tiny model: both modes agree and every field is reported."""

from __future__ import annotations

import json

import pytest

from treetrain.bench.cases import group_tree, per_turn_tree
from treetrain.cli import main


def test_synthetic_trees_have_the_requested_por():
    for por in (0.2, 0.5, 0.92):
        tree = group_tree(por, paths=16, length=100, vocab=50)
        assert tree.num_path_tokens == 1600 and abs(tree.por - por) < 0.01
    chain = per_turn_tree(turns=10, turn_len=20, vocab=50)
    assert chain.num_tokens == 200 and chain.num_path_tokens == 20 * 55
    with pytest.raises(ValueError, match="--por 0.99"):
        group_tree(0.99, paths=4, length=100, vocab=50)


def test_sample_by_kind_keeps_the_smallest_tree_of_each_kind():
    import argparse

    from treetrain.bench.command import _cases

    args = argparse.Namespace(por=[], turns=0, one_path=0, sample=True, sample_by_kind=True, sample_trees=1)
    cases = _cases(args, vocab=151_936)
    # the bundled sample's smallest per-turn tree: airline-16 (16 paths, 16,045 path tokens); smallest
    # group tree: airline-12 (6 paths, 6,137); their shapes kept by the renumbering
    assert [(name, [(t.num_paths, t.num_path_tokens) for t in trees]) for name, trees in cases] == [
        ("sample per-turn (1 trees)", [(16, 16045)]),
        ("sample group (1 trees)", [(6, 6137)]),
    ]


def test_baseline_budgets_to_search():
    from treetrain.bench.cases import ONE_PATH
    from treetrain.bench.command import baseline_budgets

    trees = [per_turn_tree(turns=3, turn_len=16, vocab=50)]  # paths of 16, 32 and 48 tokens
    assert baseline_budgets(trees, 4096) == (4096, 48, ONE_PATH)


@pytest.mark.slow
def test_bench_cli_small(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "64"]
    argv += ["--paths", "4", "--path-len", "48", "--por", "0.5", "--turns", "3", "--turn-len", "16"]
    argv += ["--one-path", "40", "--repeats", "1", "--capacity", "96", "--memory"]
    assert main(argv + ["--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["matmul_gflops"] > 0
    assert [r["name"] for r in results] == ["group POR 50%", "per-turn 3 turns", "one path 40"]
    for r in results:
        assert r["max_logprob_diff"] < 1e-4  # float32: the same log-probs from both modes
        assert r["loss_diff"] < 1e-4
        assert r["flop_bound"] >= 1 and r["speedup"] > 0 and r["baseline_peak_mb"] >= 0
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["flop_bound"])
        assert r["tree_mfu"] > 0 and r["baseline_mfu"] > 0
        # the baseline's budget searched: the tree's, --capacity 96, the longest path's, one path
        assert r["baseline_capacity"] in {-1, 96, r["computed_tokens"], 48, 40, 16 * 3}
    assert results[0]["flop_bound"] > 1 and results[0]["hf_s"] is None
    assert results[2]["flop_bound"] == 1 and results[2]["hf_s"] > 0  # one path: a plain HF step too
    assert png.stat().st_size > 1000
