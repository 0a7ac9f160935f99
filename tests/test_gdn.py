"""Gated DeltaNet on trees == independent per-path forwards of the unmodified model.

Unit checks of the routing math (conv windows, level schedule, padding invariance, the routed rule
against one-node-at-a-time and whole-path runs), then Qwen3.5 and Qwen3-Next end to end: log-probs
and every parameter gradient of a random linear function of the log-probs.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from treetrain import path_logprobs
from treetrain.models.gdn import (
    _torch_rule,
    native_chunk_rule,
    tree_gated_delta_rule,
    tree_gated_delta_rule_nodewise,
)
from treetrain.models.pathconv import conv_window_index, path_conv1d_reference, tree_causal_conv1d
from treetrain.models.recurrent import patch_recurrent_layers
from treetrain.models.scan import build_levels
from treetrain.models.support import check_model
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

from .hybrid_models import HYBRID_ARCHS, float32_runs, float64_everywhere, tiny_hybrid_model
from .reference import grads, random_coeffs, reference_copy, reference_logprobs, rel_err
from .strategies import tree_paths
from .zoo import VOCAB, zoo_model, zoo_paths

DOC = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8]]  # A B C D / A B E F / A G H, as in the docstrings
GROUP = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 9, 9], [1, 2, 3, 4, 5, 6], [1, 2]]
# every node one token: the conv window of a leaf reaches 3 nodes up
ONE_TOKEN = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 8], [1, 9], [10]]
# a chain of 1-token nodes, each with a side branch, under a long root, then long leaves
CHAIN = [[*range(1, 9), *range(20, 20 + d), 40 + d, 50, 51, 52, 53, 54] for d in range(6)]
# deep and wide: 3 levels of fan-out 3 with node lengths 1..3, over a 5-token root
DEEP_WIDE = [
    [1, 2, 3, 4, 5, 10 + a, *([20 + b] * (1 + b)), *([30 + c] * (1 + (a + c) % 3))]
    for a in range(3)
    for b in range(3)
    for c in range(3)
]
HAND = {"doc": DOC, "group": GROUP, "one_token": ONE_TOKEN, "chain": CHAIN, "deep_wide": DEEP_WIDE}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


# ---- the routing math ---------------------------------------------------------------------------


def test_docstring_example():
    packed = pack(TrajectoryTree.from_paths(DOC))
    assert packed.prev.tolist() == [-1, 0, 1, 2, 1, 4, 0, 6]
    window = conv_window_index(packed.prev, 3)
    assert window[4].tolist() == [0, 1, 4] and window[6].tolist() == [8, 0, 6]
    assert window[0].tolist() == [8, 8, 0]
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent)
    idx = [[g.tolist() for g in lv.groups] for lv in levels.levels]
    assert idx == [[[[0]]], [[[6, 7], [1, 8]]], [[[2, 3], [4, 5]]]]
    assert levels.levels[2].parent_row.tolist() == [1, 1]  # B is row 1 of level 1
    assert levels.levels[1].cu_seqlens.tolist() == [0, 2, 3]
    assert levels.levels[1].flat_index.tolist() == [6, 7, 1]
    # every token has one row in the padded and in the varlen layouts
    assert len(set(levels.padded_row.tolist())) == 8 and levels.num_padded == 9
    assert sorted(levels.varlen_row.tolist()) == list(range(8))


def test_skewed_level_is_split_by_length():
    """One long node beside many 1-token siblings: grouped, not padded to the long one."""
    paths = [[1, *range(100, 400)]] + [[1, t] for t in range(2, 40)]
    packed = pack(TrajectoryTree.from_paths(paths))
    grouped = build_levels(packed.node_start, packed.node_end, packed.node_parent)
    one = build_levels(packed.node_start, packed.node_end, packed.node_parent, pad_slack=None)
    assert [g.shape for g in grouped.levels[1].groups] == [(1, 300), (38, 1)]
    assert one.num_padded == 1 + 39 * 300 and grouped.num_padded == 1 + 300 + 38
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(packed.num_tokens))
    with float64_everywhere():
        a, b = (tree_gated_delta_rule(q, k, v, g, beta, lv) for lv in (grouped, one))
    assert rel_err(a, b) < 1e-13


def _path_rows(packed):
    return [packed.path_index[a:b] for a, b in zip(packed.path_offsets[:-1], packed.path_offsets[1:])]


def test_tree_conv_matches_per_path_conv_and_gradcheck():
    torch.manual_seed(0)
    packed = pack(TrajectoryTree.from_paths(ONE_TOKEN + CHAIN[:2]))
    T, C, width = packed.num_tokens, 5, 4
    x = torch.randn(T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, width, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, requires_grad=True)
    window = conv_window_index(packed.prev, width)
    out = tree_causal_conv1d(x, w, b, window)
    for rows in _path_rows(packed):
        ref = path_conv1d_reference(x[rows], w, b)
        assert torch.allclose(out[rows], ref, rtol=0, atol=1e-13)
    small = pack(TrajectoryTree.from_paths(DOC))
    win = conv_window_index(small.prev, 3)
    args = (torch.randn(8, 2, dtype=torch.float64, requires_grad=True), w[:2, :3].detach().requires_grad_())
    assert torch.autograd.gradcheck(lambda x_, w_: tree_causal_conv1d(x_, w_, None, win), args)


def _rule_inputs(T, Hk=2, Hv=4, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, Hk, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(T, Hv, D, generator=g, dtype=dtype)
    decay = -torch.rand(T, Hv, generator=g, dtype=dtype)
    beta = torch.rand(T, Hv, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def test_padding_leaves_the_state_unchanged():
    """Steps with q = k = v = 0, beta = 0, g = 0 are no-ops: the level padding is exact."""
    rule = _torch_rule()
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(5))
    s0 = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    _, s = rule(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=s0,
                output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=4)  # fmt: skip
    pad = lambda x: torch.cat([x, x.new_zeros(3, *x.shape[1:])])[None]  # noqa: E731
    o_p, s_p = rule(pad(q), pad(k), pad(v), g=pad(g), beta=pad(beta), initial_state=s0,
                    output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=4)  # fmt: skip
    assert torch.equal(s_p, s) or rel_err(s_p, s) < 1e-14
    assert o_p[0, 5:].abs().max() == 0


def test_native_rule_is_transformers_rule_in_float64():
    """A float64 model's rule stays float64 (transformers' own computes in float32): outputs, final
    state and input gradients equal transformers' rule with its float32 casts lifted, for chunks
    that divide the sequence, pad it, or hold one step."""
    q, k, v, g, beta = (t[None].detach() for t in _rule_inputs(37))
    s0 = torch.randn(1, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for chunk in (64, 16, 37, 1):
        args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
        mine = native_chunk_rule(*args[:5], chunk, args[5])
        assert mine[0].dtype == torch.float64
        targs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
        with float64_everywhere():
            theirs = _torch_rule()(*targs[:3], g=targs[3], beta=targs[4], chunk_size=chunk,
                                   initial_state=targs[5], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)  # fmt: skip
        for a, b in zip(mine, theirs):
            assert rel_err(a, b) < 1e-13, chunk
        coef = torch.randn_like(mine[0])
        ((mine[0] * coef).sum() + mine[1].sum()).backward()
        ((theirs[0] * coef).sum() + theirs[1].sum()).backward()
        for a, b in zip(args, targs):
            assert rel_err(a.grad, b.grad) < 1e-12, chunk


def test_rule_gets_one_query_key_head_per_value_head(monkeypatch):
    """Grouped value heads (2 q/k heads, 4 value heads): the rule is handed q and k repeated to the
    value heads' count, as HF's layers do before calling it (transformers 5.10's rule takes equal
    counts and fails on 2 vs 4; 5.24's repeats them itself)."""
    import treetrain.models.gdn as gdn

    real, calls = _torch_rule(), []

    def rule(q, k, v, **kwargs):
        assert q.shape[2] == k.shape[2] == v.shape[2], (q.shape, k.shape, v.shape)
        calls.append(q.shape)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(gdn, "_torch_rule", lambda: rule)
    packed = pack(TrajectoryTree.from_paths(DOC))
    q, k, v, g, beta = (t.detach().float() for t in _rule_inputs(packed.num_tokens))
    assert q.shape[1] < v.shape[1]
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent)
    out = tree_gated_delta_rule(q, k, v, g, beta, levels)
    nodes = (packed.node_start, packed.node_end, packed.node_parent)
    nodewise = tree_gated_delta_rule_nodewise(q, k, v, g, beta, *nodes)
    assert len(calls) == len(levels.levels) + len(packed.node_start)
    assert rel_err(out, nodewise) < 1e-5  # float32, two chunkings: rounding only (measured 1e-7)


