"""The MoE types of the model zoo are MoE, and their router aux loss is HF's.

- Every exact type that claims MoE (its support note says so, or its modeling module declares router
  logits to record) builds, as its tiny zoo model, routers and experts, and the routing acts on the
  zoo paths: every router gets a gradient and at least two experts of every MoE layer get tokens
  (nonzero gradient on their slices of the expert weights).
- ``aux_coef`` claims an aux loss exactly for the types whose HF ``...ForCausalLM`` computes one, with
  the coefficient HF's forward adds (measured from its loss with and without router logits).
- For every such type, the aux loss ``treetrain train`` adds (one tree forward, each token weighted by
  the paths through it) equals HF's ``load_balancing_loss_func`` over the paths' own per-path
  forwards, value and every parameter gradient, in float64.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import transformers

from treetrain import TrajectoryTree, pack
from treetrain.models.moe import _router_targets
from treetrain.models.rope import split_regimes
from treetrain.models.support import EXACT
from treetrain.objectives.moe_aux import aux_coef, micro_batch_aux_loss, recording
from treetrain.objectives.path_outputs import path_target_logprobs

from .hybrid_models import float64_everywhere
from .reference import fresh_rotary, grad_err, grads, reference_logprobs, rel_err
from .test_model_zoo import _too_old
from .zoo import causal_lm_types, zoo_model, zoo_paths

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def _causal_lm_class(model_type: str) -> type:
    return getattr(transformers, causal_lm_types()[model_type])


def declares_routers(model_type: str) -> bool:
    """Whether the type's modeling module has a class that records ``router_logits``."""
    module = importlib.import_module(_causal_lm_class(model_type).__module__)
    return any(
        "router_logits" in (getattr(cls, "_can_record_outputs", None) or {})
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
    )


def hf_computes_aux(model_type: str) -> bool:
    """Whether the type's HF causal LM forward computes the router load-balancing loss."""
    return "load_balancing_loss_func(" in inspect.getsource(_causal_lm_class(model_type).forward)


RUNNABLE = sorted(t for t in EXACT if t in causal_lm_types() and not _too_old(t))
CLAIMED = [t for t in RUNNABLE if "MoE" in EXACT[t]]
MOE_TYPES = sorted(set(CLAIMED) | {t for t in RUNNABLE if declares_routers(t)})
AUX_TYPES = [t for t in MOE_TYPES if hf_computes_aux(t)]


def test_moe_lists():
    """The sets the tests below run over are what they say (a type renamed or dropped shows here)."""
    assert all(declares_routers(t) for t in CLAIMED)  # a note saying MoE: HF records its routers
    assert {"beam", "flint", "lfm2_moe", "mixtral", "qwen3_moe", "dbrx", "jetmoe"} <= set(MOE_TYPES)
    assert {"qwen3_moe", "mixtral", "dbrx", "jetmoe", "flint", "gpt_oss"} <= set(AUX_TYPES)
    assert not {"deepseek_v3", "beam", "lfm2_moe", "gemma4_text"} & set(AUX_TYPES)


def _routers(model) -> dict[str, torch.nn.Module]:
    classes = tuple(cls for cls, _ in _router_targets(model))
    return {n: m for n, m in model.named_modules() if classes and isinstance(m, classes)}


def _experts(model) -> dict[str, torch.nn.Module]:
    """The routed experts' modules (``...Experts`` classes holding every expert's weights)."""
    return {
        n: m
        for n, m in model.named_modules()
        if type(m).__name__.endswith("Experts")
        and "shared" not in n.rsplit(".", 1)[-1]
        and hasattr(m, "num_experts")
    }


