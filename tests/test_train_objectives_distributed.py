"""Every objective under ``torchrun`` (FSDP2, 2 processes, gloo on CPU) equals one process:
``dpo`` (sigmoid, ipo, simpo; tree and sequence packing), ``reward`` and ``ppo_critic`` (policy and
critic both sharded). A distributed DPO and PPO-critic run resume exactly from a checkpoint (on 2
ranks; the PPO-critic one also resharded onto 1 process); DPO with ``--cp 2`` equals one process,
and ``reward`` and ``ppo_critic`` refuse ``--cp`` with the reason.

Data: windows of the bundled sample (``agent-dialogues``) around its real branch points, ids
renumbered densely (a bijection on the ids used, so every shared prefix and branch stays as it
is) to fit a tiny vocabulary: preference pairs ``prompt = 24 tokens before two paths diverge``,
``chosen / rejected = the next 6 tokens of each``; PPO-critic trees = three paths of one sample
tree around their common branch point, with a reward per path. ``--capacity 40`` and 3 records a
step make ranks unequal (a rank runs an idle pass) and split the critic's 42-token trees into parts.

One launch runs all the objectives one after the other (tests/objectives_worker.py), so the
start-up of torch and of the process group is paid once per launch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from treetrain.train.config import TrainConfig
from treetrain.train.loop import train

from .reference import tiny_config
from .test_train_distributed import finish, launch, metrics

pytestmark = pytest.mark.slow

BEFORE, AFTER, STEPS = 24, 6, 3
RUNS = {  # name -> (data set, TrainConfig options)
    "dpo": ("pairs", {"objective": "dpo", "checkpoint_every": 2}),
    "ipo": ("pairs", {"objective": "dpo", "loss": {"loss_type": "ipo"}}),
    "simpo": ("pairs", {"objective": "dpo", "loss": {"loss_type": "simpo", "label_smoothing": 0.1}}),
    "dpo_seq": ("pairs", {"objective": "dpo", "packing": "sequence"}),
    "reward": ("pairs", {"objective": "reward"}),
    "ppo_critic": ("trees", {"objective": "ppo_critic", "checkpoint_every": 2, "loss": {"critic_lr": 5e-3}}),
    "dpo_cp": ("pairs", {"objective": "dpo"}),
}
# dpo_cp: 2 ranks share each tree (--cp 2, dp 1; --capacity is per rank), vs one process with the
# same per-tree budget
PER_RANKS = {"dpo_cp": {2: {"cp": 2}, 0: {"capacity": 80}}}
# what differs between 1 and 2 ranks by construction: timings, memory, the per-rank packing
LOCAL = {"tokens_per_s", "path_tokens_per_s", "computed_tokens_per_s", "peak_memory", "step_time_s"}
LOCAL |= {"micro_batches", "imbalance", "computed_tokens", "err"}


def _branch(x: np.ndarray, y: np.ndarray) -> int:
    m = min(len(x), len(y))
    diff = np.flatnonzero(x[:m] != y[:m])
    return int(diff[0]) if diff.size else m


def sample_records() -> tuple[list[dict], list[dict]]:
    """(preference pairs, PPO-critic trees) from the bundled sample's branch points, raw token ids."""
    from treetrain.data.reader import iter_trees, sample_path

    pairs, trees = [], []
    for tree, _ in iter_trees(sample_path("agent-dialogues")):
        paths = [np.asarray(tree.path(i)) for i in range(tree.num_paths)]
        for a in range(len(paths) - 2):
            x, y, z = paths[a : a + 3]
            b = _branch(x, y)
            if BEFORE <= b < min(len(x), len(y)):  # x and y really diverge at b
                pairs.append(
                    {
                        "prompt_ids": x[b - BEFORE : b].tolist(),
                        "chosen_ids": x[b : b + AFTER].tolist(),
                        "rejected_ids": y[b : b + AFTER].tolist(),
                        "margin": 0.1 * (len(pairs) % 3),
                    }
                )
            c = min(b, _branch(x, z), _branch(y, z))
            if BEFORE <= c < min(len(x), len(y), len(z)):
                window = [p[c - BEFORE : c + AFTER].tolist() for p in (x, y, z)]
                masks = [[0] * BEFORE + [1] * (len(p) - BEFORE) for p in window]
                rewards = [round(math.sin(len(trees) + i), 3) for i in range(3)]
                trees.append({"paths": window, "loss_masks": masks, "rewards": rewards})
    return pairs, trees


