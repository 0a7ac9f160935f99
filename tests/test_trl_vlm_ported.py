"""TRL's own vision-language tests (``TestGRPOTrainerVLM``, ``TestRLOOTrainerVLM``, ``TestDPOTrainerVLM``)
with the tree trainers swapped in: the same configurations and assertions (training runs, a train
loss is logged, every parameter changes, except LLaVA's last vision layer and post-layernorm that its
feature layer -2 leaves without gradient; LoRA: base weights unchanged; DPO on text-only data: the
vision tower unchanged; DPO's own refusals).

Ported from huggingface/trl ``tests/test_{grpo,rloo,dpo}_trainer.py`` (the newest snapshot at hand,
the 1.9 development line; trl 1.16.0 installed ships no tests). Changes, all forced by running
offline on 2 CPU cores: the hub checkpoints ``trl-internal-testing/tiny-*`` become tiny random
configs of the same types (``tests/vlm_zoo.py``) with processors built from PIL image processors
and a character tokenizer (``tests/trl_vlm.py``); the ``zen-image`` / ``zen-multi-image`` datasets
become generated ones of the same shape (conversational prompts or preference pairs, one or two PIL
images per row); ``max_steps=2`` instead of 3 epochs; float32 on the CPU; the online reward counts
the letter "a" besides the length (a tiny random policy rarely stops early: equal lengths would give
zero advantages and no update).

Not ported, and why: the Gemma 4, LLaVA-NeXT, Qwen3-VL, Qwen3.5 and Qwen3.5-MoE parametrizations
(no offline processor for them here yet: their models are exact on the model side, and
``tests/test_flat_images.py`` checks their batch layouts' split); vLLM (skipped in TRL too: needs a
server); Liger (refused by the tree trainers by design: checked here); tools returning images
(needs Qwen3.5's tool-call chat template).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("PIL")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, GRPOConfig, RLOOConfig  # noqa: E402

from treetrain.integrations.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer  # noqa: E402

from .trl_vlm import image_pairs, image_prompts, reward_len, save_vlm_policy  # noqa: E402

CPU = dict(use_cpu=True, bf16=False, max_steps=2, report_to="none", save_strategy="no", disable_tqdm=True)
ONLINE = {"grpo": (TreeGRPOTrainer, GRPOConfig), "rloo": (TreeRLOOTrainer, RLOOConfig)}
LLAVA_FROZEN = ("encoder.layers.1", "post_layernorm")  # vision_feature_layer=-2: no gradient by design


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("ported")
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = save_vlm_policy(model_type, root / model_type)
        return cache[model_type]

    return get


def online(kind, policy, tmp_path, model_type, dataset=None, peft_config=None, **over):
    cls, cfg = ONLINE[kind]
    path, proc = policy(model_type)
    args = cfg(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=2, num_generations=2,
               max_completion_length=8, **CPU, **over)  # fmt: skip
    model = path
    if peft_config is not None:
        model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype="float32")
    data = dataset if dataset is not None else image_prompts(4)
    return cls(model=model, reward_funcs=reward_len, args=args, processing_class=proc, train_dataset=data,
               peft_config=peft_config)  # fmt: skip


def trained(trainer, frozen=()):
    """Train; a train loss is logged and every parameter changed (those matching ``frozen`` did not)."""
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, p in before.items():
        new = trainer.model.get_parameter(n)
        if any(f in n for f in frozen):
            assert torch.equal(p, new), f"Param {n} expected frozen by LLaVA design, but changed"
        else:
            assert not torch.equal(p, new), f"Parameter {n} has not changed."
    return trainer


# ---- GRPO and RLOO (TestGRPOTrainerVLM, TestRLOOTrainerVLM) ----------------------------------------


@pytest.mark.parametrize("kind", list(ONLINE))
@pytest.mark.parametrize("model_type", ["gemma3", "qwen2_5_vl", "qwen2_vl"])
def test_train_vlm(kind, model_type, policy, tmp_path):
    trained(online(kind, policy, tmp_path, model_type))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ONLINE))
def test_train_vlm_with_pad_to_multiple_of(kind, policy, tmp_path):
    trained(online(kind, policy, tmp_path, "gemma3", pad_to_multiple_of=7))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ONLINE))
def test_train_vlm_beta_non_zero(kind, policy, tmp_path):
    trained(online(kind, policy, tmp_path, "qwen2_5_vl", beta=0.1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ONLINE))
def test_train_vlm_peft(kind, policy, tmp_path):
    from peft import LoraConfig

    base = transformers.AutoModelForImageTextToText.from_pretrained(policy("qwen2_5_vl")[0], dtype="float32")
    base_names = {f"base_model.model.{n}" for n, _ in base.named_parameters()}
    lora = LoraConfig(target_modules=["q_proj", "v_proj"])
    trainer = online(kind, policy, tmp_path, "qwen2_5_vl", peft_config=lora)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, p in before.items():
        new = trainer.model.get_parameter(n)
        if n in base_names:
            torch.testing.assert_close(p, new, msg=f"Parameter {n} has changed.")
        elif "base_layer" not in n:
            assert not torch.equal(p, new), f"Parameter {n} has not changed."


@pytest.mark.slow
def test_train_vlm_and_importance_sampling(policy, tmp_path):
    trained(online("grpo", policy, tmp_path, "qwen2_5_vl", steps_per_generation=2))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ONLINE))
def test_train_vlm_multi_image(kind, policy, tmp_path):
    trained(online(kind, policy, tmp_path, "qwen2_5_vl", dataset=image_prompts(4, multi=True)))


@pytest.mark.parametrize("kind", list(ONLINE))
def test_train_vlm_log_multimodal_false(kind, policy, tmp_path):
    trainer = online(kind, policy, tmp_path, "gemma3", log_completions=True, log_multimodal=False)
    trainer.train()
    assert len(trainer._logs["images"]) == 0


@pytest.mark.parametrize("kind", list(ONLINE))
def test_train_vlm_and_liger_is_refused(kind, policy, tmp_path):
    with pytest.raises(ValueError, match="use_liger_kernel=True"):
        online(kind, policy, tmp_path, "qwen2_5_vl", use_liger_kernel=True)


# ---- DPO (TestDPOTrainerVLM) ------------------------------------------------------------------------


def dpo(policy, tmp_path, model_type, dataset=None, **over):
    path, proc = policy(model_type)
    cfg = dict(output_dir=str(tmp_path), max_length=None, per_device_train_batch_size=2, **CPU)
    return TreeDPOTrainer(model=path, args=DPOConfig(**{**cfg, **over}), processing_class=proc,
                          train_dataset=dataset if dataset is not None else image_pairs(4))  # fmt: skip


@pytest.mark.parametrize("model_type", ["gemma3", "llava", "qwen2_vl", "qwen2_5_vl"])
def test_dpo_train_vlm(model_type, policy, tmp_path):
    trained(dpo(policy, tmp_path, model_type), frozen=LLAVA_FROZEN if model_type == "llava" else ())


@pytest.mark.slow
def test_dpo_train_vlm_multi_image(policy, tmp_path):
    pairs = image_pairs(4, multi=True)
    over = dict(learning_rate=0.1, per_device_train_batch_size=1)
    trained(dpo(policy, tmp_path, "qwen2_5_vl", dataset=pairs, **over))


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [True, False])
def test_dpo_train_vlm_text_only_data(conversational, policy, tmp_path):
    pairs = image_pairs(4).remove_columns("image")
    if not conversational:
        keys = ("prompt", "chosen", "rejected")
        pairs = Dataset.from_dict({k: [m[0]["content"] for m in pairs[k]] for k in keys})
    trainer = dpo(policy, tmp_path, "qwen2_5_vl", dataset=pairs, max_length=1024)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, p in before.items():
        new = trainer.model.get_parameter(n)
        if n.startswith("model.visual"):
            torch.testing.assert_close(p, new, rtol=1e-12, atol=1e-12, msg=f"Param {n} is updated")
        else:
            assert not torch.equal(p, new), f"Param {n} is not updated"


@pytest.mark.slow
def test_dpo_train_vlm_with_max_length(policy, tmp_path):
    """Truncates completion tokens, keeps every image token (TRL: max_length=37 for its dataset)."""
    trainer = dpo(policy, tmp_path, "qwen2_5_vl", max_length=30)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None


def test_dpo_refusals_are_trls(policy, tmp_path):
    """TRL's own refusals stand: keep_end truncation and precomputed reference log-probs on images."""
    with pytest.warns(FutureWarning, match="keep_end.*deprecated"):
        args = dict(max_length=32, truncation_mode="keep_end")
        with pytest.raises(ValueError, match="truncation_mode='keep_end' is not supported for vision"):
            dpo(policy, tmp_path, "qwen2_5_vl", **args)
    with pytest.raises(ValueError, match="precompute_ref_log_probs.*not supported for vision datasets"):
        dpo(policy, tmp_path, "qwen2_5_vl", precompute_ref_log_probs=True)
    with pytest.raises(ValueError, match="use_liger_kernel=True"):
        dpo(policy, tmp_path, "qwen2_5_vl", use_liger_kernel=True)
