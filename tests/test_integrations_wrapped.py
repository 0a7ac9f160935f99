"""Tree scoring requested through the model's wrappers: under DistributedDataParallel (2 real
processes, gloo) the gradients are all-reduced, i.e. each rank ends with the mean of the ranks'
single-process gradients; outside any wrapper the request gives flat_logprobs' result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from treetrain.integrations.flat import flat_logprobs
from treetrain.integrations.wrapped import install_tree_scoring, wrapped_flat_logprobs

from . import ddp_flat_worker as W
from .reference import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def single_process_grads(rank: int) -> dict[str, torch.Tensor]:
    model = tiny_model("qwen3")
    ids, mask = W.batch(rank)
    W.loss(flat_logprobs(model, ids, mask, logits_to_keep=3, backend="dense"), rank).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_unwrapped_request_equals_flat_logprobs():
    model = tiny_model("qwen3")
    install_tree_scoring(model)
    ids, mask = W.batch(0)
    lp, ent = wrapped_flat_logprobs(model, ids, mask, logits_to_keep=3, return_entropy=True, backend="dense")
    ref, ref_ent = flat_logprobs(model, ids, mask, logits_to_keep=3, return_entropy=True, backend="dense")
    assert torch.equal(lp, ref) and torch.equal(ent, ref_ent)
    assert model(input_ids=ids).logits.shape == (3, 5, 97)  # without a request: the ordinary forward


def test_ddp_gradients_are_synchronized(tmp_path):
    out = tmp_path / "grads"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "ddp_flat_worker.py"), str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    alone = [single_process_grads(r) for r in (0, 1)]
    for name, g0 in ranks[0].items():
        want = (alone[0][name] + alone[1][name]) / 2  # DDP averages over ranks
        assert torch.allclose(g0, ranks[1][name], rtol=0, atol=0), name  # identical on both ranks
        assert torch.allclose(g0, want, rtol=1e-10, atol=1e-12), name
    assert not torch.allclose(alone[0]["lm_head.weight"], alone[1]["lm_head.weight"])  # ranks differ
