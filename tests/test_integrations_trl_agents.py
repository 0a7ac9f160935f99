"""TreeGRPOTrainer == trl.GRPOTrainer on TRL's multi-turn agent training: ``tools=[...]`` and
``environment_factory=...``, with a dense and a mixture-of-experts (Qwen3-MoE) tiny policy.

TRL runs its own tool loop (executing the tools, appending their results as tokens, masking them out of
the loss with ``tool_mask``), its rewards (the environment's ``get_reward`` included) and every loss;
only the policy's sampling is scripted (``tests/trl_agents.py``: a random tiny model never writes a tool
call), identically for both trainers. Compared after 2 optimizer steps (4 micro-steps, 2 iterations per
generation, KL on): every logged loss and metric, and the final weights (SGD).

Tolerances (float32, CPU): measured tree vs TRL (tools + Qwen3-MoE, environment + dense): losses
<= 1.4e-6 relative, metrics <= 1.4e-6 relative, weights 1.2e-5 and 2.1e-5 of the update size, the
order of TRL's own float32 error (~1e-5 of the update against a float64 run, see
``test_integrations_trl.py``). The bounds (1e-5 relative on losses, 1e-3 relative on metrics, 1e-4 of
the update) leave room for that rounding only; a missing token or a wrong aux weight moves them by
1e-2 or more.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from treetrain.integrations.flat import FlatBatch  # noqa: E402
from treetrain.integrations.trl import TreeGRPOTrainer  # noqa: E402

from .trl_agents import (
    Counter,
    add,
    chat_dataset,
    multiply,
    reward_short_answer,
    save_policy,
    script_generation,
)  # noqa: E402
from .trl_tiny import TRAINER_ARGS  # noqa: E402

MODES = {"tools": lambda: dict(tools=[add, multiply]), "env": lambda: dict(environment_factory=Counter)}
TOOL = {"tools": "add", "env": "step"}
NOT_COMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("agents")
    return {arch: save_policy(root / arch, arch) for arch in ("qwen3", "qwen3_moe")}


def config(out, **over) -> GRPOConfig:
    cfg = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,  # a generation batch of 8 rows = 2 prompts x 4 completions
        num_iterations=2,
        beta=0.1,
        max_completion_length=120,  # some rows run past it: truncated multi-turn completions too
        **TRAINER_ARGS,
    )
    cfg.update(over)
    return GRPOConfig(**cfg)


_RUNS: dict = {}


def train(cls, policy, out, mode, **over):
    """(logged losses [steps] float64, the logged dicts, final weights float64, the scored rows, trainer)."""
    key = (cls.__name__, policy, mode, tuple(sorted(over.items())))
    if key in _RUNS:
        return _RUNS[key]
    trainer = cls(
        model=policy,
        reward_funcs=reward_short_answer,
        args=config(out, **over),
        train_dataset=chat_dataset(4),
        **MODES[mode](),
    )
    script_generation(trainer, TOOL[mode])
    rows = []
    score = trainer._get_per_token_logps_and_entropies

    def spy(model, input_ids, attention_mask, *args, **kwargs):
        rows.append((input_ids.clone(), attention_mask.clone()))
        return score(model, input_ids, attention_mask, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = torch.tensor([h["loss"] for h in logs], dtype=torch.float64)
    weights = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}
    _RUNS[key] = losses, logs, weights, rows, trainer
    return _RUNS[key]


def update_err(w, ref, w0) -> float:
    """max |w - ref| over all weights, relative to the largest entry of the reference's update."""
    step = max((ref[n] - w0[n]).abs().max().item() for n in ref)
    assert step > 0, "the reference run did not move the weights"
    return max((w[n] - ref[n]).abs().max().item() for n in ref) / step


def distinct_prefixes(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Tokens of the rows' prefix trie, counted by hand: one per distinct (row prefix, token)."""
    rows = [tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask)]
    return len({r[: k + 1] for r in rows for k in range(len(r))})


CASES = [
    ("tools", "qwen3_moe"),
    ("env", "qwen3"),
    pytest.param("tools", "qwen3", marks=pytest.mark.slow),
    pytest.param("env", "qwen3_moe", marks=pytest.mark.slow),  # ~50 s on 2 shared cores
]


