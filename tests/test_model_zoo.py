"""The model zoo: every causal-LM architecture of the installed transformers is run exactly or refused.

- Every model type of transformers' causal-LM mapping is on treetrain's verified list
  (``treetrain.models.support.EXACT``) or refused with a ``ValueError`` naming the model type or
  the layer (fast).
- Every type on the list, as a tiny float64 model with its scalings and attention extras set away
  from their defaults, windows shorter than the paths and a length-dependent rotary table with paths
  on both sides of its threshold (``tests/zoo.py``): tree log-probs and every parameter gradient
  equal each path's own Hugging Face forward (eager attention, the literal definition; a fresh
  rotary state per path) to float64 rounding (slow: about 1 s per architecture).
- Every state-carrying layer without tree routing is refused with the layer's name, never run as
  if the tree were one sequence (a fake one per family: none is left in transformers' causal LMs).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from treetrain.integrations.flat import flat_logprobs
from treetrain.logprobs import path_logprobs
from treetrain.models import support
from treetrain.models.rope import length_rules
from treetrain.models.support import (
    ADDED_IN,
    EXACT,
    REFUSED,
    _version,
    check_model,
    refusal,
    verified_from,
    vision_verified,
)
from treetrain.models.support_vision import VISION_EXACT, VISION_TYPES

from . import zoo
from .hybrid_models import float64_everywhere
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err
from .zoo import bare_model, causal_lm_types, zoo_model, zoo_paths

# float64 end to end (float64_everywhere keeps HF's internal float32 casts in float64): what is
# left is summation order, a few ulps relative (measured 2e-16 log-probs, 1e-14 gradients)
LOGP_TOL = 1e-12
GRAD_TOL = 1e-10


def _too_old(model_type: str) -> bool:
    lowest = verified_from(model_type)
    return lowest is not None and _version(transformers.__version__) < _version(lowest)


def test_every_causal_lm_type_is_exact_or_refused_by_name():
    types = causal_lm_types()
    # the whole mapping, not a sample (142 in transformers 5.0, 196 in 5.24, 200 in 5.25)
    assert len(types) > 120
    for model_type in types:
        why = refusal(bare_model(model_type))
        if model_type in VISION_EXACT:  # multimodal types: tests/test_vlm_zoo.py runs them
            assert (why is None) == vision_verified(model_type, transformers.__version__), why
        elif model_type in EXACT and not _too_old(model_type):
            assert why is None, (model_type, why)
        elif model_type in EXACT:  # exact on the newest transformers only: refused on this one
            assert why is not None and "verified exact only with transformers >=" in why, (model_type, why)
        else:
            assert why is not None and repr(model_type) in why, (model_type, why)
            with pytest.raises(ValueError, match="not supported"):
                check_model(bare_model(model_type))


def test_no_causal_lm_type_is_refused_as_not_verified():
    """Every causal-LM type of the installed transformers is verified exact or refused by its cause;
    the fallback is left for types of a newer transformers."""
    for model_type in causal_lm_types():
        # multimodal types (Gemma 3, Qwen3.5, ...): the VLM zoo's (tests/test_vlm_zoo.py)
        assert model_type in EXACT or model_type in REFUSED or model_type in VISION_TYPES, model_type
        why = refusal(bare_model(model_type))
        assert why is None or "not verified" not in why, (model_type, why)
    newer = nn.Module()
    newer.config = SimpleNamespace(model_type="from_a_newer_transformers")
    assert "not verified exact by treetrain's model-zoo test" in refusal(newer)


def test_types_added_later_are_refused_by_name_below_their_version(monkeypatch):
    """A type verified on the transformers that added it (``ADDED_IN``) is refused by name on an older
    one (a remote-code model of that name), and a type of ``ADDED_IN`` refused by its cause stays so."""
    verified = [t for t in ADDED_IN if t in EXACT or t in VISION_EXACT]
    assert verified and len(verified) < len(ADDED_IN)
    monkeypatch.setattr(support, "version", lambda _: "5.24.0")
    for model_type in ADDED_IN:
        why = refusal(bare_model(model_type))
        assert why is not None and repr(model_type) in why, (model_type, why)
        added = f"verified exact only with transformers >= {ADDED_IN[model_type]}" in why
        assert added == (model_type in verified), (model_type, why)


# types the zoo does not build, and why: each is refused (REFUSED names the cause)
UNBUILT = {
    "blt": "a byte latent transformer: no decoder config of its own to shrink (local encoder, global "
    "transformer, local decoder and entropy patcher sub-configs)",
    "gemma4_assistant": "a drafter whose default config fails its own validation "
    "(hidden_size_per_layer_input); it needs the target model's embeddings and key/value states to run",
    "gemma4_unified_assistant": "a drafter around a full-size default text config (a 262k vocabulary); "
    "it needs the target model's embeddings and key/value states to run",
}
COMPOSITE = (
    "a composite model refused whole (vision or audio towers, encoders, a drafter's target beside its "
    "text model, each its own sub-config): the zoo builds its text model's type"
)


def _unbuilt(model_type: str) -> str | None:
    """Why the zoo does not build ``model_type`` (None: it does)."""
    if model_type in UNBUILT:
        return UNBUILT[model_type]
    if model_type not in EXACT and getattr(CONFIG_MAPPING[model_type], "sub_configs", None):
        return COMPOSITE
    return None


def test_unbuilt_types_are_refused():
    unbuilt = [t for t in causal_lm_types() if _unbuilt(t)]
    assert set(UNBUILT) <= set(unbuilt) and len(unbuilt) < 30, unbuilt
    for model_type in unbuilt:
        if model_type in VISION_TYPES:  # a multimodal type: tests/test_vlm_zoo.py builds and runs it
            continue
        assert model_type in REFUSED and model_type not in EXACT, model_type
        assert refusal(bare_model(model_type)) is not None


@pytest.mark.parametrize("model_type", [t for t in causal_lm_types() if not _unbuilt(t)])
def test_every_causal_lm_type_builds_small(model_type):
    """``zoo_model`` builds every other type of the mapping as a tiny model of its causal-LM class: the
    shrink reached its widths, depth and vocabulary (per-type fixes where the defaults do not shrink)."""
    if _too_old(model_type):  # refused by name on this transformers (its config code differs)
        pytest.skip(f"{model_type!r} is verified on transformers >= {verified_from(model_type)} only")
    model = zoo_model(model_type, dtype=torch.float32)
    assert type(model).__name__ == causal_lm_types()[model_type]
    assert model.get_input_embeddings().weight.shape[0] <= 2 * zoo.VOCAB
    assert sum(p.numel() for p in model.parameters()) < 3_000_000  # the largest, ctrl: 2.2M


# sparse attention keeping fewer keys than a zoo path sees: DSA's index_topk 4, MiniMax-M3's own block
# of 2 and its best other block of 2 (zoo.AWAY); tests/test_sparse_selection.py runs longer paths
SPARSE_SELECTION = ["axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4", "minimax_m3_vl_text"]


def _no_selection(model_type: str, monkeypatch) -> nn.Module:
    """``zoo_model(model_type)`` with a selection that keeps every key of the zoo paths (same weights)."""
    with monkeypatch.context() as m:
        m.setitem(zoo.AWAY, "index_topk", 64)
        m.setitem(zoo.AWAY, "index_topk_blocks", 64)
        return zoo_model(model_type)


@pytest.mark.parametrize("model_type", SPARSE_SELECTION)
def test_sparse_attention_beyond_its_selection(model_type, monkeypatch):
    """The zoo's sparse attention drops keys of its paths (HF's own log-probs move when it keeps them
    all), so test_exact_architecture checks the selection on a tree; an ordinary call of the prepared
    model computes HF's selection too; a backend that cannot take a per-query key subset is refused."""
    if model_type not in causal_lm_types() or _too_old(model_type):
        pytest.skip(f"transformers {transformers.__version__}: {model_type!r} is not run here")
    paths = zoo_paths()
    with float64_everywhere(), torch.no_grad():
        ref = zoo_model(model_type)
        prepared = copy.deepcopy(ref)
        want = reference_logprobs(ref, paths)
        every_key = reference_logprobs(_no_selection(model_type, monkeypatch), paths)
        assert max(rel_err(a, b) for a, b in zip(every_key, want)) > 1e-3  # measured 7e-3 (hy_v4) to 8e-2
        path_logprobs(prepared, paths[:1])  # prepares it
        ids = torch.tensor([paths[1]])  # 9 tokens, more than the selection keeps
        got = prepared(input_ids=ids, use_cache=False).logits
        assert rel_err(got, ref(input_ids=ids, use_cache=False).logits) < LOGP_TOL
    refused = "does not support a sparse attention's per-query key selection.*'dense'"
    with pytest.raises(ValueError, match=refused):
        path_logprobs(prepared, paths, backend="blocksparse")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(EXACT))
