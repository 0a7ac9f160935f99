"""TreeGRPOTrainer == trl.GRPOTrainer on policies with state-carrying layers routed along the tree.

The same two-step GRPO run as ``tests/test_integrations_trl.py`` (same completions through TRL's
``rollout_func``, KL on, two iterations per generation, SGD), with a tiny LFM2 policy from the model
zoo (short convolutions of width 4, with a bias, beside full attention): every logged loss and the
final weights agree within TRL's own float32 error (the bounds of that file, measured there;
here the update differs by 7.5e-7 of its size, the losses by 3e-8).

The conv's input-projection bias is zero, as HF initialises it: HF's LFM2 zeroes padded positions
before ``in_proj`` and its bias makes them nonzero again, so in TRL's left-padded batch a nonzero bias
reaches the first real tokens through the conv window (the zoo's random draw of it put TRL's update
1.8e-4 of its size away from the tree's, 14x TRL's own float32 error, while the tree is exact to each
sequence's own forward): padding, not the tree, would be compared.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from treetrain.integrations.trl import TreeGRPOTrainer  # noqa: E402

from .test_exact_trl import _policy  # noqa: E402
from .test_integrations_trl import initial, train, update_err  # noqa: E402


@pytest.mark.parametrize("model_type", ["lfm2"])
def test_grpo_on_a_routed_policy_equals_trl(model_type, tmp_path):
    transformers.logging.set_verbosity_error()
    policy = _policy(model_type, tmp_path / "policy", zero=".conv.in_proj.bias")
    trl_loss, trl_w, _ = train(GRPOTrainer, policy, tmp_path / "trl", loss_type="grpo")
    tree_loss, tree_w, tree_tr = train(TreeGRPOTrainer, policy, tmp_path / "tree", loss_type="grpo")
    convs = [m for m in tree_tr.model.modules() if type(m).__name__ == "Lfm2ShortConv"]
    assert convs and all("forward" in m.__dict__ for m in convs)  # routed (patched) layers ran
    assert trl_loss.numel() == tree_loss.numel() == 2
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-6, atol=1e-6), (tree_loss, trl_loss)
    err = update_err(tree_w, trl_w, initial(policy))
    assert err < 1e-5, err