@pytest.mark.parametrize("mode, arch", CASES)
def test_multi_turn_equal_trl(mode, arch, policies, tmp_path):
    trl_loss, trl_logs, trl_w, trl_rows, trl_tr = train(GRPOTrainer, policies[arch], tmp_path / "trl", mode)
    tree_loss, tree_logs, tree_w, tree_rows, tree_tr = train(
        TreeGRPOTrainer, policies[arch], tmp_path / "tr", mode
    )
    # the same rollouts: TRL's tool loop ran and its results are in the rows
    assert trl_tr._logs["completion"] == tree_tr._logs["completion"]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(trl_rows, tree_rows))
    assert trl_logs[0]["tools/call_frequency"] > 0.5
    assert trl_loss.numel() == tree_loss.numel() == 2
    assert torch.allclose(tree_loss, trl_loss, rtol=1e-5, atol=1e-7), (tree_loss, trl_loss)
    for a, b in zip(trl_logs, tree_logs):
        assert set(a) == set(b)
        for k in set(a) - NOT_COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), k
    if arch == "qwen3_moe":  # the router aux loss ran through the tree and entered the loss
        assert all(h["aux_loss"] > 0 for h in tree_logs)
    w0 = {n: p.detach().double() for n, p in transformers.AutoModelForCausalLM.from_pretrained(
        policies[arch]).named_parameters()}  # fmt: skip
    assert update_err(tree_w, trl_w, w0) < 1e-4
    # the trie found the sharing turn by turn: rows of a group share more than their prompt
    ids, mask = tree_rows[0]
    tree = FlatBatch.build(ids, mask).tree
    assert tree.num_tokens == distinct_prefixes(ids, mask)
    per_group = 0
    G = tree_tr.num_generations
    for g in range(0, ids.size(0), G):
        lens = mask[g : g + G].sum(1)
        n_prompt = len(
            os.path.commonprefix([r[m.bool()].tolist() for r, m in zip(ids[g : g + G], mask[g : g + G])])
        )
        per_group += n_prompt + int((lens - n_prompt).sum())
    assert tree.num_tokens < per_group, (tree.num_tokens, per_group)


def _padded_rows(tok, n_rows: int = 6):
    """Left-padded prompts (two prompts, three rows each) + right-padded completions of different
    lengths, rows 0 and 1 sharing their first completion tokens: ``(ids [B, L], mask [B, L], K)``."""
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("what is 1+2?", "sum 7 8")]
    comps = [
        tok(c, add_special_tokens=False)["input_ids"]
        for c in ("so 3 it is", "so 3!", "it is 4", "7", "15 it", "x")
    ]
    P, K = max(map(len, prompts)), max(map(len, comps))
    ids = torch.full((n_rows, P + K), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i in range(n_rows):
        p, c = prompts[i // 3], comps[i]
        ids[i, P - len(p) : P], mask[i, P - len(p) : P] = torch.tensor(p), 1
        ids[i, P : P + len(c)], mask[i, P : P + len(c)] = torch.tensor(c), 1
    return ids, mask, K


def test_router_aux_loss_equals_trl_per_chunk(policies, tmp_path):
    """TRL averages the load-balancing loss over its ``batch_size``-row forwards; the tree's aux loss
    (one forward, or several under the token budget) equals it and its router gradient, chunk sizes that
    split a group or leave a short last chunk included."""
    kw = dict(model=policies["qwen3_moe"], reward_funcs=reward_short_answer, train_dataset=chat_dataset(4))
    trl_tr = GRPOTrainer(args=config(tmp_path), **kw)
    tree_tr = TreeGRPOTrainer(args=config(tmp_path), **kw)
    assert trl_tr.aux_loss_enabled and tree_tr.aux_loss_enabled
    ids, mask, K = _padded_rows(trl_tr.processing_class)

    def aux_and_grad(tr, bs):
        _, _, aux = tr._get_per_token_logps_and_entropies(
            tr.model, ids, mask, K, batch_size=bs, compute_aux_loss=True
        )
        gates = [p for n, p in tr.model.named_parameters() if n.endswith("mlp.gate.weight")]
        return aux.detach(), torch.autograd.grad(aux, gates)

    for bs in (None, 2, 4):
        a, ga = aux_and_grad(trl_tr, bs)
        b, gb = aux_and_grad(tree_tr, bs)
        assert b.item() == pytest.approx(a.item(), rel=1e-6), bs  # float32 sums in another order
        for x, y in zip(ga, gb):  # float32 rounding of the router forward: ~1e-7 of the gradient's scale
            assert (y - x).abs().max() <= 1e-5 * x.abs().max(), (
                bs,
                ((y - x).abs().max() / x.abs().max()).item(),
            )
    assert not torch.isclose(aux_and_grad(trl_tr, 2)[0], aux_and_grad(trl_tr, None)[0])  # chunking matters


def test_rejects_vision_inputs_and_liger(policies, tmp_path):
    kw = dict(model=policies["qwen3"], reward_funcs=reward_short_answer, train_dataset=chat_dataset(4))
    tree_tr = TreeGRPOTrainer(args=config(tmp_path), **kw)
    ids, mask, K = _padded_rows(tree_tr.processing_class)
    with pytest.raises(ValueError, match=r"pixel_values.*text-only model"):
        tree_tr._get_per_token_logps_and_entropies(tree_tr.model, ids, mask, K, pixel_values=torch.zeros(1))
    with pytest.raises(ValueError, match="use_liger_kernel=True"):
        TreeGRPOTrainer(args=config(tmp_path, use_liger_kernel=True), **kw)