@pytest.mark.parametrize("name", ["doc", "one_token", "deep_wide"])
def test_routed_rule_matches_nodewise_and_whole_paths(name):
    with float64_everywhere():  # the PyTorch rule computes in float32 otherwise
        _routed_rule_check(name)


def _routed_rule_check(name):
    packed = pack(TrajectoryTree.from_paths(HAND[name]))
    q, k, v, g, beta = _rule_inputs(packed.num_tokens)
    levels = build_levels(packed.node_start, packed.node_end, packed.node_parent)
    out = tree_gated_delta_rule(q, k, v, g, beta, levels)
    nodewise = tree_gated_delta_rule_nodewise(
        q, k, v, g, beta, packed.node_start, packed.node_end, packed.node_parent
    )
    assert rel_err(out, nodewise) < 1e-13
    # the check has teeth: dropping the parents' states (every node from zeros) is far off
    orphans = torch.full_like(packed.node_parent, -1)
    unrouted = tree_gated_delta_rule_nodewise(q, k, v, g, beta, packed.node_start, packed.node_end, orphans)
    assert rel_err(unrouted, nodewise) > 1e-2
    rule, coef = _torch_rule(), torch.randn_like(out)
    (out * coef).sum().backward()
    mine = [t.grad.clone() for t in (q, k, v, g, beta)]
    for t in (q, k, v, g, beta):
        t.grad = None
    # each path alone from a zero state; autograd sums a shared token's gradient over its paths
    total = 0
    for rows in _path_rows(packed):
        o, _ = rule(*(t[rows][None] for t in (q, k, v)), g=g[rows][None], beta=beta[rows][None],
                    use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert rel_err(out[rows], o[0]) < 1e-13
        total = total + (o[0] * coef[rows]).sum()
    # a token shared by n paths appears n times in `total`: weight the tree's loss the same way
    counts = torch.bincount(packed.path_index, minlength=packed.num_tokens).double()
    q2, k2, v2, g2, b2 = (t.detach().requires_grad_() for t in (q, k, v, g, beta))
    out2 = tree_gated_delta_rule(q2, k2, v2, g2, b2, levels)
    (out2 * coef * counts[:, None, None]).sum().backward()
    total.backward()
    for a, t in zip([x.grad for x in (q2, k2, v2, g2, b2)], (q, k, v, g, beta)):
        assert rel_err(a, t.grad) < 1e-12
    assert all(torch.isfinite(m).all() for m in mine)


# ---- models end to end --------------------------------------------------------------------------


def _compare(arch, paths, dtype=torch.float64, seed=0):
    """(max rel err of log-probs, max rel err over parameter grads), tree vs per-path reference."""
    model = tiny_hybrid_model(arch, dtype=dtype, seed=seed)
    ref = reference_copy(model)
    coeffs = random_coeffs(paths, seed)
    tree_lp = path_logprobs(model, paths, backend="dense")
    ref_lp = reference_logprobs(ref, paths)
    sum(((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, tree_lp))).backward()
    sum(((c.to(lp.dtype) * lp).sum() for c, lp in zip(coeffs, ref_lp))).backward()
    assert [lp.shape for lp in tree_lp] == [(len(p) - 1,) for p in paths]
    lp_err = max((rel_err(a, b) for a, b in zip(tree_lp, ref_lp) if b.numel()), default=0.0)
    g_tree, g_ref = grads(model), grads(ref)
    assert g_tree.keys() == g_ref.keys()
    assert any("linear_attn" in n for n in g_ref)
    return lp_err, grad_err(g_tree, g_ref)


def grad_err(g_tree: dict, g_ref: dict) -> float:
    """Max over parameters of the max-norm relative error, the denominator floored at 1e-4 of the
    largest gradient: a gradient that is exactly zero in exact arithmetic (attention's q/k at a
    single-key position) is rounding noise (~1e-16) in one run and 0 in the other."""
    floor = 1e-4 * max(g.abs().max().item() for g in g_ref.values())
    errs = [(g_tree[n] - g_ref[n]).abs().max().item() for n in g_ref]
    if floor == 0:  # no targets at all (a single one-token path): every gradient is zero
        return max(errs)
    return max(e / max(g_ref[n].abs().max().item(), floor) for e, n in zip(errs, g_ref))


# float64 with every internal float32 cast lifted: the tree and the reference differ only in
# summation order (the level's chunk size vs the path's, the conv's gather vs F.conv1d, SDPA over
# T keys vs len(p) keys), i.e. float64 rounding (1e-16) amplified by the depth of the network and
# the conditioning of the delta rule's triangular solves. We measure <= ~1e-14; 1e-11 is the bar.
TOL64 = 1e-11
FLOOR = 1e-6


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("name", ["group", "one_token", "chain", "deep_wide"])
def test_float64_hand_trees(arch, name):
    with float64_everywhere():
        lp_err, g_err = _compare(arch, HAND[name])
    assert lp_err < TOL64 and g_err < TOL64, (lp_err, g_err)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=tree_paths(vocab=12, max_paths=6, max_len=9))
