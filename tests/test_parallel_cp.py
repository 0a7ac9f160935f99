"""Context parallelism (``treetrain.parallel.cp``): 2 and 4 gloo processes vs one process, float64.

Every rank runs its chunk; log-probs and entropies of every tree token, the SFT loss of
``compute_loss`` and every parameter gradient (summed over ranks) must equal the 1-process run,
for a dense model (Qwen3), a Gated DeltaNet hybrid (Qwen3.5: recurrent state and conv window
cross rank boundaries) and a KDA hybrid (Kimi Linear, latent attention and MoE). Float64
everywhere (``float64_everywhere``: HF's internal float32 casts off): only the summation order
differs (gradient sums over ranks), hence 1e-10 relative.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_worker import make_trees
from tests.hybrid_models import float64_everywhere, tiny_hybrid_model
from tests.reference import tiny_model
from tests.zoo import zoo_model
from treetrain import pack
from treetrain.logprobs import tree_logprobs
from treetrain.parallel.cp import CPChunk, context_parallel, cp_tree_logprobs, split_balanced

RTOL = 1e-10


def test_split_balanced_worked_example():
    pos = torch.tensor([0, 1, 2, 3, 2, 3, 1, 2])  # pairs 1 2 3 4 | 3 4 2 3: 10 and 12
    assert split_balanced(pos, 2) == [0, 4, 8]
    assert split_balanced(pos, 8) == list(range(9))
    with pytest.raises(ValueError, match="cannot be split"):
        split_balanced(pos, 9)


def test_split_balances_pairs_not_tokens():
    pos = torch.arange(100)  # one long path: the late tokens attend many more keys
    b = split_balanced(pos, 2)
    assert 65 < b[1] < 75  # pairs split near 100 / sqrt(2), not at 50 tokens
    pairs = (pos + 1).double()
    left, right = float(pairs[: b[1]].sum()), float(pairs[b[1] :].sum())
    assert abs(left - right) <= 100


def test_chunk_owner():
    c = CPChunk(None, 1, (0, 3, 5, 9))
    assert c.owner(torch.tensor([0, 2, 3, 4, 5, 8])).tolist() == [0, 0, 1, 1, 2, 2]
    assert (c.start, c.end) == (3, 5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loss(logp, ent, w1, w2):
    return (logp * w1).sum() + (ent * w2).sum()


def _model(arch: str):
    # KDA layers (kimi_linear), a Mamba2 hybrid (nemotron_h): state and conv window cross ranks
    if arch in ("kimi_linear", "nemotron_h"):
        return zoo_model(arch)
    return tiny_model(arch) if arch == "qwen3" else tiny_hybrid_model(arch)


def _worker(rank: int, world: int, port: int, out: str, arch: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from treetrain.objectives.policy import compute_loss, loss_normalizer
        from treetrain.objectives.policy_config import Objective

        model = _model(arch)
        trees = make_trees(3, seed=1)
        packed = pack(trees)
        g = torch.Generator().manual_seed(0)
        w1 = torch.randn(packed.num_tokens, generator=g, dtype=torch.float64)
        w2 = torch.randn(packed.num_tokens, generator=g, dtype=torch.float64)
        with float64_everywhere():
            logp, ent = cp_tree_logprobs(model, packed)
            _loss(logp, ent, w1, w2).backward()
            obj = Objective(name="sft")
            with context_parallel():
                sft, _ = compute_loss(model, packed, obj, loss_normalizer(trees, obj))
            sft.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for t in grads.values():
            dist.all_reduce(t)
        if rank == 0:
            torch.save({"logp": logp.detach(), "ent": ent.detach(), "sft": sft.detach(), "grads": grads}, out)
    finally:
        dist.destroy_process_group()


def _one_process(arch: str):
    from treetrain.objectives.policy import compute_loss, loss_normalizer
    from treetrain.objectives.policy_config import Objective

    model = _model(arch)
    trees = make_trees(3, seed=1)
    packed = pack(trees)
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(packed.num_tokens, generator=g, dtype=torch.float64)
    w2 = torch.randn(packed.num_tokens, generator=g, dtype=torch.float64)
    with float64_everywhere():
        logp, ent = tree_logprobs(model, packed, backend="dense")
        _loss(logp, ent, w1, w2).backward()
        obj = Objective(name="sft")
        sft, _ = compute_loss(model, packed, obj, loss_normalizer(trees, obj), backend="dense")
        sft.backward()
    return logp.detach(), ent.detach(), sft.detach(), {n: p.grad for n, p in model.named_parameters()}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() <= RTOL * b.abs().max().clamp_min(1e-30)).all())


@pytest.mark.parametrize(
    "world, arch",
    [
        (2, "qwen3"),
        # 4 ranks on the hybrid: its attention layers exercise the dense CP path as well (a 4-rank
        # dense qwen3 case passed too; left out to keep CI short, as tests/test_parallel_cp_train.py
        # trains dense on 4 CP ranks)
        pytest.param(4, "qwen3_5", marks=pytest.mark.slow),
        pytest.param(2, "kimi_linear", marks=pytest.mark.slow),
        pytest.param(2, "nemotron_h", marks=pytest.mark.slow),
    ],
)
def test_cp_equals_one_process(tmp_path, world, arch):
    out = str(tmp_path / "cp.pt")
    mp.spawn(_worker, args=(world, _free_port(), out, arch), nprocs=world, join=True)
    got = torch.load(out)
    logp, ent, sft, grads = _one_process(arch)
    assert _close(got["logp"], logp) and _close(got["ent"], ent)
    assert torch.allclose(got["sft"], sft, rtol=RTOL, atol=0)
    assert grads.keys() == got["grads"].keys()
    bad = [n for n in grads if not _close(got["grads"][n], grads[n])]
    assert not bad, bad


def test_cp_backend_outside_cp_is_a_clear_error():
    from treetrain.attention import get_backend
    from treetrain.attention.mask import TreeMask

    q = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="runs inside context parallelism only"):
        get_backend("cp")(q, q, q, TreeMask(torch.tensor([3, 3, 3])), 0.5)
