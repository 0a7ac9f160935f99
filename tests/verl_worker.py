"""One gloo rank for tests/test_integrations_verl.py (run under torchrun): the same verl batch through
verl's own FSDP2 engines and through treetrain's, plus an independent float64 per-row reference.

Saves ``OUT/rank{r}.pt``: per role (``lm``, ``critic``, ``lm_tied``) and batch layout, per engine
(``verl``, ``tree``, ``ref64``) the actor's nested log-probs and entropies, the PPO/GRPO loss of
``verl.workers.utils.losses.ppo_loss`` and every parameter gradient; the critic's values,
``value_loss`` and gradients; ``train_batch``'s grad norm. Layouts: ``v0`` (verl's padded rollout
batch through ``left_right_2_no_padding``: nested ``input_ids``, padded response fields), ``v1``
(every per-token field a jagged nested tensor, as the V1 trainer's TransferQueue hands it over)
and ``padded`` (``v0`` with ``use_remove_padding=False``: verl's engine pads the rows and runs with
an attention mask). On one rank also ``lm_bf16``: both engines in verl's default bf16 mixed
precision against the float64 reference. The test compares them.
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


def v1_nested(rows: dict[str, torch.Tensor]) -> TensorDict:
    """verl's V1 layout: every per-token field a jagged nested tensor (``prompts``, ``responses``,
    ``input_ids``, ``position_ids``; ``response_mask`` = ``loss_mask`` and the response fields over the
    response tokens), no attention mask, as ``AgentLoopWorkerTQ`` stores samples in TransferQueue."""
    P = rows["prompts"].shape[1]
    plen, rlen = rows["attention_mask"][:, :P].sum(1).tolist(), rows["attention_mask"][:, P:].sum(1).tolist()

    def jagged(tensors):
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)

    B = len(plen)
    prompts = [rows["prompts"][b, P - plen[b] :] for b in range(B)]
    responses = [rows["responses"][b, : rlen[b]] for b in range(B)]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    out = {
        "prompts": jagged(prompts),
        "responses": jagged(responses),
        "input_ids": jagged(ids),
        "position_ids": jagged([torch.arange(len(i)) for i in ids]),
    }
    for key in ("response_mask", "old_log_probs", "ref_log_prob", "advantages", "values", "returns"):
        out[key] = jagged([rows[key][b, : rlen[b]] for b in range(B)])
    out["loss_mask"] = out["response_mask"]
    return TensorDict(out, batch_size=[B])


def rank_batch(full: dict, rank: int, world: int, layout: str = "v0", **meta) -> TensorDict:
    """This rank's contiguous share of the batch (as verl's dispatch splits it) in ``layout``."""
    B = full["input_ids"].shape[0]
    sl = slice(rank * B // world, (rank + 1) * B // world)
    rows = {k: v[sl].clone() for k, v in full.items()}
    if layout == "v1":
        td = v1_nested(rows)
    else:
        td = left_right_2_no_padding(TensorDict(rows, batch_size=[sl.stop - sl.start]))
    padded = layout == "padded"
    tu.assign_non_tensor(
        td, temperature=TEMPERATURE, global_batch_size=B, use_remove_padding=not padded, **meta
    )
    return td


def engine_config(strategy: str, mixed_precision: dict | None = FP32) -> FSDPEngineConfig:
    """``mixed_precision=None``: verl's default (bf16 parameters in forward and backward, float32
    gradient reduction and master weights)."""
    cfg = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, mixed_precision=mixed_precision)
    object.__setattr__(cfg, "strategy", strategy)  # as verl's FSDPActorConfig syncs actor.strategy
    return cfg


def build(kind: str, model_type: str, path: str, mixed_precision: dict | None = FP32):
    mc = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"})
    mc.model_type = model_type
    args = (
        mc,
        engine_config("fsdp2" if kind == "verl" else "treetrain", mixed_precision),
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


def run_engine(engine, layouts: dict, loss_fn, keys, train: bool = True) -> dict:
    """Per layout (``name -> (batch, verl's micro-batches or None)``): infer_batch outputs,
    forward_backward_batch's loss and every parameter gradient (and with verl's micro-batches as
    ``same``); then (``train``) train_batch's grad norm on the first layout's batch."""
    res = {}
    for name, (td_fn, same_td_fn) in layouts.items():
        with engine.eval_mode():
            out = engine.infer_batch(td_fn())["model_output"]
            r = {k: nested_values(out[k]) for k in keys}
            if same_td_fn is not None:
                out = engine.infer_batch(same_td_fn())["model_output"]
                r["same"] = {k: nested_values(out[k]) for k in keys}
        engine.optimizer_zero_grad()
        with engine.train_mode():
            out = engine.forward_backward_batch(td_fn(), loss_fn)
            r["loss"] = float(sum(out["loss"]))
            r["grads"] = full_grads(engine.module)
            r["micro_batches"] = len(out["loss"])
        res[name] = r
    if train:
        with engine.train_mode():
            first = next(iter(layouts.values()))[0]
            res["grad_norm"] = float(engine.train_batch(first(), loss_fn)["metrics"]["grad_norm"])
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


LAYOUTS = ("v0", "v1", "padded")
VERL_MICRO = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=4)  # verl's own micro-batches of 4 rows
TREE_MICRO = dict(use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)  # parts of the rank's tree


def compare(verl: dict, tree: dict, ref: dict, layouts, extra: dict | None = None) -> dict:
    """``{layout: {"verl", "tree", "ref64"} (+ extra)}``, each engine's train_batch grad norm beside."""
    res = {
        name: {"verl": verl[name], "tree": tree[name], "ref64": ref[name], **(extra or {})}
        for name in layouts
    }
    for engine, r in (("verl", verl), ("tree", tree)):
        if "grad_norm" in r:
            res[layouts[0]][engine]["grad_norm"] = r["grad_norm"]
    return res


def last_positions(td: TensorDict) -> torch.Tensor:
    """``[N]``: a row's last position, whose log-prob scores the next row's first token."""
    last = torch.zeros(td["input_ids"].values().numel(), dtype=torch.bool)
    last[td["input_ids"].offsets()[1:] - 1] = True
    return last


def actor(path: str, full: dict, rank: int, world: int, layouts=LAYOUTS, mixed_precision=FP32) -> dict:
    """GRPO advantages through verl's ppo_loss with an entropy bonus and a KL loss."""
    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01,
                          use_kl_loss=True, kl_loss_coef=0.1, loss_agg_mode="token-mean")  # fmt: skip
    loss_fn = functools.partial(ppo_loss, config=cfg)
    batch = functools.partial(rank_batch, full, rank, world, calculate_entropy=True)
    verl_td = {n: functools.partial(batch, n, **VERL_MICRO) for n in layouts}
    tree_td = {n: functools.partial(batch, n, **TREE_MICRO) for n in layouts}
    keys = ("log_probs", "entropy")
    train = mixed_precision == FP32
    verl = run_engine(
        build("verl", "language_model", path, mixed_precision),
        {n: (verl_td[n], None) for n in layouts}, loss_fn, keys, train,
    )  # fmt: skip
    tree = run_engine(
        build("tree", "language_model", path, mixed_precision),
        {n: (tree_td[n], verl_td[n]) for n in layouts}, loss_fn, keys, train,
    )  # fmt: skip
    model64 = Qwen3ForCausalLM.from_pretrained(path, attn_implementation="eager").double()
    ref = {}
    for name in layouts:
        td = verl_td[name]()
        tu.assign_non_tensor(td, dp_size=world, batch_num_tokens=int(full["response_mask"].sum()))
        model64.zero_grad()
        ref[name] = reference(model64, td, loss_fn, lm_outputs, world)
    return compare(verl, tree, ref, layouts, {"last": last_positions(verl_td[layouts[0]]())})


