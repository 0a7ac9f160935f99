"""The training loop behind ``treetrain train``.

One optimizer step takes ``batch_trees`` whole trees (a tree never straddles two steps):

1. the loss normalizer is computed over those whole trees, before anything runs;
2. ``packing="tree"``: a tree with more distinct tokens than ``capacity`` is partitioned into parts
   of whole paths, and trees and parts are packed together into micro-batches;
   ``packing="sequence"`` (the baseline): every path becomes its own sequence (a one-path tree, so
   the mask is block-diagonal causal), packed into micro-batches under the same token budget;
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
from .config import DEFAULT_STEPS, TrainConfig, add_train_arguments, config_from_args, validate
from .packing import PackedTree, pack
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


def build_model(model: str | None, seed: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A causal LM from a local directory (weights, or only ``config.json``: random init from
    ``seed``) or, with ``model=None``, the embedded tiny Qwen3 config (random init)."""
    import transformers

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
            net = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            return net.to(device)
        config = transformers.AutoConfig.from_pretrained(path)
    # initialize in float32 whatever the dtype, so one seed gives one initial model (normal_ draws
    # differ between float32 and float64 kernels), then cast
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return net.to(device=device, dtype=dtype)


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
    if not path.is_file():
        raise ValueError(
            f"--data {cfg.data}: no such file; pass a JSONL file of trees (or omit for the sample)"
        )
    return path