TOKENS = ("prompt_ids", "chosen_ids", "rejected_ids", "paths")


def renumber(records: list[dict]) -> tuple[list[dict], int]:
    """The records with their token ids renumbered ``0..V-1`` in sorted order, and ``V``."""

    def walk(v, f):
        return [walk(u, f) for u in v] if isinstance(v, list) else f(v)

    used: set[int] = set()
    for r in records:
        for k in TOKENS:
            walk(r.get(k, []), used.add)
    ids = {t: i for i, t in enumerate(sorted(used))}
    out = [{k: walk(v, ids.__getitem__) if k in TOKENS else v for k, v in r.items()} for r in records]
    return out, len(ids)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("objectives_dist")
    pairs, trees = sample_records()
    n = 3 * STEPS
    assert len(pairs) >= n and len(trees) >= n, (len(pairs), len(trees))
    records, vocab = renumber(pairs[:n] + trees[:n])
    for name, part in (("pairs", records[:n]), ("trees", records[n:])):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    tiny_config("qwen3", vocab=vocab).save_pretrained(d / "model")
    return d


def config(workdir: Path, out: Path, name: str, **over) -> dict:
    data, options = RUNS[name]
    base = {
        "model": str(workdir / "model"),
        "data": str(workdir / f"{data}.jsonl"),
        "output": str(out / name),
        "steps": STEPS,
        "batch_trees": 3,
        "capacity": 40,
        "lr": 3e-3,
        "device": "cpu",
        "dtype": "float32",
        "checkpoint_every": 0,
        "progress": False,
        "prefetch": 0,
    }
    return base | options | over


def run_all(workdir: Path, jobs: dict[int, tuple[Path, list[dict]]]) -> None:
    """Launch every ``nproc: (directory, configs)`` job at once (0: one plain process)."""
    procs = []
    for nproc, (out, configs) in jobs.items():
        out.mkdir(parents=True, exist_ok=True)
        (out / "configs.json").write_text(json.dumps(configs))
        procs.append(launch(nproc, [str(out / "configs.json")], module="tests.objectives_worker"))
    for proc in procs:
        rc, err = finish(proc, timeout=300)
        assert rc == 0, err[-3000:]


@pytest.fixture(scope="module")
def runs(workdir, tmp_path_factory) -> dict[int, Path]:
    out = {n: tmp_path_factory.mktemp(f"ranks{max(n, 1)}") for n in (0, 2)}  # 0: one plain process
    configs = {n: [config(workdir, out[n], k, **PER_RANKS.get(k, {}).get(n, {})) for k in RUNS] for n in out}
    run_all(workdir, {n: (out[n], configs[n]) for n in out})
    return {1: out[0], 2: out[2]}


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(path / "model.safetensors").items()}


def update_err(got: dict, ref: dict, init: dict) -> float:
    """``|w_2 - w_1| / |w_1 - w_0|`` over all parameters (2-norm): the difference relative to what
    training changed (the max-norm is dominated by entries whose gradient is rounding noise, which
    AdamW turns into +-lr)."""
    num = sum(((got[k] - ref[k]) ** 2).sum().item() for k in ref)
    den = sum(((ref[k] - init[k]) ** 2).sum().item() for k in ref)
    return math.sqrt(num / den)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_equal_one(runs, workdir, name):
    one, two = metrics(runs[1] / name), metrics(runs[2] / name)
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    # Same records, same global normalizer (pairs, or trained tokens), gradients summed over
    # ranks; what differs is which micro-batch forest each record runs in and the order of the
    # float32 sums, amplified step after step by AdamW. The bar is 1e-3 relative.
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for k in a.keys() - LOCAL:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-6), (a["step"], k)
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-6)  # same weights: rounding only
    models = ["final"] + (["final_critic"] if name == "ppo_critic" else [])
    for m in models:
        w1, w2 = weights(runs[1] / name / m), weights(runs[2] / name / m)
        assert w1.keys() == w2.keys()
        init = {k: v.double() for k, v in initial_weights(workdir, name, m).items() if k in w1}
        assert init.keys() == w1.keys() or m == "final_critic"
        keys = [k for k in w1 if k in init]  # the critic's seeded head: compared below, on its own
        err = update_err(*({k: d[k] for k in keys} for d in (w2, w1, init)))
        print(f"{name} {m}: update error 2 ranks vs 1: {err:.3g}")
        assert err <= 1e-3, (m, err)
        for k in w1.keys() - init.keys():
            assert torch.allclose(w1[k], w2[k], rtol=1e-3, atol=1e-6), k


