"""treetrain as a verl engine backend: the actor, reference and critic run every micro-batch as one
prefix tree.

verl (tested: 0.9.1, the ``verl`` extra pins it) trains through engines registered in
``verl.workers.engine.EngineRegistry`` by ``(model_type, backend, device)``; the backend is the
actor's / critic's ``strategy``. This module registers ``strategy=treetrain`` for
``language_model`` (actor, reference, old-policy log-probs) and ``value_model`` (critic) on ``cuda``
and ``cpu``. The engines are verl's own FSDP2 engines (model building, sharding, optimizer, offload,
checkpoints, weight sync to the rollout: all inherited) with two changes:

- a micro-batch's rows (no-padding ``input_ids``, prompt then response) become one prefix tree that
  runs once (a prompt's ``n`` samples share it; multi-turn rows share their common history), and
  its outputs are gathered back to verl's nested layout: ``log_probs``, ``entropy`` (when
  ``calculate_entropy``), ``values``, exactly as verl's engine returns them, so
  ``verl.workers.utils.losses`` and everything downstream run unchanged;
- with ``use_dynamic_bsz`` the micro-batches are cut from the tree of the rank's whole mini-batch,
  ``max_token_len_per_gpu`` bounding each micro-batch's *distinct* tokens (verl's own split balances
  rows by length and scatters a prompt's samples over micro-batches).

Turn it on with one setting per role (the reference follows the actor)::

    actor_rollout_ref.actor.strategy=treetrain
    critic.strategy=treetrain

Every layout verl hands an engine runs: the V0 trainer's no-padding batch, the V1 trainer's fully
nested one, and ``use_remove_padding=False`` (verl's engine then pads; the tree has nothing to pad).
With data parallelism, verl's V1 trainer spreads a prompt's samples over ranks by length (it reads
neither ``use_prefix_grouper`` nor ``trainer.balance_batch``); each rank's tree shares what its rows
share. See ``docs/guides/verl.md``.

``pip install "treetrain[verl]"`` registers the engines through verl's ``verl.plugins`` entry point,
loaded by ``import verl`` in every process (driver and Ray workers). Where entry points are turned off
(``VERL_USE_EXTERNAL_PLUGINS=none``), load it by name:
``VERL_USE_EXTERNAL_MODULES=treetrain.integrations.verl``. Importing this module first registers a
``cpu`` platform in verl's platform registry (:mod:`treetrain.integrations.verl_cpu`), before verl's
engine module reads the platform; ``VERL_PLATFORM=cpu`` chooses it.

Vision-language actors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): rows with
``multi_modal_inputs`` become a tree with images (:mod:`treetrain.integrations.verl_images`: each
distinct image encoded once, a prompt's samples sharing its image tokens), verl's 3-D rotary
``position_ids`` checked against the model's own. verl's monkey patches for these models (its own
forward and flash-attention layers, class-wide) are not applied to a treetrain engine's model: tree
attention runs through transformers' own forward.

Not supported (a ``ValueError`` names the feature): other vision-language models, video inputs,
a vision-language critic, Ulysses sequence parallelism (``ulysses_sequence_parallel_size > 1``),
LoRA, QAT, Liger kernels, fused kernels, top-k distillation, ``calculate_sum_pi_squared``, FSDP1,
and the Megatron/VeOmni/TorchTitan backends (this engine is FSDP2).
"""

from __future__ import annotations

import copy
import types
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import verl
from tensordict import TensorDict
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from treetrain.integrations.verl_cpu import register_cpu_platform

