"""DPO family and Bradley-Terry reward models on pair trees == the per-path HF reference.

The reference (``baseline_*`` below) is written here from TRL's formulas, independently of
``treetrain.objectives.preference``, on the log-probs (or scores) of every path run alone through
the unmodified model (``tests/reference.py``), in float64 with the models' float32 casts lifted.
What is left is summation order (tree attention over T keys vs len(p) keys): losses agree to
~1e-15 and gradients to ~1e-13; the bound 1e-10 leaves a wide margin, while a wrong mask, a swapped
pair or a local normalizer shows as O(1e-2).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain import TrajectoryTree, pack
from treetrain.data.fields import DataError
from treetrain.data.reader import iter_trees
from treetrain.data.records import parse_record
from treetrain.objectives.preference.loss import (
    PreferenceObjective,
    compute_preference_loss,
    summarize_preference,
)
from treetrain.objectives.preference.pairs import pair_layout, pair_microbatches, preference_normalizer

from .reference import float64_casts, grad_err, reference_copy, tiny_config, tiny_model
from .reference import reference_logprobs as baseline_logprobs

TOL = 1e-10

# (prompt, chosen, rejected): shared long prompt, chosen a prefix of rejected, one-token responses,
# identical responses, responses sharing their first tokens
PAIRS = [
    ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13]),
    ([1, 2, 3], [20, 21], [20, 21, 22, 23]),
    ([5, 6], [30], [31]),
    ([7, 8, 9], [40, 41], [40, 41]),
    ([1, 2, 3, 4], [50, 51, 52, 53], [50, 51, 60]),
]

CONFIGS = {
    "sigmoid": PreferenceObjective("dpo"),
    "sigmoid-smoothed": PreferenceObjective("dpo", beta=0.5, label_smoothing=0.1),
    "ipo": PreferenceObjective("dpo", "ipo", beta=0.3),
    "simpo": PreferenceObjective("dpo", "simpo", beta=2.0, simpo_gamma=0.7),
}


def pair_tree(prompt, chosen, rejected, margin=None):
    rec = {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
    if margin is not None:
        rec["margin"] = margin
    return parse_record(rec)[0]


# ---- the per-path baseline, from TRL's formulas ---------------------------------------------------


def response_sum(model, prompt, response):
    """Sum of the response's log-probs and its length: the path run alone through the HF model."""
    lp = baseline_logprobs(model, [prompt + response])[0]
    return lp[len(prompt) - 1 :].sum() if prompt else lp.sum(), len(response) - (0 if prompt else 1)


def baseline_dpo(policy, ref, pairs, cfg):
    total = 0.0
    for prompt, chosen, rejected in pairs:
        c, n_c = response_sum(policy, prompt, chosen)
        r, n_r = response_sum(policy, prompt, rejected)
        n_c, n_r = max(n_c, 1), max(n_r, 1)
        beta, ls = cfg.beta, cfg.label_smoothing
        if cfg.loss_type == "simpo":
            x = beta * (c / n_c - r / n_r) - cfg.simpo_gamma
            total = total - (1 - ls) * F.logsigmoid(x) - ls * F.logsigmoid(-x)
            continue
        with torch.no_grad():
            c0, r0 = response_sum(ref, prompt, chosen)[0], response_sum(ref, prompt, rejected)[0]
        if cfg.loss_type == "sigmoid":
            x = beta * ((c - c0) - (r - r0))
            total = total - (1 - ls) * F.logsigmoid(x) - ls * F.logsigmoid(-x)
        else:
            total = total + ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 * beta)) ** 2
    return total / len(pairs)


def perturbed(model, seed=1, scale=0.05):
    """A copy with every weight nudged: a reference that differs from the policy."""
    out = reference_copy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out


