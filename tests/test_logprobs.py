"""path_logprobs == independent per-path forwards of the unmodified model: values and every
parameter gradient of a random linear function of the log-probs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from treetrain import path_logprobs
from treetrain.logprobs import target_logprobs

from .reference import (
    ARCHS,
    float64_casts,
    grad_err,
    grads,
    random_coeffs,
    reference_copy,
    reference_logprobs,
    rel_err,
    tiny_model,
)
from .strategies import tree_paths

GROUP = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 9, 9], [1, 2, 3, 4, 5, 6], [1, 2]]


def _compare(arch, paths, dtype=torch.float64, backend="dense", seed=0):
    """Return (max rel err of log-probs, max rel err over parameter grads) tree vs reference."""
    model = tiny_model(arch, dtype=dtype, seed=seed)
    ref = reference_copy(model)
    coeffs = random_coeffs(paths, seed, dtype=torch.float64)
    tree_lp = path_logprobs(model, paths, backend=backend)
    ref_lp = reference_logprobs(ref, paths)
    sum(((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, tree_lp))).backward()
    sum(((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, ref_lp))).backward()
    assert [lp.shape for lp in tree_lp] == [(len(p) - 1,) for p in paths]
    lp_err = max((rel_err(a, b) for a, b in zip(tree_lp, ref_lp) if b.numel()), default=0.0)
    return lp_err, grad_err(grads(model), grads(ref))


@pytest.mark.parametrize("arch", ARCHS)
def test_float64_group_tree(arch):
    # float64 with the models' float32 casts lifted: only summation order differs (SDPA over T
    # keys vs over len(p) keys, chunked head), so errors are a few float64 ulps amplified by depth:
    # 1e-11 leaves two orders of margin over what we measure (~1e-13).
    with float64_casts():
        lp_err, g_err = _compare(arch, GROUP)
    assert lp_err < 1e-11, lp_err
    assert g_err < 1e-11, g_err


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=tree_paths())
def test_float64_random_trees(arch, paths):
    with float64_casts():
        lp_err, g_err = _compare(arch, paths)
    assert lp_err < 1e-11 and g_err < 1e-11, (lp_err, g_err)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_within_reference_rounding(arch):
    """float32: tree error vs float64 truth is bounded by a small multiple of the reference's own.

    The truth is the same weights in float64 (HF's init draws different numbers per dtype, so the
    float64 model must be a converted copy, not a fresh one).
    """
    paths = GROUP
    model32 = tiny_model(arch, dtype=torch.float32)
    model64 = reference_copy(model32).double()
    with float64_casts():
        truth = reference_logprobs(model64, paths)
    ref32 = reference_logprobs(reference_copy(model32), paths)
    for backend in ("dense", "blocksparse"):
        tree32 = path_logprobs(reference_copy(model32), paths, backend=backend)
        ref_e = max(rel_err(a, b) for a, b in zip(ref32, truth))
        tree_e = max(rel_err(a, b) for a, b in zip(tree32, truth))
        # float32 rounding is ~6e-8 per op; both runs round differently (other summation orders),
        # so the tree may be a few times worse or better than the reference on any one case.
        assert ref_e < 1e-5, ref_e  # the truth really is the same model
        assert tree_e <= 4 * ref_e, (backend, tree_e, ref_e)


def test_entropy_matches_reference():
    with float64_casts():
        model = tiny_model("qwen3")
        lp, ent = path_logprobs(model, GROUP, backend="dense", return_entropy=True)
        ref_lp, ref_ent = reference_logprobs(reference_copy(model), GROUP, return_entropy=True)
    for a, b in zip(ent, ref_ent):
        assert rel_err(a, b) < 1e-11


def test_target_logprobs_gradients_small_chunks():
    """The chunked head's custom backward equals autograd through a full log-softmax."""
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=True, dtype=torch.float64)
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 11, (9,))
    gl, ge = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    lp, ent = target_logprobs(h, head, tgt, chunk=4)
    assert target_logprobs(h, head, tgt, chunk=4, entropy=False)[1].numel() == 0
    ((lp * gl).sum() + (ent * ge).sum()).backward()
    mine = [h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    h.grad = None
    head.zero_grad()
    lsm = torch.log_softmax(head(h), -1)
    lp2, ent2 = lsm.gather(1, tgt[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    ((lp2 * gl).sum() + (ent2 * ge).sum()).backward()
    assert torch.allclose(lp, lp2, rtol=0, atol=1e-13) and torch.allclose(ent, ent2, rtol=0, atol=1e-13)
    for a, b in zip(mine, [h.grad, head.weight.grad, head.bias.grad]):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    # without an entropy gradient the backward skips the entropy terms
    h.grad = None
    head.zero_grad()
    (target_logprobs(h, head, tgt, chunk=4, entropy=False)[0] * gl).sum().backward()
    no_ent = [h.grad.clone(), head.weight.grad.clone()]
    h.grad = None
    head.zero_grad()
    (torch.log_softmax(head(h), -1).gather(1, tgt[:, None])[:, 0] * gl).sum().backward()
    assert torch.allclose(no_ent[0], h.grad, atol=1e-12) and torch.allclose(
        no_ent[1], head.weight.grad, atol=1e-12
    )


def test_float32_entropy_with_large_logits_is_float32_accurate():
    """Logits far from 0 (a real model's: SmolLM2-135M's reach 43, log-sum-exp ~34, entropy ~0.6)
    must not cost digits. The entropy as ``lse - E_p[z]`` with an einsum dot product lost them in
    float32 (3e-3 per token there, 1e-3 on a GRPO batch's mean entropy); so does ``-sum p log p``
    through einsum (3e-4 per token). Here the logits sit near 40-54 over 8,192 classes and the
    entropy is ~2: the old form is off by 1.2e-3, ``-(p * log p).sum()`` by 1.9e-6, the form from
    max-shifted logits (two sums of non-negative terms) by 7.2e-7. The bound 2e-5:
    each float32 logit already carries |z| x eps ~ 54 x 6e-8 ~ 3e-6 of rounding, and the entropy a
    few of those; the gradient ``-p (log p + H)`` likewise, relative to its largest entry."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 8192, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.bias.add_(40.0)
        head.bias[:8].add_(14.0)  # a few likely classes: a peaked distribution, entropy ~2
    h = torch.randn(12, 16, dtype=torch.float64)
    tgt = torch.randint(0, 8, (12,))
    ge = torch.randn(12, dtype=torch.float64)
    head32 = torch.nn.Linear(16, 8192, bias=True)
    head32.load_state_dict({k: v.float() for k, v in head.state_dict().items()})
    grads = []
    for hd, x in ((head, h), (head32, h.float())):
        x = x.clone().requires_grad_(True)
        ent = target_logprobs(x, hd, tgt, chunk=5)[1]
        (ent * ge.to(ent.dtype)).sum().backward()
        grads.append((ent.detach().double(), x.grad.double()))
    (e64, g64), (e32, g32) = grads
    assert (e32 - e64).abs().max() < 2e-5, (e32 - e64).abs().max()
    assert (g32 - g64).abs().max() < 2e-5 * g64.abs().max(), (g32 - g64).abs().max()


def test_bf16_autocast_on_cpu_within_reference_error():
    """Under CPU autocast RoPE leaves q/k in float32 and v in bf16: the hook must unify them.

    The tree's bf16 error against the float32 truth stays within a small multiple of the
    reference's own bf16-autocast error (both round at different points: 8 mantissa bits).
    """
    model = tiny_model("qwen3", dtype=torch.float32)
    ref_model = reference_copy(model)
    truth = reference_logprobs(ref_model, GROUP)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref16 = reference_logprobs(ref_model, GROUP)
    ref_e = max((a.float() - b).abs().max().item() for a, b in zip(ref16, truth))
    for backend in ("dense", "blocksparse"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lps = path_logprobs(model, GROUP, backend=backend)
        tree_e = max((a.float() - b).abs().max().item() for a, b in zip(lps, truth))
        assert tree_e <= 4 * ref_e + 1e-3, (backend, tree_e, ref_e)
