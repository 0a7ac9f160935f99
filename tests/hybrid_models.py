"""Tiny random-init hybrid models (Gated DeltaNet + attention, mixture-of-experts): no download.

Every config mixes ``linear_attention`` and ``full_attention`` layers, uses the real conv kernel
width (4) and grouped value heads (more value heads than key heads), and a partial, multi-section
rotary embedding, so each code path a full-size checkpoint takes is exercised.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import transformers

from .reference import float64_casts, grads, random_coeffs, reference_logprobs, rel_err

HYBRID_ARCHS = ("qwen3_5", "qwen3_next")
MOE_ARCHS = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")

_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_GDN = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# rotary on half of each head, in three interleaved mrope sections (Qwen3.5 expands 2D position ids)
_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
_MROPE = dict(_ROPE, mrope_section=[2, 1, 1], mrope_interleaved=True)
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.3)


def tiny_hybrid_config(arch: str, vocab: int = 97, layers: tuple[str, ...] | None = None, **over):
    """``layers``: the layer types, default ``linear, full, linear``."""
    layer_types = list(layers or ("linear_attention", "full_attention", "linear_attention"))
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **_ATTN,
    )
    if arch == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**common, **_GDN, rope_parameters=dict(_MROPE), **over)
    elif arch == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            **common, **_GDN, **_MOE, shared_expert_intermediate_size=16, norm_topk_prob=True,
            rope_parameters=dict(_ROPE), **over,
        )  # fmt: skip
    elif arch == "qwen3_5_moe":
        common.pop("intermediate_size")
        cfg = transformers.Qwen3_5MoeTextConfig(
            **common, **_GDN, **_MOE, shared_expert_intermediate_size=16, rope_parameters=dict(_MROPE), **over
        )
    elif arch == "qwen3_moe":
        common.pop("layer_types")
        cfg = transformers.Qwen3MoeConfig(**common, **_MOE, rope_parameters=dict(_ROPE), **over)
    else:
        raise ValueError(arch)
    return cfg


def tiny_hybrid_model(arch: str, dtype=torch.float64, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = tiny_hybrid_config(arch, **over)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    # built in float32, then cast: HF's init draws different numbers per dtype, and the float32
    # and float64 models of one seed must hold the same weights for the float32 bound to mean much
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    draw = lambda p, a, b: torch.rand(p.shape, generator=g) * (b - a) + a  # noqa: E731
    with torch.no_grad():  # widen the init so log-probs are far from uniform and errors show
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
            if name.endswith("norm.weight"):  # zero-centered RMSNorms: give them a non-trivial scale
                p.copy_(draw(p, -0.5, 0.5))
            # slow decays (exp(g) ~ 0.6-0.97 per step, not HF's init, where A up to 16 forgets the
            # state within a token or two): every node's output depends on its parent's state
            if name.endswith("A_log"):
                p.copy_(draw(p, 0.05, 0.5).log())
            if name.endswith("dt_bias"):
                p.copy_(draw(p, -1.0, 0.0))
    return model.to(dtype)


def _warm_dynamo_rules():
    """Build torch.compile's table of torch functions now, from the real ``torch.zeros``:
    dynamo builds it lazily on first use, and built while the patches below are in
    place it marks the real functions as unknown ("skipped") for the rest of the run."""
    import torch._dynamo.trace_rules as rules

    rules.get_torch_obj_rule_map()
    rules._allowed_callable_ids()
    rules._disallowed_callable_ids()


@contextlib.contextmanager
def float64_everywhere():
    """``float64_casts`` plus what MoE code adds: routers take ``softmax(..., dtype=torch.float)``
    (float32 routing weights in a float64 model; DeepSeek-V2's as ``Tensor.softmax``), transformers'
    ``load_balancing_loss_func`` accumulates into ``torch.zeros(..., dtype=torch.float32)``,
    Inkling2's experts into ``torch.zeros_like(..., dtype=torch.float32)`` and Kimi-K2.5's vision merge
    into ``hidden.new_zeros(..., dtype=torch.float32)``; DiffLlama sums its lambda products with
    ``torch.sum(..., dtype=torch.float32)``. Their forward rounding is the same in a tree and a per-path
    forward (the values are per token, or parameters only), but the gradient through them is rounded
    to float32 after summing over tokens in a different order (5e-8)."""
    orig_softmax, orig_zeros, orig_zeros_like = torch.nn.functional.softmax, torch.zeros, torch.zeros_like
    orig_tensor_softmax, orig_sum, orig_tensor_sum = torch.Tensor.softmax, torch.sum, torch.Tensor.sum
    orig_new_zeros = torch.Tensor.new_zeros

    def f64(x, dtype):
        return torch.float64 if dtype is torch.float32 and x.dtype is torch.float64 else dtype

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return orig_softmax(x, dim=dim, _stacklevel=_stacklevel, dtype=f64(x, dtype))

    def tensor_softmax(x, dim, dtype=None):
        return orig_tensor_softmax(x, dim, dtype=f64(x, dtype))

    def sum_(x, *args, dtype=None, **kwargs):
        return orig_sum(x, *args, dtype=f64(x, dtype), **kwargs)

    def tensor_sum(x, *args, dtype=None, **kwargs):
        return orig_tensor_sum(x, *args, dtype=f64(x, dtype), **kwargs)

    def zeros(*size, **kwargs):
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return orig_zeros(*size, **kwargs)

    def zeros_like(x, **kwargs):
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return orig_zeros_like(x, **kwargs)

    def new_zeros(self, *size, **kwargs):
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return orig_new_zeros(self, *size, **kwargs)

    _warm_dynamo_rules()
    torch.nn.functional.softmax, torch.zeros, torch.zeros_like = softmax, zeros, zeros_like
    torch.Tensor.new_zeros = new_zeros
    torch.Tensor.softmax, torch.sum, torch.Tensor.sum = tensor_softmax, sum_, tensor_sum
    try:
        with float64_casts():
            yield
    finally:
        torch.nn.functional.softmax, torch.zeros, torch.zeros_like = orig_softmax, orig_zeros, orig_zeros_like
        torch.Tensor.new_zeros = orig_new_zeros
        torch.Tensor.softmax, torch.sum, torch.Tensor.sum = orig_tensor_softmax, orig_sum, orig_tensor_sum


def float32_runs(build, paths, tree=None, *, truth_inside: bool = True, seed: int = 0):
    """The three runs of a float32 check over ``paths`` (one random weighting of their log-probs,
    ``random_coeffs(paths, seed)``, backpropagated): the float64 truth each path alone, then a
    float32 model each path alone (a copy) and as a tree (``tree(model, paths)``, default
    ``path_logprobs``). ``build(dtype=...)`` makes the model (float64 by default); the truth's is built
    inside ``float64_everywhere`` (``truth_inside``) or before it (where float32-created buffers would
    draw other weights inside). Returns ``(log-probs [N], grads)`` of the truth, the reference, the tree."""
    from treetrain.logprobs import path_logprobs

    coeffs = random_coeffs(paths, seed)

    def run(model, fn):
        lps = fn(model, paths)
        sum((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, lps)).backward()
        return torch.cat(lps), grads(model)

    truth = None if truth_inside else build()
    with float64_everywhere():
        truth_run = run(build() if truth_inside else truth, reference_logprobs)
    model32 = build(dtype=torch.float32)
    ref_run = run(copy.deepcopy(model32), reference_logprobs)
    return truth_run, ref_run, run(model32, tree or path_logprobs)


def grad_l2_err(got: dict, want: dict) -> float:
    """Relative 2-norm error of all gradients together."""
    diff = torch.cat([(got[n].double() - want[n]).flatten() for n in want])
    return (diff.norm() / torch.cat([want[n].flatten() for n in want]).norm()).item()


def assert_float32_within_2x(runs) -> None:
    """The float32 bar on :func:`float32_runs`' output: the tree's error against the float64 truth
    within 2x of HF's own per-path error, log-probs (+1e-6: both round at ~6e-8 per op) and every
    parameter's gradient (+1e-5)."""
    (truth_lp, truth_g), (ref_lp, ref_g), (tree_lp, tree_g) = runs
    ref_e, tree_e = rel_err(ref_lp, truth_lp), rel_err(tree_lp, truth_lp)
    assert tree_e <= 2 * ref_e + 1e-6, (tree_e, ref_e)
    for n in truth_g:
        ref_e, tree_e = rel_err(ref_g[n], truth_g[n]), rel_err(tree_g[n], truth_g[n])
        assert tree_e <= 2 * ref_e + 1e-5, (n, tree_e, ref_e)