def tree_dpo(model, ref, trees, cfg, packing, capacity=10**6):
    normalizer = preference_normalizer(trees)
    sums, total = {}, 0.0
    for mb in pair_microbatches(trees, packing, capacity):
        loss, metrics = compute_preference_loss(model, pack(mb), cfg, normalizer, ref, packing=packing)
        loss.backward()
        total += loss.detach()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    return total, summarize_preference(sums)


def grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# ---- DPO ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dpo_matches_per_path_reference(name):
    """Tree packing (capacity 12 splits the longest pair trees into one-path parts) and the per-path
    baseline (``packing="sequence"``) both equal the reference: loss and every gradient."""
    cfg = CONFIGS[name]
    with float64_casts():
        model = tiny_model("qwen3")
        base = reference_copy(model)
        ref = perturbed(model)
        want = baseline_dpo(base, ref, PAIRS, cfg)
        want.backward()
        want_g = grads(base)
        trees = [pair_tree(*p) for p in PAIRS]
        for packing in ("tree", "sequence"):
            got, metrics = tree_dpo(model, ref, trees, cfg, packing, capacity=12)
            got_g = grads(model)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item()), packing
            assert grad_err(got_g, want_g) <= TOL, packing
            assert metrics["num_pairs"] == len(PAIRS)


def test_dpo_first_loss_is_ln2_and_metrics():
    """Policy == reference: every pair's d is 0, so the loss is ln 2 for sigmoid, and the rewards 0.
    Identical chosen/rejected stay defined (no NaN) and get zero gradient."""
    with float64_casts():
        model = tiny_model("qwen3")
        ref = reference_copy(model)
        trees = [pair_tree(*p) for p in PAIRS]
        loss, metrics = tree_dpo(model, ref, trees, PreferenceObjective("dpo"), "tree")
    assert loss.item() == pytest.approx(math.log(2), rel=1e-12)
    assert metrics["rewards/chosen"] == 0 and metrics["rewards/margins"] == 0
    assert metrics["rewards/accuracies"] == 0  # TRL counts chosen > rejected strictly
    with float64_casts():
        model = tiny_model("qwen3")
        ref = perturbed(model)
        same = [pair_tree([1, 2, 3], [4, 5], [4, 5])]
        loss, metrics = tree_dpo(model, ref, same, PreferenceObjective("dpo", "ipo"), "tree")
        g = grads(model)
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx((1 / (2 * 0.1)) ** 2)
    assert max(v.abs().max().item() for v in g.values()) < 1e-12


def test_dpo_metrics_by_hand():
    """rewards/* from per-path sums spelled out: two pairs, beta 0.5."""
    from treetrain.objectives.preference.loss import dpo_loss
    from treetrain.objectives.preference.pairs import PairLayout

    logps = torch.tensor([-1.0, -3.0, -2.0, -1.5], dtype=torch.float64)
    ref = torch.tensor([-2.0, -2.0, -2.0, -2.0], dtype=torch.float64)
    pairs = PairLayout(torch.tensor([0, 2]), torch.tensor([1, 3]), torch.zeros(2, dtype=torch.float64))
    cfg = PreferenceObjective("dpo", beta=0.5)
    loss, m = dpo_loss(logps, ref, torch.ones(4, dtype=torch.float64), pairs, cfg, 2.0)
    # pair 0: d = 1 - (-1) = 2; pair 1: d = 0 - 0.5 = -0.5
    x = torch.tensor([1.0, -0.25], dtype=torch.float64)  # beta * d
    want = -F.logsigmoid(x).sum().item() / 2
    assert loss.item() == pytest.approx(want, rel=1e-12)
    s = summarize_preference(m)
    assert s["rewards/chosen"] == pytest.approx((0.5 * 1 + 0.5 * 0) / 2)
    assert s["rewards/rejected"] == pytest.approx((0.5 * -1 + 0.5 * 0.5) / 2)
    assert s["rewards/accuracies"] == 0.5
    assert s["rewards/margins"] == pytest.approx((1.0 - 0.25) / 2)


