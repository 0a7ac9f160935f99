"""TreeDPOTrainer == trl.DPOTrainer and TreeRewardTrainer == trl.RewardTrainer: the same losses, every
logged metric and the same weights after 2 optimizer steps (SGD), per loss type, on a tiny float32 Qwen3
(reward: Qwen3ForSequenceClassification) over a character vocabulary, CPU.

The pairs share their prompt (and some pairs share the prompt of other pairs, and the first characters
of chosen and rejected agree sometimes): each batch is one tree for the policy and one for the DPO
reference. Tolerances (measured on sigmoid+sft: losses equal to the printed digits, worst metric
1.8e-5 relative (``rewards/rejected``, a small difference of sums), weights 1.5e-6 of the update size,
float32 summation order): 1e-5 relative on losses, 1e-3 relative on metrics, 1e-4 of the update.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

pytest.importorskip("trl")

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer  # noqa: E402

from treetrain.integrations.trl import TreeDPOTrainer, TreeRewardTrainer  # noqa: E402
from treetrain.models.hf import tree_forward as real_tree_forward  # noqa: E402

from .reference import tiny_config  # noqa: E402
from .trl_tiny import TRAINER_ARGS, char_tokenizer, save_tiny_policy  # noqa: E402

NOT_COMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
PROMPTS = ["what is 1+2?", "spell cat.", "what is 1+2?", "count to 3"]
PAIRS = [("3", "4"), ("cat", "cut"), ("three", "3 or 4"), ("1 2 3", "123"), ("ok", "no"), ("c a t", "dog")]


def pairs(n: int = 8, prompt: bool = True, margin: bool = False) -> Dataset:
    rows = {"chosen": [PAIRS[i % 6][0] for i in range(n)], "rejected": [PAIRS[i % 6][1] for i in range(n)]}
    if prompt:
        rows["prompt"] = [PROMPTS[i % 4] for i in range(n)]
    if margin:
        rows["margin"] = [0.1 * (i % 3) for i in range(n)]
    return Dataset.from_dict(rows)


def _scale_matrices(model, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(factor)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    return save_tiny_policy(tmp_path_factory.mktemp("pref") / "policy")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A 2-layer Qwen3ForSequenceClassification (one score) over the char vocabulary."""
    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_config("qwen3", vocab=len(tok), num_labels=1, pad_token_id=0, eos_token_id=1)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    _scale_matrices(model, 1.5)
    path = tmp_path_factory.mktemp("pref") / "reward"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


COMMON = dict(per_device_train_batch_size=4, **TRAINER_ARGS)


def run(cls, cfg_cls, model, out, data, ref=None, **over):
    """(logged losses, logged dicts, final weights, initial weights), all float64; checks that the tree
    forward ran (the tree trainers) or did not (TRL's). ``ref``: a reference model's directory (default:
    the policy's own initial weights, TRL's default)."""
    forwards = []

    def counting_tree_forward(*args, **kwargs):
        forwards.append(1)
        return real_tree_forward(*args, **kwargs)

    # patched where the tree trainers call it (the module's own name), counting the calls
    with mock.patch("treetrain.integrations.trl.preference.tree_forward", counting_tree_forward):
        kw = {} if ref is None else {"ref_model": transformers.AutoModelForCausalLM.from_pretrained(ref)}
        trainer = cls(
            model=model, args=cfg_cls(output_dir=str(out), **{**COMMON, **over}), train_dataset=data, **kw
        )
        w0 = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    assert bool(forwards) == cls.__name__.startswith("Tree"), (cls.__name__, len(forwards))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = torch.tensor([h["loss"] for h in logs], dtype=torch.float64)
    return losses, logs, {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}, w0


def assert_same_training(a, b):
    (la, logs_a, wa, w0), (lb, logs_b, wb, _) = a, b
    assert la.numel() == lb.numel() == 2
    assert torch.allclose(lb, la, rtol=1e-5, atol=1e-7), (lb, la)
    for x, y in zip(logs_a, logs_b):
        assert set(x) == set(y)
        for k in set(x) - NOT_COMPARED:
            assert y[k] == pytest.approx(x[k], rel=1e-3, abs=1e-6), k
    step = max((wa[n] - w0[n]).abs().max().item() for n in wa)
    assert step > 0
    assert max((wb[n] - wa[n]).abs().max().item() for n in wa) / step < 1e-4


