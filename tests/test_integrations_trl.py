"""TreeGRPOTrainer == trl.GRPOTrainer: same per-token scores, per-step losses and final weights.

Both trainers train the same tiny Qwen3 (float32, CPU, no autocast) from the same folder, with the
same seed, on the same completions: TRL's real ``rollout_func`` hook returns a deterministic set of
completions of different lengths, some ending in eos, some truncated at ``max_completion_length``,
one only eos (an empty answer). What is compared, per configuration: every logged loss, and the
final weights after the last optimizer step (SGD, so a weight error is ``lr`` times a gradient
error; Adam would turn rounding noise in near-zero gradients into full-size steps).

Tolerances (float32): TRL's own float32 run differs from the same run with a float64 model by
~1e-5 of the update size (measured; ``test_tree_within_trls_own_float32_error`` checks the tree
against that live) and by ~1 ulp in the loss. Tree vs TRL measures ~6e-7 of the update: the bounds
below (1e-5 of the update, 1e-6 + 1e-6 relative in the loss) are TRL's own float32 error.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from treetrain.integrations.flat import flat_logprobs  # noqa: E402
from treetrain.integrations.trl import TreeGRPOTrainer  # noqa: E402

from .reference import float64_casts  # noqa: E402
from .trl_tiny import (  # noqa: E402
    dataset,
    fixed_rollout,
    reward_len_and_a,
    save_tiny_nemotron_h,
    save_tiny_policy,
)

MAX_LEN = 6


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    return save_tiny_policy(tmp_path_factory.mktemp("tiny") / "policy")


def config(out, dtype=torch.float32, **over) -> GRPOConfig:
    cfg = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,  # a generation batch of 8 rows = 2 prompts x 4 completions
        max_steps=2,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        num_iterations=2,
        beta=0.1,
        max_completion_length=MAX_LEN,
        temperature=0.9,
        use_cpu=True,
        bf16=False,  # GRPOConfig defaults to bf16 autocast
        seed=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        model_init_kwargs={"dtype": dtype},
    )
    cfg.update(over)
    return GRPOConfig(**cfg)


_RUNS: dict = {}  # identical runs are shared between tests (the calibration reuses the grpo pair)


def train(cls, policy, out, dtype=torch.float32, rollout=True, peft_config=None, env_mask=False, **over):
    """(logged losses [steps] float64, final weights float64, the trainer)."""
    key = (cls.__name__, policy, str(dtype), rollout, env_mask, tuple(sorted(over.items())))
    if peft_config is None and key in _RUNS:
        return _RUNS[key]
    trainer = cls(
        model=policy,
        reward_funcs=reward_len_and_a,
        args=config(out, dtype, **over),
        train_dataset=dataset(4),
        rollout_func=fixed_rollout(MAX_LEN, env_mask) if rollout else None,
        peft_config=peft_config,
    )
    trainer.initial_weights = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h], dtype=torch.float64)
    weights = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
    if peft_config is None:
        _RUNS[key] = losses, weights, trainer
    return losses, weights, trainer


def update_err(w, ref, w0) -> float:
    """max |w - ref| over all weights, relative to the largest entry of the reference's update."""
    step = max((ref[n] - w0[n]).abs().max().item() for n in ref)
    assert step > 0, "the reference run did not move the weights"
    return max((w[n] - ref[n]).abs().max().item() for n in ref) / step


def initial(policy):
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    return {n: p.detach().double() for n, p in model.named_parameters()}