def test_float64_random_trees(arch, paths):
    with float64_everywhere():
        lp_err, g_err = _compare(arch, paths)
    assert lp_err < TOL64 and g_err < TOL64, (lp_err, g_err)


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=tree_paths(vocab=6, max_paths=10, max_len=14))
def test_float64_random_trees_more(arch, paths):
    with float64_everywhere():
        lp_err, g_err = _compare(arch, paths, seed=1)
    assert lp_err < TOL64 and g_err < TOL64, (lp_err, g_err)


@pytest.mark.parametrize("arch", [*HYBRID_ARCHS, "qwen3_5_moe"])
def test_float32_within_reference_rounding(arch):
    """float32: the tree's error against the float64 truth is within 2x of the per-path reference's
    own (log-probs and every gradient, A_log and dt_bias included), in every GDN layout."""
    (truth_lp, truth_g), (ref_lp, ref_g), (tree_lp, tree_g) = float32_runs(
        functools.partial(tiny_hybrid_model, arch),
        ONE_TOKEN + GROUP,
        lambda m, p: path_logprobs(m, p, backend="dense"),
    )
    ref_e, tree_e = rel_err(ref_lp, truth_lp), rel_err(tree_lp, truth_lp)
    # Both round at ~6e-8 per op, in different orders. Within 2x of the reference's own error, or
    # both at float32 rounding: FLOOR (1e-6, ~8 float32 ulps relative) absorbs parameters whose
    # two errors are pure rounding noise (2-3e-7 against 6-7e-7 seen: a ratio, not a defect). The
    # GDN parameters' errors (A_log, dt_bias: 1e-6 to 3e-5) are held to 2x.
    assert tree_e <= 2 * ref_e + FLOOR, (tree_e, ref_e)
    for n in truth_g:
        ref_e, tree_e = rel_err(ref_g[n], truth_g[n]), rel_err(tree_g[n], truth_g[n])
        assert tree_e <= 2 * ref_e + FLOOR, (n, tree_e, ref_e)


