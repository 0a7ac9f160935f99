"""The model zoo: every causal-LM architecture of the installed transformers is run exactly or refused.

- Every model type of transformers' causal-LM mapping is on treetrain's verified list
  (``treetrain.models.support.EXACT``) or refused with a ``ValueError`` naming the model type or
  the layer (fast).
- Every type on the list, as a tiny float64 model with its scalings and attention extras set away
  from their defaults (``tests/zoo.py``): tree log-probs and every parameter gradient equal each
  path's own Hugging Face forward (eager attention, the literal definition) to float64 rounding
  (slow: about 1 s per architecture).
- Every state-carrying layer without tree routing is refused with the layer's name, never run as
  if the tree were one sequence (a fake one per family: none is left in transformers' causal LMs).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from treetrain.logprobs import path_logprobs
from treetrain.models.support import EXACT, check_model, refusal

from .hybrid_models import float64_everywhere
from .reference import grad_err, grads, random_coeffs, reference_logprobs, rel_err
from .zoo import causal_lm_types, zoo_model, zoo_paths

# float64 end to end (float64_everywhere keeps HF's internal float32 casts in float64): what is
# left is summation order, a few ulps relative (measured 2e-16 log-probs, 1e-14 gradients)
LOGP_TOL = 1e-12
GRAD_TOL = 1e-10


def _bare(model_type: str) -> nn.Module:
    """A module that only carries ``model_type``'s default config (what the type check reads)."""
    m = nn.Module()
    try:
        m.config = CONFIG_MAPPING[model_type]()
    except Exception:  # a few defaults fail their own validation: the type is all the check reads
        m.config = SimpleNamespace(model_type=model_type)
    return m


def test_every_causal_lm_type_is_exact_or_refused_by_name():
    types = causal_lm_types()
    assert len(types) > 150  # the whole mapping, not a sample
    unknown = sorted(set(EXACT) - set(types))
    assert not unknown, f"EXACT lists model types transformers does not have: {unknown}"
    for model_type in types:
        why = refusal(_bare(model_type))
        if model_type in EXACT:
            assert why is None, (model_type, why)
        else:
            assert why is not None and repr(model_type) in why, (model_type, why)
            with pytest.raises(ValueError, match="not supported"):
                check_model(_bare(model_type))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(EXACT))
def test_exact_architecture(model_type):
    """Log-probs and every gradient of ``sum_p c_p . logp_p`` equal the per-path HF forwards."""
    paths = zoo_paths()
    coeffs = random_coeffs(paths, seed=3)
    with float64_everywhere():
        ref = zoo_model(model_type)
        tree = copy.deepcopy(ref)
        want = reference_logprobs(ref, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, want)).backward()
        got = path_logprobs(tree, paths)
        sum((c * lp).sum() for c, lp in zip(coeffs, got)).backward()
    assert max(rel_err(a, b) for a, b in zip(got, want)) < LOGP_TOL
    g_tree, g_ref = grads(tree), grads(ref)
    assert grad_err(g_tree, g_ref) < GRAD_TOL
    if model_type == "gpt_oss":  # the sinks train (they got no gradient before)
        sinks = [n for n in g_ref if n.endswith("sinks")]
        assert sinks and all(g_ref[n].abs().max() > 1e-3 for n in sinks)


class FooMamba2Mixer(nn.Module):
    """A state-space layer treetrain does not route (its name matches ``support.STATEFUL``)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


# one unrouted layer per state-carrying family (``support.STATEFUL``), refused by its name: every
# such layer transformers 5.24 ships in a causal LM is routed (Inkling's short convolutions were last)
STATEFUL_LAYERS = [
    "FooShortConvolution", "FooMamba2Mixer", "FooGatedDeltaNet", "FooLinearAttention", "FooRglru",
    "FooRwkvFeedForward", "FoomLSTM",
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
