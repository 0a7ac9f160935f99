"""The training loop behind ``treetrain train``.

One optimizer step takes ``batch_trees`` whole trees (a tree never straddles two steps):

1. the loss normalizer is computed over those whole trees, before anything runs;
2. ``packing="tree"``: a tree with more distinct tokens than ``capacity`` is partitioned into parts
   of whole paths, and trees and parts are packed together into micro-batches;
   ``packing="sequence"`` (the baseline, :mod:`treetrain.baseline`): every path becomes its own
   sequence (a one-path tree, so the mask is block-diagonal causal), packed into micro-batches under
   the same token budget; both are :mod:`treetrain.strategies` objects with the same loss entry;
3. every micro-batch runs forward and backward; its loss is already divided by the global
   normalizer, so accumulating gradients over micro-batches gives the full-batch gradient;
4. grad clipping, AdamW step, LR schedule step, one line of ``metrics.jsonl``.

Under ``torchrun`` (FSDP2, :mod:`treetrain.distributed`) every rank reads the same trees, the
step's trees and parts are assigned to ranks by FLOP cost, every rank runs as many passes as the
busiest one (idle passes add zero gradient) and gradients and metrics are summed over ranks, so a
step equals the single-process step. A non-finite loss or gradient norm stops the run before the
optimizer step (:class:`NonFiniteError`), leaving the last checkpoint as it was.

The pieces are small functions (``build_model``, ``make_batches``, ``train_step``, ``log_metrics``,
...) so that FSDP2 and resumable checkpoints slot in without reshaping the loop.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from . import distributed
from .baseline import sequence_loss, sequence_parts  # noqa: F401  (the baseline's home: baseline.py)
from .checkpoint import CheckpointError
from .config import DEFAULT_STEPS, TrainConfig, add_train_arguments, config_from_args, validate
from .lora import apply_lora, is_peft_model, save_adapter
from .lora import config_from_train as lora_config_of
from .packing import PackedTree, pack
from .sources import is_table_source
from .strategies import get_strategy
from .trackers import open_trackers
from .tree import TrajectoryTree

__all__ = [
    "StepBatch",
    "add_parser",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "default_model_config",
    "lr_factor",
    "make_batches",
    "make_microbatches",
    "train",
    "train_step",
]

SAMPLE = "agent-dialogues"  # the bundled sample ``treetrain train`` uses by default
METRIC_FIELDS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "tree_tokens",
    "computed_tokens",
    "por",
    "err",
    "tokens_per_s",
    "peak_memory",
)

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


def build_model(
    model: str | None,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    auto_class: str | None = None,
    *,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A causal LM from a local directory (weights, or only ``config.json``: random init from
    ``seed``) or, with ``model=None``, the embedded tiny Qwen3 config (random init). A directory
    whose model needs its own Python code is refused unless ``trust_remote_code``.

    ``auto_class``: another transformers auto class by name (``AutoModelForSequenceClassification``
    for reward models, built with ``num_labels=1``)."""
    import transformers

    auto = transformers.AutoModelForCausalLM
    if auto_class is not None:
        auto = getattr(transformers, auto_class)

    torch.manual_seed(seed)
    if model is None:
        config = default_model_config()
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {model}: not a Hugging Face model directory (no config.json); pass a local "
                f"directory saved with save_pretrained, or one with only config.json for random init"
            )
        weights = [*path.glob("*.safetensors"), *path.glob("*.bin")]
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
    from .models import prepare_model

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


# ---- data --------------------------------------------------------------------------------------