CONFIGS = {
    "grpo": dict(loss_type="grpo"),
    "dapo+mask_truncated": dict(loss_type="dapo", mask_truncated_completions=True),
    "dr_grpo+sequence_level": dict(loss_type="dr_grpo", importance_sampling_level="sequence"),
    "bnpo+top_entropy": dict(loss_type="bnpo", top_entropy_quantile=0.5),
    "cispo+env_mask": dict(loss_type="cispo", env_mask=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_and_updates_equal_trl(name, policy, tmp_path):
    """Two optimizer steps (4 micro-steps, 2 iterations per generation, KL on) per configuration."""
    over = CONFIGS[name]
    trl_loss, trl_w, trl_tr = train(GRPOTrainer, policy, tmp_path / "trl", **over)
    tree_loss, tree_w, tree_tr = train(TreeGRPOTrainer, policy, tmp_path / "tree", **over)
    assert trl_loss.numel() == tree_loss.numel() == 2
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-6, atol=1e-6), (tree_loss, trl_loss)
    err = update_err(tree_w, trl_w, initial(policy))
    assert err < 1e-5, err
    # metrics TRL computes from the scores agree too
    trl_logs = [h for h in trl_tr.state.log_history if "loss" in h]
    tree_logs = [h for h in tree_tr.state.log_history if "loss" in h]
    for key in ("entropy", "kl", "clip_ratio/region_mean", "cispo_clip_ratio"):
        for a, b in zip(trl_logs, tree_logs):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [dict(loss_type="sapo"), dict(loss_type="luspo"), dict(loss_type="vespo"), dict(entropy_coef=0.05)],
    ids=["sapo", "luspo", "vespo", "entropy_bonus"],
)
def test_more_loss_types_equal_trl(over, policy, tmp_path):
    """The entropy bonus differentiates through the entropies: their gradient must match too."""
    trl_loss, trl_w, _ = train(GRPOTrainer, policy, tmp_path / "trl", **over)
    tree_loss, tree_w, _ = train(TreeGRPOTrainer, policy, tmp_path / "tree", **over)
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-6, atol=1e-6), (tree_loss, trl_loss)
    assert update_err(tree_w, trl_w, initial(policy)) < 1e-5


@pytest.mark.slow
def test_tree_within_trls_own_float32_error(policy, tmp_path):
    """The tolerance's ground: against a float64 run of TRL, the tree's float32 update is no further
    off than TRL's own float32 update (a small multiple, as both round differently)."""
    _, trl32, _ = train(GRPOTrainer, policy, tmp_path / "a", **CONFIGS["grpo"])
    _, tree32, _ = train(TreeGRPOTrainer, policy, tmp_path / "b", **CONFIGS["grpo"])
    _, trl64, _ = train(GRPOTrainer, policy, tmp_path / "c", dtype=torch.float64, **CONFIGS["grpo"])
    w0 = initial(policy)
    own = update_err(trl32, trl64, w0)
    assert 0 < own < 1e-4, own  # the float64 run really is the same training
    assert update_err(tree32, trl64, w0) <= 2 * own


@pytest.mark.slow
def test_real_generation_end_to_end(policy, tmp_path):
    """No rollout hook: TRL samples with the model itself. Generation is unchanged by the subclass (same
    completions from the same seed), and the losses and update agree."""
    over = dict(max_steps=1, num_iterations=1, beta=0.0)
    trl_loss, trl_w, trl_tr = train(GRPOTrainer, policy, tmp_path / "a", rollout=False, **over)
    tree_loss, tree_w, tree_tr = train(TreeGRPOTrainer, policy, tmp_path / "b", rollout=False, **over)
    assert trl_tr._logs["completion"] == tree_tr._logs["completion"]
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-6, atol=1e-6)
    assert update_err(tree_w, trl_w, initial(policy)) < 1e-5


