"""The hybrid benchmark's pieces (benchmarks/hybrids.py, treetrain.bench.families) at tiny sizes: the
family configs and their FLOP cost, the scan schedule counts on a hand-worked tree, and one family
end to end (both parts), with the modes' log-probs equal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from benchmarks.hybrids import deep_tree, parse_args, priced_bound, run, scan_work, shape_trees, wide_tree
from treetrain.bench import cases as bench
from treetrain.bench.families import FAMILIES, family_config, linear_flops
from treetrain.trees.flops import layer_kinds, mixer_cost
from treetrain.trees.packing import pack


def test_every_family_config_has_its_layer_mix_and_a_cost():
    want = {
        "gdn": ["gdn"] * 3 + ["attention"],
        "mamba2": ["mamba2", "none", "mamba2", "attention", "mamba2", "none"],
        "mamba": ["mamba", "mamba", "attention", "mamba"],
        "rglru": ["rglru", "rglru", "attention"] * 2,
        "rwkv": ["rwkv"] * 4,
        "alibi": ["attention"] * 4,
    }
    for family in FAMILIES:
        cfg = family_config(family, hidden=32, vocab=64)
        kinds = layer_kinds(cfg)
        assert kinds == want.get(family, kinds)
        recurrent, per_pair = mixer_cost(cfg)
        assert (recurrent > 0) == (family != "alibi") and (per_pair > 0) == ("attention" in kinds)
    with pytest.raises(ValueError, match="unknown family 'hyena'"):
        family_config("hyena")


def test_linear_flops_count_matmul_weights_only():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace()
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.conv = nn.Conv1d(8, 8, 4, groups=8)  # a recurrent layer's conv: counted with the recurrence
            self.mix = nn.Parameter(torch.zeros(1, 1, 8))  # RWKV's token-shift ratios: not a matrix

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    assert linear_flops(Tiny()) == 2 * (8 * 16 + 16 * 8) == 512


def test_scan_work_of_a_per_turn_tree():
    tree = bench.per_turn_tree(turns=3, turn_len=2, vocab=50)  # paths of 2, 4, 6 tokens: one chain
    tree_side = scan_work(bench.prepare("tree", [tree], 6))
    assert tree_side == dict(calls=1, steps=6, padded=6, tokens=6)  # the chain folds into one run
    # the baseline packs [6] and [4 2] (budget 6); the 2-token path pads to 4 beside the 4-token one
    assert scan_work(bench.prepare("sequence", [tree], 6)) == dict(calls=2, steps=10, padded=14, tokens=12)


def test_fastest_capacity_takes_the_fastest_budget(monkeypatch):
    """The baseline's budget search: every candidate timed (warm-up untimed), the fastest kept; the
    candidates are clipped to all the paths in one forward (not to the tree's tokens: a larger
    budget is kept only where it is faster), and budgets that cut the same micro-batches are timed
    once."""
    tree = bench.group_tree(0.5, 4, 8, 50)  # 4 paths of 8 sharing about half
    total = tree.num_path_tokens
    assert total == 32 and tree.num_tokens < total
    seen = []

    def timed(fn, device):  # the budget stands for the time: one path per forward is fastest
        budget = fn.__defaults__[0]
        seen.append(budget)
        return {total: 3.0, 16: 2.0, bench.ONE_PATH: 1.0}[budget], 0.0

    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(bench, "train_step", lambda mode, model, trees, micro, backend: None)
    model = SimpleNamespace(zero_grad=lambda set_to_none: None)
    # 999 clips to 32 (all four paths), 16 packs two per forward, ONE_PATH and 8 one: the same cut
    assert bench.fastest_capacity(model, [tree], (999, 8, 16, bench.ONE_PATH), None, "cpu") == bench.ONE_PATH
    assert sorted(seen) == sorted([bench.ONE_PATH, 16, total] * 3)  # warm-up + 2 rounds, each budget once


def test_step_loop_bound_prices_the_layers_by_their_time():
    """The speedup is (s A_base + L_base) / (s A_tree + L_tree) for a rest s >= 1 times slower than
    the matmul rate: it lies between its value at s = 1 and the rest's own ratio, so the bound is
    the larger of the two. Hand numbers: rest 0.4 / 0.2 s, layers 1.2 / 0.4 s."""
    b = priced_bound({"sequence": 0.4, "tree": 0.2}, {"sequence": 1.2, "tree": 0.4})
    assert b["priced"] == pytest.approx(1.6 / 0.6) and b["rest"] == 2.0 and b["bound"] == b["priced"]
    for s in (1.0, 2.0, 10.0, 1e6):  # every slower rest stays under the bound
        assert (s * 0.4 + 1.2) / (s * 0.2 + 0.4) <= b["bound"] + 1e-12
    # layers that gain less than the rest: the rest's ratio bounds it
    assert priced_bound({"sequence": 0.4, "tree": 0.2}, {"sequence": 0.3, "tree": 0.2})["bound"] == 2.0


def test_linear_flops_within_one_layer():
    model = nn.Module()
    model.config = SimpleNamespace()
    model.a, model.b = nn.Linear(8, 16), nn.Linear(16, 8)
    model.get_input_embeddings = lambda: nn.Identity()
    model.get_output_embeddings = lambda: nn.Identity()
    assert linear_flops(model) == 512 and linear_flops(model, within=model.b) == 256


def test_one_path_per_forward_baseline():
    tree = bench.per_turn_tree(4, 8, 50)  # paths of 8, 16, 24, 32 tokens
    packed = bench.prepare("sequence", [tree], 32)
    assert [p.num_tokens for p in packed] == [32, 16, 32]  # [8 + 24], [16], [32]
    alone = bench.prepare("sequence", [tree], bench.ONE_PATH)
    assert sorted(p.num_tokens for p in alone) == [8, 16, 24, 32]
    with pytest.raises(AssertionError):
        bench.prepare("tree", [tree], bench.ONE_PATH)


def test_overhead_trees():
    wide, deep = pack(wide_tree(64, 4, 50)), pack(deep_tree(64, 4, 50))
    assert wide.num_tokens == 64 and wide.node_parent.tolist() == [-1, 0, 0, 0, 0]
    assert deep.num_tokens == 64 and deep.node_parent.tolist() == [-1, 0, 0, 2, 2, 4, 4]


@pytest.mark.slow
def test_one_family_end_to_end():
    a = parse_args(["--quick", "--families", "mamba", "--allocator", "system", "--threads", "1"])
    rows, over, text = run(a)
    assert [r["shape"] for r in rows] == ["per-turn", "group"]
    for row in rows:
        r = row["result"]
        assert r["max_logprob_diff"] < 1e-4 and r["speedup"] > 0  # float32: the modes agree
        assert r["flop_bound"] > row["bound_no_recurrent"] > 1  # Mamba's state work weighs the token ratio
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["flop_bound"])
        # the baseline's budget was searched: the tree's tokens or one path per micro-batch
        tree = shape_trees(a)[row["shape"]]
        assert r["baseline_capacity"] in (tree.num_tokens, int(tree.path_lengths.max()), bench.ONE_PATH)
    assert [p["nodes"] for p in over[0]["shapes"]["deep"]["points"]] == [1, 7, 31]
    assert "### Per-node overhead" in text and "| mamba (jamba) | per-turn |" in text
