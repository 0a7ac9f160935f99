"""Training configuration: embedded defaults < YAML file < command-line flags.

One flat dataclass, :class:`TrainConfig`; the objective's own options (clip range, KL and entropy
coefficients, aggregation) live in its ``loss`` dict and are handed to
``treetrain.objectives.policy.config.Objective``.
Every bad value raises a ``ValueError`` that names the option and says how to fix it.

YAML example::

    data: my_trees.jsonl
    objective: grpo
    loss: {agg_mode: seq-mean-token-mean, clip_low: 0.2}
    steps: 200
    batch_trees: 8
    lr: 1.0e-5
    schedule: cosine
    warmup_steps: 10

``treetrain train --config run.yaml --lr 3e-5 --set loss.clip_low=0.3`` overrides ``lr`` and the clip.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetrain.data.grouping import GROUPINGS
from treetrain.objectives.registry import REGISTRY

__all__ = [
    "DEFAULT_STEPS",
    "TrainConfig",
    "config_from_args",
    "load_config",
    "validate",
]

DEFAULT_STEPS = 3  # when neither steps nor epochs is set: the README's "a few steps" demo
PACKINGS = ("tree", "sequence")
SCHEDULES = ("cosine", "linear", "constant")
DTYPES = ("auto", "float32", "bfloat16", "float64")
# options of which a later source setting one clears the others from earlier sources
EXCLUSIVE = (("steps", "epochs"),)


@dataclass
class TrainConfig:
    """Everything ``treetrain train`` needs. ``None`` means "derive it" (see each field)."""

    # data
    data: str | None = None  # JSONL file; None: the bundled sample
    data_format: str | None = None  # paths | messages | tree; None: detect per line
    columns: Any = None  # table sources: "field=column,..." or a mapping (treetrain.data.sources)
    group_rows: str = "consecutive"  # TRL rows with an equal prompt -> one tree (treetrain.data.rows)
    tokenizer: str | None = None  # for messages data: a local HF tokenizer dir, or "qwen"
    skip_oversized: bool = False  # drop (and count) paths longer than capacity instead of failing
    allow_invalid_tool_arguments: bool = False  # accept tool-call arguments that are no JSON object
    # model
    model: str | None = None  # HF model dir; a dir with only config.json: random init; None: tiny Qwen3
    attention: str | None = None  # tree attention backend (dense|blocksparse|flex|triton); None: by device
    # objective
    objective: str = "sft"  # sft | reinforce | grpo | ppo | gspo | dpo | reward | ppo_critic
    loss: dict[str, Any] = field(default_factory=dict)  # the objective's options (objectives.policy.config)
    reference: str = "model"  # KL reference: model (frozen initial copy) | data (ref_logprobs field)
    ref_model: str | None = None  # dpo: the frozen reference model's directory; None: the initial weights
    advantages: str | None = None  # group | batch | none: GRPO advantages from per-path rewards
    # batching
    packing: str = "tree"  # tree: shared prefixes once; sequence: every path its own sequence
    capacity: int = 8192  # tokens per micro-batch (distinct tokens in tree mode)
    cp: int = 1  # context-parallel ranks per tree (torchrun; world = dp x cp); capacity is per rank
    batch_trees: int = 1  # trees per optimizer step (a tree is never split across steps)
    steps: int | None = None  # optimizer steps; None: from epochs, else DEFAULT_STEPS
    epochs: float | None = None  # passes over the data (fractional allowed)
    # optimizer and schedule
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "cosine"  # cosine | linear | constant, after warmup
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # final lr / peak lr for cosine and linear decay
    grad_clip: float | None = 1.0  # max global grad norm; None or 0: no clipping
    # run
    output: str | None = None  # None: runs/train, or runs/train-N when that holds an earlier run (rundir)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 autocast on CUDA, float32 on CPU) | float32 | bfloat16 | float64
    activation_checkpointing: bool = False
    prefetch: int = 2  # batches prepared ahead in a background thread; 0: inline
    checkpoint_every: int = 0  # optimizer steps between resumable checkpoints; 0: only the final model
    keep_checkpoints: int = 2  # the newest N checkpoints are kept, older ones deleted
    eval_data: str | None = None  # held-out data file: the objective's loss on it, logged as eval/...
    eval_every: int = 0  # optimizer steps between evaluations on eval_data; 0: after the last step only
    resume: bool = False  # continue from the latest checkpoint in output/checkpoints
    overwrite: bool = False  # replace an earlier run's files in output (other files are kept)
    trust_remote_code: bool = False  # let --model / --tokenizer directories run their own Python code
    max_line_bytes: int = 256 * 2**20  # a longer JSONL line is an error (read in bounded memory)
    plot: bool = False  # write output/training.png (loss and throughput)
    progress: bool = True  # tqdm progress bar
    # LoRA adapter through PEFT (treetrain.models.lora); lora_r 0: full fine-tuning
    lora_r: int = 0
    lora_alpha: float | None = None  # None: 2 * lora_r
    lora_targets: str | None = None  # comma-separated module names; None: PEFT's default
    lora_dropout: float = 0.0
    peft_config: Any = None  # YAML mapping of peft.LoraConfig fields, or a peft.LoraConfig
    report_to: str = "none"  # trackers, comma-separated: tensorboard,wandb,mlflow,trackio | none
    lazy_validate: bool = False  # check records as they are read, not the whole file before step 1
    allow_data_change: bool = False  # --resume even if the data file changed since the checkpoint
    verbose: bool = False  # library loggers (torch.distributed, ...) at their own levels

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, peft_config=None))
        d["betas"] = list(self.betas)
        if self.peft_config is not None:
            from treetrain.models.lora import peft_config_dict

            d["peft_config"] = peft_config_dict(self.peft_config)
        return d


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}

# ---- merging sources ---------------------------------------------------------------------------


# what other trainers (HF Trainer and TRL, torchtune, axolotl) call an option: hints for unknown keys
OTHER_NAMES = {
    "learning_rate": "lr", "max_steps": "steps", "num_train_epochs": "epochs",
    "output_dir": "output", "model_name_or_path": "model", "dataset": "data", "train_file": "data",
    "per_device_train_batch_size": "batch_trees", "batch_size": "batch_trees",
    "lr_scheduler_type": "schedule", "lr_scheduler": "schedule", "num_warmup_steps": "warmup_steps",
    "max_grad_norm": "grad_clip", "clip_grad_norm": "grad_clip", "gradient_clipping": "grad_clip",
    "gradient_checkpointing": "activation_checkpointing", "enable_activation_checkpointing":
    "activation_checkpointing", "save_steps": "checkpoint_every", "save_total_limit": "keep_checkpoints",
    "eval_steps": "eval_every", "eval_dataset": "eval_data", "eval_file": "eval_data",
    "resume_from_checkpoint": "resume", "tokenizer_name_or_path": "tokenizer", "torch_dtype": "dtype",
    "bf16": "dtype", "lora_rank": "lora_r", "lora_target_modules": "lora_targets",
    "ref_model_name_or_path": "ref_model",
}  # fmt: skip


def _loss_option_names() -> set[str]:
    """The objectives' own options (``loss.*``): a top-level key among them belongs under ``loss``."""
    import dataclasses as dc

    from treetrain.objectives.policy.config import Objective
    from treetrain.objectives.preference.loss import PreferenceObjective

    return {f.name for cls in (Objective, PreferenceObjective) for f in dc.fields(cls)} - {"name"}


