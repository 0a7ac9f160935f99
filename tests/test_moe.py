"""Mixture-of-experts with the router aux loss on: objective + coef * aux from one tree forward
equals the baseline's (every path a row of one padded batch through the unmodified model with
``output_router_logits=True``): the loss value and every parameter gradient, in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from treetrain import path_logprobs
from treetrain.models.moe import (
    path_count_weights,
    record_router_logits,
    tree_router_aux_loss,
    weighted_load_balancing_loss,
)
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import MOE_ARCHS, float64_everywhere, tiny_hybrid_model
from .reference import grads, random_coeffs, reference_copy, rel_err
from .strategies import tree_paths
from .test_gdn import CHAIN, GROUP, ONE_TOKEN, grad_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def baseline_loss(model, paths, coeffs):
    """sum_p <c_p, logprobs_p> + coef * aux, all paths one right-padded batch, HF's own aux loss."""
    L = max(map(len, paths))
    ids = torch.zeros(len(paths), L, dtype=torch.long)
    mask = torch.zeros(len(paths), L, dtype=torch.long)
    for i, p in enumerate(paths):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    lsm = torch.log_softmax(out.logits, dim=-1)
    objective = sum(
        (c * lsm[i, : len(p) - 1].gather(1, ids[i, 1 : len(p), None])[:, 0]).sum()
        for i, (p, c) in enumerate(zip(paths, coeffs))
    )
    return objective + model.config.router_aux_loss_coef * out.aux_loss, out.aux_loss


def tree_loss(model, paths, coeffs):
    """The training-loop recipe (see treetrain.models.moe)."""
    packed = pack(TrajectoryTree.from_paths(paths))
    with record_router_logits(model) as router_logits:
        lps = path_logprobs(model, packed, backend="dense")
    aux = tree_router_aux_loss(model, packed, router_logits)
    objective = sum((c * lp).sum() for c, lp in zip(coeffs, lps))
    return objective + model.config.router_aux_loss_coef * aux, aux


def _compare(arch, paths, seed=0):
    model = tiny_hybrid_model(arch, seed=seed)
    ref = reference_copy(model)
    coeffs = random_coeffs(paths, seed)
    with float64_everywhere():
        loss, aux = tree_loss(model, paths, coeffs)
        ref_loss, ref_aux = baseline_loss(ref, paths, coeffs)
        loss.backward()
        ref_loss.backward()
    g_tree, g_ref = grads(model), grads(ref)
    assert g_tree.keys() == g_ref.keys()
    assert any(".gate." in n for n in g_ref)  # the routers get gradients (through the aux loss)
    return rel_err(loss, ref_loss), rel_err(aux, ref_aux), grad_err(g_tree, g_ref)


# float64, internal float32 casts lifted (routers' softmax, HF's float32 accumulators): only
# summation order differs, as in test_gdn. Measured <= ~1e-14.
TOL64 = 1e-11


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("paths", [GROUP, ONE_TOKEN + CHAIN[:3]], ids=["group", "one_token_chain"])
def test_loss_and_grads_match_baseline(arch, paths):
    errs = _compare(arch, paths)
    assert max(errs) < TOL64, errs


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=tree_paths(vocab=10, max_paths=6, max_len=10, min_len=2))
def test_random_trees(arch, paths):
    errs = _compare(arch, paths, seed=2)
    assert max(errs) < TOL64, errs


def test_path_count_weights_docstring():
    packed = pack(TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]))
    assert path_count_weights(packed).tolist() == [3, 2, 1, 1, 1, 1, 1, 1]


def test_unit_weights_are_hf_unmasked_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    logits = tuple(torch.randn(11, 6, dtype=torch.float64) for _ in range(3))
    with float64_everywhere():
        hf = load_balancing_loss_func(logits, 6, 2)
    mine = weighted_load_balancing_loss(logits, torch.ones(11), 2)
    assert rel_err(mine, hf) < 1e-14


def test_recorder_needs_moe_and_one_forward():
    dense = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no router logits"), record_router_logits(dense):
        pass
    model = tiny_hybrid_model("qwen3_moe", dtype=torch.float32)
    packed = pack(TrajectoryTree.from_paths(GROUP))
    with torch.no_grad(), record_router_logits(model) as logits:
        path_logprobs(model, packed)
        path_logprobs(model, packed)
    assert len(logits) == 2 * model.config.num_hidden_layers
    assert tree_router_aux_loss(model, packed, logits).ndim == 0  # two forwards: a sum over both
    with pytest.raises(ValueError, match=r"\[T="):
        tree_router_aux_loss(model, pack(TrajectoryTree.from_paths([[1, 2]])), logits)


def test_unweighted_tree_aux_is_not_the_baseline():
    """The weighting matters: the tree's distinct tokens alone average differently."""
    model = tiny_hybrid_model("qwen3_moe")
    packed = pack(TrajectoryTree.from_paths(GROUP))
    with float64_everywhere(), torch.no_grad():
        with record_router_logits(model) as logits:
            path_logprobs(model, packed)
        _, ref_aux = baseline_loss(reference_copy(model), GROUP, random_coeffs(GROUP, 0))
        flat = weighted_load_balancing_loss(
            logits, torch.ones(packed.num_tokens), model.config.num_experts_per_tok
        )
        weighted = tree_router_aux_loss(model, packed, logits)
    assert rel_err(weighted, ref_aux) < TOL64 and rel_err(flat, ref_aux) > 1e-4  # measured 6e-4
