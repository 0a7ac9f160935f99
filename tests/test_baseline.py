"""The per-path baseline (``treetrain.objectives.baseline``) == every path alone through the unmodified
HF model.

float64 with the models' float32 casts lifted (``float64_casts``): log-probs, losses and every
parameter gradient agree to summation-order rounding. The tolerance 1e-11 is the one
``tests/test_losses.py`` justifies for the tree (measured differences there <= 1.1e-13); a wrong
sequence boundary, a shared prefix or a per-micro-batch normalizer shows as O(1e-2).
"""

from __future__ import annotations

import pytest
import torch

from treetrain import TrajectoryTree, pack
from treetrain.objectives.baseline import (
    baseline_path_logprobs,
    is_sequences,
    sequence_loss,
    sequence_microbatches,
    sequence_parts,
)
from treetrain.objectives.policy.aggregation import loss_normalizer
from treetrain.objectives.policy.training import PolicyObjective
from treetrain.train.batches import rank_microbatches
from treetrain.train.config import TrainConfig, validate

from .reference import float64_casts, grad_err, reference_copy, rel_err, tiny_model
from .reference import reference_logprobs as hf_logprobs
from .test_losses import CONFIGS, GROUP, baseline_loss, loss_err, param_grads, random_data

TOL = 1e-11


@pytest.mark.parametrize("capacity", [None, 12])
@pytest.mark.parametrize("backend", [None, "dense"])
def test_baseline_logprobs_equal_hf_per_path(capacity, backend):
    """Several sequences per forward (varlen) and one per forward give the HF per-path log-probs."""
    with float64_casts():
        model = tiny_model("qwen3")
        ref = reference_copy(model)
        tree = TrajectoryTree.from_paths(GROUP)
        want_lp, want_ent = hf_logprobs(ref, tree.paths(), return_entropy=True)
        got_lp, got_ent = baseline_path_logprobs(
            model, tree, capacity=capacity, backend=backend, return_entropy=True
        )
        assert [g.shape for g in got_lp] == [w.shape for w in want_lp]
        for g, w, ge, we in zip(got_lp, want_lp, got_ent, want_ent):
            if w.numel():
                assert rel_err(g, w) < TOL and rel_err(ge, we) < TOL


@pytest.mark.parametrize(
    "name",
    [
        "sft-token-mean",
        "sft-seq-mean-token-mean+ent",
        "grpo-seq-mean-token-mean+k3+ent",
        "gspo-token-mean+k3",
    ],
)
def test_baseline_loss_and_grads_equal_hf_per_path(name):
    """Micro-batches of sequences (capacity 12: several per step) sum to the per-path objective."""
    cfg = CONFIGS[name]
    with float64_casts():
        model = tiny_model("qwen3", seed=2)
        ref = reference_copy(model)
        lps, ents = hf_logprobs(ref, GROUP, return_entropy=True)
        data = random_data(GROUP, lps, 11, per_token_adv=True)
        tree = TrajectoryTree.from_paths(GROUP, **data)
        want = baseline_loss(cfg, lps, ents, data)
        want.backward()
        want_g = param_grads(ref)
        normalizer = loss_normalizer(tree, cfg)
        micro = sequence_microbatches([tree], 12)
        assert len(micro) > 1 and all(is_sequences(pack(mb)) for mb in micro)
        model.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro:
            loss, _ = sequence_loss(model, pack(mb), cfg, normalizer)
            loss.backward()
            total = total + loss.detach()
        assert loss_err(total, want) < TOL, (total, want)
        assert grad_err(param_grads(model), want_g) < TOL


def test_sequence_parts_keep_metadata_and_ids():
    tree = TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 2, 3]], weights=[1.0, 2.0, 3.0])
    parts = sequence_parts(tree)
    assert [p.paths()[0].tolist() for p in parts] == [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    assert [int(p.path_ids[0]) for p in parts] == [0, 1, 2]
    assert [float(p.fields["weights"][0]) for p in parts] == [1.0, 2.0, 3.0]
    assert sum(p.num_tokens for p in parts) == tree.num_path_tokens == 9


def test_sequence_loss_refuses_a_shared_prefix():
    tree = TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="sequence_microbatches"):
        sequence_loss(tiny_model("qwen3"), pack(tree), CONFIGS["sft-token-mean"], 1.0)