def _experts_with_tokens(module) -> int:
    """How many of the module's experts got a nonzero gradient (each parameter ``[E * ..., ...]``)."""
    used = torch.zeros(module.num_experts, dtype=torch.bool)
    for p in module.parameters():
        if p.grad is not None:
            used |= p.grad.reshape(module.num_experts, -1).ne(0).any(-1)
    return int(used.sum())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_zoo_model_routes(model_type):
    """Routers and experts built, every router with a gradient, >= 2 experts of each MoE layer used."""
    model = zoo_model(model_type, dtype=torch.float32)  # gradients zero or not: float32 suffices
    routers, experts = _routers(model), _experts(model)
    assert routers, f"{model_type}: no router built (every layer dense?)"
    assert experts, f"{model_type}: no experts built"
    assert all(any(True for _ in m.parameters()) for m in routers.values()), (
        f"{model_type}: parameterless router"
    )
    sum(lp.sum() for lp in reference_logprobs(model, zoo_paths())).backward()
    for name, m in routers.items():
        assert any(p.grad is not None and p.grad.ne(0).any() for p in m.parameters()), f"{name}: no gradient"
    for name, m in experts.items():
        assert _experts_with_tokens(m) >= 2, (
            f"{name}: {_experts_with_tokens(m)} of {m.num_experts} experts used"
        )


def _hf_coefficient(model, ids: torch.Tensor) -> tuple[float | None, torch.Tensor | None]:
    """(coefficient, aux loss) HF's forward uses: its loss with router logits minus its loss without,
    over its ``aux_loss`` (None, None where it returns no aux loss)."""
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        if getattr(out, "aux_loss", None) is None:  # Gemma 4, Inkling: no such field
            return None, None
        plain = model(input_ids=ids, labels=ids, output_router_logits=False, use_cache=False)
    return float((out.loss - plain.loss) / out.aux_loss), out.aux_loss


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_aux_coef_is_hf_forward(model_type):
    """An aux loss exactly where HF's forward adds one, with its coefficient (never 0 in the zoo)."""
    with float64_everywhere():
        model = zoo_model(model_type)
        want, aux = _hf_coefficient(model, torch.tensor([zoo_paths()[0]]))
    got = aux_coef(model)
    assert (got is None) == (want is None) == (model_type not in AUX_TYPES), (got, want)
    if want is not None:
        # the coefficient recovered from two float64 losses of ~5 differing by coef * aux ~ 2e-3
        assert got > 0 and aux > 0 and got == pytest.approx(want, rel=1e-9)


def hf_aux_per_path(model, paths) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` (the type's own) over the router logits of each path's own
    forward (fresh rotary state per path), every path token counted once: the padded batch's loss
    with each row computed alone."""
    per_layer = None
    for p in paths:
        fresh_rotary(model)
        out = model(input_ids=torch.tensor([p]), output_router_logits=True, use_cache=False)
        logits = [x.reshape(len(p), -1) for x in out.router_logits]
        per_layer = logits if per_layer is None else [torch.cat([a, b]) for a, b in zip(per_layer, logits)]
    func = importlib.import_module(type(model).__module__).load_balancing_loss_func
    return func(tuple(per_layer), model.num_experts, model.num_experts_per_tok)


# float64 end to end: only summation order differs (measured <= 2.2e-16 value, 5.8e-15 gradients)
AUX_TOL = 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["tree", "sequence"])
@pytest.mark.parametrize("model_type", AUX_TYPES)
def test_router_aux_loss_equals_hf(model_type, packing):
    paths = zoo_paths()
    with float64_everywhere():
        ref = zoo_model(model_type)
        tree = zoo_model(model_type)
        # the trainer's micro-batch: paths of different rope regimes share no token (batches.py)
        packed = pack(split_regimes(tree, TrajectoryTree.from_paths(paths)))
        want = hf_aux_per_path(ref, paths)
        with recording(tree, aux_coef(tree)) as logits:
            path_target_logprobs(tree, packed, packing)
        got = micro_batch_aux_loss(tree, packed, packing, logits)
        want.backward()
        got.backward()
    errs = rel_err(got, want), grad_err(grads(tree), grads(ref))
    print(f"{model_type} {packing}: aux {want.item():.6f} value err {errs[0]:.1e} grad err {errs[1]:.1e}")
    assert max(errs) < AUX_TOL, errs