@dataclass
class StepBatch:
    """The work of one optimizer step: its whole trees and the packed micro-batches that run."""

    trees: list[TrajectoryTree]
    micro: list[PackedTree]
    trees_consumed: int  # trees read from the stream so far, this batch included (data state)
    packing: str  # how ``micro`` was made: tree, or sequence (one-path trees, the baseline)
    passes: int = 0  # forward/backward passes every rank runs (the busiest rank's); 0: len(micro)
    all_computed_tokens: int | None = None  # tokens computed on all ranks; None: len of this micro
    imbalance: float = 1.0  # FLOPs of the busiest data-parallel rank / the mean (parallel.balance)
    path_tokens: int = field(init=False)  # what the per-path baseline computes
    tree_tokens: int = field(init=False)  # distinct tokens of the whole trees (perfect reuse)
    computed_tokens: int = field(init=False)  # what the micro-batches actually run

    def __post_init__(self) -> None:
        self.path_tokens = sum(t.num_path_tokens for t in self.trees)
        self.tree_tokens = sum(t.num_tokens for t in self.trees)
        self.computed_tokens = sum(p.num_tokens for p in self.micro)
        if self.all_computed_tokens is not None:
            self.computed_tokens = self.all_computed_tokens
        self.passes = self.passes or len(self.micro)

    @property
    def por(self) -> float:
        """Potential overlap ratio of the batch: ``1 - tree_tokens / path_tokens``."""
        return 1.0 - self.tree_tokens / self.path_tokens

    @property
    def err(self) -> float:
        """Effective reuse ratio: share of the possible saving the micro-batches realize
        (1 when nothing could be saved)."""
        possible = self.path_tokens - self.tree_tokens
        return (self.path_tokens - self.computed_tokens) / possible if possible else 1.0


def data_path(cfg: TrainConfig) -> Path:
    """``--data``, or the bundled sample."""
    if cfg.data is None:
        from .data import sample_path

        return Path(sample_path(SAMPLE))
    path = Path(cfg.data)
    if not path.is_file() and not (path.is_dir() and is_table_source(path)):
        raise ValueError(
            f"--data {cfg.data}: no such file; pass a JSONL file of trees, a Parquet/Arrow file or a "
            "datasets.save_to_disk directory (or omit for the sample)"
        )
    return path