@st.composite
def pair_lists(draw):
    tok = st.integers(0, 15)
    prompt = draw(st.lists(tok, min_size=1, max_size=10))
    out = []
    for _ in range(draw(st.integers(1, 3))):
        chosen = draw(st.lists(tok, min_size=1, max_size=5))
        kind = draw(st.sampled_from(["random", "prefix", "same", "extends"]))
        rejected = {
            "random": draw(st.lists(tok, min_size=1, max_size=5)),
            "prefix": chosen[: draw(st.integers(1, len(chosen)))],
            "same": list(chosen),
            "extends": chosen + draw(st.lists(tok, min_size=1, max_size=3)),
        }[kind]
        p = prompt if draw(st.booleans()) else draw(st.lists(tok, min_size=1, max_size=6))
        out.append((p, chosen, rejected))
    return out


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(pairs=pair_lists(), name=st.sampled_from(list(CONFIGS)), capacity=st.sampled_from([8, 10**6]))
def test_dpo_random_pairs(pairs, name, capacity):
    cfg = CONFIGS[name]
    with float64_casts():
        model = tiny_model("llama", vocab=16)
        base = reference_copy(model)
        ref = perturbed(model)
        want = baseline_dpo(base, ref, pairs, cfg)
        want.backward()
        want_g = grads(base)
        got, _ = tree_dpo(model, ref, [pair_tree(*p) for p in pairs], cfg, "tree", capacity)
        got_g = grads(model)
    assert abs(got.item() - want.item()) <= TOL * max(1.0, abs(want.item()))
    assert grad_err(got_g, want_g) <= TOL


# ---- reward model ---------------------------------------------------------------------------------


def tiny_reward_model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config("qwen3", num_labels=1)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(3.0)
    return model


def hf_score(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, 0]


@pytest.mark.parametrize("packing", ["tree", "sequence"])
def test_reward_matches_per_path_reference(packing):
    margins = [0.5, None, 0.0, 1.0, -0.25]
    cfg = PreferenceObjective("reward", center_rewards_coefficient=0.01)
    with float64_casts():
        model = tiny_reward_model()
        base = reference_copy(model)
        want = 0.0
        for (prompt, chosen, rejected), m in zip(PAIRS, margins):
            s_c, s_r = hf_score(base, prompt + chosen), hf_score(base, prompt + rejected)
            want = want - F.logsigmoid(s_c - s_r - (m or 0.0)) + 0.01 * (s_c + s_r) ** 2
        want = want / len(PAIRS)
        want.backward()
        want_g = grads(base)
        trees = [pair_tree(*p, margin=m) for p, m in zip(PAIRS, margins)]
        got, metrics = tree_dpo(model, None, trees, cfg, packing)
        got_g = grads(model)
    assert abs(got.item() - want.item()) <= TOL * abs(want.item())
    assert grad_err(got_g, want_g) <= TOL
    assert 0 <= metrics["accuracy"] <= 1


def test_reward_model_reloads_with_auto_class(tmp_path):
    """What training saves loads with AutoModelForSequenceClassification and scores like the tree."""
    from treetrain.models.hf import prepare_model
    from treetrain.objectives.path_outputs import path_last_hidden
    from treetrain.objectives.preference.loss import reward_head
    from treetrain.train.checkpoint import export_pretrained

    model = prepare_model(tiny_reward_model().float())
    tree = pair_tree(*PAIRS[0])
    with torch.no_grad():
        tree_scores = reward_head(model)(path_last_hidden(model, pack(tree)))[:, 0]
    export_pretrained(model, tmp_path / "rm")
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert loaded.config.num_labels == 1
    with torch.no_grad():
        for i in range(2):
            got = hf_score(loaded, tree.path(i).tolist())
            assert abs(got.item() - tree_scores[i].item()) <= 1e-5 * max(1.0, abs(got.item()))


# ---- data ---------------------------------------------------------------------------------------


