"""One gloo rank for tests/test_integrations_verl.py's vision-language cases (run under torchrun): a verl
batch with images through treetrain's engine, an independent float64 per-row reference, then verl's
own FSDP2 engine.

The model (``argv[2]``: ``qwen2_5_vl`` or ``qwen3_vl``) is tiny and random (``tests/vlm_zoo.py``'s
config: 2 text layers of 64, a 2-layer vision tower of 32, 4-pixel patches, 2x2 merge), float32.
The batch is what verl's agent loop builds (``tests/verl_vlm_batch.py``): per row
``multi_modal_inputs`` (the processor's ``pixel_values``, ``image_grid_thw`` and ``images_seqlens``
of that row's images, an empty dict for a text-only row) and ``position_ids [4, L]`` (text
positions, then the model's ``get_rope_index`` rotary rows). Rows: a GRPO group of 4 samples of a
prompt with image ``a`` (one duplicate, one a prefix of another), a group of 3 samples of a prompt
with image ``b`` (the same placeholder ids and grid, other pixels: it must not merge with ``a``),
one of them with a second image (``c``) in a tool result, and a text-only row.

verl's engine runs padded (``use_remove_padding=False``): its vision-language patches route
packed rows to flash-attention, which the CPU has not. It patches transformers' Qwen-VL
classes for the whole process, so it runs last; after it, treetrain's engine refuses to run (the
patched forward is verl's, not transformers'), which is recorded.

Saves ``OUT/rank{r}.pt``: ``{"lm": {layout: {"verl", "tree", "ref64", "last"}}, "refused": str}``,
layouts ``v0`` (verl's padded rollout batch through ``left_right_2_no_padding``) and ``v1`` (the V1
trainer's nested fields).
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests.vlm_zoo

import verl_worker as vw  # noqa: E402  (the CPU platform first, then verl)
from tensordict import TensorDict  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from tests.verl_vlm_batch import global_batch  # noqa: E402
from tests.vlm_zoo import IMAGE, vlm_model  # noqa: E402

BUDGET = 40  # treetrain's micro-batches: at most 40 distinct tokens each


def save_model(root: str, model_type: str) -> None:
    model = vlm_model(model_type, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.save_pretrained(f"{root}/actor")


def rank_batch(full: dict, mm: list, rank: int, world: int, layout: str, **meta) -> TensorDict:
    """This rank's contiguous share of the batch (as verl's dispatch splits it) in ``layout``."""
    B = full["input_ids"].shape[0]
    sl = slice(rank * B // world, (rank + 1) * B // world)
    rows = {k: v[sl].clone() for k, v in full.items()}
    if layout == "v1":
        td = vw.v1_nested({k: v for k, v in rows.items() if k != "position_ids"})
        attention = rows["attention_mask"].bool()
        td["position_ids"] = torch.nested.as_nested_tensor(
            [p[:, m] for p, m in zip(rows["position_ids"], attention)], layout=torch.jagged
        )
    else:
        td = left_right_2_no_padding(TensorDict(rows, batch_size=[sl.stop - sl.start]))
    tu.assign_non_tensor(td, multi_modal_inputs=[dict(x) for x in mm[sl]])
    tu.assign_non_tensor(
        td, temperature=vw.TEMPERATURE, global_batch_size=B, use_remove_padding=False, **meta
    )  # verl's engine: padded (flash-attention otherwise); the tree runs every layout alike
    return td


def vlm_outputs(model, td: TensorDict) -> dict:
    """Each row alone through the unmodified HF model with its images (``[N]`` log-probs, entropies)."""
    ids, mm = td["input_ids"], list(td["multi_modal_inputs"])
    out = []
    for (a, b), inputs in zip(zip(ids.offsets()[:-1], ids.offsets()[1:]), mm):
        row = ids.values()[a:b][None]
        extra = {}
        if inputs:
            extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
            extra["mm_token_type_ids"] = (row == IMAGE).long()
        logits = model(input_ids=row, **extra).logits[0].double() / vw.TEMPERATURE
        logp = logits.log_softmax(-1)
        lp = torch.cat([logp[:-1].gather(1, row[0, 1:, None])[:, 0], logp.new_zeros(1)])  # last: unread
        out.append(torch.stack([lp, -(logp.exp() * logp).sum(-1)]))
    both = torch.cat(out, 1)
    return {"log_probs": both[0], "entropy": both[1]}


def build(kind: str, path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    mc = HFModelConfig(
        path=path,
        load_tokenizer=False,
        override_config={"attn_implementation": "sdpa"},
        use_remove_padding=kind == "tree",  # verl's own: padded (its packed VLM path is flash-attention)
    )
    mc.model_type = "language_model"
    args = (
        mc,
        vw.engine_config("fsdp2" if kind == "verl" else "treetrain"),
        FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        CheckpointConfig(),
    )
    if kind == "verl":
        engine = FSDPEngineWithLMHead(*args)
    else:
        engine = EngineRegistry.new("language_model", "treetrain", *args)
    engine.initialize()
    return engine


def _count_blank_forwards(engine) -> list:
    """Record, per vision-tower call of the engine's model, whether it ran the blank 16-patch image
    (a tree forward without images: ``verl_images.blank_image``; the test's images are larger)."""
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs["grid_thw"].tolist() == [[1, 4, 4]])

    engine.module.model.visual.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def main(out_dir: str, model_type: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = f"{out_dir}/actor"
    if rank == 0:
        save_model(out_dir, model_type)
    dist.barrier()
    model64 = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager").double()
    full, mm = global_batch(model64)
    cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01,
                          use_kl_loss=True, kl_loss_coef=0.1, loss_agg_mode="token-mean")  # fmt: skip
    loss_fn = functools.partial(ppo_loss, config=cfg)
    batch = functools.partial(rank_batch, full, mm, rank, world, calculate_entropy=True)
    layouts = ("v0", "v1")
    verl_td = {n: functools.partial(batch, n, **vw.VERL_MICRO) for n in layouts}
    tree_micro = dict(use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
    tree_td = {n: functools.partial(batch, n, **tree_micro) for n in layouts}
    keys = ("log_probs", "entropy")
    tree_engine = build("tree", path)
    blank = _count_blank_forwards(tree_engine)
    tree = vw.run_engine(tree_engine, {n: (tree_td[n], verl_td[n]) for n in layouts}, loss_fn, keys)
    ref = {}  # before verl's engine patches transformers' classes
    for name in layouts:
        td = verl_td[name]()
        tu.assign_non_tensor(td, dp_size=world, batch_num_tokens=int(full["response_mask"].sum()))
        model64.zero_grad()
        ref[name] = vw.reference(model64, td, loss_fn, vlm_outputs, world)
    verl = vw.run_engine(build("verl", path), {n: (verl_td[n], None) for n in layouts}, loss_fn, keys)
    results = {
        "lm": vw.compare(verl, tree, ref, layouts, {"last": vw.last_positions(verl_td["v0"]())}),
        "text_only_forwards": blank,  # tree forwards without images (the tower on a blank image)
    }
    try:
        with tree_engine.eval_mode():
            tree_engine.infer_batch(verl_td["v0"]())
        results["refused"] = ""
    except ValueError as e:
        results["refused"] = str(e)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from treetrain.parallel.fsdp import exit_rank

    exit_rank(0)  # no interpreter teardown (see exit_rank)
