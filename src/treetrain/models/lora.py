"""LoRA adapters through PEFT: the tree forward runs unchanged inside a ``peft.PeftModel``.

PEFT replaces the targeted ``nn.Linear`` layers by LoRA layers; attention still goes through the
``treetrain`` attention function and recurrent layers keep their tree routing, so every path
gets the gradients of its own per-path forward, now of the adapter's parameters only. The final
model is the adapter (``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``),
loadable with ``peft.PeftModel.from_pretrained(base_model, OUTPUT/final)``.

Command line: ``--lora-r 16 --lora-alpha 32 --lora-targets q_proj,v_proj --lora-dropout 0.05``;
YAML/Python: ``peft_config: {r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}`` (any
``peft.LoraConfig`` field) or a ``peft.LoraConfig`` object.

>>> model = apply_lora(model, lora_config(r=8, alpha=16, targets="q_proj,v_proj"))
>>> path_logprobs(model, [[1, 2, 3], [1, 2, 4]])  # tree attention, LoRA gradients
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "add_lora_arguments",
    "apply_lora",
    "is_peft_model",
    "lora_config",
    "peft_config_of",
    "save_adapter",
]


def _peft():
    try:
        import peft
    except ImportError:
        raise ValueError("LoRA needs the peft package: pip install 'treetrain[lora]'") from None
    return peft


def lora_config(
    r: int,
    alpha: float | None = None,
    targets: str | list[str] | None = None,
    dropout: float = 0.0,
    **extra: Any,
):
    """A ``peft.LoraConfig`` for a causal LM. ``targets``: module names, comma-separated or a
    list (``None``: PEFT's default for the architecture); ``alpha`` defaults to ``2 * r``."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"--lora-r: the adapter rank must be a positive integer, got {r!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"--lora-dropout: must be in [0, 1), got {dropout!r}")
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
        if not targets:
            raise ValueError("--lora-targets: expected module names, e.g. q_proj,k_proj,v_proj,o_proj")
    kwargs = dict(
        r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=targets, lora_dropout=dropout
    )
    return _peft().LoraConfig(task_type="CAUSAL_LM", **(kwargs | extra))


def peft_config_of(value) -> Any:
    """``peft_config`` from YAML (a mapping of ``LoraConfig`` fields) or Python (a ``PeftConfig``)."""
    peft = _peft()
    if isinstance(value, peft.PeftConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"peft_config: expected a mapping of peft.LoraConfig fields, got {value!r}")
    fields = dict(value)
    fields.setdefault("task_type", "CAUSAL_LM")
    try:
        return peft.LoraConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"peft_config: not a valid peft.LoraConfig ({e})") from None


def peft_config_dict(value) -> dict[str, Any]:
    """JSON-ready fields of a ``peft_config`` (a mapping, or a ``PeftConfig``: sets become lists)."""
    fields = dict(value) if isinstance(value, Mapping) else value.to_dict()
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in fields.items()}


def config_from_train(cfg) -> Any | None:
    """The adapter config a ``TrainConfig`` asks for (``lora_r`` or ``peft_config``), or None."""
    if cfg.lora_r and cfg.peft_config is not None:
        raise ValueError("--lora-r and peft_config both configure the adapter; set only one of them")
    if cfg.peft_config is not None:
        return peft_config_of(cfg.peft_config)
    if cfg.lora_r:
        return lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout)
    if cfg.lora_alpha is not None or cfg.lora_targets is not None or cfg.lora_dropout:
        raise ValueError("--lora-alpha, --lora-targets and --lora-dropout need --lora-r (the adapter rank)")
    return None


def is_peft_model(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # not imported: no PeftModel exists (and importing it takes ~0.6 s)
    return peft is not None and isinstance(model, peft.PeftModel)


def apply_lora(model: nn.Module, config) -> nn.Module:
    """Wrap a (tree-prepared) causal LM in a ``PeftModel``: only the adapter trains."""
    from treetrain.models.hf import prepare_model

    prepare_model(model)  # before wrapping: PEFT's layers then sit inside the tree-aware modules
    peft = _peft()
    try:
        with warnings.catch_warnings():
            # PeftModel.__init__ (peft 0.21) reads the model's ``is_gradient_checkpointing``, an alias
            # transformers 5 deprecates with a FutureWarning on every read: a warning about PEFT's code
            # that no user can act on; treetrain reads no deprecated attribute itself
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"LoRA: {e} (name the layers with --lora-targets, e.g. q_proj,v_proj)") from None


def save_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """``save_pretrained`` of the adapter alone (``adapter_config.json``, safetensors weights).

    Collective under FSDP: the full state dict is gathered, rank 0 writes.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = Path(out_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        model.save_pretrained(out, state_dict=full, is_main_process=True)
    if dist.is_initialized():
        dist.barrier()
    return out


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapter (PEFT)")
    g.add_argument(
        "--lora-r", type=int, help="train a LoRA adapter of this rank instead of the model (default off)"
    )
    g.add_argument("--lora-alpha", type=float, help="LoRA scaling numerator (default 2 * rank)")
    g.add_argument(
        "--lora-targets",
        help="comma-separated module names, e.g. q_proj,k_proj,v_proj,o_proj (default: PEFT's per "
        "architecture); or all-linear",
    )
    g.add_argument("--lora-dropout", type=float, help="dropout on the adapter's input (default 0)")