DPO_CASES = {
    "sigmoid+sft": dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    "ipo+wpo": dict(loss_type="ipo", use_weighting=True),
    "apo_zero+ld_alpha": pytest.param(dict(loss_type="apo_zero", ld_alpha=0.5), marks=pytest.mark.slow),
    "sigmoid+precomputed_ref": pytest.param(dict(precompute_ref_log_probs=True), marks=pytest.mark.slow),
    "hinge": pytest.param(dict(loss_type="hinge"), marks=pytest.mark.slow),
    "robust": pytest.param(dict(loss_type="robust", label_smoothing=0.1), marks=pytest.mark.slow),
    "sigmoid_norm+js": pytest.param(
        dict(loss_type="sigmoid_norm", f_divergence_type="js_divergence"), marks=pytest.mark.slow
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    """The policy with its matrices scaled by 1.1: a reference whose rewards are not 0 at step 1.

    With the policy as its own reference, step 1's rewards are 0 up to rounding, and the tree (whose
    float32 rounding depends on which rows share a batch: the precompute pass batches them in order,
    training shuffled) and TRL's padded batch round a tie differently: ``rewards/accuracies``,
    the share of rows with margin > 0, then counts rounding (measured 0.25 vs 0 on a 2e-7 margin)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    _scale_matrices(model, 1.1)
    path = tmp_path_factory.mktemp("pref") / "reference"
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("over", list(DPO_CASES.values()), ids=list(DPO_CASES))
def test_dpo_equal_trl(over, policy, reference, tmp_path):
    over = dict(over, beta=0.5)
    ref = reference if over.get("precompute_ref_log_probs") else None
    a = run(DPOTrainer, DPOConfig, policy, tmp_path / "trl", pairs(), ref=ref, **over)
    b = run(TreeDPOTrainer, DPOConfig, policy, tmp_path / "tree", pairs(), ref=ref, **over)
    assert_same_training(a, b)


@pytest.mark.parametrize(
    "data, over",
    [
        pytest.param(dict(prompt=True), {}, marks=pytest.mark.slow),
        (dict(prompt=True, margin=True), dict(center_rewards_coefficient=0.01)),
        pytest.param(dict(prompt=False), {}, marks=pytest.mark.slow),
    ],
    ids=["prompt", "margin+center", "implicit_prompt"],
)
def test_reward_equal_trl(data, over, reward_model, tmp_path):
    a = run(RewardTrainer, RewardConfig, reward_model, tmp_path / "trl", pairs(**data), **over)
    b = run(TreeRewardTrainer, RewardConfig, reward_model, tmp_path / "tree", pairs(**data), **over)
    assert_same_training(a, b)


def test_dpo_moe_aux_loss_equal_trl(tmp_path):
    """A Qwen3-MoE policy: TRL's fused head adds ``router_aux_loss_coef * aux`` to the DPO loss and logs
    ``aux_loss``; the tree's (its rows path-weighted in one tree) gives the same loss, metric and update."""
    from .trl_agents import save_policy

    transformers.logging.set_verbosity_error()
    moe = save_policy(tmp_path / "moe", "qwen3_moe")
    a = run(DPOTrainer, DPOConfig, moe, tmp_path / "trl", pairs(), beta=0.5)
    b = run(TreeDPOTrainer, DPOConfig, moe, tmp_path / "tree", pairs(), beta=0.5)
    assert all(h["aux_loss"] > 0 for h in b[1])
    assert_same_training(a, b)


def test_fused_request_refuses_what_the_tree_cannot_give():
    """Image inputs to a text-only model, pre-shifted labels (context/sequence parallelism) and labels
    that are not the row's own tokens raise naming the problem; a call without ``fused_lm_head`` is the
    model's own forward."""
    from trl.trainer.utils import add_fused_lm_head

    from treetrain.integrations.trl.preference import FusedTreeRequest
    from treetrain.integrations.wrapped import REQUEST_KWARG, install_tree_scoring

    from .reference import tiny_model

    model = tiny_model("qwen3", dtype=torch.float32)
    add_fused_lm_head(model)
    install_tree_scoring(model)
    req = {REQUEST_KWARG: FusedTreeRequest("TreeDPOTrainer", ("log_probs",))}
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **req)
    assert out.log_probs.shape == (2, 3) and out.log_probs[1, 2] == 0 and (out.log_probs[:, :2] < 0).all()
    assert model(input_ids=ids, attention_mask=mask, **req).logits.shape == (2, 4, 97)
    with pytest.raises(ValueError, match=r"pixel_values.*text-only model"):
        model(
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            fused_lm_head=True,
            pixel_values=torch.zeros(1),
            **req,
        )
    with pytest.raises(ValueError, match="pre-shifted labels"):
        model(
            input_ids=ids, attention_mask=mask, labels=labels, shift_labels=labels, fused_lm_head=True, **req
        )
    bad = labels.clone()
    bad[0, 2] = 9
    with pytest.raises(ValueError, match="scored label must be the input token"):
        model(input_ids=ids, attention_mask=mask, labels=bad, fused_lm_head=True, **req)


@pytest.mark.parametrize("model_type", ["granite", "minicpm3", "gemma2"])
def test_fused_request_applies_the_models_head(model_type):
    """The tree's fused head takes its scale and cap from ``models.head.lm_head`` (Granite: logits /
    3, MiniCPM3: hidden / 3, Gemma 2: final softcap 3; ``tests/zoo.py``): TRL's fused head's per-token
    outputs. float64 models, but TRL's kernel returns float32: bound 4 float32 ulps of the largest value
    (measured 0, and 1 ulp on Gemma 2's mean logit); without the scale or cap: off by 3e-3 to 4."""
    from trl.trainer.utils import add_fused_lm_head

    from treetrain.integrations.trl.preference import FusedTreeRequest
    from treetrain.integrations.wrapped import REQUEST_KWARG, install_tree_scoring

    from .zoo import zoo_model

    model = zoo_model(model_type)
    outputs = ("log_probs", "entropy", "mean_logits")
    add_fused_lm_head(model, outputs=outputs)
    install_tree_scoring(model)
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 11, 12, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    call = dict(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    want = model(**call)
    got = model(**call, **{REQUEST_KWARG: FusedTreeRequest("TreeDPOTrainer", outputs)})
    for name in outputs:
        w, g = getattr(want, name), getattr(got, name)
        assert (g - w).abs().max() <= 4 * torch.finfo(w.dtype).eps * w.abs().max(), name


def test_all_four_drop_ins_import_from_one_place():
    """``treetrain.integrations.trl`` is where a user imports every TRL drop-in from (issue 36)."""
    import trl

    import treetrain.integrations.trl as place

    assert sorted(place.__all__) == [
        "TESTED_TRL", "TreeDPOTrainer", "TreeGRPOTrainer", "TreeRLOOTrainer", "TreeRewardTrainer"
    ]  # fmt: skip
    for name in ("GRPO", "RLOO", "DPO", "Reward"):
        assert issubclass(getattr(place, f"Tree{name}Trainer"), getattr(trl, f"{name}Trainer"))
    assert place.TreeDPOTrainer is TreeDPOTrainer
