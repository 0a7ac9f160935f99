"""What a new user hit on a second trial (issue 35), through the ``treetrain`` command line where it
is command-line behaviour: the model directory's tokenizer, a final model that loads with its
tokenizer, re-runs without ``--output``, ``--keep-checkpoints``, the banner and step lines,
``--eval-data``, a summary whose figures say what they count, hints for unknown config keys and hub
ids, ``stats`` listing every bad record and showing text, and the example configs.

A test's first training run goes through the real ``treetrain`` command in a subprocess (``treetrain``
below); the other commands, which only need the command line's parsing, messages and exit status, run
in-process through :func:`treetrain.cli.main` (``cli`` below: the same argv, stdout, stderr and status,
without a second process's ~5 s of imports).

Models are tiny random-init configs (no download); every run is one to four steps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from treetrain.train.config import TrainConfig, load_config, merge, validate
from treetrain.train.loop import train

from .reference import tiny_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def treetrain(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treetrain", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=cwd,
    )


def cli(capsys, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``treetrain ARGV`` in-process (``main(argv)`` from ``cwd``): its status, stdout and stderr in
    the subprocess's form (argparse's own errors exit through SystemExit: its code is the status)."""
    from treetrain.cli import main

    capsys.readouterr()
    here = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["treetrain", *argv], rc, out, err)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A config-only model directory (random init from --seed): vocabulary 97, no tokenizer."""
    d = tmp_path_factory.mktemp("tiny")
    tiny_config("qwen3", vocab=97).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A model directory with weights and a tokenizer (the offline Qwen one, with its chat template)."""
    from treetrain.data.chat import load_tokenizer

    d = tmp_path_factory.mktemp("chat-model")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab=151936)).save_pretrained(d)
    load_tokenizer("qwen").save_pretrained(d)
    return d