def test_strategies_differ_only_in_units():
    """The policy objective's micro-batches for ``--packing tree`` and ``sequence``: what training runs."""
    trees = [TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5]]), TrajectoryTree.from_paths([[7, 8]])]
    objective = PolicyObjective(CONFIGS["sft-token-mean"])
    tree_mb = objective.microbatches(trees, "tree", 16)
    seq_mb = objective.microbatches(trees, "sequence", 16)
    assert sum(t.num_tokens for mb in tree_mb for t in mb) == 7  # shared [1, 2] once
    assert sum(t.num_tokens for mb in seq_mb for t in mb) == 9  # every path alone
    assert sorted(t.num_tokens for mb in seq_mb for t in mb) == [2, 3, 4]
    config = tiny_model("qwen3").config
    mine, passes, computed, _ = rank_microbatches(objective, trees, "sequence", 4, 0, 2, config)
    assert passes >= 1 and computed == 9 and all(is_sequences(pack(mb)) for mb in mine)
    with pytest.raises(ValueError, match="packing"):
        validate(TrainConfig(packing="trees"))


def test_one_sequence_runs_sdpa_causal_and_a_forest_the_tree_backend_alike():
    """A one-path forward takes SDPA's causal kernel; a forest of sequences takes the tree backend:
    the same log-probs (float64) either way, equal to each path alone through the unmodified HF
    model, also when the same tree is given twice."""
    with float64_casts():
        model = tiny_model("qwen3", seed=3)
        tree = TrajectoryTree.from_paths([list(range(1, 40))])
        other = TrajectoryTree.from_paths([[5, 6, 7, 8, 9]])
        one = baseline_path_logprobs(model, tree)[0]
        three = baseline_path_logprobs(model, [other, tree, other])
        want = hf_logprobs(reference_copy(model), [*other.paths(), *tree.paths()])
        assert rel_err(one, want[1]) < TOL and rel_err(three[1], want[1]) < TOL
        assert rel_err(three[0], want[0]) < TOL and rel_err(three[2], want[0]) < TOL


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize(
    "chunk, keep_bytes, kept",
    [
        (16, None, True),  # one chunk, within the default budget: kept
        (4, None, True),  # 3 chunks (4 + 4 + 1 rows), 792 bytes of logits: all kept
        (4, 9 * 11 * 8, True),  # exactly the budget
        (4, 9 * 11 * 8 - 1, False),  # a byte short: every chunk recomputed in backward
        (16, 0, False),
    ],
)
def test_head_keeps_logits_within_budget_and_matches_autograd(
    monkeypatch, with_entropy, chunk, keep_bytes, kept
):
    """Backward reuses the forward's logits when all ``N x V`` of them fit ``keep_bytes`` (no
    recomputed head matmul), else recomputes each chunk; either way the gradients equal autograd
    through a full log-softmax, also on a second backward (which recomputes: kept logits are
    released by the first)."""
    from torch.nn import functional as F

    from treetrain.logprobs import _TargetLogprobs

    torch.manual_seed(1)
    head = torch.nn.Linear(6, 11, bias=True, dtype=torch.float64)
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 11, (9,))
    gl, ge = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    calls, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(1) or linear(*a))  # counts head matmuls
    lp, ent = _TargetLogprobs.apply(h, head.weight, head.bias, tgt, chunk, with_entropy, None, keep_bytes)
    forward_calls = len(calls)
    loss = (lp * gl).sum() + ((ent * ge).sum() if with_entropy else 0.0)
    loss.backward(retain_graph=True)
    first_backward_calls = len(calls) - forward_calls
    monkeypatch.undo()
    assert forward_calls == -(-9 // chunk)
    assert first_backward_calls == (0 if kept else forward_calls)  # recomputed head matmuls
    first = [h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    loss.backward()  # the second backward recomputes: the kept logits were released
    second = [h.grad - first[0], head.weight.grad - first[1], head.bias.grad - first[2]]
    h.grad = None
    head.zero_grad()
    lsm = torch.log_softmax(head(h), -1)
    want = (lsm.gather(1, tgt[:, None])[:, 0] * gl).sum()
    if with_entropy:
        want = want + (-(lsm.exp() * lsm).sum(-1) * ge).sum()
    want.backward()
    for a, b, c in zip(first, second, [h.grad, head.weight.grad, head.bias.grad]):
        assert torch.allclose(a, c, rtol=0, atol=1e-12) and torch.allclose(b, c, rtol=0, atol=1e-12)
