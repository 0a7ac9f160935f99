"""One gloo rank for tests/test_integrations_verl.py (run under torchrun): the same verl batch through
verl's own FSDP2 engines and through treetrain's, plus an independent float64 per-row reference.

Saves ``OUT/rank{r}.pt``: per engine (``verl``, ``tree``, ``ref64``) the actor's nested log-probs and
entropies, the PPO/GRPO loss of ``verl.workers.utils.losses.ppo_loss`` and every parameter gradient;
the critic's values, ``value_loss`` and gradients; ``train_batch``'s grad norm. The test compares them.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from treetrain.integrations.verl_cpu import use_cpu_platform

use_cpu_platform()

import verl.utils.model as verl_model  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transformers import AutoModelForTokenClassification, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import (  # noqa: E402
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
)
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import (  # noqa: E402
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)
from verl.workers.utils.losses import ppo_loss, value_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import treetrain.integrations.verl  # noqa: E402, F401  (registers strategy=treetrain)


def _load_valuehead_sdpa(local_path, torch_dtype, model_config, trust_remote_code):
    """verl.utils.model.load_valuehead_model with sdpa: verl 0.9.1 hard-codes flash_attention_2 there
    (CUDA-only), so its critic engine cannot load on the CPU otherwise. Same class, same weights."""
    return AutoModelForTokenClassification.from_pretrained(
        local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )


verl_model.load_valuehead_model = _load_valuehead_sdpa

CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
TEMPERATURE = 0.8
BUDGET = 20  # treetrain's micro-batches: at most 20 distinct tokens each (several per rank)


def save_models(root: str) -> None:
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**CONFIG)).save_pretrained(f"{root}/actor")
    Qwen3ForCausalLM(Qwen3Config(**{**CONFIG, "tie_word_embeddings": True})).save_pretrained(
        f"{root}/actor_tied"
    )
    AutoModelForTokenClassification.from_config(Qwen3Config(**CONFIG, num_labels=1)).save_pretrained(
        f"{root}/critic"
    )


def global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two prompts x 4 samples, verl's padded rollout layout (prompts left-, responses right-padded).

    Sample 2 repeats sample 0 (a duplicate row) and sample 3 is a prefix of sample 1 (a shorter
    response): the trie keeps both as rows.
    """
    g = torch.Generator().manual_seed(seed)
    V, P, R = CONFIG["vocab_size"], 9, 7
    rows = []
    for plen in (9, 6):
        prompt = torch.randint(1, V, (plen,), generator=g)
        r0, r1 = torch.randint(1, V, (6,), generator=g), torch.randint(1, V, (7,), generator=g)
        rows += [(prompt, r) for r in (r0, r1, r0.clone(), r1[:3].clone())]
    B = len(rows)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    pmask, rmask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        prompts[b, P - len(p) :], pmask[b, P - len(p) :] = p, 1
        responses[b, : len(r)], rmask[b, : len(r)] = r, 1
    attention = torch.cat([pmask, rmask], 1)
    adv = torch.randn(B, 1, generator=g).expand(B, R) * rmask  # GRPO: one advantage per sample
    return dict(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], 1),
        attention_mask=attention,
        position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        response_mask=rmask,
        old_log_probs=(-2.0 - torch.rand(B, R, generator=g)) * rmask,
        ref_log_prob=(-2.0 - torch.rand(B, R, generator=g)) * rmask,
        advantages=adv.contiguous(),
        values=torch.randn(B, R, generator=g) * rmask,
        returns=torch.randn(B, R, generator=g) * rmask,
    )


def rank_batch(full: dict, rank: int, world: int, **meta) -> TensorDict:
    """This rank's contiguous share of the batch (as verl's dispatch splits it), no-padding layout."""
    B = full["input_ids"].shape[0]
    sl = slice(rank * B // world, (rank + 1) * B // world)
    td = TensorDict({k: v[sl].clone() for k, v in full.items()}, batch_size=[sl.stop - sl.start])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=TEMPERATURE, global_batch_size=B, use_remove_padding=True, **meta)
    return td


def engine_config(strategy: str) -> FSDPEngineConfig:
    cfg = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, mixed_precision=FP32)
    object.__setattr__(cfg, "strategy", strategy)  # as verl's FSDPActorConfig syncs actor.strategy
    return cfg


def build(kind: str, model_type: str, path: str):
    mc = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"})
    mc.model_type = model_type
    args = (
        mc,
        engine_config("fsdp2" if kind == "verl" else "treetrain"),
        FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        CheckpointConfig(),
    )
    if kind == "verl":
        engine = (FSDPEngineWithLMHead if model_type == "language_model" else FSDPEngineWithValueHead)(*args)
    else:
        engine = EngineRegistry.new(model_type, "treetrain", *args)
    engine.initialize()
    return engine


def full_grads(module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in module.named_parameters()
    }


def nested_values(nt) -> torch.Tensor:
    return nt.values().detach().clone()


