"""One gloo rank for tests/test_integrations_verl_host.py (run under torchrun, ``VERL_PLATFORM=cpu``):
what verl's trainer does with a ``strategy=treetrain`` engine besides computing log-probs.

Saves ``OUT/host.pt``:

- ``checkpoint``: an engine trained one step saves a checkpoint (verl's FSDP checkpoint manager:
  model, optimizer, lr scheduler); a freshly built engine loads it; both then take the same step.
  Parameters and optimizer state after loading, and the grad norm and parameters after the step.
- ``weights``: what verl's weight sync sends the rollout (``engine.get_per_tensor_param()``: full
  tensors under Hugging Face names): names and tensors against the checkpoint's own model.
- ``reorder``: the batch in the order verl's V1 ``_balance_batch`` leaves it for two ranks (one
  rank's share after the other), through the engine, against the batch in rollout order.
- ``ulysses``: the ``ValueError`` that ``ulysses_sequence_parallel_size=2`` raises with verl's own
  config classes.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from treetrain.integrations.verl_cpu import use_cpu_platform

use_cpu_platform()

import verl_worker as vw  # noqa: E402  (the parity test's model, batch and engine builder)
from transformers import Qwen3ForCausalLM  # noqa: E402
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions  # noqa: E402
from verl.workers.config import (  # noqa: E402
    FSDPActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
)
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

LOSS = dict(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01,
            use_kl_loss=True, kl_loss_coef=0.1, loss_agg_mode="token-mean")  # fmt: skip


loss_fn = functools.partial(ppo_loss, config=FSDPActorConfig(**LOSS))


def batch(full: dict, order=None):
    rows = {k: v if order is None else v[order] for k, v in full.items()}
    return vw.rank_batch(rows, 0, 1, "v1", calculate_entropy=True, **vw.TREE_MICRO)


def params(engine) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in engine.module.named_parameters()}


def optimizer_state(engine) -> list[torch.Tensor]:
    out = []
    for state in engine.optimizer.state.values():
        out += [v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for v in state.values()]
    return out


def checkpoint(path: str, full: dict, out_dir: str) -> dict:
    saver = vw.build("tree", "language_model", path)
    with saver.train_mode():
        saver.train_batch(batch(full), loss_fn)
    saver.save_checkpoint(f"{out_dir}/ckpt", global_step=1)
    loader = vw.build("tree", "language_model", path)
    loader.load_checkpoint(f"{out_dir}/ckpt", del_local_after_load=False)
    res = {"saved": params(saver), "loaded": params(loader)}
    res["opt_saved"], res["opt_loaded"] = optimizer_state(saver), optimizer_state(loader)
    for name, engine in (("saver", saver), ("loader", loader)):
        with engine.train_mode():
            res[f"{name}_grad_norm"] = float(engine.train_batch(batch(full), loss_fn)["metrics"]["grad_norm"])
        res[f"{name}_after"] = params(engine)
    res["weights"] = {n: t.detach().clone() for n, t in loader.get_per_tensor_param()[0]}
    res["hf"] = dict(Qwen3ForCausalLM.from_pretrained(path).state_dict())  # the weights before training
    return res


def reorder(path: str, full: dict) -> dict:
    """The V1 trainer's ``_balance_batch`` for two data-parallel ranks: rows partitioned by length
    workload (``equal_size``), each rank's share kept in rollout order, the shares back to back."""
    lengths = full["attention_mask"].sum(1)
    parts = get_seqlen_balanced_partitions(calculate_workload(lengths), k_partitions=2, equal_size=True)
    order = torch.tensor([i for part in parts for i in part])
    engine = vw.build("tree", "language_model", path)
    res = {"order": order, "parts": parts}
    for name, o in (("rollout", None), ("balanced", order)):
        with engine.eval_mode():
            res[name] = engine.infer_batch(batch(full, o))["model_output"]["log_probs"].values().clone()
        engine.optimizer_zero_grad()
        with engine.train_mode():
            res[f"{name}_loss"] = float(sum(engine.forward_backward_batch(batch(full, o), loss_fn)["loss"]))
    res["offsets"] = batch(full)["input_ids"].offsets()
    return res


def ulysses(path: str) -> str:
    mc = HFModelConfig(path=path, load_tokenizer=False)
    cfg = FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=2)
    object.__setattr__(cfg, "strategy", "treetrain")
    try:
        EngineRegistry.new("language_model", "treetrain", mc, cfg, FSDPOptimizerConfig(lr=1e-3), None)
    except ValueError as e:
        return str(e)
    return "no error"


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    vw.save_models(out_dir)
    full = vw.global_batch()
    res = {
        "checkpoint": checkpoint(f"{out_dir}/actor", full, out_dir),
        "reorder": reorder(f"{out_dir}/actor", full),
        "ulysses": ulysses(f"{out_dir}/actor"),
    }
    torch.save(res, f"{out_dir}/host.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    from treetrain.parallel.fsdp import exit_rank

    exit_rank(0)  # no interpreter teardown (see exit_rank)
