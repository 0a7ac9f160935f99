"""Sliding-window tree attention: the window is measured along each path (``pos[q] - pos[k] < W``).

Every backend against the dense reference mask (itself checked by hand below), then whole
sliding-window models (Mistral, Qwen2, Gemma 2 and 3) against per-path forwards of the unmodified
Hugging Face model, in float64, with windows shorter than the shared prefix: the window then
hides shared keys from some queries and not from others, which is where a tree could go wrong.

float64 tolerances: as in test_logprobs, only the summation order differs from the reference
(~1e-13 measured); 1e-10 (attention) and 1e-11 (models) leave ample margin and still catch one
wrong (query, key) pair, which moves results by O(1 / window).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import copy  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from treetrain import path_logprobs  # noqa: E402
from treetrain.attention import get_backend  # noqa: E402
from treetrain.attention.blocksparse import blocksparse_attention  # noqa: E402
from treetrain.attention.dense import dense_attention  # noqa: E402
from treetrain.attention.flex import flex_tree_attention  # noqa: E402
from treetrain.attention.mask import (  # noqa: E402
    TreeMask,
    block_classes,  # noqa: E402
    dense_tree_mask,
)

from .reference import float64_casts, grad_err, grads, random_coeffs, reference_logprobs, rel_err  # noqa: E402
from .strategies import random_parents, tree_from_parents  # noqa: E402

CONTINUE = 0.75  # random_parents: this file's forests run a little deeper than its default
DESIGN = [-1, 0, 1, 2, 1, 4, 0, 6]  # A B C D E F G H: paths A B C D, A B E F, A G H


def test_design_example_by_hand():
    end, pos = tree_from_parents(DESIGN)
    assert end.tolist() == [8, 6, 4, 4, 6, 6, 8, 8] and pos.tolist() == [0, 1, 2, 3, 2, 3, 1, 2]
    mask = dense_tree_mask(end, pos, window=2).int().tolist()
    assert mask[3] == [0, 0, 1, 1, 0, 0, 0, 0]  # D (pos 3) sees C D, not A B
    assert mask[5] == [0, 0, 0, 0, 1, 1, 0, 0]  # F (pos 3) sees E F: C D are another branch
    assert mask[7] == [0, 0, 0, 0, 0, 0, 1, 1]  # H (pos 2) sees G H
    assert mask[4] == [0, 1, 0, 0, 1, 0, 0, 0]  # E (pos 2) sees B E
    assert dense_tree_mask(end, pos, window=100).equal(dense_tree_mask(end))
    assert dense_tree_mask(end, pos, window=1).equal(torch.eye(8, dtype=torch.bool))


def test_block_classes_with_window_match_dense():
    end, pos = tree_from_parents(random_parents(61, random.Random(3), CONTINUE))
    for window, block in [(1, 4), (3, 4), (5, 8), (20, 8)]:
        any_allowed, full = block_classes(end, block, pos, window)
        dense = dense_tree_mask(end, pos, window)
        for qb in range(any_allowed.shape[0]):
            for kb in range(any_allowed.shape[1]):
                tile = dense[qb * block : qb * block + block, kb * block : kb * block + block]
                assert bool(full[qb, kb]) == bool(tile.all())
                assert bool(any_allowed[qb, kb]) or not bool(tile.any())


def _run(attn, q, k, v, do, end, pos, window, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = attn(q, k, v, TreeMask(end, position_ids=pos), 0.6, window=window, **kw)
    return [o, *torch.autograd.grad(o, (q, k, v), do)]


def _inputs(T, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(h, T, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv, hq)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(1, 70),
    rng=st.randoms(use_true_random=False),
    window=st.integers(1, 12),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    block=st.sampled_from([2, 3, 8]),
)
def test_blocksparse_window_matches_dense(T, rng, window, heads, block):
    end, pos = tree_from_parents(random_parents(T, rng, CONTINUE))
    inputs = _inputs(T, *heads, 8, torch.float64, rng.randint(0, 2**16))
    ref = _run(dense_attention, *inputs, end, pos, window)
    got = _run(blocksparse_attention, *inputs, end, pos, window, block=block)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        # relative, floored at 1: with window 1 each query sees itself only and dq is exactly 0
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1.0)
        assert err < 1e-10, (name, err)


def test_flex_window_forward_matches_dense_on_cpu():
    chain = [t - 1 for t in range(100)]
    end, pos = tree_from_parents(chain + random_parents(100, random.Random(0), CONTINUE))
    q, k, v, _ = _inputs(200, 4, 2, 16, torch.float32, 0)
    for window in (7, 90):
        mask = TreeMask(end, position_ids=pos)
        got = flex_tree_attention(q, k, v, mask, 0.5, window=window)
        ref = dense_attention(q, k, v, mask, 0.5, window=window)
        assert (got - ref).abs().max() < 1e-5, window  # float32 rounding over <= 300 keys
        capped = flex_tree_attention(q, k, v, mask, 0.5, window=window, softcap=2.0)
        assert (capped - dense_attention(q, k, v, mask, 0.5, window=window, softcap=2.0)).abs().max() < 1e-5


def test_triton_window_matches_dense():
    tk = pytest.importorskip("treetrain.attention.triton_kernel")
    if not tk.triton_available():
        pytest.skip("needs triton and CUDA or TRITON_INTERPRET=1")
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    end, pos = tree_from_parents([t - 1 for t in range(20)] + random_parents(45, random.Random(1), CONTINUE))
    inputs = _inputs(65, 4, 2, 16, torch.float32, 1)
    for window in (1, 5):
        ref = _run(dense_attention, *(x.double() for x in inputs), end, pos, window)
        got = _run(
            tk.triton_tree_attention, *(x.to(device) for x in inputs), end.to(device), pos.to(device),
            window, block_m=16, block_n=16,
        )  # fmt: skip
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert (a.double().cpu() - b).abs().max() < 1e-4, (window, name)  # fp32, as test_attention_triton


@pytest.mark.parametrize("backend", ["blocksparse", "triton"])
def test_softcap_unsupported_backends_say_which_to_use(backend):
    end, pos = tree_from_parents(DESIGN)
    q, k, v, _ = _inputs(8, 2, 1, 16, torch.float32, 0)
    with pytest.raises(ValueError, match=f"not supported by the {backend} backend.*'dense'"):
        get_backend(backend)(q, k, v, TreeMask(end, position_ids=pos), 0.5, softcap=50.0)


def test_window_needs_positions():
    end, _ = tree_from_parents(DESIGN)
    q = torch.randn(1, 8, 8)
    with pytest.raises(ValueError, match="position_ids"):
        dense_attention(q, q, q, TreeMask(end), 1.0, window=2)


# ------------------------------------------------------------------------------------------------
# Whole models against per-path Hugging Face forwards.
# ------------------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
WINDOW = 3
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def sliding_config(arch: str):
    """Tiny random configs; two layers, so the interleaved archs have one local and one global."""
    if arch == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    if arch == "qwen2":  # layers >= max_window_layers slide
        return transformers.Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
    if arch == "gemma2":  # both softcaps, small enough to bite on these logits
        return transformers.Gemma2Config(
            **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    # windows a layer never passes to the attention call: HF applies them only in its mask
    if arch == "qwen2_moe":  # even layers below max_window_layers slide: layer 0
        return transformers.Qwen2MoeConfig(
            **COMMON, **MOE, shared_expert_intermediate_size=16, use_sliding_window=True,
            sliding_window=WINDOW, max_window_layers=1,
        )  # fmt: skip
    if arch == "phimoe":  # every layer slides
        return transformers.PhimoeConfig(**COMMON, **MOE, num_local_experts=4, sliding_window=WINDOW)
    if arch == "olmoe":  # a user-set window OLMoE passes to the call, but its mask (causal) ignores
        cfg = transformers.OlmoeConfig(**COMMON, **MOE)
        cfg.sliding_window = WINDOW
        return cfg
    raise ValueError(arch)


def sliding_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = sliding_config(arch)
    cfg._attn_implementation = "eager"  # HF's literal definition of the window and the softcap
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    return model


# shared prefix of 6 > WINDOW, branches of different lengths, a duplicate and a short path
PATHS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [1, 2, 3, 4, 5, 6, 11, 12],
    [1, 2, 3, 4, 5, 6, 11, 13, 14, 15, 16],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [1, 2, 3],
    [20, 21, 22, 23, 24, 25],
]


@contextlib.contextmanager
def float64_softmax():
    """HF's eager attention takes its softmax in float32 (``dtype=torch.float32``): keep float64."""
    orig = torch.nn.functional.softmax

    def softmax(x, *args, dtype=None, **kwargs):
        return orig(x, *args, dtype=torch.float64 if dtype is torch.float32 else dtype, **kwargs)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = orig