def _reader_options(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """``treetrain.data`` reader options from the config."""
    return {
        "format": cfg.data_format,
        "vocab_size": vocab_size,
        "capacity": cfg.capacity,
        "skip_oversized": cfg.skip_oversized,
        "tokenizer": cfg.tokenizer,
    }


def _read_trees(cfg: TrainConfig, vocab_size: int) -> Iterator[TrajectoryTree]:
    """One lazy pass over the data file; errors name file, line and field."""
    from .data import iter_trees

    for tree, _info in iter_trees(data_path(cfg), **_reader_options(cfg, vocab_size)):
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
    stream = itertools.chain.from_iterable(_read_trees(cfg, vocab_size) for _ in itertools.count())
    first = next(stream, None)
    if first is None:
        raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")
    return itertools.islice(itertools.chain([first], stream), skip, total)


def sequence_parts(tree: TrajectoryTree) -> list[TrajectoryTree]:
    """The baseline's unit: every path its own one-path tree (a plain causal sequence)."""
    return [tree.subset([i]) for i in range(tree.num_paths)]


def sequence_logprobs(model: nn.Module, ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence ``ids [L]`` through the model's own causal attention (SDPA, no tree mask):
    log-probs and entropies of its ``L - 1`` targets, through the same chunked LM head as trees."""
    from .logprobs import target_logprobs

    decoder = getattr(model, "treetrain_decoder", None) or model.base_model  # FSDP's root entry
    hidden = decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    return target_logprobs(hidden[:-1], model.get_output_embeddings(), ids[1:], chunk)


def sequence_loss(
    model: nn.Module,
    packed: PackedTree,
    objective,
    normalizer: float,
    ref_model: nn.Module | None = None,
    *,
    backend: str | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-sequence baseline for one micro-batch of one-path trees: every path its own forward
    with plain causal attention (what trainers without tree packing run), then the same per-path
    objective (``treetrain.losses.objective``) under the step's global normalizer.

    Drop-in for ``treetrain.losses.compute_loss``; ``backend`` (tree attention) is unused.
    """
    from .logprobs import DEFAULT_CHUNK
    from .losses import PathMeta
    from .losses import objective as path_objective

    chunk = chunk or DEFAULT_CHUNK
    device = model.get_input_embeddings().weight.device
    ids = [torch.as_tensor(t.path(0), device=device) for t in packed.trees]
    logp, ent = zip(*(sequence_logprobs(model, x, chunk) for x in ids))
    ref = None
    if objective.kl_coef and ref_model is not None:
        with torch.no_grad():
            ref = torch.cat([sequence_logprobs(ref_model, x, chunk)[0] for x in ids])
    entropy = torch.cat(ent) if objective.entropy_coef else torch.cat(ent).detach()
    meta = PathMeta.from_trees(packed)
    return path_objective(torch.cat(logp), meta, objective, normalizer, entropy=entropy, ref_logprobs=ref)


def make_microbatches(trees: list[TrajectoryTree], packing: str, capacity: int) -> list[list[TrajectoryTree]]:
    """Group the step's trees into micro-batches of at most ``capacity`` tokens each.

    ``tree``: whole trees, those larger than ``capacity`` partitioned into parts of whole paths.
    ``sequence``: every path its own sequence. Either way the pieces are packed several to a
    micro-batch by :func:`treetrain.partition.pack_microbatches`.
    """
    from .partition import pack_microbatches

    if packing == "sequence":
        trees = [seq for tree in trees for seq in sequence_parts(tree)]
    return pack_microbatches(trees, capacity)


def rank_microbatches(
    trees: list[TrajectoryTree], packing: str, capacity: int, rank: int, world_size: int, model_config
) -> tuple[list[list[TrajectoryTree]], int, int]:
    """This rank's micro-batches when the step's work is split over ``world_size`` ranks.

    Whole trees (parts of whole paths for trees over ``capacity``; single paths with ``sequence``
    packing) go to ranks by their training FLOPs (``distributed.tree_cost``, LPT), then each rank
    packs its own pieces. Every rank computes the same plan from the same trees, with no
    communication. Returns (this rank's micro-batches, the most micro-batches any rank has, the
    tokens all ranks compute).

    FSDP's collectives run once per forward, so every rank must run the same number of forwards:
    ``sequence`` packing runs one forward per path (:func:`sequence_loss`), hence one path per
    micro-batch here, and idle ranks pad with one-forward dummy passes.
    """
    from .partition import pack_microbatches, partition

    units = [seq for tree in trees for seq in sequence_parts(tree)] if packing == "sequence" else trees
    pieces = [part for unit in units for part in partition(unit, capacity)]
    costs = [distributed.tree_cost(piece, model_config) for piece in pieces]
    plan = distributed.assign_to_ranks(costs, world_size)
    if packing == "sequence":
        per_rank = [[[pieces[i]] for i in idx] for idx in plan]
    else:
        per_rank = [pack_microbatches([pieces[i] for i in idx], capacity) for idx in plan]
    computed = sum(t.num_tokens for mbs in per_rank for mb in mbs for t in mb)
    return per_rank[rank], max(len(mbs) for mbs in per_rank), computed


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
        if world_size == 1:
            micro = [pack(mb) for mb in make_microbatches(trees, cfg.packing, cfg.capacity)]
            yield StepBatch(trees=trees, micro=micro, trees_consumed=consumed, packing=cfg.packing)
            continue
        mine, passes, computed = rank_microbatches(
            trees, cfg.packing, cfg.capacity, rank, world_size, model_config
        )
        yield StepBatch(
            trees=trees,
            micro=[pack(mb) for mb in mine],
            trees_consumed=consumed,
            packing=cfg.packing,
            passes=passes,
            all_computed_tokens=computed,
        )


def prefetched(batches: Iterator[StepBatch], depth: int) -> Iterable[StepBatch]:
    """Prepare batches ``depth`` ahead in a background thread (tokenize, partition, pack)."""
    if depth <= 0:
        return batches
    from .data import prefetch

    return prefetch(batches, depth)


# ---- one optimizer step ------------------------------------------------------------------------


def build_objective(cfg: TrainConfig):
    """``treetrain.losses.Objective`` from ``--objective`` and the ``loss`` options."""
    from .losses import Objective

    try:
        return Objective(name=cfg.objective, **cfg.loss)
    except TypeError as e:
        raise ValueError(f"loss: {e}; see treetrain.losses.Objective for the objective's options") from None


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
) -> dict[str, float]:
    """Forward and backward over every micro-batch, then clip and step.

    The normalizer comes from the whole trees of the step, so the micro-batch losses sum to the
    full-batch loss and the accumulated gradient is the full-batch gradient. Returns the step's
    objective metrics (``treetrain.losses.summarize_metrics`` of the summed micro-batch metrics)
    plus ``grad_norm`` (before clipping).
    """
    from .losses import compute_loss, loss_normalizer, summarize_metrics

    loss_fn = sequence_loss if batch.packing == "sequence" else compute_loss
    device = next(model.parameters()).device
    normalizer = loss_normalizer(batch.trees, objective)
    sums: dict[str, torch.Tensor] = {}
    for packed in batch.micro:
        with autocast_context(device, autocast_dtype):
            loss, metrics = loss_fn(
                model, packed.to(device), objective, normalizer, ref_model=ref_model, backend=backend
            )
        loss.backward()
        for k, v in metrics.items():
            sums[k] = sums[k] + v.double() if k in sums else v.double()
    for _ in range(batch.passes - len(batch.micro)):  # FSDP's collectives need every rank's pass
        with autocast_context(device, autocast_dtype):
            idle = distributed.dummy_loss(model, backend)
        idle.backward()
    sums = distributed.all_reduce_sum_dict(sums)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip else float("inf")
    grad_norm = distributed.clip_grad_norm_(params, max_norm)
    out = summarize_metrics(sums) | {"grad_norm": float(grad_norm)}
    if not (math.isfinite(out.get("loss", 0.0)) and math.isfinite(out["grad_norm"])):
        optimizer.zero_grad(set_to_none=True)  # the same values on every rank: all stop together
        raise NonFiniteError(f"non-finite loss ({out.get('loss')}) or gradient norm ({out['grad_norm']})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
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

    ``tokens`` counts baseline path tokens, so ``tokens_per_s`` is the same useful work per second
    in both packing modes (their ratio is the speedup). ``peak_memory`` is in MiB.
    """
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
        "tokens_per_s": batch.path_tokens / seconds if seconds > 0 else float("inf"),
        "peak_memory": mem,
        "step_time_s": seconds,
        "micro_batches": len(batch.micro),
        "trees": len(batch.trees),
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
    from . import checkpoint

    info = distributed.init_distributed("cpu" if cfg.device == "cpu" else "auto")
    device = info.device if info.distributed else resolve_device(cfg.device)
    param_dtype, autocast_dtype = resolve_dtype(cfg.dtype, device)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    model = configure_model(
        build_model(cfg.model, cfg.seed, param_dtype, device), cfg.activation_checkpointing
    )
    objective = build_objective(cfg)
    ref_model = build_reference_model(model) if objective.kl_coef and cfg.reference == "model" else None
    # FSDP2 from outside the model (a no-op in one process), before the optimizer sees the parameters
    model = distributed.shard_model(
        model, mixed_precision=autocast_dtype is not None and device.type == "cuda"
    )
    optimizer = build_optimizer(model, cfg)
    steps, total_trees = total_steps(cfg, model.config.get_text_config().vocab_size)
    scheduler = build_scheduler(optimizer, cfg, steps)
    run = Run(cfg, device, autocast_dtype, model, ref_model, objective, optimizer, scheduler, steps, out)
    run.total_trees = total_trees
    latest = checkpoint.latest_checkpoint(out) if cfg.resume else None
    if latest is not None:
        run.start_step, data_state = checkpoint.load_checkpoint(latest, model, optimizer, scheduler)
        run.trees_done = int(data_state.get("trees_consumed", 0))
    return run


def run_loop(run: Run, metrics_path: Path) -> list[dict[str, Any]]:
    """The optimizer steps: one ``train_step`` per batch, a metrics line, the progress bar, and a
    resumable checkpoint every ``checkpoint_every`` steps."""
    from tqdm.auto import tqdm

    from . import checkpoint

    cfg, device = run.cfg, run.device
    info = distributed.init_distributed()
    vocab_size = run.model.config.get_text_config().vocab_size
    batches = prefetched(
        make_batches(
            cfg,
            vocab_size,
            run.steps - run.start_step,
            run.trees_done,
            rank=info.rank,
            world_size=info.world_size,
            model_config=run.model.config,
            total_trees=run.total_trees,
        ),
        cfg.prefetch,
    )
    records: list[dict[str, Any]] = []
    if info.is_main and run.start_step:
        truncate_metrics(metrics_path, run.start_step)
    with (
        open(metrics_path, "a" if run.start_step else "w")
        if info.is_main
        else contextlib.nullcontext() as fh,
        tqdm(
            total=run.steps, initial=run.start_step, unit="step", disable=not (cfg.progress and info.is_main)
        ) as bar,
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
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            bar.update(1)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < run.steps:
                data_state = {"trees_consumed": batch.trees_consumed}
                checkpoint.save_checkpoint(run.out, step, run.model, run.optimizer, run.scheduler, data_state)
    return records


def train(cfg: TrainConfig, *, quiet: bool = False) -> TrainResult:
    """Run ``cfg`` end to end: setup, the loop, the final model (``save_pretrained``, safetensors,
    loadable with plain transformers), the plot and the summary table (unless ``quiet``)."""
    from .checkpoint import export_pretrained

    cfg = validate(cfg)
    run = setup(cfg)
    metrics_path = run.out / "metrics.jsonl"
    t0 = time.perf_counter()
    records = run_loop(run, metrics_path)
    wall = time.perf_counter() - t0
    final = export_pretrained(run.model, run.out / "final")
    is_main = distributed.init_distributed().is_main
    plot = plot_metrics(records, run.out / "training.png") if cfg.plot and records and is_main else None
    outputs = {"metrics": metrics_path, "model": final} | ({"plot": plot} if plot else {})
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
    try:
        train(config_from_args(args))
    except NonFiniteError as e:
        if distributed.init_distributed().is_main:
            print(f"treetrain train: stopped: {e}", file=sys.stderr)
        return 1
    finally:
        distributed.destroy()
    return 0
