"""PPO with a learned critic on trees == every path alone through the unmodified HF models.

The reference runs each path through an ``AutoModelForTokenClassification`` critic (values) and an
``AutoModelForCausalLM`` policy (log-probs), then GAE, the clipped value loss and PPO's clipped
surrogate written out here in plain loops (independent of ``treetrain``), in float64 with the
models' float32 casts lifted. The tree runs each distinct token once in both models. Differences
left are summation orders: ~1e-15 on losses, ~1e-13 on gradients; the bound 1e-10 is far below
any real mistake (a shared branch-point advantage, a misaligned value, a local normalizer).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain import TrajectoryTree, pack
from treetrain.objectives.policy.aggregation import PathMeta
from treetrain.objectives.policy.config import Objective
from treetrain.objectives.value import compute_ppo_critic_loss, gae_per_path, path_values

from .reference import float64_casts, grad_err, reference_copy, tiny_config, tiny_model
from .reference import reference_logprobs as baseline_logprobs
from .strategies import tree_paths

TOL = 1e-10
GAMMA, LAM, CLIP = 0.99, 0.9, 0.2


def tiny_critic(seed=1, vocab=97):
    torch.manual_seed(seed)
    cfg = tiny_config("qwen3", vocab=vocab, num_labels=1)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForTokenClassification.from_config(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    return model.eval()  # no dropout: the tree and the reference must see the same network


def test_gae_by_hand():
    values = torch.tensor([0.5, 0.2, 0.1, 9.0, 0.3, 0.4], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.float64)  # path 1: an untrained target first
    adv, ret = gae_per_path(values, torch.tensor([1.0, -1.0]), mask, torch.tensor([3, 3]), 1.0, 1.0)
    # path 0: deltas [-0.3, -0.1, 0.9] -> advantages [0.5, 0.8, 0.9]; path 1 (targets 1, 2 only):
    # deltas [0.4 - 0.3, -1 - 0.4] = [0.1, -1.4] -> [-1.3, -1.4]
    want = torch.tensor([0.5, 0.8, 0.9, 0.0, -1.3, -1.4], dtype=torch.float64)
    assert torch.allclose(adv, want, atol=1e-12)
    assert torch.allclose(ret, torch.tensor([1.0, 1.0, 1.0, 0.0, -1.0, -1.0], dtype=torch.float64))


def reference_ppo(policy, critic, paths, masks, rewards, old_lps, cfg_vf=0.5):
    """Per-path: values, GAE, clipped value loss + PPO surrogate, token-mean over the batch."""
    N = sum(float(m[1:].sum()) for m in masks)
    total = 0.0
    lps = baseline_logprobs(policy, paths)
    for p, (path, m) in enumerate(zip(paths, masks)):
        ids = torch.tensor([path])
        v_all = critic(input_ids=ids).logits[0, :-1, 0]  # [L - 1], aligned with targets
        tm = m[1:]
        idx = [j for j in range(len(path) - 1) if tm[j] > 0]
        vd = v_all.detach()
        adv = {}
        running = 0.0
        for k in range(len(idx) - 1, -1, -1):
            j = idx[k]
            nxt = vd[idx[k + 1]] if k + 1 < len(idx) else 0.0
            r = rewards[p] if k == len(idx) - 1 else 0.0
            running = r + GAMMA * nxt - vd[j] + GAMMA * LAM * running
            adv[j] = running
        for j in idx:
            ret = adv[j] + vd[j]
            v = v_all[j]
            vc = vd[j] + torch.clamp(v - vd[j], -CLIP, CLIP)
            total = total + cfg_vf * 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2) / N
            ratio = torch.exp(lps[p][j] - old_lps[p][j])
            a = adv[j]
            total = total + torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)) / N
    return total


def tree_ppo(policy, critic, tree, packing, cfg_vf=0.5):
    packed = pack(tree)
    N = float(PathMeta.from_trees(packed).mask.sum())
    cfg = Objective("ppo", clip_low=CLIP)
    loss, _ = compute_ppo_critic_loss(
        policy,
        critic,
        packed,
        cfg,
        N,
        N,
        packing=packing,
        gamma=GAMMA,
        lam=LAM,
        vf_coef=cfg_vf,
        value_clip=CLIP,
    )
    return loss


def grads_of(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(paths=tree_paths(vocab=12, max_paths=5, max_len=9, min_len=2), seed=st.integers(0, 2**16))
def test_ppo_with_critic_matches_per_path_reference(paths, seed):
    g = torch.Generator().manual_seed(seed)
    masks = [(torch.rand(len(p), generator=g) < 0.7).double() for p in paths]
    for m in masks:
        m[-1] = 1.0  # the reward sits on a trained last token
    rewards = torch.randn(len(paths), generator=g, dtype=torch.float64).tolist()
    with float64_casts():
        policy, critic = tiny_model("qwen3", vocab=12), tiny_critic(vocab=12)
        old = [
            lp.detach() + 0.1 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
            for lp in baseline_logprobs(policy, paths)
        ]
        ref_p, ref_c = reference_copy(policy), reference_copy(critic)
        want = reference_ppo(ref_p, ref_c, paths, masks, rewards, old)
        want.backward()
        want_p, want_c = grads_of(ref_p), grads_of(ref_c)
        tree = TrajectoryTree.from_paths(paths, loss_masks=masks, rewards=rewards, old_logprobs=old)
        for packing in ("tree", "sequence"):
            got = tree_ppo(policy, critic, tree, packing)
            got.backward()
            assert abs(got.item() - want.item()) <= TOL * max(1.0, abs(want.item())), packing
            assert grad_err(grads_of(policy), want_p) <= TOL, packing
            assert grad_err(grads_of(critic), want_c) <= TOL, packing


def test_branch_point_values_shared_advantages_per_path():
    """Paths [1 2 3 4] and [1 2 5]: the value at the branch point (context [1 2]) is computed once
    and equal for both paths, while its advantage differs (different successors and rewards)."""
    tree = TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5]], rewards=[1.0, -1.0])
    with float64_casts():
        critic = tiny_critic(vocab=12)
        packed = pack(tree)
        meta = PathMeta.from_trees(packed)
        values = path_values(critic, packed).detach()
        adv, _ = gae_per_path(values, torch.tensor([1.0, -1.0]), meta.mask, meta.num_targets, GAMMA, LAM)
    # targets: path 0 -> [V(1), V(12), V(123)], path 1 -> [V(1), V(12)]
    assert values[1] == values[4] and values[0] == values[3]
    assert adv[1] != adv[4]
    with pytest.raises(ValueError, match="score"):
        path_values(tiny_model("qwen3", vocab=12), packed)


def test_ppo_critic_needs_rewards():
    tree = TrajectoryTree.from_paths([[1, 2, 3], [1, 2, 4]], advantages=[1.0, -1.0])
    with pytest.raises(ValueError, match="rewards"):
        compute_ppo_critic_loss(
            tiny_model("qwen3", vocab=12), tiny_critic(vocab=12), pack(tree), None, 1.0, 1.0
        )