GDN_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def branching_paths(seed: int = 2) -> list[list[int]]:
    """Seven paths over a 100-token trunk (longer than a chunk of 64, so nodes and paths span
    chunks) branching at 10, 40, 70 and 100 tokens and again 30 tokens past 100: paths of 13 to 155
    tokens, nodes of 3 to 65, 298 distinct tokens. Token 1 first: a tree beside the zoo paths'
    (tokens >= 3)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    trunk, mid = [1, *draw(99)], draw(30)
    return [
        trunk + draw(5), trunk + draw(20), trunk + mid + draw(10), trunk + mid + draw(25),
        trunk[:40] + draw(40), trunk[:10] + draw(3), trunk[:70] + mid[:5] + draw(60),
    ]  # fmt: skip


def fast_decays(model_type: str, dtype=torch.float64) -> torch.nn.Module:
    """The zoo model with HF's own decay init (``A ~ U(0.01, 16)``, ``dt_bias = 1``) instead of the
    zoo's slow decays: log decays of -0.1 to -40 per step (median -11; the zoo's: -0.01 to -0.7),
    so a 64-step chunk's cumulative log decay reaches -1400 and its pairwise differences
    ``exp(G_i - G_j)`` lose float32 digits: HF's own gradients of ``A_log`` and ``dt_bias`` are then
    1e-5 to 7e-5 off, well above rounding."""
    model = zoo_model(model_type, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_((torch.rand(p.shape, generator=g) * 15.99 + 0.01).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
    return model.to(dtype)


# float32 vs the float64 truth, per parameter: both runs round at ~6e-8 per op in different orders
# (the tree's chunks are its nodes', HF's the path's 64), so where both errors are pure rounding
# (4e-7 to 2.4e-6 measured here) their ratio is noise (up to 2.3x here, q_norm at 1.1e-6 vs 2.4e-6;
# 4.6x seen on other trees); FLOOR32 (~17 float32 ulps) absorbs that. Measured tree / HF ratios of
# the decay gate's parameters: 0.5-1.1 (zoo decays, errors 4e-7 to 1.7e-6), 0.5-1.1 (fast decays,
# 2.5e-6 to 7e-5, where the floor is small against 2x: the bar is 2x there).
FLOOR32 = 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("decays", ["zoo", "fast"])
@pytest.mark.parametrize("model_type", GDN_TYPES)
def test_float32_gradients_per_parameter(model_type, decays):
    """float32 on the zoo's tree and a branching one with paths over a chunk: the tree's error
    against the float64 truth (each path alone through HF, float32 casts lifted) is within 2x of HF's
    own per-path float32 error, log-probs and each parameter's gradient on its own."""
    build = functools.partial(zoo_model if decays == "zoo" else fast_decays, model_type)
    (truth_lp, truth_g), (ref_lp, ref_g), (tree_lp, tree_g) = float32_runs(
        build, zoo_paths() + branching_paths(), truth_inside=False, seed=3
    )
    ref_e, tree_e = rel_err(ref_lp, truth_lp), rel_err(tree_lp, truth_lp)
    assert tree_e <= 2 * ref_e + FLOOR32, (tree_e, ref_e)
    assert any(n.endswith("A_log") for n in truth_g)
    for n in truth_g:
        ref_e, tree_e = rel_err(ref_g[n], truth_g[n]), rel_err(tree_g[n], truth_g[n])
        assert tree_e <= 2 * ref_e + FLOOR32, (n, tree_e, ref_e)