@pytest.mark.slow
def test_peft_lora_with_reference_from_disabled_adapter(policy, tmp_path):
    """PEFT wraps the policy; the reference is the same model with the adapter disabled (TRL's
    ``use_adapter``): the tree forward runs inside those wrappers, so both see the adapter state."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    over = dict(max_steps=1, learning_rate=0.5)
    trl_loss, trl_w, trl_tr = train(GRPOTrainer, policy, tmp_path / "a", peft_config=lora, **over)
    tree_loss, tree_w, tree_tr = train(TreeGRPOTrainer, policy, tmp_path / "b", peft_config=lora, **over)
    assert trl_tr.ref_model is None and any("lora" in n for n in tree_w)
    kl = [h["kl"] for h in tree_tr.state.log_history if "kl" in h]
    assert kl and kl[0] > 0  # the random-init adapter moves the policy away from the base (reference)
    assert kl == pytest.approx([h["kl"] for h in trl_tr.state.log_history if "kl" in h], rel=1e-4)
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-6, atol=1e-6)
    assert update_err(tree_w, trl_w, trl_tr.initial_weights) < 1e-5  # only the LoRA weights move


def _batch(tok):
    """Left-padded prompts + right-padded completions as TRL builds them; row 1's completion is
    shorter, row 3's is masked out entirely (mask_truncated_completions)."""
    prompts = ["what is 1+2?", "what is 1+2?", "spell cat.", "spell cat."]
    comps = [[5, 6, 7, 1], [5, 8, 1], [9, 9, 9, 9], [9, 4, 4, 4]]
    P = max(len(tok(p)["input_ids"]) for p in prompts)
    ids = torch.zeros(4, P + 4, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        pi = tok(p)["input_ids"]
        ids[i, P - len(pi) : P], mask[i, P - len(pi) : P] = torch.tensor(pi), 1
        ids[i, P : P + len(c)], mask[i, P : P + len(c)] = torch.tensor(c), 1
    mask[3, P:] = 0
    return ids, mask


def test_scoring_matches_trl_and_float64_truth(policy, tmp_path):
    """The overridden method returns TRL's layout and values (policy and reference, with entropies);
    a token budget (``batch_size=1``: one row's worth of tokens per forward) changes nothing."""
    trl_tr = GRPOTrainer(
        model=policy, reward_funcs=reward_len_and_a, args=config(tmp_path), train_dataset=dataset()
    )
    tree_tr = TreeGRPOTrainer(
        model=policy, reward_funcs=reward_len_and_a, args=config(tmp_path), train_dataset=dataset()
    )
    ids, mask = _batch(trl_tr.processing_class)
    m64 = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    with float64_casts():
        truth, truth_ent = flat_logprobs(
            m64, ids, mask, logits_to_keep=4, temperature=0.9, return_entropy=True, backend="dense"
        )
    trl_lp, trl_ent, _ = trl_tr._get_per_token_logps_and_entropies(
        trl_tr.model, ids, mask, 4, compute_entropy=True
    )
    for bs in (None, 1):
        lp, ent, aux = tree_tr._get_per_token_logps_and_entropies(
            tree_tr.model, ids, mask, 4, batch_size=bs, compute_entropy=True
        )
        assert lp.shape == ent.shape == (4, 4) and aux is None and lp.dtype == torch.float32
        assert (lp[3] == 0).all() and lp[1, 3] == 0  # masked positions are 0, as TRL's
        # float32 vs the float64 truth: within a small multiple of TRL's own float32 error
        own = (trl_lp.double() - truth).abs().max().item()
        assert (lp.double() - truth).abs().max().item() <= 4 * own + 1e-7
        own_ent = (trl_ent.double() - truth_ent).abs().max().item()
        assert (ent.double() - truth_ent).abs().max().item() <= 4 * own_ent + 1e-7
    ref_lp, ref_ent, _ = tree_tr._get_per_token_logps_and_entropies(tree_tr.ref_model, ids, mask, 4)
    assert ref_ent is None and torch.allclose(ref_lp, lp, atol=1e-6)


@pytest.mark.parametrize("cast_head", [False, True])
def test_bf16_autocast_within_trls_own_error(policy, tmp_path, cast_head):
    """GRPOConfig's default ``bf16=True`` (CPU autocast) and ``cast_lm_head_to_fp32``: the tree's
    error against the float64 truth stays within a small multiple of TRL's own (8 mantissa bits)."""
    args = config(tmp_path, bf16=True, cast_lm_head_to_fp32=cast_head)
    trl_tr = GRPOTrainer(model=policy, reward_funcs=reward_len_and_a, args=args, train_dataset=dataset())
    tree_tr = TreeGRPOTrainer(model=policy, reward_funcs=reward_len_and_a, args=args, train_dataset=dataset())
    ids, mask = _batch(trl_tr.processing_class)
    m64 = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    with float64_casts():
        truth = flat_logprobs(m64, ids, mask, logits_to_keep=4, temperature=0.9, backend="dense")
    trl_lp, _, _ = trl_tr._get_per_token_logps_and_entropies(trl_tr.model, ids, mask, 4)
    lp, _, _ = tree_tr._get_per_token_logps_and_entropies(tree_tr.model, ids, mask, 4)
    own = (trl_lp.double() - truth).abs().max().item()
    assert 1e-5 < own < 0.1, own  # autocast really ran, and TRL is still near the truth
    assert (lp.double() - truth).abs().max().item() <= 4 * own


def test_other_trl_versions_warn_or_refuse(policy, tmp_path, monkeypatch):
    import trl as trl_module

    monkeypatch.setattr(trl_module, "__version__", "9.9.9")
    with pytest.warns(UserWarning, match=r"tested with trl==1\.16\.0, this is trl 9\.9\.9"):
        TreeGRPOTrainer(
            model=policy, reward_funcs=reward_len_and_a, args=config(tmp_path), train_dataset=dataset()
        )
    monkeypatch.delattr(GRPOTrainer, "_get_per_token_logps_and_entropies")
    with pytest.raises(ImportError, match="has no GRPOTrainer._get_per_token_logps_and_entropies"):
        TreeGRPOTrainer(
            model=policy, reward_funcs=reward_len_and_a, args=config(tmp_path), train_dataset=dataset()
        )


RLOO_CASES = {
    "kl+2_iterations": dict(beta=0.1, num_iterations=2),
    "normalized": pytest.param(dict(normalize_advantages=True), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("over", list(RLOO_CASES.values()), ids=list(RLOO_CASES))
def test_rloo_equal_trl(over, policy, tmp_path):
    """TreeRLOOTrainer == trl.RLOOTrainer: TRL samples with the model itself (RLOO has no rollout hook),
    the same completions from the same seed; losses, every metric and the update agree."""
    from trl import RLOOConfig, RLOOTrainer

    from treetrain.integrations.trl import TreeRLOOTrainer

    def run(cls, out):
        keep = [
            "per_device_train_batch_size",
            "num_generations",
            "gradient_accumulation_steps",
            "max_steps",
            "learning_rate",
            "optim",
            "lr_scheduler_type",
            "max_completion_length",
            "temperature",
            "use_cpu",
            "bf16",
            "seed",
            "logging_steps",
            "report_to",
            "save_strategy",
            "disable_tqdm",
        ]
        grpo = config(out)
        cfg = RLOOConfig(output_dir=str(out), **{k: getattr(grpo, k) for k in keep}, **over)
        tr = cls(model=policy, reward_funcs=reward_len_and_a, args=cfg, train_dataset=dataset(4))
        tr.train()
        logs = [h for h in tr.state.log_history if "loss" in h]
        return logs, {n: p.detach().double().clone() for n, p in tr.model.named_parameters()}, tr

    a_logs, a_w, a_tr = run(RLOOTrainer, tmp_path / "a")
    b_logs, b_w, b_tr = run(TreeRLOOTrainer, tmp_path / "b")
    assert a_tr._logs["completion"] == b_tr._logs["completion"]
    assert len(a_logs) == len(b_logs) == 2
    for x, y in zip(a_logs, b_logs):
        assert set(x) == set(y)
        for k in set(x) - {
            "step_time",
            "train_runtime",
            "train_samples_per_second",
            "train_steps_per_second",
        }:
            assert y[k] == pytest.approx(x[k], rel=1e-5 if k == "loss" else 1e-3, abs=1e-6), k
    assert update_err(b_w, a_w, initial(policy)) < 1e-4


def test_nemotron_h_equal_trl(tmp_path_factory):
    """A Mamba2 hybrid policy (Nemotron-H: Mamba2 mixer, attention, MLP): TRL's GRPO runs with the
    tree, its Mamba2 states routed along the tree (prompt and shared completion prefixes run once),
    and the losses and update equal TRL's, to TRL's own float32 error as above."""
    transformers.logging.set_verbosity_error()
    policy = save_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron_h") / "policy")
    over = dict(CONFIGS["grpo"], max_steps=1)  # one step: 2 micro-steps x 2 iterations, KL on
    trl_loss, trl_w, _ = train(GRPOTrainer, policy, tmp_path_factory.mktemp("trl"), **over)
    tree_loss, tree_w, tree_tr = train(TreeGRPOTrainer, policy, tmp_path_factory.mktemp("tree"), **over)
    assert any(type(m).__name__ == "NemotronHMamba2Mixer" for m in tree_tr.model.modules())
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-6, atol=1e-6), (tree_loss, trl_loss)
    assert update_err(tree_w, trl_w, initial(policy)) < 1e-5