def _unknown(key: str, source: str) -> ValueError:
    """The unknown option named, with the nearest one (or the one another trainer's name means)."""
    near = OTHER_NAMES.get(key) or next(iter(difflib.get_close_matches(key, FIELDS, n=1)), None)
    if near is not None:
        hint = f"did you mean {near!r}?"
    elif key in _loss_option_names():
        hint = f"an objective option: put it under loss, as loss: {{{key}: ...}} or --set loss.{key}=..."
    else:
        hint = "treetrain train --help lists every option; flag --some-name is option some_name"
    return ValueError(f"{source}: unknown option {key!r} ({hint})")


def merge(cfg: TrainConfig, values: Mapping[str, Any], source: str) -> TrainConfig:
    """``cfg`` with ``values`` applied on top (``source`` names them in errors).

    ``loss`` dicts merge key by key. Setting one of ``steps``/``epochs`` clears the other, so a
    command-line ``--epochs`` overrides a YAML ``steps``.
    """
    out = dataclasses.replace(cfg, loss=dict(cfg.loss))
    given = {k.replace("-", "_") for k, v in values.items() if v is not None}
    for group in EXCLUSIVE:
        if len(given.intersection(group)) > 1:
            names = " and ".join(f"--{k}" for k in group)
            raise ValueError(f"{source}: {names} both set the length of the run; set only one of them")
    for key, value in values.items():
        key = key.replace("-", "_")
        if key not in FIELDS:
            raise _unknown(key, source)
        if key in ("peft_config", "columns") and isinstance(value, Mapping):
            value = dict(value)
        if key == "loss":
            if not isinstance(value, Mapping):
                raise ValueError(f"{source}: loss must be a mapping of objective options, got {value!r}")
            out.loss.update(value)
            continue
        for group in EXCLUSIVE:
            if key in group and value is not None:
                for other in group:
                    if other != key:
                        setattr(out, other, None)
        setattr(out, key, value)
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict (validated later, with everything else)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config: no such file {str(path)!r}; pass the path of a YAML config file")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(values, Mapping):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    return dict(values)


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """``["lr=1e-4", "loss.kl_coef=0.1"]`` -> ``{"lr": 1e-4, "loss": {"kl_coef": 0.1}}`` (YAML values)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE (--set lr=1e-4, --set loss.kl_coef=0.1)")
        value = yaml.safe_load(raw) if raw else None
        head, dot, sub = key.partition(".")
        if dot:
            if head != "loss":
                raise ValueError(f"--set {item!r}: only loss.* options are nested; use --set {sub}=...")
            out.setdefault("loss", {})[sub] = value
        else:
            out[head] = value
    return out


# ---- validation --------------------------------------------------------------------------------


def _coerce(name: str, value: Any, kind: type, source: str = "") -> Any:
    flag = f"--{name.replace('_', '-')}"
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{flag}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise ValueError(f"{flag}: expected an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)  # YAML reads "1e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{flag}: expected a finite number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{flag}: expected a string, got {value!r}")
        return value
    raise AssertionError(kind)


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        near = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ValueError(
            f"--{name.replace('_', '-')}: expected one of {', '.join(choices)}; got {value!r}{hint}"
        )


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"--{name.replace('_', '-')}: must be {need} number, got {value!r}")


_SAFETY_BOOLS = ("lazy_validate", "allow_data_change", "verbose")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check and normalize every option; returns a new config with types coerced."""
    c = dataclasses.replace(cfg, loss=dict(cfg.loss))
    for name in ("data", "data_format", "tokenizer", "model", "attention", "ref_model", "advantages"):
        if getattr(c, name) is not None:
            setattr(c, name, _coerce(name, getattr(c, name), str))
    for name in ("output", "eval_data"):
        if getattr(c, name) is not None:
            setattr(c, name, _coerce(name, getattr(c, name), str))
    for name in ("objective", "reference", "packing", "schedule", "device", "dtype"):
        setattr(c, name, _coerce(name, getattr(c, name), str))
    for name in ("skip_oversized", "activation_checkpointing", "resume", "plot", "progress", *_SAFETY_BOOLS):
        setattr(c, name, _coerce(name, getattr(c, name), bool))
    for name in ("allow_invalid_tool_arguments",):
        setattr(c, name, _coerce(name, getattr(c, name), bool))
    for name in ("overwrite", "trust_remote_code"):
        setattr(c, name, _coerce(name, getattr(c, name), bool))
    for name in ("capacity", "batch_trees", "warmup_steps", "seed", "prefetch", "checkpoint_every"):
        setattr(c, name, _coerce(name, getattr(c, name), int))
    c.keep_checkpoints = _coerce("keep_checkpoints", c.keep_checkpoints, int)
    _positive("keep_checkpoints", c.keep_checkpoints)
    c.eval_every = _coerce("eval_every", c.eval_every, int)
    _positive("eval_every", c.eval_every, allow_zero=True)
    if c.eval_every and c.eval_data is None:
        raise ValueError(f"--eval-every {c.eval_every}: there is nothing to evaluate; pass --eval-data FILE")
    c.max_line_bytes = _coerce("max_line_bytes", c.max_line_bytes, int)
    _positive("max_line_bytes", c.max_line_bytes)
    c.cp = _coerce("cp", c.cp, int)
    _positive("cp", c.cp)
    if c.cp > 1 and c.packing != "tree":
        raise ValueError(f"--cp {c.cp}: context parallelism splits packed trees; use --packing tree")
    for name in ("lr", "eps", "weight_decay", "min_lr_ratio"):
        setattr(c, name, _coerce(name, getattr(c, name), float))

    _choice("objective", c.objective, tuple(REGISTRY))
    _choice("packing", c.packing, PACKINGS)
    _choice("schedule", c.schedule, SCHEDULES)
    _choice("dtype", c.dtype, DTYPES)
    _choice("reference", c.reference, ("model", "data"))
    if c.data_format is not None:
        _choice("data_format", c.data_format, ("paths", "messages", "tree", "preference"))
    if c.advantages is not None:
        _choice("advantages", c.advantages, ("group", "batch", "none"))
    _positive("capacity", c.capacity)
    _positive("batch_trees", c.batch_trees)
    _positive("lr", c.lr)
    _positive("eps", c.eps)
    _positive("weight_decay", c.weight_decay, allow_zero=True)
    _positive("warmup_steps", c.warmup_steps, allow_zero=True)
    _positive("prefetch", c.prefetch, allow_zero=True)
    _positive("checkpoint_every", c.checkpoint_every, allow_zero=True)
    if not 0.0 <= c.min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio: must be in [0, 1] (final lr / peak lr), got {c.min_lr_ratio}")

    if c.steps is not None and c.epochs is not None:
        raise ValueError("--steps and --epochs: both set the length of the run; set only one of them")
    if c.steps is not None:
        c.steps = _coerce("steps", c.steps, int)
        _positive("steps", c.steps)
    if c.epochs is not None:
        c.epochs = _coerce("epochs", c.epochs, float)
        _positive("epochs", c.epochs)
    if c.steps is not None and c.warmup_steps >= c.steps > 1:
        raise ValueError(
            f"--warmup-steps: {c.warmup_steps} warmup steps leave no training at full lr in {c.steps} "
            f"steps; use fewer warmup steps or more --steps"
        )

    if c.grad_clip is not None:
        c.grad_clip = _coerce("grad_clip", c.grad_clip, float)
        _positive("grad_clip", c.grad_clip, allow_zero=True)
        c.grad_clip = c.grad_clip or None

    betas = c.betas
    if isinstance(betas, str):
        betas = [b for b in betas.replace(",", " ").split() if b]
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"--betas: expected two numbers (beta1 beta2), got {c.betas!r}")
    betas = tuple(_coerce("betas", b, float) for b in betas)
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"--betas: each must be in [0, 1), e.g. 0.9 0.95; got {betas}")
    c.betas = betas

    if c.device != "auto" and not (c.device == "cpu" or c.device.startswith("cuda")):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N; got {c.device!r}")
    if c.attention is not None:
        _choice("attention", c.attention, ("dense", "blocksparse", "flex", "triton"))
    if not isinstance(c.loss, dict) or not all(isinstance(k, str) for k in c.loss):
        raise ValueError(f"loss: expected a mapping of objective option names to values, got {c.loss!r}")
    c.lora_r = _coerce("lora_r", c.lora_r or 0, int)
    c.lora_dropout = _coerce("lora_dropout", c.lora_dropout or 0.0, float)
    if c.lora_alpha is not None:
        c.lora_alpha = _coerce("lora_alpha", c.lora_alpha, float)
    if c.lora_targets is not None and not isinstance(c.lora_targets, str):  # YAML list
        c.lora_targets = ",".join(map(str, c.lora_targets))
    _choice("group_rows", c.group_rows, GROUPINGS)
    if c.columns is not None:
        from treetrain.data.sources import parse_columns

        c.columns = parse_columns(c.columns)
    if not isinstance(c.report_to, str):  # YAML list
        c.report_to = ",".join(map(str, c.report_to or ["none"]))
    from treetrain.train.trackers import parse_report_to

    parse_report_to(c.report_to)  # known names, libraries installed
    if c.lora_r or c.peft_config is not None or c.lora_alpha is not None or c.lora_targets:
        from treetrain.models.lora import config_from_train

        config_from_train(c)  # checks the adapter options (and that peft is installed)
    return c


# ---- command line (the flags: treetrain.train.flags) ---------------------------------------------


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``--config``, then the flags that were given, then ``--set``; validated."""
    cfg = TrainConfig()
    if getattr(args, "config", None):
        cfg = merge(cfg, load_config(args.config), f"--config {args.config}")
    flags = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    cfg = merge(cfg, flags, "command line")
    if getattr(args, "set", None):
        cfg = merge(cfg, parse_set(args.set), "--set")
    return validate(cfg)