def _compare(arch: str, backend: str):

    model = sliding_model(arch)
    ref = copy.deepcopy(model)
    coeffs = random_coeffs(PATHS, 0)
    with float64_casts(), float64_softmax():
        tree_lp = path_logprobs(model, PATHS, backend=backend)
        ref_lp = reference_logprobs(ref, PATHS)
        sum((c * lp).sum() for c, lp in zip(coeffs, tree_lp)).backward()
        sum((c * lp).sum() for c, lp in zip(coeffs, ref_lp)).backward()
    lp_err = max(rel_err(a, b) for a, b in zip(tree_lp, ref_lp))
    return lp_err, grad_err(grads(model), grads(ref))


ARCHS = ["mistral", "qwen2", "gemma2", "gemma3", "qwen2_moe", "phimoe", "olmoe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_model_matches_per_path_reference(arch):
    lp_err, g_err = _compare(arch, "dense")
    assert lp_err < 1e-11 and g_err < 1e-11, (lp_err, g_err)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_model_blocksparse_matches_per_path_reference(arch):
    lp_err, g_err = _compare(arch, "blocksparse")
    assert lp_err < 1e-11 and g_err < 1e-11, (lp_err, g_err)


@pytest.mark.parametrize("arch", ["mistral", "qwen2_moe", "phimoe"])
def test_window_changes_the_result(arch):
    """Guard against a vacuous pass: the same weights with the window off give other log-probs
    (Qwen2-MoE and PhiMoE: the window their masks apply, which the attention call never sees)."""
    model = sliding_model(arch)
    with float64_casts(), torch.no_grad():
        windowed = path_logprobs(model, PATHS, backend="dense")
        if arch == "qwen2_moe":
            model.config.layer_types = ["full_attention"] * 2
        else:
            model.config.sliding_window = None
        full = path_logprobs(model, PATHS, backend="dense")
    assert rel_err(windowed[0], full[0]) > 1e-3


def test_gemma2_blocksparse_softcap_error_names_the_alternative():
    from treetrain.models.hf import auto_backend

    model = sliding_model("gemma2")
    refusal = "'blocksparse' does not support attention logit softcapping.*'dense' or 'flex'"
    with pytest.raises(ValueError, match=refusal):
        path_logprobs(model, PATHS, backend="blocksparse")
    # the automatic choice avoids it: dense on CPU (flex on CUDA)
    assert auto_backend(model, torch.device("cpu")) == "dense"
    assert auto_backend(sliding_model("gemma3"), torch.device("cpu")) == "blocksparse"
    assert len(path_logprobs(model, PATHS)) == len(PATHS)


def test_final_logit_softcap_head_matches_autograd():
    """The chunked head with Gemma 2's final softcap: log-probs, entropies and their gradients
    against autograd through ``log_softmax(cap * tanh(h W^T / cap))``."""
    from treetrain.logprobs import target_logprobs
    from treetrain.models.head import LMHead

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=True).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g, dtype=torch.float64) * 2)
    h = torch.randn(7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    cl, ce = (
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn(7, generator=g, dtype=torch.float64),
    )
    logp, ent = target_logprobs(h, LMHead(head.weight, head.bias, softcap=2.0), t, chunk=3)
    got = [logp, ent, *torch.autograd.grad((cl * logp + ce * ent).sum(), (h, head.weight, head.bias))]
    lsm = torch.log_softmax(torch.tanh(head(h) / 2.0) * 2.0, -1)
    ref_logp, ref_ent = lsm.gather(1, t[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    want = [ref_logp, ref_ent]
    want += torch.autograd.grad((cl * ref_logp + ce * ref_ent).sum(), (h, head.weight, head.bias))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-12, rel_err(a, b)
    capped_lp, _ = target_logprobs(h, head, t, chunk=3)
    assert rel_err(capped_lp, logp) > 1e-2  # the cap matters at this scale


def test_layer_masks_refuse_what_the_tree_cannot_compute():
    """The mask function HF composes is probed: causal and causal-with-window pass, with the window
    HF names; a chunked or bidirectional mask, or a layer handed a mask of the model's own, raises."""
    from transformers import masking_utils as mu

    from treetrain.models.layer_masks import layer_window, mask_interface, padding_mask

    tree = TreeMask(torch.tensor([4, 4, 4, 4]), position_ids=torch.arange(4))
    with padding_mask(tree, 4, "cpu") as pad:
        kw = dict(batch_size=1, q_length=4, kv_length=4, attention_mask=pad)
        full = mask_interface(mask_function=mu.causal_mask_function, **kw)
        slide = mask_interface(mask_function=mu.sliding_window_causal_mask_function(3), local_size=3, **kw)
        assert layer_window(full, tree) is None and layer_window(slide, tree) == 3
        with pytest.raises(ValueError, match="not causal with a sliding window of 3"):  # chunked
            chunked = mu.chunked_causal_mask_function(3, torch.zeros(1))
            mask_interface(mask_function=chunked, local_size=3, **kw)
        with pytest.raises(ValueError, match="not causal"):
            mask_interface(mask_function=mu.bidirectional_mask_function, **kw)
        with pytest.raises(ValueError, match="builds its own attention mask"):
            layer_window(torch.ones(1, 1, 4, 4, dtype=torch.bool), tree)
    # outside a tree forward: transformers' own SDPA mask
    plain = mask_interface(mask_function=mu.causal_mask_function, **kw, allow_is_causal_skip=False)
    assert plain.shape == (1, 1, 4, 4) and plain[0, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())