def critic(path: str, full: dict, rank: int, world: int, layouts=LAYOUTS) -> dict:
    """verl's value_loss (clipped)."""
    cfg = FSDPCriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=4, cliprange_value=0.5)
    loss_fn = functools.partial(value_loss, config=cfg)
    verl_td = {n: functools.partial(rank_batch, full, rank, world, n, **VERL_MICRO) for n in layouts}
    tree_td = {n: functools.partial(rank_batch, full, rank, world, n, **TREE_MICRO) for n in layouts}
    keys = ("values",)
    verl_engine, tree_engine = build("verl", "value_model", path), build("tree", "value_model", path)
    verl = run_engine(verl_engine, {n: (verl_td[n], None) for n in layouts}, loss_fn, keys)
    tree = run_engine(tree_engine, {n: (tree_td[n], verl_td[n]) for n in layouts}, loss_fn, keys)
    model64 = AutoModelForTokenClassification.from_pretrained(path, attn_implementation="eager").double()
    values = lambda m, td: {"values": per_row(m, td, lambda m, ids: m(input_ids=ids).logits[0, :, 0])}  # noqa: E731
    ref = {}
    for name in layouts:
        td = verl_td[name]()
        tu.assign_non_tensor(td, dp_size=world, batch_num_tokens=int(full["response_mask"].sum()))
        model64.zero_grad()
        ref[name] = reference(model64, td, loss_fn, values, world)
    return compare(verl, tree, ref, layouts)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        save_models(out_dir)
    dist.barrier()
    full = global_batch()
    layouts = LAYOUTS if world == 1 else LAYOUTS[:2]  # padded rows are a per-rank matter: one rank
    results = {
        "lm": actor(f"{out_dir}/actor", full, rank, world, layouts),
        "critic": critic(f"{out_dir}/critic", full, rank, world, layouts),
    }
    if world == 1:  # tied embeddings (Qwen3 up to 4B): the LM head is the embedding, no FSDP unit of its own
        results["lm_tied"] = actor(f"{out_dir}/actor_tied", full, rank, world, layouts=("v0",))
        # verl's default mixed precision: each engine against the float64 reference
        results["lm_bf16"] = actor(f"{out_dir}/actor", full, rank, world, ("v0",), mixed_precision=None)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    from treetrain.parallel.fsdp import exit_rank

    exit_rank(0)  # no interpreter teardown (see exit_rank)