def test_pair_tree_layout():
    tree = pair_tree([1, 2, 3], [4, 5], [4], margin=0.5)
    assert [p.tolist() for p in tree.paths()] == [[1, 2, 3, 4, 5], [1, 2, 3, 4]]
    assert [m.tolist() for m in tree.fields["loss_masks"]] == [[0, 0, 0, 1, 1], [0, 0, 0, 1]]
    assert tree.num_tokens == 5  # the rejected response is a prefix of the chosen one
    pairs = pair_layout(tree)
    assert pairs.chosen.tolist() == [0] and pairs.rejected.tolist() == [1] and pairs.margin.tolist() == [0.5]
    parts = pair_microbatches([tree, tree], "sequence", 100)
    assert len(parts) == 1 and [t.path_ids.tolist() for t in parts[0]] == [[0], [1], [0], [1]]
    assert pair_layout(parts[0]).chosen.tolist() == [0, 2]
    with pytest.raises(ValueError, match="preference pairs"):
        pair_layout(TrajectoryTree.from_paths([[1, 2], [1, 3]]))


def test_pairs_sharing_a_prompt_merge_into_one_tree():
    """Two pairs on one prompt (tree packing): one tree, the prompt once, pairs in order."""
    a, b = pair_tree([1, 2], [3], [4], margin=0.5), pair_tree([1, 2], [5], [6], margin=1.0)
    (mb,) = pair_microbatches([a, b], "tree", 100)
    (merged,) = mb
    assert merged.num_tokens == 6 and merged.num_path_tokens == 12
    assert [p.tolist() for p in merged.paths()] == [[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 6]]
    pairs = pair_layout(merged)
    assert pairs.chosen.tolist() == [0, 2] and pairs.margin.tolist() == [0.5, 1.0]
    # over capacity: each pair tree stays its own micro-batch
    assert [len(m) for m in pair_microbatches([a, b], "tree", 4)] == [1, 1]


@pytest.mark.parametrize(
    "record, field, reason",
    [
        ({"prompt_ids": [1, 2]}, "chosen_ids", "missing"),
        ({"prompt_ids": [1], "chosen_ids": [2]}, "rejected_ids", "missing"),
        ({"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [2]}, "chosen_ids", "empty response"),
        ({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "margin": "big"}, "margin", "number"),
        ({"prompt_ids": [1], "chosen_ids": [2], "rejected": []}, "rejected", "mixes"),
        ({"chosen_ids": [2], "rejected_ids": [3], "extra": 1}, "extra", "unknown key"),
        (
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": "hello", "rejected": "no"},
            "chosen",
            "plain",
        ),
    ],
)
def test_bad_records_name_file_line_field(tmp_path, record, field, reason):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        list(iter_trees(path))
    assert e.value.line == 2 and e.value.field[0] == field and reason in e.value.reason
    assert f'{path}:2: field "{field}"' in str(e.value)


def test_conversational_pairs_render_with_the_chat_template():
    tok = pytest.importorskip("treetrain.data.chat").load_tokenizer("qwen")
    rec = {
        "prompt": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Let me think."},
            {"role": "user", "content": "Answer."},
        ],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    tree, fmt = parse_record(rec, tokenizer=tok)
    assert fmt == "preference" and tree.num_paths == 2
    from treetrain.data.chat import render_chat

    for i, key in enumerate(("chosen", "rejected")):
        full = render_chat(tok, [*rec["prompt"], *rec[key]])
        assert tree.path(i).tolist() == list(full.ids)
        mask = tree.fields["loss_masks"][i]
        trained = tok.decode(tree.path(i)[mask > 0].tolist())
        assert trained.startswith(rec[key][0]["content"]) and "Let me think" not in trained
    # the prompt is shared: the tree holds it once
    assert tree.num_tokens < tree.num_path_tokens - len(render_chat(tok, rec["prompt"]).ids) + 8
