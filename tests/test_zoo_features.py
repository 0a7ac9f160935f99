"""The zoo's configs exercise what each type is claimed exact for: an option set away from its default
acts, and the tree crosses the boundaries its algorithms work in.

``tests/test_model_zoo.py`` compares the tree with each path's own HF forward on tiny configs. That
comparison proves nothing about a feature the tiny config never switches on: a window longer than the
paths, a scaling HF never reads, a zero init that silences a branch. Here, per exact text type:

- every option the zoo sets (``zoo.zoo_options``: ``AWAY``'s scalings and attention extras, the type's
  ``PER_TYPE`` entries) and the length-dependent rotary table, put back to the type's default alone
  (same seed, same weights), moves the log-probs by more than ``ACTS``, unless ``INERT`` says why it
  cannot. An option whose default changes the parameters (a width, a count, a bias) is structural:
  its parameters exist and :func:`tests.test_model_zoo.test_exact_architecture` checks that each of
  them gets a nonzero gradient;
- chunked and blocked algorithms get paths longer than a chunk, with a branch point inside one, and
  convolutions reach back across a branch point (fast, from the config).

Worked example (gemma2): reverting ``final_logit_softcapping`` (3.0 -> 30.0) moves the log-probs by
0.04, ``sliding_window`` (3 -> 4096) by 0.99: both act, far above float64 rounding.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from treetrain.models.rope import length_rules
from treetrain.models.support import EXACT

from . import zoo
from .hybrid_models import float64_everywhere
from .reference import reference_logprobs
from .test_model_zoo import _too_old
from .zoo import causal_lm_types, zoo_model, zoo_paths

# an option acts when reverting it moves some log-prob by more than this: 100x the zoo's float64 bar
# (test_model_zoo.LOGP_TOL, 1e-12), so a tree that ignored the option would fail that test
ACTS = 1e-10

_CONST_SEEN = "it only scales init draws, which tests/zoo.py's zoo_model overwrites"
# options the zoo sets that cannot act on the type, and why (each checked to still be inert, so the
# list cannot go stale)
INERT = {
    ("olmoe", "sliding_window"): "OLMoE passes it to the attention call but never puts it in its mask "
    "(HF's eager and SDPA attention ignore it); set to show the tree ignores it too",
    ("mpt", "logit_scale"): "MPT's config carries it; HF's MptForCausalLM never reads it",
    ("gemma3_text", "attn_logit_softcapping"): "Gemma 3's config carries it; its attention has no "
    "logit cap (Gemma 2's had)",
    ("olmo_hybrid", "linear_a_log_min"): _CONST_SEEN,
    ("olmo_hybrid", "linear_a_log_max"): _CONST_SEEN,
    ("mamba2", "time_step_rank"): "Mamba2's mixer has no dt projection of that rank (Mamba 1 has)",
    ("nemotron_h", "time_step_min"): "an init bound of dt_bias, which tests/zoo.py's zoo_model overwrites",
    ("nemotron_h", "sliding_window"): "NemotronH's config carries it; its attention layers are full",
    ("hrm_text", "L_bp_cycles"): "which L cycles run without gradient: changes gradients only (the exact "
    "test compares every gradient), never the log-probs",
    ("jamba", "attn_layer_period"): "with 2 layers and offset 1, period 2 and the default 8 give the "
    "same layer mix (attention at layer 1)",
    ("jamba", "expert_layer_period"): "with 2 layers and offset 0, period 2 and the default 2 are the same",
    ("qwen2_moe", "max_window_layers"): "Qwen2-MoE slides its layers below max_window_layers: both 1 "
    "and the default 28 cover the sliding layer 0 of the zoo's 2",
    ("inkling_text", "logits_mup_width_multiplier"): "its default is the zoo's 0.5 already",
    ("longcat_flash", "ffn_hidden_size"): "an alias of intermediate_size, which the zoo sets anyway",
    ("longcat_flash", "expert_ffn_hidden_size"): "an alias of moe_intermediate_size, set anyway",
    ("longcat_flash", "moe_topk"): "an alias of num_experts_per_tok, set anyway",
    ("zamba2", "n_mamba_heads"): "Zamba2 derives its Mamba heads from mamba_headdim",
    ("zamba2", "kv_channels"): "Zamba2's attention derives its head width from attention_hidden_size",
    ("zamba2", "num_query_groups"): "Zamba2's attention takes its key/value heads from num_key_value_heads",
    ("bailing_hybrid", "short_conv_kernel_size"): "BailingHybrid's KDA layers read linear_conv_kernel_dim",
    ("axk2", "index_n_heads"): "the zoo's 16 index heads are its default (set back from SMALL's 2)",
    ("hy_v4", "index_n_heads"): "the zoo's 16 index heads are its default (set back from SMALL's 2)",
    ("bailing_hybrid", "mlp_layer_types"): "[dense, sparse], what first_k_dense_replace = 1 derives",
    ("kimi_linear", "mlp_layer_types"): "[dense, sparse], what first_k_dense_replace = 1 derives",
    ("falcon", "rope"): "the zoo's Falcon uses ALiBi (alibi=True): its rotary module is built, not used",
}
# options that change the arithmetic, not the function: the chunk a scan or lightning attention sums in
# (test_chunks_and_kernels_reach_across_branches checks that the zoo paths cross chunks), and a float32
# residual, which float64_everywhere lifts (it acts as shipped: test_as_shipped_and_flat)
ARITHMETIC = ("chunk_size", "mamba_chunk_size", "block_size", "residual_in_fp32")


def _types() -> list[str]:
    return [t for t in sorted(EXACT) if t in causal_lm_types() and not _too_old(t)]


def _shapes(model) -> dict[str, torch.Size]:
    return {n: p.shape for n, p in model.named_parameters()}


def _rotary_depends_on_length(model) -> bool:
    return bool(length_rules(model.config)) and any("Rotary" in type(m).__name__ for m in model.modules())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _types())
def test_zoo_options_act(model_type):
    getattr(transformers, causal_lm_types()[model_type])  # import first (see test_exact_architecture)
    with float64_everywhere():  # as test_exact_architecture: HF's float32 casts lifted
        _options_act(model_type)


def _options_act(model_type: str) -> None:
    paths = zoo_paths()
    model = zoo_model(model_type)
    with torch.no_grad():
        base = reference_logprobs(model, paths)
    options = [o for o in zoo.zoo_options(model_type) if o not in ARITHMETIC]
    if _rotary_depends_on_length(model):
        options.append("rope")
    moved = {}
    for option in options:
        try:
            other = zoo_model(model_type, revert=option)
        except Exception:  # noqa: BLE001 (config validators raise their own classes)
            continue  # its default does not fit the small config (a width, a layer count): structural
        if _shapes(other) != _shapes(model):
            continue  # structural: test_exact_architecture checks its parameters get gradients
        try:
            with torch.no_grad():
                lp = reference_logprobs(other, paths)
        except (RuntimeError, TypeError, ValueError):  # e.g. a top-k of None experts: HF needs it set
            continue
        moved[option] = max((a - b).abs().max().item() for a, b in zip(lp, base))
    inert = {o for o, d in moved.items() if not d > ACTS}  # NaN (a default HF cannot run) is not "acts"
    listed = {o for (t, o) in INERT if t == model_type}
    assert inert == listed, {
        "inert but not in INERT": {o: moved[o] for o in inert - listed},
        "in INERT but acts": {o: moved.get(o) for o in listed - inert},
    }


# config fields of chunked / blocked algorithms (the chunk a scan or lightning attention works in) and
# of short convolutions (their width)
CHUNKS = ARITHMETIC[:3]
KERNELS = (
    "conv_kernel", "mamba_d_conv", "conv_L_cache", "linear_conv_kernel_dim", "conv1d_width",
    "conv_kernel_size", "d_conv",
)  # fmt: skip


def _branch_points(paths: list[list[int]]) -> set[int]:
    """Path positions where some pair of paths first differs."""
    points = set()
    for i, a in enumerate(paths):
        for b in paths[:i]:
            n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            points.add(n)
    return points


def test_branch_points_of_zoo_paths():
    # the zoo paths share 5 tokens (the fourth only 3): [6, 6, 8, 9] tokens, branching at 3 and 5
    paths = zoo_paths()
    assert sorted(map(len, paths)) == [6, 6, 8, 9]
    assert _branch_points(paths) == {3, 5}


@pytest.mark.parametrize("model_type", _types())
def test_chunks_and_kernels_reach_across_branches(model_type):
    """Every chunk size is shorter than the longest path and has a branch point strictly inside a chunk
    (the scan carries a state across a chunk boundary and a node boundary); every convolution is at
    least 2 wide (a branch's first token reads the shared prefix through it); every sliding window is
    shorter than the longest path; a length-dependent rotary table has paths on both sides of its
    threshold."""
    cfg = zoo.zoo_config(model_type)
    paths = zoo_paths()
    longest, shortest = max(map(len, paths)), min(map(len, paths))
    points = _branch_points(paths)
    for key in CHUNKS:
        c = getattr(cfg, key, None)
        if isinstance(c, int) and not isinstance(c, bool):
            assert c < longest and any(p % c for p in points), (key, c)
    for key in KERNELS:
        k = getattr(cfg, key, None)
        if isinstance(k, int) and not isinstance(k, bool):
            assert k >= 2, (key, k)
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and (model_type, "sliding_window") not in INERT:
        assert window < longest, window
    for rule in length_rules(cfg):
        assert shortest <= rule.threshold < longest, rule
