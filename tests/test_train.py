"""The training loop and ``treetrain train``: outputs, tree == sequence baseline, partition
invariance, config precedence and errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from treetrain.cli import build_parser, main
from treetrain.train.build import build_model, lr_factor
from treetrain.train.checkpoint import latest_checkpoint
from treetrain.train.config import TrainConfig, config_from_args, validate
from treetrain.train.loop import train
from treetrain.train.outputs import METRIC_FIELDS

from .reference import float64_casts, tiny_config

VOCAB = 97


def write_trees(path, n_trees: int = 6, seed: int = 0):
    """Paths-format JSONL: per-turn chains (each path extends the previous one, as per-turn
    samples of a dialogue do) and groups (several answers to one prompt), with loss masks."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n_trees):
            prompt = rng.integers(0, VOCAB, int(rng.integers(8, 16))).tolist()
            paths, masks = [], []
            if i % 2 == 0:  # per-turn chain: turn k's path is turn k-1's path plus user + reply
                prefix, mask = prompt, [0] * len(prompt)
                for _ in range(int(rng.integers(2, 4))):
                    user = rng.integers(0, VOCAB, 4).tolist()
                    reply = rng.integers(0, VOCAB, int(rng.integers(3, 7))).tolist()
                    prefix, mask = prefix + user + reply, mask + [0] * 4 + [1] * len(reply)
                    paths.append(prefix)
                    masks.append(mask)
            else:  # group: several sampled answers to one prompt
                for _ in range(int(rng.integers(3, 7))):
                    reply = rng.integers(0, VOCAB, int(rng.integers(6, 12))).tolist()
                    paths.append(prompt + reply)
                    masks.append([0] * len(prompt) + [1] * len(reply))
            f.write(json.dumps({"paths": paths, "loss_masks": masks}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    """A data file and a config-only model directory (random init from the seed)."""
    d = tmp_path_factory.mktemp("train")
    write_trees(d / "trees.jsonl")
    model_dir = d / "tiny"
    tiny_config("qwen3", vocab=VOCAB).save_pretrained(model_dir)
    return d


def run(setup_dir, tmp_path, **over):
    cfg = TrainConfig(
        data=str(setup_dir / "trees.jsonl"),
        model=str(setup_dir / "tiny"),
        output=str(tmp_path / "out"),
        steps=3,
        batch_trees=2,
        lr=1e-2,
        warmup_steps=1,
        progress=False,
        prefetch=0,
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return train(cfg, quiet=True)


def weights(model_dir) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ---- the default run, end to end ---------------------------------------------------------------


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path, capsys):
    """``treetrain train`` with the embedded defaults (tiny random Qwen3 with Qwen's 151,936-id
    vocabulary, bundled sample), cut to its first step (the first tree: the LM head over the full
    vocabulary dominates on CPU): metrics with every field, a plot, a final model that loads with
    plain transformers."""
    out = tmp_path / "run"
    rc = main(["train", "--output", str(out), "--steps", "1", "--plot", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "path tokens" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    for r in records:
        assert set(METRIC_FIELDS) <= r.keys()
        assert np.isfinite(r["loss"]) and r["tokens"] >= r["tree_tokens"] > 0 and r["tokens_per_s"] > 0
        # path tokens / s is the useful work (tokens_per_s keeps that meaning); computed tokens / s
        # what the step ran, so their ratio is path tokens / computed tokens
        assert r["tokens_per_s"] == r["path_tokens_per_s"]
        ratio = r["path_tokens_per_s"] / r["computed_tokens_per_s"]
        assert abs(ratio - r["tokens"] / r["computed_tokens"]) < 1e-9
    assert (out / "training.png").stat().st_size > 0
    assert list((out / "final").glob("*.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "qwen3"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_small_run_outputs_and_final_weights(setup_dir, tmp_path):
    """metrics.jsonl has every field each step; the final checkpoint holds the trained weights."""
    res = run(setup_dir, tmp_path, steps=2)
    lines = res.metrics.read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert set(METRIC_FIELDS) <= rec.keys()
    assert rec["por"] == pytest.approx(1 - rec["tree_tokens"] / rec["tokens"])
    assert rec["err"] == 1.0  # nothing partitioned: every shared token computed once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(res.final)
    init = build_model(str(setup_dir / "tiny"), seed=0, dtype=torch.float32, device=torch.device("cpu"))
    assert max_diff(weights(res.final), {k: v.double() for k, v in loaded.state_dict().items()}) == 0
    assert max_diff(weights(res.final), {k: v.double() for k, v in init.state_dict().items()}) > 0


# ---- tree == sequence baseline, and partition invariance ---------------------------------------


def _compare_runs(setup_dir, tmp_path, a: dict, b: dict):
    """float32 runs ``a`` and ``b`` and a float64 run of ``b``: per-step losses and final weights.

    Returns (loss diff a-b, loss diff b-truth, weight diff a-b, weight diff b-truth), max over steps
    and parameters. The float64 run (its models' float32 casts lifted) is the truth that measures
    how much float32 rounding alone moves run ``b``.
    """
    ra = run(setup_dir, tmp_path / "a", **a)
    rb = run(setup_dir, tmp_path / "b", **b)
    with float64_casts():
        truth = run(setup_dir, tmp_path / "t", dtype="float64", **b)
    la, lb, lt = ([r["loss"] for r in x.records] for x in (ra, rb, truth))
    wa, wb, wt = weights(ra.final), weights(rb.final), weights(truth.final)
    return (
        max(abs(x - y) for x, y in zip(la, lb)),
        max(abs(x - y) for x, y in zip(lb, lt)),
        max_diff(wa, wb),
        max_diff(wb, wt),
        ra,
        rb,
    )


def test_tree_equals_sequence_baseline(setup_dir, tmp_path):
    """Tree packing and the per-path baseline take the same optimizer steps.

    Both compute the same sums in different orders (tree attention over the packed tree vs each
    path alone through the model's own SDPA; a shared token's gradient summed inside one backward
    vs over its copies), so in float32 they may differ only by rounding. The yardstick is how far
    float32 rounding moves the baseline itself from the float64 truth, ``e``: two float32 runs each
    about ``e`` from the truth differ by up to about ``2e`` (triangle inequality), and 4x leaves
    a factor 2 for the tree's rounding being worse than the baseline's. AdamW's normalized update
    turns a rounding-sized difference in a near-zero gradient into a visible weight difference,
    which is why weights are compared this way rather than to a fixed epsilon. A floor of a few
    float32 ulps at the values' scale (losses ~5, weights ~0.1) covers steps where the baseline
    happens to land within an ulp of the truth. Measured: losses 4.8e-7 (e = 3.9e-7), weights
    1.4e-5 (e = 7.6e-6).
    """
    dl, dl_ref, dw, dw_ref, tree, seq = _compare_runs(
        setup_dir, tmp_path, {"packing": "tree"}, {"packing": "sequence"}
    )
    assert [r["tokens"] for r in tree.records] == [r["tokens"] for r in seq.records]
    assert all(r["tree_tokens"] < r["tokens"] for r in tree.records)  # the data does share prefixes
    assert all(r["computed_tokens"] == r["tokens"] for r in seq.records)
    print(f"losses {dl:.3g} (ref {dl_ref:.3g}), weights {dw:.3g} (ref {dw_ref:.3g})")
    assert dl <= 4 * dl_ref + 4e-6, (dl, dl_ref)
    assert dw <= 4 * dw_ref + 1e-7, (dw, dw_ref)


def test_partitioned_tree_equals_whole_tree(setup_dir, tmp_path):
    """A capacity smaller than the trees: parts of whole paths, gradient-accumulated under the
    step's global normalizer, give the same step as the whole trees (float32 rounding only)."""
    big, small = {"capacity": 4096}, {"capacity": 48}  # chains (<= 45 tokens) fit, groups do not
    dl, dl_ref, dw, dw_ref, parts, whole = _compare_runs(setup_dir, tmp_path, small, big)
    assert any(r["computed_tokens"] > r["tree_tokens"] for r in parts.records), "nothing was partitioned"
    assert any(r["micro_batches"] > 1 for r in parts.records)
    assert all(r["err"] == 1.0 for r in whole.records)
    print(f"losses {dl:.3g} (ref {dl_ref:.3g}), weights {dw:.3g} (ref {dw_ref:.3g})")
    assert dl <= 4 * dl_ref + 4e-6, (dl, dl_ref)
    assert dw <= 4 * dw_ref + 1e-7, (dw, dw_ref)


def test_activation_checkpointing_same_step(setup_dir, tmp_path):
    """HF gradient checkpointing through the tree forward: recomputation gives the same step."""
    plain = run(setup_dir, tmp_path / "plain", steps=2)
    ckpt = run(setup_dir, tmp_path / "ckpt", steps=2, activation_checkpointing=True)
    assert [r["loss"] for r in plain.records] == pytest.approx([r["loss"] for r in ckpt.records], rel=1e-6)
    assert max_diff(weights(plain.final), weights(ckpt.final)) < 1e-6


def test_resume_continues_the_same_run(setup_dir, tmp_path):
    """A 4-step run checkpointed at step 2, resumed from there: steps 3-4 and the final weights
    come out the same (data position, optimizer, schedule restored); metrics.jsonl keeps steps
    1-2 and gets 3-4 rewritten."""
    out = tmp_path / "run"
    full = run(setup_dir, tmp_path, steps=4, checkpoint_every=2, output=str(out))
    full_weights = weights(full.final)
    ckpts = out / "checkpoints"
    assert latest_checkpoint(out) == ckpts / "step_4"  # the final step is checkpointed too
    shutil.rmtree(ckpts / "step_4")  # as if the run had been killed after its step-2 checkpoint
    (ckpts / "latest").write_text("step_2\n")
    resumed = run(setup_dir, tmp_path, steps=4, resume=True, output=str(out))
    assert [r["step"] for r in resumed.records] == [3, 4]
    want = [r["loss"] for r in full.records[2:]]
    assert [r["loss"] for r in resumed.records] == pytest.approx(want, rel=1e-6)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert max_diff(full_weights, weights(resumed.final)) < 1e-6


def test_epochs_count_steps(setup_dir, tmp_path):
    res = run(setup_dir, tmp_path, steps=None, epochs=1.5, batch_trees=4)  # 6 trees: 9 -> 3 steps
    assert len(res.records) == 3 and [r["trees"] for r in res.records] == [4, 4, 1]


# ---- configuration -----------------------------------------------------------------------------


def parse(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_yaml_then_flags_then_set(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "lr: 3.0e-4\nbatch_trees: 8\nsteps: 50\nschedule: linear\nloss: {agg_mode: seq-mean-token-mean}\n"
        "betas: [0.8, 0.9]\n"
    )
    cfg = parse(["--config", str(yaml_file)])
    assert (cfg.lr, cfg.batch_trees, cfg.steps, cfg.schedule) == (3e-4, 8, 50, "linear")
    assert cfg.betas == (0.8, 0.9) and cfg.loss == {"agg_mode": "seq-mean-token-mean"}
    assert cfg.capacity == TrainConfig().capacity  # untouched: the embedded default

    cfg = parse(["--config", str(yaml_file), "--lr", "1e-3", "--epochs", "2", "--set", "loss.kl_coef=0.1"])
    assert cfg.lr == 1e-3 and cfg.batch_trees == 8  # the flag wins, the rest stays from YAML
    assert cfg.epochs == 2 and cfg.steps is None  # --epochs replaces the YAML's steps
    assert cfg.loss == {"agg_mode": "seq-mean-token-mean", "kl_coef": 0.1}  # merged key by key

    cfg = parse(["--config", str(yaml_file), "--lr", "1e-3", "--set", "lr=5e-5", "--no-progress"])
    assert cfg.lr == 5e-5 and cfg.progress is False  # --set is applied last


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--packing", "trees"], "--packing: expected one of tree, sequence"),
        (["--capacity", "0"], "--capacity: must be a positive"),
        (["--batch-trees", "-1"], "--batch-trees: must be a positive"),
        (["--schedule", "step"], "--schedule: expected one of cosine, linear, constant"),
        (["--dtype", "fp16"], "--dtype: expected one of"),
        (["--betas", "0.9", "1.5"], r"--betas: each must be in \[0, 1\)"),
        (["--steps", "5", "--warmup-steps", "5"], "--warmup-steps: 5 warmup steps"),
        (["--set", "lrr=1"], "unknown option 'lrr' \\(did you mean 'lr'\\?\\)"),
        (["--set", "lr"], "--set 'lr': expected KEY=VALUE"),
        (["--config", "/nonexistent.yaml"], "--config: no such file"),
        (["--device", "tpu"], "--device: expected auto, cpu, cuda"),
    ],
)
def test_bad_values_name_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(argv)


def test_bad_yaml_key_and_type(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("capacity: many\n")
    with pytest.raises(ValueError, match="--capacity: expected an integer, got 'many'"):
        parse(["--config", str(f)])
    f.write_text("lerning_rate: 1\n")
    with pytest.raises(ValueError, match=r"unknown option 'lerning_rate'"):
        parse(["--config", str(f)])
    f.write_text("steps: 3\nepochs: 1\n")  # one source setting both is ambiguous
    with pytest.raises(ValueError, match="--steps and --epochs both set the length"):
        parse(["--config", str(f)])


def test_runtime_errors_are_clear(setup_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--model .*no config.json"):
        run(setup_dir, tmp_path, model=str(tmp_path))
    with pytest.raises(ValueError, match="--data .*no such file"):
        run(setup_dir, tmp_path, data=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="loss: unknown option clip; valid loss options: agg_mode, "):
        run(setup_dir, tmp_path, loss={"clip": 0.2})
    assert main(["train", "--capacity", "0"]) == 2  # the CLI prints one line, no traceback
    assert "treetrain train: error: --capacity" in capsys.readouterr().err


def test_lr_schedule():
    f = [lr_factor(s, warmup=2, total=10, schedule="cosine", min_ratio=0.1) for s in range(11)]
    assert f[0] == pytest.approx(1 / 3) and f[1] == pytest.approx(2 / 3) and f[2] == 1.0
    assert all(a > b for a, b in zip(f[2:], f[3:10])) and f[9] > 0.1 and f[10] == pytest.approx(0.1)
    lin = [lr_factor(s, 0, 5, "linear") for s in range(5)]
    assert lin == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])  # every step trains; 0 after the last
    assert {lr_factor(s, 0, 5, "constant") for s in range(5)} == {1.0}


def test_validate_is_idempotent():
    cfg = validate(TrainConfig(betas="0.9, 0.99", grad_clip=0))
    assert cfg.betas == (0.9, 0.99) and cfg.grad_clip is None
    assert validate(cfg) == cfg