CHAT = [
    {"messages": [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                  [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey there"}]]},
]  # fmt: skip


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


PATHS = [{"paths": [[1, 2, 3, 4], [1, 2, 5]], "rewards": [1.0, 0.0]},
         {"paths": [[6, 7, 8], [6, 7, 9, 10]], "rewards": [0.5, 0.25]}]  # fmt: skip


# ---- items 1 and 2: the model directory's tokenizer; a final model that loads with it -----------


def test_model_directory_tokenizer_is_used_and_saved_beside_the_final_model(chat_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    out = ok(cli(capsys, "stats", "--data", str(data), "--model", str(chat_model), "--show", "1"))
    assert re.search(r"^paths +2$", out, re.M) and '"<|im_start|>user\\nhi<|im_end|>' in out, out  # text
    run = tmp_path / "run"
    out = ok(treetrain("train", "--data", str(data), "--model", str(chat_model), "--steps", "1",
                       "--output", str(run), "--no-progress"))  # fmt: skip
    assert f"tokenizer  {chat_model} (the --model directory's)" in out
    final = run / "final"
    tok = transformers.AutoTokenizer.from_pretrained(final)
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    source = transformers.AutoTokenizer.from_pretrained(chat_model)
    chat = CHAT[0]["messages"][0]
    assert tok.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(chat, tokenize=False)
    ids = tok.apply_chat_template(chat, return_dict=True, return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 151936)


def test_lora_adapter_output_holds_the_tokenizer(chat_model, tmp_path):
    peft = pytest.importorskip("peft")
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    cfg = TrainConfig(data=str(data), model=str(chat_model), steps=1, lora_r=2, output=str(tmp_path / "run"),
                      progress=False, prefetch=0)  # fmt: skip
    final = train(cfg, quiet=True).final
    assert (final / "adapter_config.json").is_file() and (final / "tokenizer.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(final).chat_template
    base = transformers.AutoModelForCausalLM.from_pretrained(chat_model)
    peft.PeftModel.from_pretrained(base, final)


# ---- item 4 (and 7): re-running without --output; the banner and a line per step -----------------


def test_rerun_without_output_makes_a_new_run_directory(tiny, tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", PATHS)
    argv = ("train", "--data", str(data), "--model", str(tiny), "--steps", "2", "--no-progress")
    first = ok(treetrain(*argv, cwd=tmp_path))
    n = sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3")).parameters()
    )
    for row in (f"treetrain train: model      {tiny} (qwen3, config.json only: random init from --seed 0)",
                f"parameters {n:,} trainable of {n:,}", "data       ", "2 trees, 4 paths, 14 path tokens",
                "device     cpu, float32", "output     runs/train\n"):  # fmt: skip
        assert row in first, first  # the banner
    line = r"^step 1/2  loss \d+\.\d{4}  lr 0\.001  grad_norm \S+  path tokens/s \S+  reward_mean 0\.5$"
    assert re.search(line, first, re.M), first
    assert re.search(r"^step 2/2  loss .*  reward_mean 0\.375$", first, re.M), first
    before = {p: p.read_bytes() for p in (tmp_path / "runs" / "train").rglob("*") if p.is_file()}

    second = ok(cli(capsys, *argv, cwd=tmp_path))
    assert "output     runs/train-2\n" in second and "outputs in " in second and "runs/train-2/" in second
    assert {p: p.read_bytes() for p in (tmp_path / "runs" / "train").rglob("*") if p.is_file()} == before
    assert (tmp_path / "runs" / "train-2" / "final" / "model.safetensors").is_file()

    # --resume without --output continues the newest run (here: refused, it has no checkpoint)
    proc = cli(capsys, *argv, "--resume", cwd=tmp_path)
    refusal = "--output runs/train-2: --resume, but this finished run has no checkpoint"
    assert proc.returncode == 2 and refusal in proc.stderr, proc.stderr

    # an explicit --output holding a run without checkpoints: no --resume advised (it could not work)
    proc = cli(capsys, *argv, "--output", "runs/train", cwd=tmp_path)
    assert proc.returncode == 2 and "holds an earlier run" in proc.stderr, proc.stderr
    assert "--resume" not in proc.stderr and "no checkpoint to continue from" in proc.stderr


# ---- items 6 and 9: --keep-checkpoints; the summary of a resumed run --------------------------


def test_keep_checkpoints_and_the_summary_of_a_resumed_run(tiny, tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", PATHS)
    run = tmp_path / "run"
    argv = ("train", "--data", str(data), "--model", str(tiny), "--output", str(run), "--no-progress",
            "--checkpoint-every", "1")  # fmt: skip
    ok(treetrain(*argv, "--steps", "3", "--keep-checkpoints", "3"))
    names = lambda: sorted(p.name for p in (run / "checkpoints").iterdir())  # noqa: E731
    assert names() == ["latest", "step_1", "step_2", "step_3"]  # the default would keep 2
    out = ok(cli(capsys, *argv, "--steps", "4", "--keep-checkpoints", "1", "--resume"))
    assert names() == ["latest", "step_4"]
    loss = [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert re.search(r"steps +4  \(this run: step 4, [\d.]+ s wall; resumed after step 3\)", out), out
    assert f"loss                 {loss[0]:.4f} (step 1) -> {loss[3]:.4f} (step 4), whole run" in out
    assert f"{loss[3]:.4f} (step 4), this run" in out
    assert re.search(r"path tokens +\d+  what the per-path baseline computes \(step 4: ", out), out


# ---- item 9: DPO's computed tokens below the tree tokens -----------------------------------------


def test_dpo_summary_says_what_computed_tokens_count(tiny, tmp_path):
    prompt = list(range(1, 31))
    pairs = [{"prompt_ids": prompt, "chosen_ids": [40, 41], "rejected_ids": [42]},
             {"prompt_ids": prompt, "chosen_ids": [43], "rejected_ids": [44, 45]}]  # fmt: skip
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    argv = (
        "--data",
        str(data),
        "--model",
        str(tiny),
        "--objective",
        "dpo",
        "--steps",
        "1",
        "--batch-trees",
        "2",
    )
    out = ok(treetrain("train", *argv, "--output", str(tmp_path / "run"), "--no-progress"))
    # two records of 33 and 33 distinct tokens; one merged tree of 36 ran
    assert "tree tokens          66  distinct tokens of each record's tree" in out, out
    assert "computed tokens      36  what the micro-batches ran (71.4% of path tokens saved: fewer than " \
           "tree tokens, as records that share a prefix ran as one tree)" in out, out  # fmt: skip
    assert not re.search(r"ERR 1\d\d", out)


# ---- item 8: --eval-data -----------------------------------------------------------------------------


def test_eval_data_is_the_objectives_loss_on_held_out_trees(tiny, tmp_path):
    from treetrain.data.reader import iter_trees
    from treetrain.objectives.policy.aggregation import loss_normalizer
    from treetrain.objectives.policy.config import Objective
    from treetrain.objectives.policy.loss import compute_loss
    from treetrain.trees.packing import pack

    data = write_jsonl(tmp_path / "p.jsonl", PATHS)
    held = write_jsonl(tmp_path / "held.jsonl", [{"paths": [[3, 4, 5, 6], [3, 4, 7]], "rewards": [2.0, 0.0]}])
    run = tmp_path / "run"
    out = ok(treetrain("train", "--data", str(data), "--model", str(tiny), "--steps", "3", "--eval-data",
                       str(held), "--eval-every", "2", "--output", str(run), "--no-progress",
                       "--report-to", "tensorboard"))  # fmt: skip
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert ["eval/loss" in r for r in records] == [False, True, True]  # every 2 steps and the last
    assert records[2]["eval/reward_mean"] == 1.0 and records[2]["eval/reward_max"] == 2.0
    assert re.search(r"^step 3/3  .*  eval/loss \d+\.\d{4}  eval/reward_mean 1\.0000$", out, re.M), out
    # the same number from the final model, through the public API (float32: summation order only)
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
    trees = [tree for tree, _ in iter_trees(held)]
    objective = Objective(name="sft")
    with torch.no_grad():
        loss, _ = compute_loss(model, pack(trees), objective, loss_normalizer(trees, objective))
    assert float(loss) == pytest.approx(records[2]["eval/loss"], rel=1e-5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 3]


# ---- item 10: hints ------------------------------------------------------------------------------------


def test_unknown_config_keys_get_the_nearest_option(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-4\n")
    proc = treetrain("train", "--config", str(config))
    assert proc.returncode == 2 and "unknown option 'learning_rate' (did you mean 'lr'?)" in proc.stderr
    assert "known options" not in proc.stderr and len(proc.stderr) < 300, proc.stderr
    hint = r"unknown option 'kl_coef' \(an objective option: put it under loss, as loss: \{kl_coef: \.\.\.\}"
    with pytest.raises(ValueError, match=hint):
        merge(TrainConfig(), {"kl_coef": 0.1}, "--config run.yaml")
    with pytest.raises(ValueError, match=r"option 'wibble' \(treetrain train --help lists every option"):
        merge(TrainConfig(), {"wibble": 1}, "--config run.yaml")


def test_a_hub_id_says_nothing_is_downloaded_and_how_to_pass_a_local_copy(tmp_path, capsys):
    hint = ("'Qwen/Qwen3-0.6B' looks like a Hugging Face Hub id, but treetrain never downloads: fetch a "
            "local copy first (hf download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B) and pass --model "
            "Qwen3-0.6B")  # fmt: skip
    for command in ("train", "stats"):
        proc = cli(capsys, command, "--model", "Qwen/Qwen3-0.6B", cwd=tmp_path)
        assert proc.returncode == 2 and hint in proc.stderr, proc.stderr


def test_stats_lists_every_bad_record_as_train_does(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"paths": [[1, 2, 3]], "loss_masks": [[0, 1]]}\n{"paths": [[1, 2]]}\n'
                   '{"paths": [[1, 2]], "advantage": [1.0]}\n')  # fmt: skip
    proc = treetrain("stats", "--data", str(bad))
    assert proc.returncode == 2 and "2 of 3 records are invalid" in proc.stderr, proc.stderr
    assert f'{bad}:1: field "loss_masks"[0]' in proc.stderr and f'{bad}:3: field "advantage"' in proc.stderr


# ---- item 5: the data guide's tool-call conversation and what stats --show prints for it ----------


def _marked_block(text: str, marker: str) -> str:
    m = re.search(rf"<!-- {marker} -->\n```\w+\n(.*?)\n```", text, re.S)
    assert m, marker
    return m.group(1)


def test_data_guide_tool_call_example_is_the_shipped_file_and_its_stats_output():
    guide = (ROOT / "docs" / "guides" / "data.md").read_text()
    record = json.loads(_marked_block(guide, "tool-call-record"))
    assert record == json.loads((ROOT / "examples" / "data" / "tool_calls.jsonl").read_text())
    first, second = record["messages"]
    assert len(first[2]["tool_calls"]) == 2 and [m["role"] for m in first[3:5]] == ["tool", "tool"]
    argv = (
        "--data",
        "examples/data/tool_calls.jsonl",
        "--tokenizer",
        "qwen",
        "--show",
        "1",
        "--show-chars",
        "0",
    )
    out = ok(treetrain("stats", *argv, cwd=ROOT))
    assert out.rstrip("\n") == _marked_block(guide, "tool-call-stats")


# ---- item 10: the example configs ------------------------------------------------------------------


CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def test_example_configs_cover_the_main_runs():
    assert {p.stem for p in CONFIGS} >= {"sft", "grpo", "dpo", "lora", "distributed"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_example_config_parses_and_names_existing_files(path):
    cfg = validate(merge(TrainConfig(), load_config(path), f"--config {path}"))
    for name in ("data", "eval_data"):
        if getattr(cfg, name) is not None:
            assert (ROOT / getattr(cfg, name)).is_file(), (path, name)


@pytest.mark.parametrize("name", ["grpo", "dpo"])
def test_example_config_runs_a_step(name, tmp_path, monkeypatch):
    """The two whose data is small (the bundled sample's trees make a step of the others slower)."""
    monkeypatch.chdir(ROOT)  # the configs name data files relative to the repository root
    path = ROOT / "examples" / "configs" / f"{name}.yaml"
    values = load_config(path) | {"steps": 1, "output": str(tmp_path / "run"), "progress": False}
    result = train(merge(TrainConfig(), values, str(path)), quiet=True)
    assert len(result.records) == 1 and (result.final / "tokenizer.json").is_file()
