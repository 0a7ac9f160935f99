"""TreeGRPOTrainer, TreeRLOOTrainer and TreeDPOTrainer on vision-language policies == TRL's trainers.

One training step of each tree trainer and of the TRL trainer it replaces, on the same batch of a
TRL-style image dataset (PIL images in an ``image`` column, conversational prompts, a processor from
a PIL image processor and a character tokenizer: ``tests/trl_vlm.py``), for a Qwen2-VL policy (3D
rotary positions, patches by grid) and a Gemma 3 policy (fixed-size images, bidirectional image
blocks, ``token_type_ids``): the loss, every logged metric and every parameter's gradient (vision
tower included) before the optimizer step. GRPO and RLOO score the policy (entropies too), the old
policy (``steps_per_generation=2``) and the reference (``beta > 0``); the rows of a prompt carry the
same image, which the tree encodes once.

Precision: TRL's fused LM head computes in float32 whatever the model's dtype
(``trl.kernels.chunked_logprob``), so no run is float64 end to end. Both trainers run float32 (TRL's
default); the truth is TRL's own step with the float64 model (its head still float32). The tree must
agree with TRL within a small multiple (4x) of TRL's own float32 error against that truth, measured
in the same test: on the loss, on each metric and on the gradients (the largest difference over
all parameters relative to the largest gradient entry).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("PIL")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from treetrain.integrations.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer  # noqa: E402

from .trl_vlm import image_pairs, image_prompts, image_rollout, reward_len, save_vlm_policy  # noqa: E402

NOT_COMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch"}
ONE_STEP = dict(
    max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", use_cpu=True, bf16=False,
    seed=0, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, max_grad_norm=0.0,
)  # fmt: skip
ONLINE = dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2)
ONLINE.update(beta=0.1, max_completion_length=5)
FACTOR = 4  # float32: the tree within 4x the trainers' own float32 error
F64 = 1e-5  # float64 models: TRL's head still rounds to float32 (its log-probs ~1e-7 relative)
FLOOR = 1e-6  # relative: below it the float32 error measure itself is noise


class GradGrab(TrainerCallback):
    """Every parameter's gradient (float64) at the optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = model.named_parameters()
        self.grads = {n: p.grad.detach().double().clone() for n, p in params if p.grad is not None}


def _model_kwargs(dtype):
    return {"dtype": dtype, "attn_implementation": "sdpa"}  # HF eager NaNs a left-padded float64 row


def one_step(kind: str, cls, policy, tmp_path, dtype=torch.float32):
    """``(last logged metrics, grads, trainer)`` of one step of ``cls`` (``kind``: grpo, rloo, dpo)."""
    path, proc = policy
    grab = GradGrab()
    out = str(tmp_path / f"{cls.__name__}_{dtype}")
    common = dict(model=path, processing_class=proc, callbacks=[grab])
    if kind == "dpo":
        args = DPOConfig(output_dir=out, per_device_train_batch_size=4, max_length=None, beta=0.1, **ONE_STEP,
                         model_init_kwargs=_model_kwargs(dtype))  # fmt: skip
        trainer = cls(args=args, train_dataset=image_pairs(4), **common)
    elif kind == "grpo":
        args = GRPOConfig(output_dir=out, **ONLINE, **ONE_STEP, model_init_kwargs=_model_kwargs(dtype))
        trainer = cls(args=args, reward_funcs=reward_len, train_dataset=image_prompts(4),
                      rollout_func=image_rollout(5), **common)  # fmt: skip
    else:
        args = RLOOConfig(
            output_dir=out,
            **ONLINE,
            **ONE_STEP,
            model_init_kwargs=_model_kwargs(dtype),
            generation_kwargs={"suppress_tokens": list(range(100, 128))},
        )  # text tokens only
        trainer = cls(args=args, reward_funcs=reward_len, train_dataset=image_prompts(4), **common)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1
    return logs[0], grab.grads, trainer


def grad_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(g.abs().max().item() for g in b.values())
    assert scale > 0
    return max((a[n] - b[n]).abs().max().item() for n in b) / scale


def rel(a, b) -> float:
    return abs(a - b) / max(abs(b), 1e-3)


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("vlm")
    return {
        (t, d): save_vlm_policy(t, root / f"{t}_{d}", dtype=getattr(torch, d))
        for t in ("qwen2_vl", "gemma3")
        for d in ("float32", "float64")
    }


TRAINERS = {"grpo": (GRPOTrainer, TreeGRPOTrainer), "rloo": (RLOOTrainer, TreeRLOOTrainer),
            "dpo": (DPOTrainer, TreeDPOTrainer)}  # fmt: skip


def compare(a, b) -> dict[str, float]:
    """Relative differences of two runs ``(logs, grads)``: ``grads`` (over all parameters, relative to
    the largest entry) and each metric (relative, floored at 1e-3)."""
    (la, ga), (lb, gb) = a, b
    assert set(la) == set(lb)
    out = {"grads": grad_err(ga, gb)}
    for k in set(la) - NOT_COMPARED:
        if la[k] is None or lb[k] is None:
            assert la[k] is None and lb[k] is None, k
            continue
        out[k] = rel(la[k], lb[k])
    return out


@pytest.mark.parametrize("model_type", ["qwen2_vl", "gemma3"])
@pytest.mark.parametrize("kind", list(TRAINERS))
def test_one_step_equals_trl(kind, model_type, policies, tmp_path):
    """float64 models: the tree equals TRL to TRL's float32 head (F64); float32: within 4x of the
    larger of the two trainers' own float32 errors (each against its float64 run)."""
    runs = {}
    for name, cls in zip(("trl", "tree"), TRAINERS[kind]):
        for d in ("float32", "float64"):
            logs, grads, trainer = one_step(kind, cls, policies[model_type, d], tmp_path, getattr(torch, d))
            runs[name, d] = (logs, grads)
            if kind != "dpo":  # the same completions (RLOO samples them: same seed, same model)
                runs[name, d, "completions"] = trainer._logs["completion"]
    if kind != "dpo":
        assert len({repr(v) for k, v in runs.items() if k[-1] == "completions"}) == 1
    exact = compare(runs["tree", "float64"], runs["trl", "float64"])
    got = compare(runs["tree", "float32"], runs["trl", "float32"])
    own_trl = compare(runs["trl", "float32"], runs["trl", "float64"])
    own_tree = compare(runs["tree", "float32"], runs["tree", "float64"])
    for k in got:
        own = max(own_trl[k], own_tree[k], FLOOR)
        assert exact[k] <= F64, (k, exact[k])
        assert got[k] <= FACTOR * own, (k, got[k], own_trl[k], own_tree[k])
    worst = max(exact, key=exact.get)
    print(
        f"\n{kind} {model_type}: float64 grads {exact['grads']:.1e}, loss {exact['loss']:.1e}, "
        f"worst {worst} "
        f"{exact[worst]:.1e}; float32 grads {got['grads']:.1e} (own: TRL {own_trl['grads']:.1e}, tree "
        f"{own_tree['grads']:.1e}), loss {got['loss']:.1e} (own: TRL {own_trl['loss']:.1e}, tree "
        f"{own_tree['loss']:.1e})"
    )