def initial_weights(workdir: Path, name: str, which: str) -> dict[str, torch.Tensor]:
    """The run's initial model (seed 0): the policy, or for the critic its backbone (the policy's)."""
    from treetrain.train.build import build_model

    auto = "AutoModelForSequenceClassification" if name == "reward" else None
    model = build_model(str(workdir / "model"), 0, torch.float32, torch.device("cpu"), auto)
    state = model.state_dict()
    if which == "final_critic":  # the critic's backbone keys are the policy's ``model.*``
        return {k: v for k, v in state.items() if k.startswith("model.")}
    return state


def cut_at(src: Path, dst: Path, step: int) -> Path:
    """A copy of a finished run as if it had stopped after its checkpoint ``step``."""
    shutil.copytree(src, dst)
    for ck in (dst / "checkpoints").glob("step_*"):
        if int(ck.name.split("_")[1]) > step:
            shutil.rmtree(ck)
    (dst / "checkpoints" / "latest").write_text(f"step_{step}\n")
    shutil.rmtree(dst / "final", ignore_errors=True)
    shutil.rmtree(dst / "final_critic", ignore_errors=True)
    return dst


def test_resume_distributed_dpo_and_ppo_critic(runs, workdir, tmp_path):
    """Both models, both AdamW states, the schedule and the data position come back: step 3 of a
    2-rank run resumed from its step-2 checkpoint equals the uninterrupted 2-rank run bit for bit;
    resumed on 1 process (DCP reshards 2 -> 1), it equals it within the 1-rank-vs-2 rounding."""
    two, one = tmp_path / "two", tmp_path / "one"
    jobs = {
        2: (two, [config(workdir, two, n, resume=True) for n in ("dpo", "ppo_critic")]),
        0: (one, [config(workdir, one, "ppo_critic", resume=True)]),
    }
    for out, configs in jobs.values():
        for cfg in configs:
            name = Path(cfg["output"]).name
            cut_at(runs[2] / name, out / name, 2)
    run_all(workdir, jobs)
    for out, names in ((two, ("dpo", "ppo_critic")), (one, ("ppo_critic",))):
        for name in names:
            full, got = metrics(runs[2] / name), metrics(out / name)
            assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step logged once
            keys = ("loss", "grad_norm", "lr")
            keys += ("value_loss", "critic_grad_norm") if name == "ppo_critic" else ()
            for k in keys:
                if out == two:
                    assert got[-1][k] == full[-1][k], (name, k)
                else:
                    assert got[-1][k] == pytest.approx(full[-1][k], rel=1e-3), (name, k)
            models = ["final"] + (["final_critic"] if name == "ppo_critic" else [])
            for m in models:
                w_full, w_got = weights(runs[2] / name / m), weights(out / name / m)
                if out == two:
                    assert all(torch.equal(w_full[k], w_got[k]) for k in w_full), (name, m)
                else:
                    assert all(torch.allclose(w_full[k], w_got[k], rtol=1e-3, atol=1e-5) for k in w_full)


@pytest.mark.parametrize(
    "objective, why",
    [
        ("reward", "the reward head reads each path's last hidden state"),
        ("ppo_critic", "the critic's values and GAE run along whole paths"),
    ],
)
def test_cp_refused_with_the_reason(workdir, tmp_path, objective, why):
    data = workdir / ("trees.jsonl" if objective == "ppo_critic" else "pairs.jsonl")
    cfg = TrainConfig(objective=objective, cp=2, model=str(workdir / "model"), data=str(data))
    cfg.output, cfg.progress = str(tmp_path / "run"), False
    with pytest.raises(ValueError, match=rf"--objective {objective}: --cp 2 is not supported: {why}"):
        train(cfg, quiet=True)