# before verl's engine modules, which fix the process's platform when imported (VERL_PLATFORM=cpu picks it)
register_cpu_platform()

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.device import get_device_id, get_device_name  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import (  # noqa: E402
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches  # noqa: E402

from treetrain.integrations.verl_images import (  # noqa: E402
    VERL_VISION_TYPES,
    blank_image,
    check_rope_positions,
    check_unpatched,
    row_images,
    without_verl_vision_patches,
)
from treetrain.integrations.verl_rows import RowTree, balanced_parts, split_rows  # noqa: E402
from treetrain.logprobs import LOGITS_KEEP_BYTES, target_logprobs  # noqa: E402
from treetrain.models.head import LMHead, lm_head  # noqa: E402
from treetrain.models.hf import prepare_model, tree_forward  # noqa: E402

__all__ = ["BACKEND", "TESTED_VERL", "TreeEngineWithLMHead", "TreeEngineWithValueHead"]

BACKEND = "treetrain"
TESTED_VERL = "0.9.1"
_TREE_METHOD = "treetrain_tree_outputs"  # root-level entry point, run inside FSDP's root hooks
_HEAD_METHOD = "treetrain_head_logprobs"  # the LM head's, inside its own FSDP unit's hooks

if verl.__version__ != TESTED_VERL:
    warnings.warn(
        f"treetrain's verl engine is tested with verl=={TESTED_VERL}, this is verl {verl.__version__}: it "
        "subclasses verl's FSDP engine; check tests/test_integrations_verl.py ('treetrain[verl]' pins it)",
        stacklevel=2,
    )


def check_supported(model_config, engine_config, vision: bool = False) -> None:
    """A ``ValueError`` naming the first configured feature the treetrain engine does not support;
    ``vision``: the engine runs the vision-language types of ``VERL_VISION_TYPES`` (the actor's)."""
    hf = model_config.hf_config
    model_type = getattr(hf, "model_type", None)
    is_vision = getattr(hf, "vision_config", None) is not None
    checks = [
        (
            is_vision and not (vision and model_type in VERL_VISION_TYPES),
            f"the vision-language model type {model_type!r}"
            + (" as a critic" if not vision else f" (it runs {', '.join(sorted(VERL_VISION_TYPES))})"),
            "a text-only model" if not vision else "one of those",
        ),
        (
            engine_config.ulysses_sequence_parallel_size > 1,
            "Ulysses sequence parallelism "
            f"(ulysses_sequence_parallel_size={engine_config.ulysses_sequence_parallel_size})",
            "1",
        ),
        (model_config.lora_rank > 0 or model_config.lora_adapter_path, "LoRA (model.lora_rank)", "0"),
        (model_config.use_liger, "Liger kernels (model.use_liger)", "false"),
        (model_config.use_fused_kernels, "fused kernels (model.use_fused_kernels)", "false"),
        (getattr(getattr(engine_config, "qat", None), "enable", False), "QAT (qat.enable)", "false"),
    ]
    for bad, feature, fix in checks:
        if bad:
            raise ValueError(
                f"the treetrain verl engine does not support {feature} yet; set it to {fix}, "
                "or use strategy=fsdp2 (verl's own engine) for this role"
            )


def _as_fsdp2(engine_config):
    """A copy of the role's engine config that verl's FSDP code reads as FSDP2 (``strategy`` is
    ``treetrain`` in the user's config: it picks this engine from the registry)."""
    if engine_config.strategy not in (BACKEND, "fsdp2"):
        raise ValueError(
            f"the treetrain engine runs on FSDP2; got engine strategy {engine_config.strategy!r}"
        )
    config = copy.copy(engine_config)
    object.__setattr__(config, "strategy", "fsdp2")
    return config


def _check_micro_batch(mb: TensorDict, vision: bool) -> None:
    flags = {
        "multi_modal_inputs": not vision and "multi_modal_inputs" in mb.keys(),  # noqa: SIM118 (a TensorDict)
        "distillation_use_topk": tu.get_non_tensor_data(mb, "distillation_use_topk", False),
        "calculate_sum_pi_squared": tu.get_non_tensor_data(mb, "calculate_sum_pi_squared", False),
        "use_fused_kernels": tu.get_non_tensor_data(mb, "use_fused_kernels", False),
    }
    for name, on in flags.items():
        if on:
            raise ValueError(f"the treetrain verl engine does not support {name} yet (got it in the batch)")


def _scalar_temperature(temperature) -> float:
    """verl's ``temperature``: a number, or one per row (all equal here: a tree shares its rows' hidden
    states, and one micro-batch's rows are sampled at one temperature)."""
    if not isinstance(temperature, torch.Tensor):
        return float(temperature)
    t = temperature.reshape(-1)
    if t.numel() == 0 or not bool((t == t[0]).all()):
        raise ValueError(f"per-row temperatures must be equal within a micro-batch, got {t.tolist()[:8]}")
    return float(t[0])


def _logits_keep_bytes(micro_batch: TensorDict, vocab: int) -> int:
    """Bytes of float32 logits the tree's head may keep for backward instead of recomputing them:
    what verl's own engine holds for one micro-batch under the same settings (``[tokens, vocab]``
    for ``max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``, else for this micro-batch's row
    tokens), and never less than treetrain's default (:data:`treetrain.logprobs.LOGITS_KEEP_BYTES`).
    A tree scores at most its rows' tokens, so it holds no more logits than verl would.

    Example: ``max_token_len_per_gpu = 16384``, vocab 151,936: 9.96 GB (verl's engine materializes
    that much); a tree of 9,000 scored positions keeps its 5.5 GB of logits, where the 1 GiB default
    would recompute the head matmul in backward (a third more head FLOPs)."""
    tokens = None
    if tu.get_non_tensor_data(micro_batch, "use_dynamic_bsz", True):
        tokens = tu.get_non_tensor_data(micro_batch, "max_token_len_per_gpu", None)
    if tokens is None:
        tokens = micro_batch["input_ids"].values().numel()
    return max(LOGITS_KEEP_BYTES, int(tokens) * vocab * 4)


def _lm_outputs(self: nn.Module, packed, src, labels, temperature: float, entropy: bool, chunk, keep: int):
    """(root method of the causal LM) log-probs and entropies ``[M]`` of the ``(src, labels)`` pairs.

    The model's exact head (:func:`treetrain.models.head.lm_head`: logit scales, softcap), then verl's
    division of the final logits by the temperature (``post = 1 / temperature``, after the cap);
    ``keep``: bytes of logits kept for backward (:func:`_logits_keep_bytes`). A vision-language
    model's tower runs on every forward (a blank image's features times 0 without images:
    :func:`~treetrain.integrations.verl_images.blank_image`)."""
    with blank_image(self, packed):
        hidden = tree_forward(self, packed)
    rows = hidden.index_select(0, src.to(hidden.device))
    head = self.get_output_embeddings()
    # its transforms as floats: FSDP must see no sharded parameter among the head call's arguments
    exact = lm_head(self)
    transforms = {
        "hidden_scale": exact.hidden_scale,
        "logit_scale": exact.logit_scale,
        "softcap": exact.softcap,
    }
    return getattr(head, _HEAD_METHOD)(
        rows, labels.to(hidden.device), chunk, entropy, transforms, 1.0 / temperature, keep
    )


def _head_logprobs(
    self: nn.Linear, rows, labels, chunk, entropy: bool, transforms: dict, post: float, keep: int
):
    """(method of the LM head) chunked log-softmax at ``labels``: ``[chunk, vocab]`` logits at a time,
    kept for backward while all of them fit ``keep`` bytes."""
    head = LMHead(self.weight, self.bias, **transforms)
    return target_logprobs(rows, head, labels, chunk, entropy, keep_bytes=keep, post=post)


def _values(self: nn.Module, packed):
    """(root method of the token classifier) the value of every tree token ``[T]``."""
    hidden = tree_forward(self, packed)
    dropout = getattr(self, "dropout", None)
    if dropout is not None:
        hidden = dropout(hidden)
    return self.score(hidden).squeeze(-1)


def _install(module: nn.Module, root_method, head: nn.Module | None = None) -> None:
    """Tree attention on ``module``; its tree entry point (and the head's) run through FSDP's hooks."""
    prepare_model(module)
    object.__setattr__(module, "_treetrain_classes", tuple(dict.fromkeys(type(m) for m in module.modules())))
    object.__setattr__(module, _TREE_METHOD, types.MethodType(root_method, module))
    if isinstance(module, FSDPModule):
        register_fsdp_forward_method(module, _TREE_METHOD)
    if head is not None:
        object.__setattr__(head, _HEAD_METHOD, types.MethodType(_head_logprobs, head))
        if isinstance(head, FSDPModule):
            register_fsdp_forward_method(head, _HEAD_METHOD)


class _TreeEngineMixin:
    """What both treetrain engines change in verl's FSDP engine: the micro-batches and their forward."""

    _VISION = False  # whether rows may carry images (the actor's engine)

    def _row_images(self, data: TensorDict):
        return row_images(data, self.module) if self._VISION else None

    def _tree_micro_batches(self, data: TensorDict):
        """verl's micro-batches, or with ``use_dynamic_bsz`` parts of the rank's tree under
        ``max_token_len_per_gpu`` distinct tokens, as many on every data-parallel rank."""
        if not tu.get_non_tensor_data(data, "use_dynamic_bsz", True):
            return prepare_micro_batches(
                data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True
            )
        if tu.get_non_tensor_data(data, "force_group_size", 1) != 1:
            raise ValueError(
                "the treetrain verl engine does not support force_group_size > 1 (reward-model pairs)"
            )
        ids = data["input_ids"]
        values, offsets = ids.values().cpu().numpy(), ids.offsets().cpu().numpy()
        rows = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        budget, longest = int(data["max_token_len_per_gpu"]), max(len(r) for r in rows)
        parts = split_rows(rows, budget, self.module, self._row_images(data)) if longest <= budget else []
        # agreed on by every rank before any raises (a rank raising alone would hang the others)
        agreed = torch.tensor([len(parts), longest, -len(rows)], device=get_device_name())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.get_data_parallel_group())
        count, longest, fewest_rows = int(agreed[0]), int(agreed[1]), -int(agreed[2])
        if longest > budget:
            raise ValueError(f"max_token_len_per_gpu ({budget}) must hold the longest row ({longest} tokens)")
        if count > fewest_rows:
            raise ValueError(
                f"a rank has {fewest_rows} rows for {count} micro-batches (every rank runs as many as the "
                "busiest): raise max_token_len_per_gpu or the mini-batch size"
            )
        indices = [p.tolist() for p in balanced_parts(parts, count)]
        return [tu.index_select_tensor_dict(data, idx) for idx in indices], indices

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False) -> list[TensorDict]:
        # verl's FSDPEngine.forward_backward_batch, micro-batches from _tree_micro_batches
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = self._tree_micro_batches(data)
        output_lst = []
        ctx = torch.no_grad() if forward_only else nullcontext()
        scaler = getattr(self, "scaler", None)
        for i, micro_batch in enumerate(micro_batches):
            sync_ctx = (
                nullcontext()
                if forward_only
                else self._gradient_sync_context(is_last_micro_batch=i == len(micro_batches) - 1)
            )
            with ctx, sync_ctx, torch.profiler.record_function(f"micro_batch{i}"):
                loss, meta_info = self.forward_step(
                    micro_batch, loss_function=loss_function, forward_only=forward_only
                )
                if not forward_only:
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    if not return_model_output:
                        meta_info.pop("model_output", None)
            output_lst.append(meta_info)
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        _check_micro_batch(micro_batch, self._VISION)
        check_unpatched(self.module._treetrain_classes)
        ids = micro_batch["input_ids"]  # the tree is built on the host, before the batch moves
        pos = micro_batch["position_ids"].values()
        rows = RowTree.build(ids.values(), ids.offsets(), pos, self.module, self._row_images(micro_batch))
        if pos.dim() == 2:  # verl's [4, N]: text, then the model's 3-D rotary positions
            check_rope_positions(pos[1:], rows.dfs, rows.packed, self.module)
        micro_batch = micro_batch.to(get_device_id())
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast_ctx = (
            nullcontext()
            if autocast_dtype == torch.float32
            else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)
        )
        with autocast_ctx:
            model_output = self._tree_model_output(micro_batch, rows)
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
                )
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
        return loss, output

    def _nested(self, flat: torch.Tensor, rows: RowTree) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(flat, rows.offsets.to(flat.device))


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])
class TreeEngineWithLMHead(_TreeEngineMixin, FSDPEngineWithLMHead):
    """verl's FSDP2 actor/reference engine; every micro-batch runs as one prefix tree."""

    _VISION = True

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        check_supported(model_config, engine_config, vision=True)
        super().__init__(model_config, _as_fsdp2(engine_config), optimizer_config, checkpoint_config)

    def _build_module(self):
        hf = self.model_config.hf_config
        saved = hf._attn_implementation
        hf._attn_implementation = "sdpa"  # loads on every device (tree attention replaces it)
        try:
            with without_verl_vision_patches():
                return super()._build_module()
        finally:
            hf._attn_implementation = saved

    def _build_model_optimizer(self):
        super()._build_model_optimizer()
        _install(self.module, _lm_outputs, self.module.get_output_embeddings())

    def _tree_model_output(self, micro_batch: TensorDict, rows: RowTree) -> dict:
        entropy = tu.get_non_tensor_data(micro_batch, "calculate_entropy", False)
        if tu.get_non_tensor_data(micro_batch, "distillation_only", False):
            raise ValueError("the treetrain verl engine does not support distillation_only yet")
        temperature = _scalar_temperature(micro_batch["temperature"])
        keep = _logits_keep_bytes(micro_batch, self.model_config.hf_config.get_text_config().vocab_size)
        logp, ent = getattr(self.module, _TREE_METHOD)(
            rows.packed, rows.src, rows.labels, temperature, entropy, None, keep
        )
        inverse = rows.inverse.to(logp.device)
        out = {"log_probs": self._nested(logp.index_select(0, inverse), rows)}
        if entropy:
            out["entropy"] = self._nested(ent.index_select(0, inverse), rows)
        return out


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cuda", "cpu"])
class TreeEngineWithValueHead(_TreeEngineMixin, FSDPEngineWithValueHead):
    """verl's FSDP2 critic engine; every micro-batch runs as one prefix tree."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        check_supported(model_config, engine_config)
        super().__init__(model_config, _as_fsdp2(engine_config), optimizer_config, checkpoint_config)

    def _build_module(self):
        # verl's FSDPEngine._build_module, value branch, loading with sdpa: verl.utils.model's
        # load_valuehead_model hard-codes flash_attention_2 (CUDA-only), which tree attention replaces.
        from transformers import AutoModelForTokenClassification
        from verl.utils.fsdp_utils import get_init_weight_context_manager
        from verl.utils.torch_dtypes import PrecisionType

        hf = self.model_config.hf_config
        hf.num_labels, hf.classifier_dropout, hf.hidden_dropout, hf.summary_dropout_prob = 1, 0.0, "0", 0.0
        dtype = self.engine_config.model_dtype or ("fp32" if not self.engine_config.forward_only else "bf16")
        dtype = PrecisionType.to_dtype(dtype)
        init = get_init_weight_context_manager(
            use_meta_tensor=not hf.tie_word_embeddings, mesh=self.device_mesh
        )
        with init(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = AutoModelForTokenClassification.from_pretrained(
                self.model_config.local_path,
                torch_dtype=dtype,
                config=hf,
                attn_implementation="sdpa",
                trust_remote_code=self.model_config.trust_remote_code,
            )
        module.to(dtype)
        if self.model_config.enable_gradient_checkpointing:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return module

    def _build_model_optimizer(self):
        super()._build_model_optimizer()
        if not hasattr(self.module, "score"):
            raise ValueError(
                f"the treetrain critic needs a token-classification value head (`score`), got "
                f"{type(self.module).__name__}"
            )
        _install(self.module, _values)

    def _tree_model_output(self, micro_batch: TensorDict, rows: RowTree) -> dict:
        values = getattr(self.module, _TREE_METHOD)(rows.packed)
        return {"values": self._nested(values.index_select(0, rows.dfs.to(values.device)), rows)}