def _reader_options(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """``treetrain.data`` reader options from the config."""
    return {
        "format": cfg.data_format,
        "vocab_size": vocab_size,
        "capacity": cfg.capacity,
        "skip_oversized": cfg.skip_oversized,
        "tokenizer": _tokenizer(cfg.tokenizer, cfg.trust_remote_code) if cfg.tokenizer else None,
        "max_line_bytes": cfg.max_line_bytes,
        "columns": cfg.columns,
    }


def _per_tree_budget(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the token budget of one packed tree: ``--capacity`` is per rank, and ``--cp N``
    ranks share each tree."""
    return dataclasses.replace(cfg, capacity=cfg.capacity * cfg.cp) if cfg.cp > 1 else cfg


@functools.lru_cache(maxsize=2)
def _tokenizer(name: str, trust_remote_code: bool):
    """``--tokenizer``, loaded once per run (code in its directory runs only with ``trust_remote_code``)."""
    from .chat import load_tokenizer

    with refuse_remote_code("--tokenizer", name):
        return load_tokenizer(name, trust_remote_code=trust_remote_code)


def _read_trees(cfg: TrainConfig, vocab_size: int) -> Iterator[TrajectoryTree]:
    """One lazy pass over the data file; errors name file, line and field."""
    from .data import iter_trees

    for tree, _info in iter_trees(data_path(cfg), **_reader_options(cfg, vocab_size)):
        if cfg.objective == "ppo_critic":  # rewards per path, no advantages: named by file and line
            from .critic import check_record

            check_record(tree, _info)
        yield tree


def count_trees(cfg: TrainConfig, vocab_size: int) -> int:
    """Trees in the data file (one validating pass: every bad record is listed), for ``--epochs``."""
    from .data import validate_file

    counts = validate_file(data_path(cfg), **_reader_options(cfg, vocab_size))
    if counts.samples == 0:
        raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")
    return counts.samples


def tree_stream(
    cfg: TrainConfig, vocab_size: int, skip: int = 0, total: int | None = None
) -> Iterator[TrajectoryTree]:
    """Trees in file order, epoch after epoch, lazily: trees ``skip`` (resume) to ``total`` (the end
    of a fractional last epoch; None: no end) of that endless stream."""
    stream = _epochs(cfg, vocab_size)
    first = next(stream, None)
    if first is None:
        raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")
    return itertools.islice(itertools.chain([first], stream), skip, total)


def _epochs(cfg: TrainConfig, vocab_size: int) -> Iterator[TrajectoryTree]:
    """The data file's trees, epoch after epoch; an epoch without a tree is an error (not a spin)."""
    for _ in itertools.count():
        n = 0
        for n, tree in enumerate(_read_trees(cfg, vocab_size), start=1):  # noqa: B007
            yield tree
        if n == 0:
            raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")


def make_microbatches(trees: list[TrajectoryTree], packing: str, capacity: int) -> list[list[TrajectoryTree]]:
    """Group the step's trees into micro-batches of at most ``capacity`` tokens each.

    ``tree``: whole trees, those larger than ``capacity`` partitioned into parts of whole paths.
    ``sequence``: every path its own sequence. See :mod:`treetrain.strategies`.
    """
    return get_strategy(packing).microbatches(trees, capacity)


def rank_microbatches(
    trees: list[TrajectoryTree], packing: str, capacity: int, rank: int, world_size: int, model_config
) -> tuple[list[list[TrajectoryTree]], int, int, float]:
    """This rank's micro-batches, the most any rank has, the tokens all ranks compute and the
    FLOP imbalance (:meth:`treetrain.strategies.TreePacking.rank_plan`). Idle ranks pad with dummy
    passes."""
    return get_strategy(packing).rank_plan(trees, capacity, rank, world_size, model_config)


def make_batches(
    cfg: TrainConfig,
    vocab_size: int,
    steps: int,
    start_tree: int = 0,
    *,
    rank: int = 0,
    world_size: int = 1,
    model_config=None,
    total_trees: int | None = None,
) -> Iterator[StepBatch]:
    """``steps`` optimizer-step batches of ``batch_trees`` trees, packed and ready to run.

    With ``world_size > 1`` each batch holds every tree of the step (for the loss normalizer and
    the metrics) but only this rank's micro-batches (:func:`rank_microbatches`).
    """
    stream = tree_stream(cfg, vocab_size, skip=start_tree, total=total_trees)
    consumed = start_tree
    for _ in range(steps):
        trees = list(itertools.islice(stream, cfg.batch_trees))
        if not trees:  # the run's last tree was read (``--epochs``)
            return
        if cfg.advantages is not None:  # per-path rewards -> group-normalized advantages
            from .advantages import assign_advantages

            trees = assign_advantages(trees, cfg.advantages)
        consumed += len(trees)
        if cfg.objective in ("dpo", "reward"):  # whole pairs per micro-batch
            from .objectives_preference import pair_microbatches

            if world_size > 1:
                raise ValueError(f"--objective {cfg.objective}: one process only (no torchrun) for now")
            micro = [pack(mb) for mb in pair_microbatches(trees, cfg.packing, cfg.capacity)]
            yield StepBatch(trees=trees, micro=micro, trees_consumed=consumed, packing=cfg.packing)
            continue
        if world_size == 1:
            micro = [pack(mb) for mb in make_microbatches(trees, cfg.packing, cfg.capacity)]
            yield StepBatch(trees=trees, micro=micro, trees_consumed=consumed, packing=cfg.packing)
            continue
        mine, passes, computed, imbalance = rank_microbatches(
            trees, cfg.packing, cfg.capacity, rank, world_size, model_config
        )
        yield StepBatch(
            trees=trees,
            micro=[pack(mb) for mb in mine],
            trees_consumed=consumed,
            packing=cfg.packing,
            passes=passes,
            all_computed_tokens=computed,
            imbalance=imbalance,
        )


def prefetched(batches: Iterator[StepBatch], depth: int) -> Iterable[StepBatch]:
    """Prepare batches ``depth`` ahead in a background thread (tokenize, partition, pack)."""
    if depth <= 0:
        return batches
    from .data import prefetch

    return prefetch(batches, depth)


# ---- one optimizer step ------------------------------------------------------------------------


def build_objective(cfg: TrainConfig):
    """``treetrain.losses.Objective`` from ``--objective`` and the ``loss`` options (dpo and reward:
    ``treetrain.objectives_preference.PreferenceObjective``)."""
    from .losses import Objective
    from .objectives_preference import PREFERENCE_OBJECTIVES, PreferenceObjective

    if cfg.objective == "ppo_critic":  # the policy's ppo objective; the critic's options: treetrain.critic
        from .critic import policy_objective

        return policy_objective(cfg)
    cls = PreferenceObjective if cfg.objective in PREFERENCE_OBJECTIVES else Objective
    known = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    unknown = sorted(set(cfg.loss) - set(known))
    if unknown:
        raise ValueError(
            f"loss: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"valid loss options: {', '.join(known)} (for --objective {cfg.objective})"
        )
    try:
        return cls(name=cfg.objective, **cfg.loss)
    except TypeError as e:
        raise ValueError(f"loss: {e}; see {cls.__module__}.{cls.__name__} for the options") from None


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite; the step was not applied."""


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    objective,
    *,
    grad_clip: float | None,
    autocast_dtype: torch.dtype | None = None,
    ref_model: nn.Module | None = None,
    backend: str | None = None,
    cp=None,
    critic=None,
) -> dict[str, float]:
    """Forward and backward over every micro-batch, then clip and step.

    The normalizer comes from the whole trees of the step, so the micro-batch losses sum to the
    full-batch loss and the accumulated gradient is the full-batch gradient. Returns the step's
    objective metrics (``treetrain.losses.summarize_metrics`` of the summed micro-batch metrics)
    plus ``grad_norm`` (before clipping).
    """
    from . import moe_aux
    from . import objectives_preference as pref
    from .losses import loss_normalizer, summarize_metrics

    loss_fn = get_strategy(batch.packing).loss
    device = next(model.parameters()).device
    if isinstance(objective, pref.PreferenceObjective):  # dpo, reward: per-path tensors, either packing
        loss_fn = functools.partial(pref.compute_preference_loss, packing=batch.packing)
        normalizer, summarize_metrics = pref.preference_normalizer(batch.trees), pref.summarize_preference
    else:
        normalizer = loss_normalizer(batch.trees, objective)
    if critic is not None:  # ppo_critic: GAE advantages from the value model (treetrain.critic)
        from .critic import summarize as summarize_metrics

        loss_fn = critic.loss_fn(batch.trees, batch.packing)
    sums: dict[str, torch.Tensor] = {}
    cp_size = cp.cp_size if cp is not None else 1  # parallel.cp.CPLayout: ranks sharing each tree
    aux_coef = moe_aux.aux_coef(model)  # MoE router load-balancing loss, see treetrain.moe_aux
    for packed in batch.micro:
        cp_scope = cp.scope() if cp is not None else contextlib.nullcontext()
        with autocast_context(device, autocast_dtype), cp_scope, moe_aux.recording(model, aux_coef) as router:
            loss, metrics = loss_fn(
                model, packed.to(device), objective, normalizer, ref_model=ref_model, backend=backend
            )
        if aux_coef is not None:
            share = sum(t.num_path_tokens for t in packed.trees) / batch.path_tokens
            aux = share * moe_aux.micro_batch_aux_loss(model, packed, batch.packing, router)
            loss, metrics["aux_loss"] = loss + aux_coef * aux, aux.detach()
        loss.backward()
        for k, v in metrics.items():
            sums[k] = sums[k] + v.double() if k in sums else v.double()
    for _ in range(batch.passes - len(batch.micro)):  # FSDP's collectives need every rank's pass
        with autocast_context(device, autocast_dtype):
            idle = distributed.dummy_loss(model, backend)
        idle.backward()
    sums = distributed.all_reduce_sum_dict(sums)
    if cp_size > 1:  # every rank of a context-parallel group computed the same full metrics
        sums = {k: v / cp_size for k, v in sums.items()}
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip else float("inf")
    grad_norm = distributed.clip_grad_norm_(params, max_norm)
    out = summarize_metrics(sums) | {"grad_norm": float(grad_norm)}
    if "aux_loss" in sums:
        out["aux_loss"] = float(sums["aux_loss"])
    if critic is not None:  # its own gradient norm and clip
        out["critic_grad_norm"] = critic.clip(grad_clip)
    finite = math.isfinite(out.get("loss", 0.0)) and math.isfinite(out["grad_norm"])
    if not (finite and math.isfinite(out.get("critic_grad_norm", 0.0))):
        optimizer.zero_grad(set_to_none=True)  # the same values on every rank: all stop together
        if critic is not None:
            critic.optimizer.zero_grad(set_to_none=True)
        norms = f"{out['grad_norm']}" + (f", critic {out['critic_grad_norm']}" if critic is not None else "")
        raise NonFiniteError(f"non-finite loss ({out.get('loss')}) or gradient norm ({norms})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if critic is not None:
        critic.step(optimizer)
    return out


# ---- metrics, summary, plot, outputs -----------------------------------------------------------


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def step_record(
    step: int, metrics: dict[str, float], lr: float, batch: StepBatch, seconds: float, mem: float
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: the required fields first, then the objective's metrics.

    ``tokens`` counts baseline path tokens and ``tokens_per_s`` (= ``path_tokens_per_s``) is path
    tokens per second: the same useful work in both packing modes, so the ratio of two runs' values
    is the speedup. ``computed_tokens_per_s`` is what the step actually ran per second (distinct
    tree tokens, plus prefixes recomputed by partitioning; the path tokens with ``sequence``): a
    hardware throughput, not comparable across modes. ``peak_memory`` is in MiB.
    """
    rate = (lambda n: n / seconds) if seconds > 0 else (lambda n: float("inf"))
    record = {
        "step": step,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "lr": lr,
        "tokens": batch.path_tokens,
        "tree_tokens": batch.tree_tokens,
        "computed_tokens": batch.computed_tokens,
        "por": batch.por,
        "err": batch.err,
        "tokens_per_s": rate(batch.path_tokens),
        "path_tokens_per_s": rate(batch.path_tokens),
        "computed_tokens_per_s": rate(batch.computed_tokens),
        "peak_memory": mem,
        "step_time_s": seconds,
        "micro_batches": len(batch.micro),
        "trees": len(batch.trees),
        "imbalance": batch.imbalance,
    }
    return record | {k: v for k, v in metrics.items() if k not in record}


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the ``metrics.jsonl`` lines of steps up to ``last_step`` (a resumed run rewrites the
    steps after its checkpoint); replaced atomically."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines(keepends=True) if ln.strip()]
    keep = [ln for ln in keep if json.loads(ln).get("step", 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)


def log_metrics(fh: TextIO, record: dict[str, Any]) -> None:
    fh.write(json.dumps(record) + "\n")
    fh.flush()


def summary_table(
    records: list[dict[str, Any]], cfg: TrainConfig, outputs: dict[str, Path], wall: float
) -> str:
    """The end-of-run table."""
    if not records:
        return "no optimizer steps were run"
    path_tok = sum(r["tokens"] for r in records)
    tree_tok = sum(r["tree_tokens"] for r in records)
    comp_tok = sum(r["computed_tokens"] for r in records)
    step_time = sum(r["step_time_s"] for r in records)
    possible = path_tok - tree_tok
    rows = [
        ("steps", f"{records[-1]['step']}  ({len(records)} this run, {wall:.1f} s wall)"),
        ("packing / objective", f"{cfg.packing} / {cfg.objective}"),
        ("loss first -> last", f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"),
        ("path tokens", f"{path_tok:,}  (what the per-path baseline computes)"),
        ("tree tokens", f"{tree_tok:,}  (POR {1 - tree_tok / path_tok:.1%})"),
        (
            "computed tokens",
            f"{comp_tok:,}  (ERR {(path_tok - comp_tok) / possible if possible else 1.0:.1%})",
        ),
        ("path tokens / s", f"{path_tok / step_time:,.0f}" if step_time > 0 else "-"),
        ("peak memory", f"{max(r['peak_memory'] for r in records):,.0f} MiB"),
    ]
    rows += [(f"{name} ->", str(path)) for name, path in outputs.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def plot_metrics(records: list[dict[str, Any]], path: Path) -> Path:
    """PNG of loss and path tokens/s per step (matplotlib, Agg backend)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'treetrain[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, [r["loss"] for r in records], marker="o")
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [r["tokens_per_s"] for r in records], marker="o", color="tab:green")
    ax2.set_ylabel("path tokens / s")
    ax2.set_xlabel("optimizer step")
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def total_steps(cfg: TrainConfig, vocab_size: int) -> tuple[int, int | None]:
    """(optimizer steps, trees the run reads: ``epochs`` x the file's trees, or None for no limit).

    With ``--epochs`` the last step may hold fewer than ``batch_trees`` trees.
    """
    if cfg.steps is not None:
        return cfg.steps, None
    if cfg.epochs is not None:
        trees = max(1, math.ceil(cfg.epochs * count_trees(cfg, vocab_size)))
        return math.ceil(trees / cfg.batch_trees), trees
    return DEFAULT_STEPS, None


# ---- the loop ----------------------------------------------------------------------------------


@dataclass
class Run:
    """What the loop works on, built by :func:`setup`."""

    cfg: TrainConfig
    device: torch.device
    autocast_dtype: torch.dtype | None
    model: nn.Module
    ref_model: nn.Module | None
    objective: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps: int
    out: Path
    start_step: int = 0
    trees_done: int = 0
    total_trees: int | None = None  # the run's last tree (``--epochs``); None: ``steps`` decide
    cp: Any = None  # parallel.cp.CPLayout (dp x cp mesh); set by setup
    critic: Any = None  # treetrain.critic.Critic: --objective ppo_critic's value model and its AdamW


@dataclass
class TrainResult:
    output: Path
    metrics: Path
    final: Path
    plot: Path | None
    records: list[dict[str, Any]]


def setup(cfg: TrainConfig) -> Run:
    """Model, objective, reference model, optimizer, schedule; resumed from the latest checkpoint
    under ``OUTPUT/checkpoints`` with ``resume``."""
    from . import checkpoint, guards

    info = distributed.init_distributed("cpu" if cfg.device == "cpu" else "auto")
    device = info.device if info.distributed else resolve_device(cfg.device)
    param_dtype, autocast_dtype = resolve_dtype(cfg.dtype, device)
    out = Path(cfg.output)
    from . import rundir

    rundir.check_output(out, resume=cfg.resume, overwrite=cfg.overwrite)  # before any work or write
    distributed.barrier()
    if info.is_main and cfg.overwrite:
        rundir.clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    auto_class = "AutoModelForSequenceClassification" if cfg.objective == "reward" else None
    model = configure_model(
        build_model(
            cfg.model, cfg.seed, param_dtype, device, auto_class, trust_remote_code=cfg.trust_remote_code
        ),
        cfg.activation_checkpointing,
    )
    critic = None
    if cfg.objective == "ppo_critic":  # a value model from the policy's initial weights (treetrain.critic)
        from .critic import build_critic

        critic = build_critic(model, cfg, info.distributed)
    lora = lora_config_of(cfg)
    model = apply_lora(model, lora) if lora is not None else model
    objective = build_objective(cfg)
    ref_model = build_reference_model(model) if objective.kl_coef and cfg.reference == "model" else None
    if getattr(objective, "needs_reference", False):  # dpo: --ref-model, or the initial weights
        ref_model = build_reference_model(
            configure_model(build_model(cfg.ref_model, cfg.seed, param_dtype, device), False)
            if cfg.ref_model
            else model
        )
    # FSDP2 from outside the model (a no-op in one process), before the optimizer sees the parameters
    model = distributed.shard_model(
        model, mixed_precision=autocast_dtype is not None and device.type == "cuda"
    )
    optimizer = build_optimizer(model, cfg)
    if critic is not None:  # DCP's state of several optimizers allows no empty group (LoRA's no-decay)
        from .critic import drop_empty_groups

        drop_empty_groups(optimizer)
    vocab_size = model.config.get_text_config().vocab_size
    if not cfg.lazy_validate and cfg.epochs is None:  # --epochs counts the trees in a validating pass
        options = _reader_options(_per_tree_budget(cfg), vocab_size)
        guards.validate_data(data_path(cfg), options, cfg.progress and info.is_main)
    steps, total_trees = total_steps(cfg, vocab_size)
    scheduler = build_scheduler(optimizer, cfg, steps)
    run = Run(cfg, device, autocast_dtype, model, ref_model, objective, optimizer, scheduler, steps, out)
    run.total_trees, run.critic = total_trees, critic
    from .parallel.cp import init_cp

    run.cp = init_cp(cfg.cp)
    latest = checkpoint.latest_checkpoint(out) if cfg.resume else None
    if cfg.resume and latest is None and info.is_main:
        print(f"treetrain train: --resume: no checkpoint under {out / 'checkpoints'}; starting from step 0")
    if latest is not None:
        from .critic import with_critic

        state = with_critic(model, optimizer, critic)  # with a critic: both models and optimizers
        run.start_step, data_state = checkpoint.load_checkpoint(latest, *state, scheduler)
        guards.check_resume(latest, data_state, data_path(cfg), cfg, announce=info.is_main)
        run.trees_done = int(data_state.get("trees_consumed", 0))
    return run


def run_loop(run: Run, metrics_path: Path) -> list[dict[str, Any]]:
    """The optimizer steps: one ``train_step`` per batch, a metrics line, the progress bar, and a
    resumable checkpoint every ``checkpoint_every`` steps."""
    from tqdm.auto import tqdm

    from . import checkpoint
    from .signals import Preempted, StopOnSignal

    cfg, device = run.cfg, run.device
    info = distributed.init_distributed()
    vocab_size = run.model.config.get_text_config().vocab_size
    from .parallel.cp import init_cp

    cp = run.cp or init_cp(1)
    batches = prefetched(
        make_batches(
            _per_tree_budget(cfg),
            vocab_size,
            run.steps - run.start_step,
            run.trees_done,
            rank=cp.dp_rank,
            world_size=cp.dp_size,
            model_config=run.model.config,
            total_trees=run.total_trees,
        ),
        cfg.prefetch,
    )
    records: list[dict[str, Any]] = []
    if info.is_main and run.start_step:
        truncate_metrics(metrics_path, run.start_step)
    with (
        contextlib.closing(batches) if hasattr(batches, "close") else contextlib.nullcontext(),
        StopOnSignal(announce=info.is_main) as stop,
        open(metrics_path, "a" if run.start_step else "w")
        if info.is_main
        else contextlib.nullcontext() as fh,
        tqdm(
            total=run.steps, initial=run.start_step, unit="step", disable=not (cfg.progress and info.is_main)
        ) as bar,
        open_trackers(cfg.report_to, run.out, cfg.to_dict(), enabled=info.is_main) as trackers,
    ):
        for step, batch in enumerate(batches, start=run.start_step + 1):
            lr = run.optimizer.param_groups[0]["lr"]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            try:
                metrics = train_step(
                    run.model,
                    run.optimizer,
                    batch,
                    run.objective,
                    grad_clip=cfg.grad_clip,
                    autocast_dtype=run.autocast_dtype,
                    ref_model=run.ref_model,
                    backend=cfg.attention,
                    cp=cp,
                    critic=run.critic,
                )
            except NonFiniteError as e:
                last = checkpoint.latest_checkpoint(run.out)
                where = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
                raise NonFiniteError(
                    f"step {step}: {e}; stopped before the optimizer step, nothing of this step was "
                    f"applied and {where} (continue from it with --resume after fixing the cause, "
                    "e.g. a lower --lr)"
                ) from None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            run.scheduler.step()
            record = step_record(step, metrics, lr, batch, seconds, peak_memory_mib(device))
            records.append(record)
            if fh is not None:
                log_metrics(fh, record)
                trackers.log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            bar.update(1)
            stopping = stop.should_stop()
            if stopping or (cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == run.steps)):
                saved = save_step(run, step, batch.trees_consumed)
            if stopping:
                bar.close()
                raise Preempted(stop.signum, step, str(saved))
    return records


def save_step(run: Run, step: int, trees_consumed: int) -> Path:
    """Checkpoint ``step`` (with the data file's fingerprint and the config, checked on resume)."""
    from .critic import with_critic
    from .guards import save_or_explain

    model, optimizer = with_critic(run.model, run.optimizer, run.critic)  # with a critic: both of each
    return save_or_explain(run.out, step, model, optimizer, run.scheduler, trees_consumed, run.cfg)


def train(cfg: TrainConfig | dict[str, Any], *, quiet: bool = False) -> TrainResult:
    """Run ``cfg`` end to end: setup, the loop, the final model (``save_pretrained``, safetensors,
    loadable with plain transformers), the plot and the summary table (unless ``quiet``)."""
    from .checkpoint import export_pretrained

    if isinstance(cfg, dict):  # the YAML form: {"steps": 1, "lr": 1e-4, "loss": {...}}
        from .config import merge

        cfg = merge(TrainConfig(), cfg, "train(config)")
    elif not isinstance(cfg, TrainConfig):
        raise ValueError(f"train: expected a TrainConfig or a dict of options, got {type(cfg).__name__}")
    cfg = validate(cfg)
    run = setup(cfg)
    metrics_path = run.out / "metrics.jsonl"
    t0 = time.perf_counter()
    records = run_loop(run, metrics_path)
    wall = time.perf_counter() - t0
    if is_peft_model(run.model):  # the adapter alone, for peft.PeftModel.from_pretrained
        final = save_adapter(run.model, run.out / "final")
    else:
        final = export_pretrained(run.model, run.out / "final")
    is_main = distributed.init_distributed().is_main
    plot = plot_metrics(records, run.out / "training.png") if cfg.plot and records and is_main else None
    outputs = {"metrics": metrics_path, "model": final} | ({"plot": plot} if plot else {})
    if run.critic is not None:  # loadable with AutoModelForTokenClassification.from_pretrained
        outputs["critic"] = export_pretrained(run.critic.model, run.out / "final_critic")
    if not quiet and is_main:
        print(f"treetrain train: done, outputs in {run.out.resolve()}/")
        print(summary_table(records, cfg, outputs, wall))
    return TrainResult(output=run.out, metrics=metrics_path, final=final, plot=plot, records=records)


# ---- command line ------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``treetrain train`` subcommand (flags: :func:`treetrain.config.add_train_arguments`)."""
    p = sub.add_parser(
        "train",
        help="train a causal LM on tree-structured trajectories",
        description="Train a causal LM on trees of token paths; every shared prefix is computed once. "
        "With no arguments: a tiny random-init Qwen3 on the bundled sample, a few steps.",
    )
    add_train_arguments(p)
    p.set_defaults(handler=main)
    return p


def main(args: argparse.Namespace) -> int:
    """``treetrain train``: defaults < ``--config`` < flags < ``--set``, then :func:`train`."""
    from .guards import CheckpointWriteError
    from .signals import Preempted

    try:
        cfg = config_from_args(args)
        if not cfg.verbose:
            from .logs import quiet_library_loggers

            quiet_library_loggers()
        train(cfg)
    except CheckpointError as e:  # a corrupted, tampered or unsafe checkpoint: named, no traceback
        if distributed.init_distributed().is_main:
            print(f"treetrain train: error: {e}", file=sys.stderr)
        return 1
    except (NonFiniteError, CheckpointWriteError, Preempted) as e:
        if distributed.init_distributed().is_main:
            print(f"treetrain train: stopped: {e}", file=sys.stderr)
        return e.exit_code if isinstance(e, Preempted) else 1
    except RuntimeError as e:  # a peer died or timed out (torchrun stops the rest)
        peer_gone = isinstance(e, torch.distributed.DistError) or any(
            s in str(e) for s in ("gloo", "Connection reset", "Connection closed", "NCCL", "Broken pipe")
        )
        if not (peer_gone and distributed.init_distributed().distributed):
            raise
        import signal

        with contextlib.suppress(ValueError):  # torchrun's SIGTERM to the survivors: say why first
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = distributed.init_distributed().rank
        print(
            f"treetrain train: rank {rank}: stopped: a collective failed, another rank is gone or "
            f"stuck ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            file=sys.stderr,
        )
        return 1
    finally:
        distributed.destroy()
    return 0
