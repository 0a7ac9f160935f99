"""The exact LM head (``treetrain.models.head``): every transform between the last hidden state and
the logits, by hand and against each architecture's own forward, in every scoring path (path
log-probs, the flat/TRL layout, the baseline)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from treetrain.integrations.flat import flat_logprobs
from treetrain.logprobs import path_logprobs, target_logprobs
from treetrain.models.head import LMHead, lm_head
from treetrain.models.hf import decoder_of
from treetrain.objectives.baseline import baseline_path_logprobs
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import float64_everywhere
from .reference import rel_err
from .zoo import zoo_model, zoo_paths

# W = [[1, 0], [0, 1], [1, 1]], h = [1, 2]: the projection's logits are [1, 2, 3]
W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
H = torch.tensor([[1.0, 2.0]], dtype=torch.float64)


def _logp(z: list[float], target: int) -> float:
    return z[target] - math.log(sum(math.exp(x) for x in z))


@pytest.mark.parametrize(
    "head, logits",
    [
        (LMHead(W), [1.0, 2.0, 3.0]),
        (LMHead(W, logit_scale=2.5), [2.5, 5.0, 7.5]),  # Cohere's logit_scale
        (LMHead(W, logit_scale=1 / 4), [0.25, 0.5, 0.75]),  # Granite: / logits_scaling (4)
        (LMHead(W, hidden_scale=0.5), [0.5, 1.0, 1.5]),  # MiniCPM3: hidden / logits_scaling (2)
        (LMHead(W, bias=torch.tensor([1.0, 0, 0], dtype=torch.float64), logit_scale=2.0), [4.0, 4.0, 6.0]),
        (LMHead(W, softcap=2.0), [2 * math.tanh(0.5), 2 * math.tanh(1.0), 2 * math.tanh(1.5)]),  # Gemma 2
        (LMHead(W, logit_scale=3.0, softcap=2.0), [2 * math.tanh(1.5), 2 * math.tanh(3), 2 * math.tanh(4.5)]),
    ],
)
def test_head_transforms_by_hand(head, logits):
    assert torch.allclose(head.logits(H)[0], torch.tensor(logits, dtype=torch.float64), atol=1e-15)
    for t in range(3):
        lp, ent = target_logprobs(H, head, torch.tensor([t]), chunk=1)
        assert abs(lp.item() - _logp(logits, t)) < 1e-14
    p = [math.exp(_logp(logits, t)) for t in range(3)]
    assert abs(ent.item() + sum(x * math.log(x) for x in p)) < 1e-14


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_post_scale_and_gradients_match_autograd(softcap):
    """``post`` (TRL's 1 / temperature) after the cap, a logit scale and a bias: log-probs,
    entropies and gradients of hidden, weight and bias against autograd on the full logits."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(11, 8, generator=g, dtype=torch.float64) * 2).requires_grad_()
    b = torch.randn(11, generator=g, dtype=torch.float64).requires_grad_()
    h = torch.randn(7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    cl, ce = (
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn(7, generator=g, dtype=torch.float64),
    )
    head = LMHead(w, b, hidden_scale=0.7, logit_scale=1.9, softcap=softcap)
    logp, ent = target_logprobs(h, head, t, chunk=3, post=1 / 0.8)
    got = [logp, ent, *torch.autograd.grad((cl * logp + ce * ent).sum(), (h, w, b))]
    lsm = torch.log_softmax(head.logits(h) / 0.8, -1)
    ref_lp, ref_ent = lsm.gather(1, t[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    want = [ref_lp, ref_ent, *torch.autograd.grad((cl * ref_lp + ce * ref_ent).sum(), (h, w, b))]
    for a, e in zip(got, want):
        assert rel_err(a, e) < 1e-12


# each architecture's head, derived from the model, against its own forward's logits
HEADS = {
    "cohere": dict(logit_scale=2.5),
    "cohere2": dict(logit_scale=2.5),
    "cohere2_moe": dict(logit_scale=2.5),
    "cohere_compass_text": dict(logit_scale=2.5),
    "granite": dict(logit_scale=1 / 3.0),
    "granitemoe": dict(logit_scale=1 / 3.0),
    "hyperclovax": dict(logit_scale=3.0),
    "minicpm3": dict(hidden_scale=16 / 64),  # logits_scaling = hidden_size / dim_model_base
    "falcon_h1": dict(logit_scale=0.7),
    "gemma2": dict(softcap=3.0),
    "gemma3_text": dict(softcap=3.0),
    "vaultgemma": dict(softcap=3.0),
    "beam": dict(softcap=3.0),
    "gemma3n_text": dict(softcap=3.0),
    "gemma4_text": dict(softcap=3.0),
    "gemma4_unified_text": dict(softcap=3.0),
    "recurrent_gemma": dict(softcap=5.0),  # logits_soft_cap
    "xlstm": dict(softcap=6.0),  # output_logit_soft_cap
    "dory": dict(),  # its per-token logit scale folded into the weight rows
    "llama": dict(),
}


@pytest.mark.parametrize("model_type", sorted(HEADS))
def test_derived_head_reproduces_the_models_logits(model_type):
    model = zoo_model(model_type)
    head = lm_head(model)
    for k, v in HEADS[model_type].items():
        assert getattr(head, k) == pytest.approx(v), (k, getattr(head, k))
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    with float64_everywhere(), torch.no_grad():
        # the decoder's output, what the head reads (Gemma 3n's last hidden_states entry precedes its
        # AltUp collapse and final norm)
        hidden = decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state
        logits = model(input_ids=ids, use_cache=False).logits
        assert rel_err(head.logits(hidden[0]), logits[0]) < 1e-13


def _trees(paths):
    return [TrajectoryTree.from_paths(paths)]


@pytest.mark.parametrize("model_type", ["cohere", "granite", "gemma2"])
def test_every_scoring_path_applies_the_head(model_type):
    """Path log-probs, the per-path baseline and the flat (TRL) layout with a temperature all give
    each path's own forward (the flat one: ``log_softmax(logits / T)``, as TRL scores)."""
    paths = zoo_paths()
    temperature = 0.7
    with float64_everywhere(), torch.no_grad():
        model = zoo_model(model_type)
        ref = copy.deepcopy(model)
        want, want_t = [], []
        for p in paths:
            logits = ref(input_ids=torch.tensor([p]), use_cache=False).logits[0, :-1]
            tgt = torch.tensor(p[1:])[:, None]
            want.append(torch.log_softmax(logits, -1).gather(1, tgt)[:, 0])
            want_t.append(torch.log_softmax(logits / temperature, -1).gather(1, tgt)[:, 0])
        got = path_logprobs(model, paths)
        base = baseline_path_logprobs(model, _trees(paths))
        L = max(map(len, paths))
        ids = torch.zeros(len(paths), L, dtype=torch.long)
        mask = torch.zeros(len(paths), L, dtype=torch.long)
        for i, p in enumerate(paths):  # left padded, as TRL's prompts
            ids[i, L - len(p) :], mask[i, L - len(p) :] = torch.tensor(p), 1
        flat = flat_logprobs(model, ids, mask, temperature=temperature)
    for i, p in enumerate(paths):
        assert rel_err(got[i], want[i]) < 1e-12
        assert rel_err(base[i], want[i]) < 1e-12
        assert rel_err(flat[i, L - len(p) + 1 :], want_t[i]) < 1e-12


def test_non_linear_head_is_refused():
    model = zoo_model("llama", dtype=torch.float32)
    model.lm_head = nn.Sequential(nn.Linear(64, 128))
    with pytest.raises(ValueError, match="nn.Linear"):
        lm_head(model)


def test_aya_vision_head_follows_its_forward():
    """Aya Vision's forward multiplies the logits by ``text_config.logit_scale`` from transformers 5.25
    (5.24 and older do not): the derived head reproduces the installed forward's logits either way."""
    from .vlm_zoo import vlm_model

    model = vlm_model("aya_vision")
    assert model.config.text_config.logit_scale != 1.0  # the zoo sets it away from 1
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    with float64_everywhere(), torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        logits = model(input_ids=ids, use_cache=False).logits
    assert rel_err(lm_head(model).logits(hidden[0]), logits[0]) < 1e-13  # float64: rounding only
