"""Objectives on the tree's per-path view == the same formulas on per-path baseline forwards.

The baseline (``baseline_loss``) is written here independently of ``treetrain.objectives.policy``: a plain
loop
over paths on the log-probs of each path run alone through the unmodified model
(``tests/reference.py``). Everything runs in float64 with the models' float32 casts lifted
(``float64_casts``), so the only differences left are summation orders (tree attention over T keys
vs len(p) keys, the per-token weights' index_add vs per-path sums): a few float64 ulps (~1e-16)
amplified by depth and by the loss's sums: measured <= 2e-15 on losses, <= 1.1e-13 on gradients
(15 random trees x 10 objectives). The bound 1e-11 leaves two orders of margin, while a real
mistake (a wrong mask offset, a per-tree instead of per-path advantage, a local instead of a global
normalizer) shows as O(1e-2) or more.

Gradients are compared with ``tests/reference.py``'s ``grad_err``: per parameter, relative to its
own largest entry floored at 1e-3 of the model's largest (a parameter whose true gradient is 0
carries only rounding noise in the baseline, which no relative measure fits).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from treetrain import TrajectoryTree, pack
from treetrain.objectives.advantages import group_advantages
from treetrain.objectives.policy.aggregation import PathMeta, loss_normalizer
from treetrain.objectives.policy.config import Objective, objective_needs
from treetrain.objectives.policy.loss import (
    compute_loss,
    kl_penalty,
    objective,
    reference_logprobs,
    summarize_metrics,
    token_weights,
)

from .reference import float64_casts, grad_err, reference_copy, tiny_model
from .reference import reference_logprobs as baseline_logprobs
from .strategies import tree_paths

TOL = 1e-11

# shared prefixes of different lengths, a duplicate path (different metadata) and a prefix path
GROUP = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 7, 8],
    [1, 2, 3, 7, 9, 9, 9],
    [1, 2, 3, 4, 5, 6],
    [1, 2],
    [10, 11, 12],
]

CONFIGS = {
    "sft-token-mean": Objective("sft"),
    "sft-seq-mean-token-mean+ent": Objective("sft", "seq-mean-token-mean", entropy_coef=0.1),
    "sft-token-sum": Objective("sft", "token-sum"),
    "reinforce-token-mean+ent": Objective("reinforce", entropy_coef=0.05),
    "reinforce-sum-norm+k1": Objective(
        "reinforce", "seq-mean-token-sum-norm", norm_length=8, kl_coef=0.2, kl_estimator="k1"
    ),
    "ppo-dual-clip+k2": Objective(
        "ppo", clip_low=0.1, clip_high=0.15, dual_clip_c=1.5, kl_coef=0.3, kl_estimator="k2"
    ),
    "grpo-seq-mean-token-mean+k3+ent": Objective(
        "grpo", "seq-mean-token-mean", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.02
    ),
    "grpo-seq-mean-token-sum": Objective("grpo", "seq-mean-token-sum", clip_low=0.1),
    "gspo-seq-mean-token-mean": Objective("gspo", "seq-mean-token-mean", clip_low=0.05, clip_high=0.08),
    "gspo-token-mean+k3": Objective("gspo", clip_low=0.05, clip_high=0.08, kl_coef=0.1),
}


# ---- the baseline, written directly on per-path tensors ---------------------------------------------


def baseline_loss(cfg: Objective, lps, ents, data) -> torch.Tensor:
    """``sum_p w_p * agg(per-token losses of p)`` exactly as the module docstring states it."""
    num, den = 0.0, 0.0
    for p, lp in enumerate(lps):
        m = torch.tensor(data["loss_masks"][p][1:], dtype=lp.dtype)
        adv = data["advantages"][p]
        A = torch.full_like(lp, adv) if np.ndim(adv) == 0 else torch.tensor(adv[1:], dtype=lp.dtype)
        old = torch.as_tensor(data["old_logprobs"][p], dtype=lp.dtype)
        ref = torch.as_tensor(data["ref_logprobs"][p], dtype=lp.dtype)
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        if cfg.name == "sft":
            loss = -lp
        elif cfg.name == "reinforce":
            loss = -A * lp
        elif cfg.name in ("ppo", "grpo"):
            r = torch.exp(lp - old)
            loss = torch.maximum(-A * r, -A * r.clamp(lo, hi))
            if cfg.dual_clip_c is not None:
                loss = torch.where(A < 0, torch.minimum(loss, -A * cfg.dual_clip_c), loss)
        else:  # gspo-token: value = sequence ratio, gradient through each token's own log-prob
            s = torch.exp(((lp - old) * m).sum() / max(m.sum(), 1))
            r = torch.exp(lp - lp.detach()) * s.detach()
            loss = torch.maximum(-A * r, -A * r.clamp(lo, hi))
        d = lp - ref
        kl = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) + d - 1}[cfg.kl_estimator]
        loss = loss + cfg.kl_coef * kl - cfg.entropy_coef * ents[p]
        w, n, total = data["weights"][p], m.sum(), (loss * m).sum()
        if cfg.agg_mode == "token-mean":
            num, den = num + w * total, den + w * n
        elif n > 0 and cfg.agg_mode == "seq-mean-token-mean":
            num, den = num + w * total / n, den + w
        elif n > 0 and cfg.agg_mode == "seq-mean-token-sum":
            num, den = num + w * total, den + w
        elif n > 0 and cfg.agg_mode == "seq-mean-token-sum-norm":
            num, den = num + w * total / cfg.norm_length, den + w
        elif cfg.agg_mode == "token-sum":
            num, den = num + w * total, 1.0
    return num / den


def random_data(paths, true_lps, seed: int, per_token_adv: bool) -> dict:
    """Per-path metadata: every path draws its own masks, advantages, old and ref log-probs, so a
    shared prefix carries different values in different paths (and duplicates differ too)."""
    rng = np.random.default_rng(seed)
    masks = [rng.integers(0, 2, len(p)).astype(float) for p in paths]
    masks[0][-1] = 1.0  # at least one trainable target in the batch
    if per_token_adv:
        adv = [rng.normal(size=len(p)) for p in paths]
    else:
        adv = list(rng.normal(size=len(paths)))
    # old/ref near the true log-probs so ratios straddle the clip bounds
    old = [lp.detach().numpy() + rng.normal(scale=0.15, size=lp.numel()) for lp in true_lps]
    ref = [lp.detach().numpy() + rng.normal(scale=0.5, size=lp.numel()) for lp in true_lps]
    weights = list(rng.uniform(0.5, 2.0, size=len(paths)))
    return dict(loss_masks=masks, advantages=adv, old_logprobs=old, ref_logprobs=ref, weights=weights)


def build_tree(paths, data) -> TrajectoryTree:
    return TrajectoryTree.from_paths(paths, **data)


def param_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where none reached it, e.g. every target clipped)."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def loss_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(a.item() - b.item()) / max(1.0, abs(b.item()))


def tree_loss_and_grads(model, batch, cfg, normalizer, **kw):
    model.zero_grad(set_to_none=True)
    loss, metrics = compute_loss(model, batch, cfg, normalizer, backend="dense", **kw)
    loss.backward()
    return loss.detach(), param_grads(model), metrics


# ---- equivalence with the baseline ------------------------------------------------------------------


# no shrinking: each example runs every objective; a failure prints its example as drawn
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
    paths=tree_paths(min_len=2, max_paths=5, max_len=10), seed=st.integers(0, 2**16), per_tok=st.booleans()
)
def test_objectives_match_baseline_on_random_trees(paths, seed, per_tok):
    with float64_casts():
        model = tiny_model("qwen3", seed=seed % 7)
        ref = reference_copy(model)
        lps, ents = baseline_logprobs(ref, paths, return_entropy=True)
        data = random_data(paths, lps, seed, per_tok)
        tree = build_tree(paths, data)
        params = dict(ref.named_parameters())
        for name, cfg in CONFIGS.items():
            want = baseline_loss(cfg, lps, ents, data)
            want_g = torch.autograd.grad(want, list(params.values()), retain_graph=True, allow_unused=True)
            want_g = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), want_g)}
            got, got_g, _ = tree_loss_and_grads(model, tree, cfg, loss_normalizer(tree, cfg))
            assert loss_err(got, want) < TOL, (name, got.item(), want.item())
            assert grad_err(got_g, want_g) < TOL, (name, grad_err(got_g, want_g))


@pytest.mark.parametrize(
    "name", ["ppo-dual-clip+k2", "grpo-seq-mean-token-mean+k3+ent", "gspo-token-mean+k3"]
)
def test_kl_from_reference_model_matches_baseline(name):
    """``ref_model=``: reference log-probs from one no-grad tree forward of another model."""
    cfg = CONFIGS[name]
    with float64_casts():
        model, ref_model = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
        base = reference_copy(model)
        lps, ents = baseline_logprobs(base, GROUP, return_entropy=True)
        data = random_data(GROUP, lps, 3, per_token_adv=True)
        data["ref_logprobs"] = [x.detach() for x in baseline_logprobs(reference_copy(ref_model), GROUP)]
        want = baseline_loss(cfg, lps, ents, data)
        want.backward()
        del data["ref_logprobs"]
        tree = build_tree(GROUP, data)
        got, got_g, _ = tree_loss_and_grads(model, tree, cfg, loss_normalizer(tree, cfg), ref_model=ref_model)
    assert loss_err(got, want) < TOL
    assert grad_err(got_g, param_grads(base)) < TOL
    assert all(p.grad is None for p in ref_model.parameters())


def test_reference_logprobs_helper():
    with float64_casts():
        model = tiny_model("llama")
        got = reference_logprobs(model, GROUP, backend="dense")
        want = baseline_logprobs(reference_copy(model), GROUP)
    assert all(not g.requires_grad for g in got)
    assert max((g - w).abs().max().item() for g, w in zip(got, want) if w.numel()) < TOL


# ---- global normalization: any split of the paths sums to the whole ----------------------------------


@pytest.mark.parametrize(
    "name", ["sft-seq-mean-token-mean+ent", "reinforce-sum-norm+k1", "ppo-dual-clip+k2", "gspo-token-mean+k3"]
)
def test_parts_with_global_normalizer_sum_to_whole(name):
    cfg = CONFIGS[name]
    with float64_casts():
        model = tiny_model("qwen3", seed=2)
        lps = baseline_logprobs(reference_copy(model), GROUP)
        data = random_data(GROUP, lps, 5, per_token_adv=True)
        whole = build_tree(GROUP, data)
        # two parts that cut through the shared [1 2 3] prefix: it is recomputed in each part
        parts = [whole.subset([0, 2, 5]), whole.subset([1, 3, 4])]
        n_whole = loss_normalizer(whole, cfg)
        n_parts = loss_normalizer(parts, cfg)
        assert n_parts == pytest.approx(n_whole, rel=1e-15)
        assert sum(loss_normalizer(p, cfg) for p in parts) == pytest.approx(n_whole, rel=1e-15)

        loss, g, metrics = tree_loss_and_grads(model, whole, cfg, n_whole)
        # micro-batches: each part alone, gradients accumulated, losses and metric sums added
        model.zero_grad(set_to_none=True)
        split_loss, split_metrics = 0.0, {}
        for part in parts:
            part_loss, part_metrics = compute_loss(model, part, cfg, n_whole, backend="dense")
            part_loss.backward()
            split_loss = split_loss + part_loss.detach()
            for k, v in part_metrics.items():
                split_metrics[k] = split_metrics.get(k, 0.0) + v
        split_g = param_grads(model)
        # a forest: both parts packed into one micro-batch
        forest_loss, forest_g, _ = tree_loss_and_grads(model, pack(parts), cfg, n_whole)
    assert loss_err(split_loss, loss) < TOL and loss_err(forest_loss, loss) < TOL
    assert grad_err(split_g, g) < TOL and grad_err(forest_g, g) < TOL
    assert metrics.keys() == split_metrics.keys()
    for k in metrics:
        assert abs(metrics[k].item() - split_metrics[k].item()) <= TOL * max(1.0, abs(metrics[k].item())), k


# ---- the per-token-weight fast path == the expanded per-path view ------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        Objective("sft", "token-mean", entropy_coef=0.1),
        Objective("sft", "seq-mean-token-mean"),
        Objective("reinforce", "seq-mean-token-sum-norm", norm_length=5, entropy_coef=-0.05),
        Objective("reinforce", "token-sum"),
    ],
)
def test_token_weights_equal_expanded(cfg):
    assert objective_needs(cfg).token_weights
    expanded = Objective(**{**cfg.__dict__, "use_token_weights": False})
    assert not objective_needs(expanded).token_weights
    with float64_casts():
        model = tiny_model("qwen3", seed=4)
        lps = baseline_logprobs(reference_copy(model), GROUP)
        data = random_data(GROUP, lps, 7, per_token_adv=True)
        tree = build_tree(GROUP, data)
        N = loss_normalizer(tree, cfg)
        fast, fast_g, fast_m = tree_loss_and_grads(model, tree, cfg, N)
        slow, slow_g, slow_m = tree_loss_and_grads(model, tree, expanded, N)
    assert loss_err(fast, slow) < 1e-13 and grad_err(fast_g, slow_g) < 1e-13
    assert fast_m.keys() == slow_m.keys()
    for k in fast_m:
        assert abs(fast_m[k].item() - slow_m[k].item()) <= 1e-13 * max(1.0, abs(slow_m[k].item())), k


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_skipping_the_entropy_metric_changes_nothing_else(name):
    """``report_entropy=False`` (what ``treetrain bench`` runs) gives the same loss and gradients as
    the default and drops only the entropy metric; float64, so equality is to rounding (1e-13)."""
    cfg = Objective(name)
    quiet = Objective(name, report_entropy=False)
    with float64_casts():
        model = tiny_model("qwen3", seed=4)
        lps = baseline_logprobs(reference_copy(model), GROUP)
        tree = build_tree(GROUP, random_data(GROUP, lps, 7, per_token_adv=False))
        N = loss_normalizer(tree, cfg)
        loud, loud_g, loud_m = tree_loss_and_grads(model, tree, cfg, N)
        calm, calm_g, calm_m = tree_loss_and_grads(model, tree, quiet, N)
    assert loss_err(calm, loud) < 1e-13 and grad_err(calm_g, loud_g) < 1e-13
    assert "entropy_sum" in loud_m and set(loud_m) - set(calm_m) == {"entropy_sum"}


def test_token_weights_by_hand():
    """Paths [1 2 3], [1 2 4], [1 2 3]: DFS tokens 1 2 3 4; token 2 is a target in every path."""
    tree = TrajectoryTree.from_paths(
        [[1, 2, 3], [1, 2, 4], [1, 2, 3]],
        loss_masks=[[0, 1, 1], [0, 0, 1], [0, 1, 1]],
        advantages=[1.0, 2.0, -3.0],
    )
    packed = pack(tree)
    assert packed.input_ids.tolist() == [1, 2, 3, 4]
    meta = PathMeta.from_trees(packed)
    # token-sum: W_ent counts the paths training each token; W_logp sums their advantages
    w_lp, w_ent = token_weights(meta, packed, Objective("reinforce", "token-sum"), 1.0)
    assert w_ent.tolist() == [0, 2, 2, 1]  # tokens 2 and 3: paths 0 and 2 (2 is masked in path 1)
    assert w_lp.tolist() == [0, 1 - 3, 1 - 3, 2]
    # token-mean: divided by the 5 trainable targets
    w_lp, _ = token_weights(meta, packed, Objective("reinforce"), loss_normalizer(tree, "token-mean"))
    assert torch.allclose(w_lp, torch.tensor([0, -2, -2, 2], dtype=torch.float64) / 5)


# ---- hand-written numeric cases ----------------------------------------------------------------------


def _two_paths(**fields):
    # path 0 [5 6 7]: targets 6 7, both trainable; path 1 [5 6 8 9]: targets 6 8 9, all trainable
    return TrajectoryTree.from_paths(
        [[5, 6, 7], [5, 6, 8, 9]], loss_masks=[[0, 1, 1], [0, 1, 1, 1]], weights=[1.0, 3.0], **fields
    )


@pytest.mark.parametrize(
    "agg_mode, norm_length, expected",
    [
        # per-path token sums of -lp: path 0: 1 + 2 = 3 (2 tokens), path 1: 0.5 + 3 + 4 = 7.5 (3 tokens)
        ("token-mean", None, (1 * 3 + 3 * 7.5) / (1 * 2 + 3 * 3)),  # 25.5 / 11
        ("seq-mean-token-mean", None, (1 * 3 / 2 + 3 * 7.5 / 3) / (1 + 3)),  # 2.25
        ("seq-mean-token-sum", None, (1 * 3 + 3 * 7.5) / (1 + 3)),  # 6.375
        ("seq-mean-token-sum-norm", 4, (1 * 3 / 4 + 3 * 7.5 / 4) / (1 + 3)),  # 1.59375
        ("token-sum", None, 1 * 3 + 3 * 7.5),  # 25.5
    ],
)
def test_sft_aggregation_by_hand(agg_mode, norm_length, expected):
    tree = _two_paths()
    cfg = Objective("sft", agg_mode, norm_length=norm_length)
    lps = [
        torch.tensor([-1.0, -2.0], dtype=torch.float64),
        torch.tensor([-0.5, -3.0, -4.0], dtype=torch.float64),
    ]
    loss, metrics = objective(lps, PathMeta.from_trees(tree), cfg, loss_normalizer(tree, cfg))
    assert loss.item() == pytest.approx(expected, rel=1e-15)
    assert metrics["num_tokens"].item() == 5 and metrics["num_paths"].item() == 2
    assert metrics["logprob_sum"].item() == -10.5


def test_loss_mask_offsets_and_fully_masked_path():
    """mask of log-prob entry j is loss_masks[p][j + 1]; a path with no trainable target counts in no
    seq-mean-* denominator."""
    tree = TrajectoryTree.from_paths([[5, 6, 7], [5, 6, 8]], loss_masks=[[1, 0, 1], [1, 0, 0]])
    lps = [torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([-5.0, -7.0], dtype=torch.float64)]
    meta = PathMeta.from_trees(tree)
    assert meta.mask.tolist() == [0, 1, 0, 0]
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        cfg = Objective("sft", mode)
        assert loss_normalizer(tree, cfg) == 1.0
        assert objective(lps, meta, cfg, loss_normalizer(tree, cfg))[0].item() == 2.0


def test_ppo_clipping_by_hand():
    # ratios 1.5, 0.5, 4.0, 1.1 against old log-probs 0; advantages +1, -1, -1, +2; clip [0.8, 1.3]
    #   r=1.5, A=+1: max(-1.5, -1.3) = -1.3   clipped (zero gradient)
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped (zero gradient)
    #   r=4.0, A=-1: max( 4.0,  1.3) =  4.0   unclipped; dual-clip c=3: min(4.0, 3) = 3 (zero gradient)
    #   r=1.1, A=+2: max(-2.2, -2.2) = -2.2   inside the range: gradient -A r = -2.2
    tree = TrajectoryTree.from_paths(
        [[1, 2, 3, 4, 5]], advantages=[[0.0, 1.0, -1.0, -1.0, 2.0]], old_logprobs=[[0.0, 0.0, 0.0, 0.0]]
    )
    meta = PathMeta.from_trees(tree)
    for c, expected, grad_2 in ((3.0, -1.3 + 0.8 + 3.0 - 2.2, 0.0), (None, -1.3 + 0.8 + 4.0 - 2.2, 4.0)):
        lp = torch.tensor([1.5, 0.5, 4.0, 1.1], dtype=torch.float64).log().requires_grad_()
        cfg = Objective("ppo", "token-sum", clip_low=0.2, clip_high=0.3, dual_clip_c=c)
        loss, metrics = objective([lp], meta, cfg, 1.0)
        loss.backward()
        assert loss.item() == pytest.approx(expected, rel=1e-14)
        assert torch.allclose(lp.grad, torch.tensor([0.0, 0.0, grad_2, -2.2], dtype=torch.float64))
        assert metrics["clipped_tokens"].item() == 2
        assert metrics["dual_clipped_tokens"].item() == (1 if c else 0)
        assert metrics["ratio_sum"].item() == pytest.approx(1.5 + 0.5 + 4.0 + 1.1, rel=1e-14)
        assert summarize_metrics(metrics)["clipfrac"] == 0.5


def test_gspo_is_the_sequence_objective_by_hand():
    """Scalar advantages, seq-mean-token-mean: GSPO-token's value and gradient equal GSPO's
    ``mean_p max(-A s_p, -A clip(s_p))`` with ``s_p = exp(mean_j (lp - old))`` differentiated in full.

    Path 0: lp - old = [0.1, 0.3] -> s = exp(0.2) = 1.2214 > 1.2, A = +1 -> -1.2, clipped (no gradient)
    Path 1: lp - old = [-0.05, 0.05] -> s = 1, A = -2 -> 2, gradient -A s / n = 1 per token
    loss = (-1.2 + 2) / 2 = 0.4
    """
    tree = TrajectoryTree.from_paths(
        [[1, 2, 3], [1, 4, 5]], advantages=[1.0, -2.0], old_logprobs=[[-1.0, -2.0], [-1.0, -1.0]]
    )
    cfg = Objective("gspo", "seq-mean-token-mean", clip_low=0.2, clip_high=0.2)
    lp = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in ([-0.9, -1.7], [-1.05, -0.95])]
    loss, metrics = objective(lp, PathMeta.from_trees(tree), cfg, loss_normalizer(tree, cfg))
    loss.backward()
    assert loss.item() == pytest.approx(0.4, rel=1e-14)
    assert lp[0].grad.tolist() == [0.0, 0.0]
    assert torch.allclose(lp[1].grad, torch.tensor([0.5, 0.5], dtype=torch.float64))  # 1 per token / 2 paths
    assert metrics["clipped_tokens"].item() == 2
    # the sequence form, with random log-probs and unclipped ratios (wide clip)
    cfg = Objective("gspo", "seq-mean-token-mean", clip_low=0.9, clip_high=10.0)
    torch.manual_seed(0)
    old = [torch.tensor([-1.0, -2.0]).double(), torch.tensor([-1.0, -1.0]).double()]
    lp = [(o + 0.3 * torch.randn(2, dtype=torch.float64)).requires_grad_() for o in old]
    loss, _ = objective(lp, PathMeta.from_trees(tree), cfg, 2.0)
    g = torch.autograd.grad(loss, lp)
    seq = sum(-a * torch.exp((x - o).mean()) for a, x, o in zip([1.0, -2.0], lp, old)) / 2
    assert loss.item() == pytest.approx(seq.item(), rel=1e-14)
    for a, b in zip(g, torch.autograd.grad(seq, lp)):
        assert torch.allclose(a, b, rtol=1e-14, atol=0)


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-1.5], dtype=torch.float64)
    assert kl_penalty(lp, ref, "k1").item() == 0.5
    assert kl_penalty(lp, ref, "k2").item() == 0.125
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-15)  # 0.10653


def test_group_advantages_by_hand():
    # group a: rewards 1 0 1, mean 2/3, sample std sqrt(1/3); group b: one path keeps its reward
    adv = group_advantages([1.0, 0.0, 1.0, 5.0], ["a", "a", "a", "b"], eps=0.0)
    s = math.sqrt(1 / 3)
    assert np.allclose(adv, [(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, 5.0], rtol=1e-15, atol=0)
    assert np.allclose(group_advantages([1.0, 0.0], [0, 0], norm_by_std=False), [0.5, -0.5])


def test_masked_targets_cannot_poison_the_loss():
    """A masked target may carry any old/ref log-prob (e.g. none known for a prompt token)."""
    tree = TrajectoryTree.from_paths(
        [[1, 2, 3]],
        loss_masks=[[0, 0, 1]],
        advantages=[[0.0, np.nan, 1.0]],
        old_logprobs=[[-1e30, -1.0]],
        ref_logprobs=[[1e30, -1.0]],
    )
    lp = torch.tensor([-1.0, -1.0], dtype=torch.float64, requires_grad=True)
    cfg = Objective("ppo", kl_coef=0.1, kl_estimator="k3")
    loss, _ = objective([lp], PathMeta.from_trees(tree), cfg, loss_normalizer(tree, cfg))
    loss.backward()
    assert loss.item() == -1.0 and lp.grad.tolist() == [0.0, -1.0]


# ---- configuration errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="dpo"), "objective name"),
        (dict(agg_mode="mean"), "agg_mode"),
        (dict(agg_mode="seq-mean-token-sum-norm"), "norm_length"),
        (dict(norm_length=4), "norm_length"),
        (dict(name="ppo", clip_low=1.0), "clip_low"),
        (dict(name="ppo", dual_clip_c=1.0), "dual_clip_c"),
        (dict(name="gspo", dual_clip_c=3.0), "dual_clip_c"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(kl_coef=-1.0), "kl_coef"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Objective(**kwargs)


def test_defaults():
    assert (Objective("ppo").clip_low, Objective("ppo").clip_high) == (0.2, 0.2)
    assert (Objective("ppo", clip_low=0.2, clip_high=0.28).clip_high) == 0.28
    assert (Objective("gspo").clip_low, Objective("gspo").clip_high) == (3e-4, 4e-4)
    needs = objective_needs(Objective("grpo", kl_coef=0.01))
    assert needs.advantages and needs.old_logprobs and needs.ref_logprobs and not needs.token_weights


def test_missing_fields_name_the_field_and_the_fix():
    tree = TrajectoryTree.from_paths([[1, 2, 3]], advantages=[1.0])
    meta, lp = PathMeta.from_trees(tree), [torch.zeros(2, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"old_logprobs.*from_paths\(\.\.\., old_logprobs=.*reinforce"):
        objective(lp, meta, Objective("ppo"), 1.0)
    with pytest.raises(ValueError, match="needs advantages.*group_advantages"):
        objective(lp, PathMeta.from_trees(TrajectoryTree.from_paths([[1, 2, 3]])), Objective("grpo"), 1.0)
    with pytest.raises(ValueError, match="ref_model=.*ref_logprobs"):
        objective(lp, meta, Objective("reinforce", kl_coef=0.1), 1.0)
    with pytest.raises(ValueError, match="return_entropy=True"):
        objective(lp, meta, Objective("reinforce", entropy_coef=0.1), 1.0)
    with pytest.raises(ValueError, match="no trainable target"):
        loss_normalizer(TrajectoryTree.from_paths([[1, 2]], loss_masks=[[1, 0]]), "token-mean")
    with pytest.raises(ValueError, match="some trees"):
        PathMeta.from_trees([tree, TrajectoryTree.from_paths([[4, 5]])]).advantages  # noqa: B018
