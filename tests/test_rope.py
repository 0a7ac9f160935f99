"""Rotary tables that depend on the forward's length (``treetrain.models.rope``): dynamic NTK and
longrope, against each path's own forward through a fresh Hugging Face model.

Hand-built paths share a 12-token prefix and end on both sides of the threshold (20 tokens): 5, 18,
20 (at it), 21 (just past), 25 and 39 (twice). HF rotates each path by its own length's table, so
the prefix is rotated one way for the short paths and another for each long regime: the tree splits
it (``split_regimes``) and rotates each token by its own path's table. Before, the longest path
decided for all: log-probs differed by 8e-4 (dynamic) and 1.2e-3 (longrope) here.

float64 with HF's internal float32 casts off (``float64_everywhere``): only summation order differs, so
1e-12 (log-probs) and 1e-10 (gradients), as the model zoo.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from treetrain import pack
from treetrain.integrations.flat import flat_logprobs
from treetrain.logprobs import path_logprobs, tree_logprobs
from treetrain.models.rope import LengthRule, length_rules, regime_keys, split_regimes
from treetrain.models.support import VERIFIED_FROM, _version
from treetrain.parallel.depth_first import depth_first_backward, weighted_token_loss
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import float64_everywhere
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err

THRESHOLD = 20
FACTORS = dict(short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.0, 3.0, 5.0])  # head_dim 8
ROPES = {  # (rope_parameters, config overrides): the threshold is 20 tokens in both
    "dynamic": (dict(rope_type="dynamic", factor=2.0), dict(max_position_embeddings=THRESHOLD)),
    "longrope": (
        dict(rope_type="longrope", original_max_position_embeddings=THRESHOLD, **FACTORS),
        # factor 80 / 20: longrope's attention scaling is on too; Phi-3 copies its config's
        # original_max_position_embeddings into the rope parameters
        dict(max_position_embeddings=80, original_max_position_embeddings=THRESHOLD),
    ),
}
COMMON = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2,
    bos_token_id=1,
)  # fmt: skip


def rope_model(arch: str, rope: dict, seed: int = 0, **over):
    """Llama (dynamic: Llama and Qwen2 configs use it) or Phi-3 (longrope: Phi-3, 3.5, 4-mini)."""
    torch.manual_seed(seed)
    params = dict(rope, rope_theta=10000.0)
    cls = {"llama": transformers.LlamaConfig, "phi3": transformers.Phi3Config}[arch]
    cfg = cls(**COMMON, **over, rope_parameters=params)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    return model


def hand_paths() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, 97, (n,), generator=g).tolist()  # noqa: E731
    base = draw(12)
    return [base + draw(n - 12) for n in (18, 20, 21, 39, 39, 25)] + [base[:5]]


CASES = [("dynamic", "llama"), ("longrope", "phi3")]


def test_regime_keys_by_hand():
    lengths = torch.tensor([5, 18, 20, 21, 25, 39])
    longrope = (LengthRule("longrope", 20),)
    dynamic = (LengthRule("dynamic", 20),)
    assert regime_keys(longrope, lengths).tolist() == [1, 1, 1, 21, 21, 21]  # short | long
    assert regime_keys(dynamic, lengths).tolist() == [1, 1, 1, 21, 25, 39]  # each longer length alone
    both = (LengthRule("longrope", 10), LengthRule("dynamic", 30))
    assert regime_keys(both, torch.tensor([9, 10, 11, 30, 31])).tolist() == [1, 1, 11, 11, 31]


ORIGINAL = dict(original_max_position_embeddings=THRESHOLD)
STEADY = {  # length-independent scalings: their table depends on positions only
    "default": {},
    "linear": dict(factor=2.0),
    "yarn": dict(factor=4.0, **ORIGINAL),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, **ORIGINAL),
}


@pytest.mark.parametrize("rope_type", sorted(STEADY))
def test_length_independent_scalings_stay_unsplit_and_exact(rope_type):
    paths = hand_paths()
    rope = dict(rope_type=rope_type, **STEADY[rope_type])
    model = rope_model("llama", rope, max_position_embeddings=80 if ORIGINAL.keys() & rope.keys() else 20)
    tree = TrajectoryTree.from_paths(paths)
    assert length_rules(model.config) == () and split_regimes(model, tree) is tree
    ref = copy.deepcopy(model)
    with float64_everywhere():
        want = reference_logprobs(ref, paths)
        got = path_logprobs(model, tree)
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-12


def test_split_by_regime_by_hand():
    tree = TrajectoryTree.from_paths(hand_paths())
    assert tree.num_tokens == 12 + 6 + 8 + 9 + 27 + 27 + 13  # 102: the prefix once
    longrope = split_regimes(rope_model("phi3", ROPES["longrope"][0], **ROPES["longrope"][1]), tree)
    assert longrope.num_tokens == (12 + 6 + 8) + (12 + 9 + 27 + 27 + 13)  # short | long: prefix twice
    dynamic = split_regimes(rope_model("llama", ROPES["dynamic"][0], **ROPES["dynamic"][1]), tree)
    assert dynamic.num_tokens == (12 + 6 + 8) + 21 + (12 + 27 + 27) + 25  # <= 20 | 21 | 39 x2 | 25
    assert [p.tolist() for p in dynamic.paths()] == hand_paths()  # same paths, same order


@pytest.mark.parametrize("kind, arch", CASES)
def test_tree_equals_fresh_per_path_forward(kind, arch):
    """Log-probs and every gradient, through path_logprobs (one forward over both regimes)."""
    paths = hand_paths()
    model = rope_model(arch, ROPES[kind][0], **ROPES[kind][1])
    ref = copy.deepcopy(model)
    coeffs = random_coeffs(paths, 1)
    with float64_everywhere():
        want = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
        got = path_logprobs(model, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-12
    assert grad_err(grads(model), grads(ref)) < 1e-10


@pytest.mark.parametrize("kind, arch", CASES)
def test_flat_logprobs_does_not_depend_on_max_tokens(kind, arch):
    """Right-padded rows, every forward size: the same log-probs, each row's own forward's."""
    paths = hand_paths()
    model = rope_model(arch, ROPES[kind][0], **ROPES[kind][1])
    L = max(map(len, paths))
    ids = torch.zeros(len(paths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(paths):
        ids[b, : len(p)], mask[b, : len(p)] = torch.tensor(p), 1
    with float64_everywhere(), torch.no_grad():
        want = reference_logprobs(model, paths)
        outs = [flat_logprobs(model, ids, mask, max_tokens=m) for m in (None, 45, 30)]
    for out in outs:
        for b, p in enumerate(paths):
            assert rel_err(out[b, 1 : len(p)], want[b]) < 1e-12


def test_depth_first_on_a_split_tree_and_the_unsplit_refusal():
    """Depth-first runs node by node (each node's own positions): tokens keep their paths' tables.
    A tree packed without the split is refused by name, in every scorer that gets it packed."""
    kind, arch = CASES[1]
    model = rope_model(arch, ROPES[kind][0], **ROPES[kind][1])
    tree = TrajectoryTree.from_paths(hand_paths())
    packed = pack(split_regimes(model, tree))
    w = torch.randn(packed.num_tokens, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with float64_everywhere():
        want, _ = tree_logprobs(model, packed, entropy=False)
        _, got = depth_first_backward(model, packed, weighted_token_loss(w))
        assert rel_err(got, want.detach()) < 1e-12
        with pytest.raises(ValueError, match=r"shared by paths of 5 and 39 tokens.*split_regimes"):
            tree_logprobs(model, pack(tree))
        with pytest.raises(ValueError, match="split_regimes"):
            depth_first_backward(model, pack(tree), weighted_token_loss(torch.ones(tree.num_tokens)))


def test_hf_dynamic_rope_depends_on_the_forwards_before():
    """HF's dynamic rotary keeps the table of the longest forward so far (until one shorter than
    max_position_embeddings resets it): a path of 25 tokens scored after one of 39 gets the 39-token
    table. treetrain gives every path a fresh model's table and leaves the module's state alone."""
    paths = hand_paths()
    model = rope_model("llama", ROPES["dynamic"][0], **ROPES["dynamic"][1])
    ids = torch.tensor(paths[5])[None]  # 25 tokens
    with torch.no_grad():
        fresh = model(ids).logits
        model(torch.tensor(paths[3])[None])  # 39 tokens: the table grows to 39
        after = model(ids).logits  # 25 <= 39 cached and 25 > 20: HF keeps the 39-token table
        rotary = model.model.rotary_emb
        state = (rotary.inv_freq.clone(), rotary.max_seq_len_cached)
        tree = path_logprobs(model, [paths[5]])[0]
    if _version(transformers.__version__) >= _version(VERIFIED_FROM):  # older HF: no state kept
        assert rel_err(after, fresh) > 1e-6 and state[1] == 39
    assert rotary.max_seq_len_cached == state[1] and torch.equal(rotary.inv_freq, state[0])
    logp = torch.log_softmax(fresh[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    assert rel_err(tree, logp) < 1e-6  # the fresh table (HF's float32 casts on: 1e-6)
