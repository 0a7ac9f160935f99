"""ALiBi decoders (BLOOM, MPT, Falcon) on trees == each path through the unmodified model.

The model zoo checks each type once in float64 (``tests/zoo.py`` sets their options away from the
defaults). Here: Falcon's other variants (rotary, multi-query, sequential attention, its SDPA
reference), float32 against HF's own float32 error, the controls that show the checks have teeth,
ordinary calls, activation checkpointing, and the backends that must refuse ALiBi.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from treetrain.logprobs import path_logprobs
from treetrain.models.alibi import patch_own_attention
from treetrain.models.hf import prepare_model, tree_forward
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from . import zoo
from .hybrid_models import assert_float32_within_2x, float32_runs, float64_everywhere
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err
from .zoo import zoo_model, zoo_paths

LOGP_TOL, GRAD_TOL = 1e-12, 1e-10  # float64 end to end, as the model zoo


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def _model(model_type, dtype=torch.float64, attn="eager", **over):
    saved = zoo.PER_TYPE.get(model_type)
    zoo.PER_TYPE[model_type] = {**(saved or {}), **over}
    try:
        return zoo_model(model_type, dtype=dtype, attn=attn)
    finally:
        zoo.PER_TYPE[model_type] = saved


def _errors(ref, paths=None, backend=None, seed=3):
    """(log-prob error, gradient error) of the tree against ``ref``'s per-path forwards."""
    paths = paths or zoo_paths()
    coeffs = random_coeffs(paths, seed=seed, dtype=next(ref.parameters()).dtype)
    tree = copy.deepcopy(ref)
    want = reference_logprobs(ref, paths)
    sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
    got = path_logprobs(tree, paths, backend=backend)
    sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    return max(rel_err(a, b) for a, b in zip(got, want)), grad_err(grads(tree), grads(ref))


FALCON = {
    "rotary-multi-query": dict(alibi=False, new_decoder_architecture=False, multi_query=True),
    "alibi-sdpa": dict(_attn="sdpa"),  # HF's SDPA path adds the bias once, its eager path twice
    "alibi-sequential": dict(
        new_decoder_architecture=False, multi_query=False, num_kv_heads=12, parallel_attn=False, bias=True
    ),
}


@pytest.mark.parametrize("variant", FALCON)
def test_falcon_variants_exact(variant):
    over = dict(FALCON[variant])
    attn = over.pop("_attn", "eager")
    with float64_everywhere():
        lp, g = _errors(_model("falcon", attn=attn, **over), backend="dense")
    assert lp < LOGP_TOL and g < GRAD_TOL, (lp, g)


# BLOOM's irrational slopes, a tree with one-token nodes, a root shared by all, a one-token path
PATHS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11], [5, 6, 12, 13, 14, 15, 16, 17], [5, 18], [19, 20, 21]]


@pytest.mark.parametrize("model_type", ["bloom", "mpt", "falcon"])
def test_float32_within_reference_rounding(model_type):
    """float32: the tree's error against the float64 truth is within 2x of HF's own per-path error
    (log-probs and every gradient; plus 1e-6 / 1e-5 relative: both round at ~6e-8 per op)."""
    assert_float32_within_2x(float32_runs(functools.partial(_model, model_type), PATHS))


def test_controls_fail():
    """The checks have teeth: the bias at DFS indices instead of path positions, and Falcon's eager
    model scored with its SDPA semantics (the bias once), are both far off."""
    import treetrain.models.alibi as alibi

    with float64_everywhere():
        model = _model("bloom")
        orig = alibi.tree_bias
        try:
            alibi.tree_bias = lambda d, pos, dtype: orig(d, torch.arange(pos.numel()), dtype)
            lp, _ = _errors(model, PATHS)
        finally:
            alibi.tree_bias = orig
        assert lp > 1e-3
        from transformers.models.falcon.modeling_falcon import FalconAttention

        if not hasattr(FalconAttention, "_split_heads"):  # transformers >= 5.25: one ALiBi path for both
            return  # implementations (the bias in the mask, once), so there is no second semantics to miss
        eager = _model("falcon")
        eager.config._attn_implementation = "sdpa"  # the tree reads it: one bias, the model adds two
        tree = copy.deepcopy(eager)
        eager.config._attn_implementation = "eager"
        want = torch.cat(reference_logprobs(eager, PATHS))
        assert rel_err(torch.cat(path_logprobs(tree, PATHS)).detach(), want.detach()) > 1e-3


@pytest.mark.parametrize("model_type", ["bloom", "mpt", "falcon"])
def test_ordinary_calls_unchanged_and_patch_idempotent(model_type):
    # a prepared model's ordinary call runs SDPA where HF's code calls the attention interface (Falcon
    # from transformers 5.25, which dropped FalconAttention._split_heads); BLOOM's and MPT's are their own
    from transformers.models.falcon.modeling_falcon import FalconAttention

    interface = model_type == "falcon" and not hasattr(FalconAttention, "_split_heads")
    model = _model(model_type, dtype=torch.float32, attn="sdpa" if interface else "eager")
    ref = copy.deepcopy(model)
    prepare_model(model)
    assert patch_own_attention(model) == 3 == patch_own_attention(model)  # the decoder, 2 attentions
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    twin = copy.deepcopy(model)  # a deep copy runs its own modules (the patches are bound methods)
    assert twin.base_model.forward.__self__ is twin.base_model


def test_activation_checkpointing_recomputes_along_the_tree():
    """The tree reaches each attention as a block argument, which the checkpoint replays."""
    with float64_everywhere():
        ref = _model("bloom")
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref.train()
        lp, g = _errors(ref, PATHS)
    assert lp < LOGP_TOL and g < GRAD_TOL, (lp, g)


@pytest.mark.parametrize("backend", ["cp", "depth_first"])
def test_backends_without_alibi_refuse(backend):
    model = _model("mpt", dtype=torch.float32)
    packed = pack(TrajectoryTree.from_paths(PATHS))
    with pytest.raises(ValueError, match=rf"backend '{backend}' does not support ALiBi position bias"):
        tree_forward(model, packed, backend=backend)


def test_mpt_path_longer_than_its_table_is_refused():
    model = _model("mpt", dtype=torch.float32, max_seq_len=6)
    with pytest.raises(ValueError, match="longer than max_seq_len=6"):
        path_logprobs(model, PATHS)


def test_attention_dropout_in_training_is_refused():
    model = _model("bloom", dtype=torch.float32, attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="attention dropout"):
        path_logprobs(model, PATHS)


def test_falcon_rotary_runs_depth_first_exactly():
    """Falcon's rotary variant carries no bias: the depth-first run (one node at a time) takes it,
    with the packed run's log-probs and gradients; its ALiBi variant is refused there by name."""
    from treetrain.logprobs import tree_logprobs
    from treetrain.models.rope import split_regimes
    from treetrain.parallel.depth_first import depth_first_backward, weighted_token_loss

    model = _model("falcon", alibi=False)  # the zoo's dynamic-NTK rope: split by regime first
    packed = pack(split_regimes(model, TrajectoryTree.from_paths(PATHS)))
    w = torch.rand(packed.num_tokens, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp, _ = tree_logprobs(model, packed, backend="dense", entropy=False)
    (-(w * logp).sum()).backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)
    _, got = depth_first_backward(model, packed, weighted_token_loss(w))
    assert rel_err(got, logp.detach()) < 1e-12 and grad_err(grads(model), want) < 1e-10
    with pytest.raises(ValueError, match="'depth_first' does not support ALiBi"):
        depth_first_backward(_model("falcon"), packed, weighted_token_loss(w))
