"""The data side of a run: trees read lazily from ``--data`` (or the bundled sample), epoch after
epoch, grouped ``batch_trees`` to an optimizer step and packed into micro-batches by the objective
(:class:`treetrain.objectives.interface.TrainObjective`); under ``torchrun`` each rank keeps its own.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetrain.data.sources import is_table_source
from treetrain.models.rope import split_regimes
from treetrain.train.build import refuse_remote_code
from treetrain.train.config import DEFAULT_STEPS, TrainConfig
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.tree import TrajectoryTree

SAMPLE = "agent-dialogues"  # the bundled sample ``treetrain train`` uses by default
# a model known by name (treetrain.models.pretrained) has its own vocabulary, not the Qwen ids of SAMPLE:
# the messages sample, rendered with the model's own tokenizer
PRETRAINED_SAMPLE = "agent-dialogues-messages"


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


def default_sample(model: str | None) -> Path:
    """The bundled sample a run without ``--data`` reads: the messages one for a ``--model`` known by
    name (rendered with its own tokenizer), else the Qwen-tokenized trees."""
    from treetrain.data.reader import sample_path
    from treetrain.models.pretrained import PRETRAINED

    return Path(sample_path(PRETRAINED_SAMPLE if model in PRETRAINED else SAMPLE))


def data_path(cfg: TrainConfig) -> Path:
    """``--data``, or the bundled sample (:func:`default_sample`)."""
    if cfg.data is None:
        return default_sample(cfg.model)
    path = Path(cfg.data)
    if path.is_dir() and not is_table_source(path):
        raise ValueError(
            f"--data {cfg.data}: is a directory, not a data file (nor a datasets.save_to_disk directory: "
            "no state.json or dataset_dict.json in it); pass a JSONL file of trees or a Parquet/Arrow file"
        )
    if not path.is_file() and not path.is_dir():
        raise ValueError(
            f"--data {cfg.data}: no such file; pass a JSONL file of trees, a Parquet/Arrow file or a "
            "datasets.save_to_disk directory (or omit for the sample)"
        )
    return path


def _reader_options(cfg: TrainConfig, vocab_size: int, objective=None) -> dict[str, Any]:
    """``treetrain.data.records`` reader options from the config; with ``objective``, each record is
    also checked for what the run needs of it (:func:`record_check`)."""
    return {
        "format": cfg.data_format,
        "vocab_size": vocab_size,
        "capacity": cfg.capacity,
        "skip_oversized": cfg.skip_oversized,
        "tokenizer": _tokenizer(name, cfg.trust_remote_code) if (name := _tokenizer_name(cfg)) else None,
        "max_line_bytes": cfg.max_line_bytes,
        "columns": cfg.columns,
        "group_rows": cfg.group_rows,
        "allow_invalid_tool_arguments": cfg.allow_invalid_tool_arguments,
        "check": record_check(cfg, objective) if objective is not None else None,
    }


def record_check(cfg: TrainConfig, objective) -> Callable[[TrajectoryTree, Any], None]:
    """What the run needs of each record, checked as it is read (so before step 1, with the whole
    file's validation): the objective's ``check_record`` and, with ``--advantages``, per-path
    ``rewards`` (:func:`treetrain.objectives.advantages.check_rewards`). Errors name the record."""
    from treetrain.objectives.advantages import check_rewards

    def check(tree: TrajectoryTree, info) -> None:
        objective.check_record(tree, info)
        if cfg.advantages is not None:
            check_rewards(tree, info, cfg.advantages)

    return check


def _per_tree_budget(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the token budget of one packed tree: ``--capacity`` is per rank, and ``--cp N``
    ranks share each tree."""
    return dataclasses.replace(cfg, capacity=cfg.capacity * cfg.cp) if cfg.cp > 1 else cfg


def _tokenizer_name(cfg: TrainConfig) -> str | None:
    """``--tokenizer`` (a directory, ``qwen``, or a model name of ``treetrain.models.pretrained``), or
    for a ``--model`` known by name its own tokenizer; None: none."""
    from treetrain.models.pretrained import is_pretrained_name, resolve_model

    if cfg.tokenizer:
        return resolve_model(cfg.tokenizer)
    return resolve_model(cfg.model) if is_pretrained_name(cfg.model) else None


@functools.lru_cache(maxsize=2)
def _tokenizer(name: str, trust_remote_code: bool):
    """``--tokenizer``, loaded once per run (code in its directory runs only with ``trust_remote_code``)."""
    from treetrain.data.chat import load_tokenizer

    with refuse_remote_code("--tokenizer", name):
        return load_tokenizer(name, trust_remote_code=trust_remote_code)


def _read_trees(cfg: TrainConfig, vocab_size: int, objective=None) -> Iterator[TrajectoryTree]:
    """One lazy pass over the data file; errors name file, line and field. ``objective``: its record
    check (and ``--advantages``' rewards) on each record, :func:`record_check`."""
    from treetrain.data.reader import iter_trees

    for tree, _info in iter_trees(data_path(cfg), **_reader_options(cfg, vocab_size, objective)):
        yield tree


def count_trees(cfg: TrainConfig, vocab_size: int) -> int:
    """Trees in the data file (one validating pass: every bad record is listed), for ``--epochs``."""
    from treetrain.data.reader import validate_file

    counts = validate_file(data_path(cfg), **_reader_options(cfg, vocab_size))
    if counts.samples == 0:
        raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")
    return counts.samples


def tree_stream(
    cfg: TrainConfig, vocab_size: int, skip: int = 0, total: int | None = None, objective=None
) -> Iterator[TrajectoryTree]:
    """Trees in file order, epoch after epoch, lazily: trees ``skip`` (resume) to ``total`` (the end
    of a fractional last epoch; None: no end) of that endless stream; ``objective``: see
    :func:`_read_trees`."""
    stream = _epochs(cfg, vocab_size, objective)
    first = next(stream, None)
    if first is None:
        raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")
    return itertools.islice(itertools.chain([first], stream), skip, total)


def _epochs(cfg: TrainConfig, vocab_size: int, objective=None) -> Iterator[TrajectoryTree]:
    """The data file's trees, epoch after epoch; an epoch without a tree is an error (not a spin)."""
    for _ in itertools.count():
        n = 0
        for n, tree in enumerate(_read_trees(cfg, vocab_size, objective), start=1):  # noqa: B007
            yield tree
        if n == 0:
            raise ValueError(f"--data {data_path(cfg)}: the file holds no trees")


def rank_microbatches(
    objective,
    trees: list[TrajectoryTree],
    packing: str,
    capacity: int,
    rank: int,
    world_size: int,
    model_config,
) -> tuple[list[list[TrajectoryTree]], int, int, float]:
    """This rank's micro-batches, the most any rank has, the tokens all ranks compute and the FLOP
    imbalance. The objective's units (whole trees or parts of whole paths; whole preference pairs)
    go to ranks by their training FLOPs (:func:`treetrain.parallel.balance.balanced_units`), then each
    rank packs its own (``objective.pack``). Every rank computes the same plan from the same trees,
    with no communication. Idle ranks pad with ``objective.idle_loss`` passes."""
    from treetrain.parallel import fsdp as distributed
    from treetrain.parallel.balance import balanced_units

    units = objective.units(trees, packing, capacity)
    units, plan, imbalance = balanced_units(
        units, world_size, lambda t: distributed.tree_cost(t, model_config), split=objective.split_units
    )
    per_rank = [objective.pack([units[i] for i in idx], packing, capacity) for idx in plan]
    computed = sum(t.num_tokens for mbs in per_rank for mb in mbs for t in mb)
    return per_rank[rank], max(len(mbs) for mbs in per_rank), computed, imbalance


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
    objective=None,
) -> Iterator[StepBatch]:
    """``steps`` optimizer-step batches of ``batch_trees`` trees, packed and ready to run.

    ``objective`` (a :class:`treetrain.objectives.interface.TrainObjective`; default: the one of
    ``cfg``) checks the records and groups the trees into micro-batches. With ``model_config``,
    each tree is first split by the model's rope regimes (``models.rope.split_regimes``: a no-op
    unless the rope depends on the forward's length), so every micro-batch and partition inherits
    it. With ``world_size > 1`` each batch holds every tree of the step (for the loss normalizer and
    the metrics) but only this rank's micro-batches (:func:`rank_microbatches`).
    """
    if objective is None:
        from treetrain.objectives.registry import build_objective

        objective = build_objective(cfg)
    stream = tree_stream(cfg, vocab_size, skip=start_tree, total=total_trees, objective=objective)
    consumed = start_tree
    for _ in range(steps):
        trees = list(itertools.islice(stream, cfg.batch_trees))
        if not trees:  # the run's last tree was read (``--epochs``)
            return
        if model_config is not None:  # length-dependent rope: paths of two regimes share no token
            trees = [split_regimes(model_config, t) for t in trees]
        if cfg.advantages is not None:  # per-path rewards -> group-normalized advantages
            from treetrain.objectives.advantages import assign_advantages

            trees = assign_advantages(trees, cfg.advantages)
        consumed += len(trees)
        if world_size == 1:
            micro = [pack(mb) for mb in objective.microbatches(trees, cfg.packing, cfg.capacity)]
            yield StepBatch(trees=trees, micro=micro, trees_consumed=consumed, packing=cfg.packing)
            continue
        mine, passes, computed, imbalance = rank_microbatches(
            objective, trees, cfg.packing, cfg.capacity, rank, world_size, model_config
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
    from treetrain.data.reader import prefetch

    return prefetch(batches, depth)


def total_steps(cfg: TrainConfig, vocab_size: int, file_trees: int | None = None) -> tuple[int, int | None]:
    """(optimizer steps, trees the run reads: ``epochs`` x the file's trees, or None for no limit).

    With ``--epochs`` the last step may hold fewer than ``batch_trees`` trees. ``file_trees``: the
    data file's trees when already counted (else a validating pass counts them).
    """
    if cfg.steps is not None:
        return cfg.steps, None
    if cfg.epochs is not None:
        n = file_trees if file_trees is not None else count_trees(cfg, vocab_size)
        trees = max(1, math.ceil(cfg.epochs * n))
        return math.ceil(trees / cfg.batch_trees), trees
    return DEFAULT_STEPS, None
