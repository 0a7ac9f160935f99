"""Checkpoints: exact resume (model, optimizer, schedule, data position, RNG), keep-last-K, the
``latest`` pointer, crash safety (SIGKILL in the middle of a save), and the final HF export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from treetrain import path_logprobs
from treetrain.train.checkpoint import (
    CheckpointError,
    export_pretrained,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from treetrain.train.checkpoint_files import FAULT_ENV

from .reference import tiny_model

ROOT = Path(__file__).resolve().parents[1]
PATHS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 7, 8, 9, 10, 11]]


def build(seed: int = 0, **over):
    model = tiny_model("qwen3", dtype=torch.float32, seed=seed, **over)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def step(model, opt, sched) -> float:
    """One step whose data depends on the RNG (dropout-like noise), so RNG restore is checked."""
    noise = torch.rand(())
    loss = -sum(lp.sum() for lp in path_logprobs(model, PATHS)) * (1 + 0.1 * noise)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.item()


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_resumes_exactly(tmp_path, tied):
    model, opt, sched = build(tie_word_embeddings=tied)
    torch.manual_seed(7)
    for _ in range(2):
        step(model, opt, sched)
    ck = save_checkpoint(tmp_path, 2, model, opt, sched, {"trees_consumed": 6, "epoch": 0})
    assert ck == tmp_path / "checkpoints" / "step_2"
    expected = [step(model, opt, sched) for _ in range(2)]
    final = weights(model)

    model2, opt2, sched2 = build(seed=3, tie_word_embeddings=tied)  # other init: all from the checkpoint
    torch.manual_seed(99)  # other RNG: restored from the checkpoint
    assert load_checkpoint(tmp_path, model2, opt2, sched2) == (2, {"trees_consumed": 6, "epoch": 0})
    assert sched2.last_epoch == 2 and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    assert [step(model2, opt2, sched2) for _ in range(2)] == expected
    assert all(torch.equal(final[k], v) for k, v in weights(model2).items())


def test_load_accepts_run_checkpoints_or_step_dir(tmp_path):
    model, opt, sched = build()
    save_checkpoint(tmp_path / "checkpoints", 1, model, opt, sched, {})  # the checkpoints dir itself
    for where in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "step_1"):
        assert load_checkpoint(where, *build(seed=1))[0] == 1
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "elsewhere", model, opt, sched)
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_keep_last_k_and_latest_pointer(tmp_path):
    model, opt, sched = build()
    for s in (1, 2, 3, 4):
        save_checkpoint(tmp_path, s, model, opt, sched, {"s": s}, keep=2)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3", "step_4"]
    assert (root / "latest").read_text().strip() == "step_4"
    assert latest_checkpoint(tmp_path) == root / "step_4"
    # a stale pointer (or none) falls back to the newest complete checkpoint; debris is ignored
    (root / "latest").write_text("step_9\n")
    (root / "step_7.tmp").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step_4"
    (root / "latest").unlink()
    assert latest_checkpoint(tmp_path) == root / "step_4"
    # re-saving an existing step replaces it; the next save clears the debris
    save_checkpoint(tmp_path, 4, model, opt, sched, {"s": "again"}, keep=2)
    assert verify_checkpoint(root / "step_4")["data_state"] == {"s": "again"}
    assert not (root / "step_7.tmp").exists()


def test_verify_detects_truncation(tmp_path):
    model, opt, sched = build()
    ck = save_checkpoint(tmp_path, 1, model, opt, sched, {})
    meta = verify_checkpoint(ck)
    assert meta["step"] == 1 and meta["world_size"] == 1 and "state/.metadata" in meta["files"]
    shard = next((ck / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="bytes, expected"):
        verify_checkpoint(ck)
    with pytest.raises(CheckpointError):
        load_checkpoint(ck, model, opt, sched)


def test_data_state_must_be_json(tmp_path):
    model, opt, sched = build()
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 1, model, opt, sched, {"bad": object()})
    assert latest_checkpoint(tmp_path) is None


def test_export_pretrained_loads_with_transformers(tmp_path):
    import transformers

    model, opt, sched = build()
    step(model, opt, sched)
    out = export_pretrained(model, tmp_path / "final")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config._attn_implementation == "sdpa"
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


# ---- crash safety: SIGKILL in the middle of a save ----------------------------------------------

CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from treetrain.train.checkpoint import save_checkpoint
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    def step():
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step(); opt.zero_grad(); sched.step()
    run = sys.argv[1]
    step()
    save_checkpoint(run, 1, model, opt, sched, {"trees_consumed": 1})
    torch.save(model.state_dict(), run + "/weights_1.pt")
    step()
    save_checkpoint(run, 2, model, opt, sched, {"trees_consumed": 2})  # killed in here
    print("not killed")
    """
)


def _load_into_fresh(ck: Path):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return load_checkpoint(ck, model, opt, sched), model


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["state_written", "before_rename", "before_latest"])
def test_sigkill_during_save_keeps_last_good_checkpoint(tmp_path, stage):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, FAULT_ENV: f"{stage}@2", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-2000:])
    root = tmp_path / "checkpoints"
    # The pointer still names step 1 and step 1 is whole; the interrupted save left only debris
    # (state_written / before_rename: step_2.tmp) or a complete step_2 not yet pointed to.
    assert (root / "latest").read_text().strip() == "step_1"
    assert latest_checkpoint(tmp_path) == root / "step_1"
    verify_checkpoint(root / "step_1")
    (step, data), model = _load_into_fresh(tmp_path)
    assert (step, data) == (1, {"trees_consumed": 1})
    saved = torch.load(tmp_path / "weights_1.pt")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    leftovers = sorted(p.name for p in root.iterdir())
    if stage == "before_latest":
        assert leftovers == ["latest", "step_1", "step_2"]
        verify_checkpoint(root / "step_2")
    else:
        assert leftovers == ["latest", "step_1", "step_2.tmp"]
        with pytest.raises(CheckpointError):
            load_checkpoint(root / "step_2.tmp", model, None, None)