def run_engine(engine, td_fn, loss_fn, keys, same_td_fn=None) -> dict:
    """infer_batch outputs, forward_backward_batch's loss and every parameter gradient, train_batch's
    grad norm. ``same_td_fn``: also infer with that batch (verl's own micro-batching) as ``same``."""
    with engine.eval_mode():
        out = engine.infer_batch(td_fn())["model_output"]
        res = {k: nested_values(out[k]) for k in keys}
        if same_td_fn is not None:
            out = engine.infer_batch(same_td_fn())["model_output"]
            res["same"] = {k: nested_values(out[k]) for k in keys}
    engine.optimizer_zero_grad()
    with engine.train_mode():
        out = engine.forward_backward_batch(td_fn(), loss_fn)
        res["loss"] = float(sum(out["loss"]))
        res["grads"] = full_grads(engine.module)
        res["micro_batches"] = len(out["loss"])
    with engine.train_mode():
        res["grad_norm"] = float(engine.train_batch(td_fn(), loss_fn)["metrics"]["grad_norm"])
    return res


def per_row(model, td: TensorDict, fn) -> torch.Tensor:
    """``fn(model, row ids [1, L]) -> [L]`` for every row alone, concatenated (the nested layout)."""
    ids = td["input_ids"]
    return torch.cat(
        [fn(model, ids.values()[a:b][None]) for a, b in zip(ids.offsets()[:-1], ids.offsets()[1:])]
    )


def lm_row(model, ids):
    logits = model(input_ids=ids).logits[0].double() / TEMPERATURE
    logp = logits.log_softmax(-1)
    lp = torch.cat([logp[:-1].gather(1, ids[0, 1:, None])[:, 0], logp.new_zeros(1)])  # last: unread
    return torch.stack([lp, -(logp.exp() * logp).sum(-1)])


def reference(model, td: TensorDict, loss_fn, model_output, world: int) -> dict:
    """An independent per-row float64 forward of the same weights through verl's loss function."""
    out = model_output(model, td)
    loss, _ = loss_fn(
        model_output={
            k: torch.nested.nested_tensor_from_jagged(v, td["input_ids"].offsets()) for k, v in out.items()
        },
        data=td,
    )
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        grads[n] = g / world  # FSDP averages gradients over ranks; verl's losses scale by dp_size
    res = {k: v.detach() for k, v in out.items()}
    res.update(loss=float(loss), grads=grads)
    return res


def lm_outputs(model, td: TensorDict) -> dict:
    both = per_row(model, td, lambda m, ids: lm_row(m, ids).T).T
    return {"log_probs": both[0], "entropy": both[1]}


def actor(path: str, full: dict, rank: int, world: int) -> dict:
    """GRPO advantages through verl's ppo_loss with an entropy bonus and a KL loss."""
    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01,
                          use_kl_loss=True, kl_loss_coef=0.1, loss_agg_mode="token-mean")  # fmt: skip
    loss_fn = functools.partial(ppo_loss, config=cfg)
    batch = functools.partial(rank_batch, full, rank, world, calculate_entropy=True)
    verl_td = functools.partial(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    tree_td = functools.partial(batch, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
    keys = ("log_probs", "entropy")
    res = {
        "verl": run_engine(build("verl", "language_model", path), verl_td, loss_fn, keys),
        "tree": run_engine(build("tree", "language_model", path), tree_td, loss_fn, keys, verl_td),
    }
    model64 = Qwen3ForCausalLM.from_pretrained(path, attn_implementation="eager").double()
    td = verl_td()
    tu.assign_non_tensor(td, dp_size=world, batch_num_tokens=int(full["response_mask"].sum()))
    res["ref64"] = reference(model64, td, loss_fn, lm_outputs, world)
    last = torch.zeros(td["input_ids"].values().numel(), dtype=torch.bool)
    last[td["input_ids"].offsets()[1:] - 1] = True  # a row's last log-prob scores the next row's first token
    res["last"] = last
    return res


def critic(path: str, full: dict, rank: int, world: int) -> dict:
    """verl's value_loss (clipped)."""
    cfg = FSDPCriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=4, cliprange_value=0.5)
    loss_fn = functools.partial(value_loss, config=cfg)
    verl_td = functools.partial(
        rank_batch, full, rank, world, use_dynamic_bsz=False, micro_batch_size_per_gpu=4
    )
    tree_td = functools.partial(
        rank_batch, full, rank, world, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET
    )
    keys = ("values",)
    res = {
        "verl": run_engine(build("verl", "value_model", path), verl_td, loss_fn, keys),
        "tree": run_engine(build("tree", "value_model", path), tree_td, loss_fn, keys, verl_td),
    }
    model64 = AutoModelForTokenClassification.from_pretrained(path, attn_implementation="eager").double()
    td = verl_td()
    tu.assign_non_tensor(td, dp_size=world, batch_num_tokens=int(full["response_mask"].sum()))
    values = lambda m, td: {"values": per_row(m, td, lambda m, ids: m(input_ids=ids).logits[0, :, 0])}  # noqa: E731
    res["ref64"] = reference(model64, td, loss_fn, values, world)
    return res


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        save_models(out_dir)
    dist.barrier()
    full = global_batch()
    results = {
        "lm": actor(f"{out_dir}/actor", full, rank, world),
        "critic": critic(f"{out_dir}/critic", full, rank, world),
    }
    if world == 1:  # tied embeddings (Qwen3 up to 4B): the LM head is the embedding, no FSDP unit of its own
        results["lm_tied"] = actor(f"{out_dir}/actor_tied", full, rank, world)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