def test_without_routing_the_check_fails(monkeypatch):
    """Control: unpatched GDN layers run the packed DFS sequence as one sequence (state leaks from
    a branch into its sibling); the model-level comparison catches it."""
    import treetrain.models.recurrent as recurrent

    monkeypatch.setattr(recurrent, "patch_recurrent_layers", lambda model: 0)
    with float64_everywhere():
        lp_err, _ = _compare("qwen3_5", GROUP)
    assert lp_err > 1e-3


# ---- patching -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_ordinary_calls_unchanged_and_patch_idempotent(arch):
    model = tiny_hybrid_model(arch, dtype=torch.float32)
    ref = reference_copy(model)
    assert patch_recurrent_layers(model) == 2 and patch_recurrent_layers(model) == 2
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # a deep copy routes through its own modules (the patch is a bound method, copied with them)
    twin = copy.deepcopy(model)
    gdn = next(m for m in twin.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    assert gdn.forward.__self__ is gdn
    with torch.no_grad():
        assert (
            rel_err(torch.cat(path_logprobs(twin, GROUP)), torch.cat(reference_logprobs(ref, GROUP))) < 1e-5
        )


def test_unsupported_recurrent_layer_raises():
    class FooMamba2Mixer(torch.nn.Module):
        pass

    model = torch.nn.Sequential(FooMamba2Mixer())
    with pytest.raises(ValueError, match="no tree routing"):
        check_model(model)


def test_subclassed_layers_are_routed():
    """FSDP2's fully_shard swaps a module's class for an ``FSDP<Name>`` subclass."""
    model = tiny_hybrid_model("qwen3_next", dtype=torch.float32)
    ref = reference_copy(model)
    for m in model.modules():
        if type(m).__name__ == "Qwen3NextGatedDeltaNet":
            m.__class__ = type("FSDPQwen3NextGatedDeltaNet", (type(m),), {})
    assert patch_recurrent_layers(model) == 2
    with torch.no_grad():
        err = rel_err(torch.cat(path_logprobs(model, GROUP)), torch.cat(reference_logprobs(ref, GROUP)))
    assert err < 1e-5