def test_exact_architecture(model_type):
    """Log-probs and every gradient of ``sum_p c_p . logp_p`` equal the per-path HF forwards."""
    if model_type not in causal_lm_types():  # listed for another transformers version
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    if _too_old(model_type):  # refused by name on this transformers, not run unverified
        with pytest.raises(ValueError, match="verified exact only with transformers"):
            check_model(bare_model(model_type))
        return
    paths = zoo_paths()
    coeffs = random_coeffs(paths, seed=3)
    # import the modeling module first: older GPT-BigCode scripts (torch.jit) its softmax helpers at
    # import, which must not see float64_everywhere's patched softmax
    getattr(transformers, causal_lm_types()[model_type])
    with float64_everywhere():
        ref = zoo_model(model_type)
        tree = copy.deepcopy(ref)
        want = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
        got = path_logprobs(tree, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    assert max(rel_err(a, b) for a, b in zip(got, want)) < LOGP_TOL
    # its rotary table depends on length: the tree must have seen it (a config may carry rope
    # parameters its model never uses, e.g. Granite 4.0-H without position_embedding_type="rope")
    rotary = any("Rotary" in type(m).__name__ for m in tree.modules())
    if length_rules(tree.config) and rotary:
        assert tree.__dict__.get("_treetrain_rotary"), f"{model_type}: no length-dependent rotary patched"
    g_tree, g_ref = grads(tree), grads(ref)
    assert grad_err(g_tree, g_ref) < GRAD_TOL
    silent = _silent_parameters(ref)
    assert not {n for n in silent if not _no_gradient_reason(model_type, n)}, silent
    if model_type == "gpt_oss":  # the sinks train (they got no gradient before)
        sinks = [n for n in g_ref if n.endswith("sinks")]
        assert sinks and all(g_ref[n].abs().max() > 1e-3 for n in sinks)


# parameters HF itself gives no gradient (or one that is 0 up to rounding), by name (a suffix, or a
# piece of the name), each with why; any other parameter with no gradient fails test_exact_architecture:
# a zoo config under which a trained branch never acts (a zero init, a router with one expert left)
NO_GRADIENT = {
    "expert_bias": "aux-loss-free balancing (AFMoE): a bias that only picks the top-k experts",
    "e_score_correction_bias": "aux-loss-free balancing (ERNIE 4.5 MoE, Laguna): only picks experts",
    ".indexer.": "sparse attention's indexer (DSA, MiniMax-M3): HF runs it without gradient (a selection)",
    "z_L_init": "HRM's frozen low-cycle initial state (requires_grad False in HF)",
    "k_proj.bias": "a key bias adds q.b to all of a query's scores, which softmax cancels: its true "
    "gradient is 0, HF's is rounding (BioGPT)",
    "Wk.bias": "as k_proj.bias (CTRL)",
}
# types whose HF code drops a trained parameter from the forward the zoo runs
NO_GRADIENT_BY_TYPE = {
    "bloom": (("dense.bias", "dense_4h_to_h.bias"), "pretraining_tp > 1 with slow_but_exact sums the "
              "attention output's and the MLP's partial products without their output biases (HF's "
              "BloomAttention, BloomMLP)"),
}  # fmt: skip


def _silent_parameters(model) -> list[str]:
    """Parameters whose gradient is None or at most 1e-9 of the model's largest gradient entry."""
    scale = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    return [
        n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max().item() <= 1e-9 * scale
    ]


def _no_gradient_reason(model_type: str, name: str) -> str | None:
    """Why ``name`` legitimately gets no gradient in ``model_type`` (None: it should get one)."""
    own = NO_GRADIENT_BY_TYPE.get(model_type)
    if own is not None and any(name.endswith(suffix) for suffix in own[0]):
        return own[1]
    return next((why for key, why in NO_GRADIENT.items() if key in name), None)


def test_kolibri1_1_refusal_cause_still_holds(monkeypatch):
    """Kolibri 1.1 is refused because its indexer reads and rewrites the layer's mask as a dense
    ``[T, T]`` tensor: forced onto the list, a tree forward fails in its code on the tree's layer
    mask. When that changes this test fails, and the type is to be looked at again."""
    if "kolibri1_1" not in causal_lm_types():
        pytest.skip(f"transformers {transformers.__version__} has no kolibri1_1")
    monkeypatch.setitem(EXACT, "kolibri1_1", "")
    with pytest.raises(TypeError, match="finfo"):
        path_logprobs(zoo_model("kolibri1_1"), zoo_paths())


class FooMamba2Mixer(nn.Module):
    """A state-space layer treetrain does not route (its name matches ``support.STATEFUL``)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


# one unrouted layer per state-carrying family (``support.STATEFUL``), refused by its name: every
# such layer transformers 5.24 ships in a causal LM is routed (Inkling's short convolutions were last)
STATEFUL_LAYERS = [
    "FooShortConvolution", "FooMamba2Mixer", "FooGatedDeltaNet", "FooLinearAttention", "FooRglru",
    "FooRwkvFeedForward", "FoomLSTM", "FooCCAProjection",
]  # fmt: skip


@pytest.mark.parametrize("layer", STATEFUL_LAYERS)
def test_stateful_layers_are_refused_by_name(layer):
    model = zoo_model("llama", dtype=torch.float32)
    model.model.layers[0].mixer = type(layer, (FooMamba2Mixer,), {})()
    with pytest.raises(ValueError, match=f"recurrent layer {layer} .*no tree routing"):
        check_model(model)


def _with_unrouted_layer(model_type: str = "llama") -> nn.Module:
    model = zoo_model(model_type, dtype=torch.float32)
    model.model.layers[0].mixer = FooMamba2Mixer()
    return model


def test_unrouted_layer_refused_before_it_runs():
    """Falcon-H1 once ran silently wrong (3.4e-3) before its mixer was routed: an unrouted layer
    makes path_logprobs raise, naming the layer, before any forward."""
    with pytest.raises(ValueError, match="FooMamba2Mixer"):
        path_logprobs(_with_unrouted_layer(), zoo_paths())


def test_refusal_survives_fsdp_style_subclass_and_peft_wrapper():
    """FSDP2 swaps a module's class for an ``FSDP<Name>`` subclass; PEFT wraps the model."""
    model = _with_unrouted_layer()
    model.model.layers[0].mixer.__class__ = type("FSDPFooMamba2Mixer", (FooMamba2Mixer,), {})

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

    with pytest.raises(ValueError, match="FSDPFooMamba2Mixer"):
        check_model(Wrapper(model))


def test_exact_model_with_unknown_stateful_layer_is_refused():
    """The model type alone is not enough: a listed type carrying a state-space layer is refused."""
    with pytest.raises(ValueError, match="FooMamba2Mixer"):
        check_model(_with_unrouted_layer())


# HF as shipped computes norms, rotary tables, routers and recurrences in float32 inside a float64
# model; tree and per-path forwards each round those differently, so they agree to float32 rounding
# of a few ops: measured at most 1.0e-7 (log-probs, mamba2; flat the same) and 3.0e-6 (gradients, opt)
SHIPPED_LOGP_TOL = 1e-6
SHIPPED_GRAD_TOL = 1e-5
# HF's own forward of these cannot run in float64 as shipped: its experts accumulate in a float32
# buffer then multiply float64 weights (a dtype error); test_exact_architecture covers them
SHIPPED_FLOAT64_FAILS = {"inkling2_text", "inkling2_loop_text"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(EXACT))
def test_as_shipped_and_flat(model_type):
    """What a user measures: HF's code untouched (no float64 patches), float64 weights. The tree's
    log-probs and every gradient, and ``flat_logprobs`` on the padded batch of the same paths (a
    scorer of its own: it splits rope regimes and packs per forward), equal the per-path forwards."""
    if model_type not in causal_lm_types() or _too_old(model_type):
        pytest.skip(f"transformers {transformers.__version__}: {model_type!r} is not run here")
    if model_type in SHIPPED_FLOAT64_FAILS:
        pytest.skip(f"{model_type}: HF's own float64 forward raises as shipped (float32 experts' sum)")
    paths = zoo_paths()
    coeffs = random_coeffs(paths, seed=3)
    ref = zoo_model(model_type)
    tree = copy.deepcopy(ref)
    want = reference_logprobs(ref, paths)
    sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
    got = path_logprobs(tree, paths)
    sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    assert max(rel_err(a, b) for a, b in zip(got, want)) < SHIPPED_LOGP_TOL
    assert grad_err(grads(tree), grads(ref)) < SHIPPED_GRAD_TOL
    L = max(map(len, paths))
    ids = torch.tensor([p + [0] * (L - len(p)) for p in paths])
    am = torch.tensor([[1] * len(p) + [0] * (L - len(p)) for p in paths])
    with torch.no_grad():
        flat = flat_logprobs(tree, ids, am)  # [B, L]: entry [b, c] scores ids[b, c]
    flat_err = max(rel_err(flat[b, 1 : len(p)], want[b].detach()) for b, p in enumerate(paths))
    assert flat_err < SHIPPED_LOGP_TOL
